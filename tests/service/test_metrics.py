"""Prometheus metrics of real dispatcher and worker processes, and the dashboard."""

from __future__ import annotations

import json
import pathlib
import re
import socket
import struct
import time
import urllib.request

import grpc
import pytest

import jaxfeed
from jaxfeed.service import metrics
from jaxfeed.service.protocol import data_socket
from jaxfeed.service.protocol import rpc
from jaxfeed.service.protocol import spec

parser = pytest.importorskip("prometheus_client.parser")

pytestmark = pytest.mark.timeout(120)

DASHBOARD = pathlib.Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "jaxfeed.json"


def _metrics_url(process) -> str:
  line = process._lines.get(timeout=30)  # pylint: disable=protected-access
  assert " metrics on http://127.0.0.1:" in line, line
  return line.split()[-1]


def scrape(url: str) -> dict[tuple[str, tuple], float]:
  """(sample name, sorted labels) -> value of one /metrics page."""
  with urllib.request.urlopen(url, timeout=10) as response:
    text = response.read().decode()
  return {
    (s.name, tuple(sorted(s.labels.items()))): s.value
    for family in parser.text_string_to_metric_families(text)
    for s in family.samples
  }


def value(samples: dict, name: str, **labels: str) -> float:
  return samples[(name, tuple(sorted(labels.items())))]


def test_dispatcher_and_worker_export_what_they_serve(cluster, tmp_path):
  dispatcher = cluster(
    "dispatcher",
    "--port=0",
    f"--work_dir={tmp_path}",
    "--metrics_port=0",
    "--split_size=10",
    "--nojournal_fsync",
  )
  dispatcher_url = _metrics_url(dispatcher)
  worker = cluster(
    "worker",
    f"--dispatcher_address={dispatcher.address}",
    "--port=0",
    "--metrics_port=0",
    "--heartbeat_interval_s=0.2",
    "--buffer_size=2",
  )
  worker_url = _metrics_url(worker)
  dataset = jaxfeed.Dataset.range(200).batch(4)
  with dataset.distribute(
    dispatcher.address, "distributed_epoch", visitation="exactly_once"
  ).make_iterator() as iterator:
    first = [next(iterator) for _ in range(10)]
    during = scrape(dispatcher_url)
    rest = list(iterator)
  assert sum(len(b) for b in first + rest) == 200
  served = scrape(worker_url)
  after = scrape(dispatcher_url)

  job = next(labels for name, labels in during if name == "jaxfeed_job_split_lag")
  job = dict(job)["job"]
  assert value(during, "jaxfeed_dispatcher_workers") == 1
  assert value(during, "jaxfeed_dispatcher_jobs") == 1
  assert value(during, "jaxfeed_job_clients", job=job) == 1
  # Issued, not acknowledged yet: the worker buffers and the client holds some.
  assert 0 < value(during, "jaxfeed_job_split_lag", job=job) <= 20
  assert value(during, "jaxfeed_job_positions_issued", job=job) > 0
  assert value(after, "jaxfeed_journal_bytes") > 0
  assert value(after, "jaxfeed_journal_replay_records") == 0  # a fresh work_dir

  # Every batch the client got, once (each 10-position split batches on its own).
  assert value(served, "jaxfeed_worker_elements_served_total", job=job) == len(first + rest)
  assert value(served, "jaxfeed_worker_bytes_served_total", job=job) >= 200 * 8
  assert ("jaxfeed_worker_errors_total", (("job", job),)) not in served
  # The module's list of metrics is what the servers export (pool metrics
  # need an elastic pool).
  listed = {n for n in _listed_metrics() if not n.startswith("jaxfeed_pool_")}
  exported = {name for name, _ in [*during, *served]}
  # Checked by tests of their own: errors, and the buffers of live tasks.
  own_tests = {
    "jaxfeed_worker_errors_total",
    "jaxfeed_rpc_errors_total",
    "jaxfeed_client_rpc_errors_total",
    "jaxfeed_worker_buffer_fill",
    "jaxfeed_job_scaling_decisions_total",  # a per_job pool's: test_job_autoscaler.py
    "jaxfeed_autocache_decisions_total",  # test_autocache_policy_service.py
  }
  assert listed - own_tests <= exported, listed - exported


def _errors(samples: dict, name: str) -> dict[tuple[str, str], float]:
  """(method, code) -> count of an error counter's samples."""
  return {
    (dict(labels)["method"], dict(labels)["code"]): v
    for (sample, labels), v in samples.items()
    if sample == name
  }


def _delta(after: dict, before: dict) -> dict:
  return {key: v - before.get(key, 0) for key, v in after.items() if v != before.get(key, 0)}


TOKEN, WORKER_TOKEN = "metrics-client-token", "metrics-worker-token"


def test_rpc_errors_are_counted_by_method_and_code_on_both_ends(cluster, tmp_path):
  dispatcher = cluster(
    "dispatcher",
    "--port=0",
    f"--work_dir={tmp_path}",
    "--metrics_port=0",
    f"--auth_token={TOKEN}",
    f"--worker_token={WORKER_TOKEN}",
    "--nojournal_fsync",
  )
  dispatcher_url = _metrics_url(dispatcher)
  worker = cluster(
    "worker",
    f"--dispatcher_address={dispatcher.address}",
    "--port=0",
    "--metrics_port=0",
    "--heartbeat_interval_s=0.2",
    f"--worker_token={WORKER_TOKEN}",
  )
  worker_url = _metrics_url(worker)
  from jaxfeed import service  # pylint: disable=g-import-not-at-top

  client_metrics = service.serve_client_metrics("127.0.0.1", 0)
  try:
    client_before = _errors(scrape(client_metrics.url), "jaxfeed_client_rpc_errors_total")
    channel = rpc.make_channel(dispatcher.address)
    try:
      raw = lambda method: channel.unary_unary(  # noqa: E731
        "/jaxfeed.service.Dispatcher/" + method,
        request_serializer=lambda b: b,
        response_deserializer=lambda b: b,
      )
      codes = []
      for method, data, token in [
        ("GetOrCreateJob", b"", None),  # no credential
        ("GetOrCreateJob", b"", "wrong"),
        ("RegisterDataset", b"\xff\xff", TOKEN),  # not a proto
        ("NoSuchMethod", b"", TOKEN),
      ]:
        with pytest.raises(grpc.RpcError) as failed:
          raw(method)(
            data, timeout=10, metadata=((rpc.TOKEN_METADATA_KEY, token),) if token else None
          )
        codes.append(failed.value.code())
      assert codes == [grpc.StatusCode.UNAUTHENTICATED] * 2 + [
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.UNIMPLEMENTED,
      ]
    finally:
      channel.close()
    worker_channel = rpc.make_channel(worker.address)
    try:  # the worker's gRPC data path without a read ticket
      stream = worker_channel.unary_stream(
        "/jaxfeed.service.Worker/GetElements", request_serializer=lambda b: b
      )
      with pytest.raises(grpc.RpcError) as failed:
        list(stream(b"", timeout=10))
      assert failed.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
      worker_channel.close()
    # The data socket: a hello without a ticket, and one that is no JSON.
    connection = data_socket.DataConnection(worker.data_address, {"task_id": 1})
    with pytest.raises(data_socket.DataConnectionError, match="read ticket"):
      connection.next_item()
    connection.close()
    with socket.create_connection(worker.data_address.rsplit(":", 1)) as garbage:
      garbage.sendall(struct.pack("<I", 5) + b"{oops")
      garbage.settimeout(10)
      assert b"Malformed hello" in garbage.recv(4096)

    assert _errors(scrape(dispatcher_url), "jaxfeed_rpc_errors_total") == {
      ("GetOrCreateJob", "UNAUTHENTICATED"): 2,
      ("RegisterDataset", "INVALID_ARGUMENT"): 1,
      ("unknown", "UNIMPLEMENTED"): 1,
    }
    assert _errors(scrape(worker_url), "jaxfeed_rpc_errors_total") == {
      ("GetElements", "UNAUTHENTICATED"): 1,
      ("data_socket", "UNAUTHENTICATED"): 1,
      ("data_socket", "INVALID_ARGUMENT"): 1,
    }
    # This process's side of the same calls (the raw socket is no client's).
    assert _delta(
      _errors(scrape(client_metrics.url), "jaxfeed_client_rpc_errors_total"), client_before
    ) == {
      ("GetOrCreateJob", "UNAUTHENTICATED"): 2,
      ("RegisterDataset", "INVALID_ARGUMENT"): 1,
      ("NoSuchMethod", "UNIMPLEMENTED"): 1,
      ("GetElements", "UNAUTHENTICATED"): 1,
      ("data_socket", "UNAUTHENTICATED"): 1,
    }
  finally:
    client_metrics.close()

  # A worker whose dispatcher is gone counts its failing heartbeats.
  dispatcher.kill()
  deadline = time.monotonic() + 60
  while not _errors(scrape(worker_url), "jaxfeed_client_rpc_errors_total").get(
    ("WorkerHeartbeat", "UNAVAILABLE")
  ):
    assert time.monotonic() < deadline, "no failed heartbeat was counted"
    time.sleep(0.2)


def test_worker_buffer_fill_rises_when_its_consumer_stops_reading():
  from jaxfeed import service  # pylint: disable=g-import-not-at-top

  with (
    service.DispatchServer() as dispatcher,
    service.WorkerServer(
      service.WorkerConfig(
        dispatcher_address=dispatcher.target, heartbeat_interval_s=0.2, buffer_size=4
      )
    ) as worker,
  ):
    server = metrics.serve_worker(worker, "127.0.0.1", 0)
    try:
      with jaxfeed.Dataset.range(10**6).distribute(dispatcher.target).make_iterator() as iterator:
        next(iterator)
        job = str(next(iter(dispatcher.state.jobs)))
        fills = []
        deadline = time.monotonic() + 60
        while not fills or fills[-1] < 1.0:  # the client's buffer, then the worker's
          assert time.monotonic() < deadline, fills[-5:]
          fills.append(value(scrape(server.url), "jaxfeed_worker_buffer_fill", job=job))
          time.sleep(0.05)
        assert all(0 <= f <= 1 for f in fills)
    finally:
      server.close()


def test_a_failing_pipeline_counts_a_task_error_for_its_job():
  import service_udfs  # pylint: disable=g-import-not-at-top
  from jaxfeed import service  # pylint: disable=g-import-not-at-top

  with (
    service.DispatchServer() as dispatcher,
    service.WorkerServer(
      service.WorkerConfig(dispatcher_address=dispatcher.target, heartbeat_interval_s=0.2)
    ) as worker,
  ):
    server = metrics.serve_worker(worker, "127.0.0.1", 0)
    try:
      dataset = jaxfeed.Dataset.range(20).map(service_udfs.fails_at_five)
      with dataset.distribute(dispatcher.target).make_iterator() as iterator:
        assert next(iterator) == 0
        job = str(next(iter(dispatcher.state.jobs)))
        with pytest.raises(Exception, match="element five is bad"):
          list(iterator)
      assert value(scrape(server.url), "jaxfeed_worker_errors_total", job=job) == 1
    finally:
      server.close()


def test_a_healthy_read_counts_no_errors_on_either_end():
  from jaxfeed import service  # pylint: disable=g-import-not-at-top

  with (
    service.DispatchServer() as dispatcher,
    service.WorkerServer(
      service.WorkerConfig(dispatcher_address=dispatcher.target, heartbeat_interval_s=0.2)
    ) as worker,
  ):
    served = [
      metrics.serve_dispatcher(dispatcher, "127.0.0.1", 0),
      metrics.serve_worker(worker, "127.0.0.1", 0),
    ]
    try:
      before = _errors(scrape(served[1].url), "jaxfeed_client_rpc_errors_total")
      for transfer in ("socket", "grpc"):
        dataset = jaxfeed.Dataset.range(50)
        with dataset.distribute(
          dispatcher.target, data_transfer=transfer
        ).make_iterator() as iterator:
          assert len(list(iterator)) == 50
        with dataset.distribute(
          dispatcher.target, data_transfer=transfer
        ).make_iterator() as iterator:
          next(iterator)  # closed mid-read: cancelled, not failed
      assert _errors(scrape(served[0].url), "jaxfeed_rpc_errors_total") == {}
      assert _errors(scrape(served[1].url), "jaxfeed_rpc_errors_total") == {}
      assert _errors(scrape(served[1].url), "jaxfeed_client_rpc_errors_total") == before
    finally:
      for server in served:
        server.close()


@pytest.mark.parametrize("transfer", ["socket", "grpc"])
def test_a_client_gone_before_its_task_stops_is_no_error(transfer):
  """The consumer closes while the worker's connection waits for an element;
  the job is released and the worker stops the task: nobody is left to get
  an error, so none is counted."""
  from jaxfeed import service  # pylint: disable=g-import-not-at-top
  import service_udfs  # pylint: disable=g-import-not-at-top

  with (
    service.DispatchServer(service.DispatcherConfig(udf_modules=("service_udfs",))) as dispatcher,
    service.WorkerServer(
      service.WorkerConfig(dispatcher_address=dispatcher.target, heartbeat_interval_s=0.1)
    ) as worker,
  ):
    served = metrics.serve_worker(worker, "127.0.0.1", 0)
    try:
      dataset = jaxfeed.Dataset.range(10).map(service_udfs.dawdle)
      with dataset.distribute(
        dispatcher.target, data_transfer=transfer
      ).make_iterator() as iterator:
        assert next(iterator)["x"] == 0
      time.sleep(1.5)  # the task stops while the next element is on its way
      assert _errors(scrape(served.url), "jaxfeed_rpc_errors_total") == {}
    finally:
      served.close()


def _listed_metrics() -> set[str]:
  return set(re.findall(r"^  (jaxfeed_\w+)", metrics.__doc__, re.M))


def test_client_reports_reach_the_dispatchers_metrics():
  from jaxfeed import service  # pylint: disable=g-import-not-at-top

  with (
    service.DispatchServer() as dispatcher,
    service.WorkerServer(
      service.WorkerConfig(dispatcher_address=dispatcher.target, heartbeat_interval_s=0.2)
    ),
  ):
    server = metrics.serve_dispatcher(dispatcher, "127.0.0.1", 0)
    try:
      dataset = jaxfeed.Dataset.range(100)
      with dataset.distribute(dispatcher.target).make_iterator() as iterator:
        assert len(list(iterator)) == 100
        samples = scrape(server.url)
        job = str(next(iter(dispatcher.state.jobs)))
        # Cumulative consumer reports arrive with client heartbeats.
        assert value(samples, "jaxfeed_job_client_wait_seconds_total", job=job) >= 0
        assert 0 <= value(samples, "jaxfeed_job_client_buffer_fill", job=job) <= 1
    finally:
      server.close()
  with pytest.raises(OSError):  # the port was released
    urllib.request.urlopen(server.url, timeout=2)


def test_metrics_port_off_serves_nothing_and_bad_ports_are_named():
  assert metrics.serve_dispatcher(object(), "127.0.0.1", metrics.OFF) is None
  with pytest.raises(ValueError, match="metrics_port"):
    metrics.serve_worker(object(), "127.0.0.1", 70000)


def test_every_dashboard_query_names_an_exported_metric():
  dashboard = json.loads(DASHBOARD.read_text())
  exported = _listed_metrics()
  assert len(exported) >= 15
  queries = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
  assert queries
  for query in queries:
    names = set(re.findall(r"jaxfeed_\w+", query))
    assert names and names <= exported, (query, names - exported)


def test_restart_replay_and_pool_decisions_are_exported(tmp_path):
  from jaxfeed import service  # pylint: disable=g-import-not-at-top

  with service.DispatchServer(service.DispatcherConfig(work_dir=str(tmp_path))) as dispatcher:
    dispatcher.state.register_dataset(spec.to_dataset_def(jaxfeed.Dataset.range(10).node))
  config = service.DispatcherConfig(
    work_dir=str(tmp_path),
    autoscale=service.AutoscaleConfig(min_workers=1, max_workers=1, interval_s=0.2),
  )
  with service.DispatchServer(config) as dispatcher:
    server = metrics.serve_dispatcher(dispatcher, "127.0.0.1", 0)
    try:
      deadline = time.monotonic() + 30
      while not dispatcher.autoscaler.decisions:
        assert time.monotonic() < deadline
        time.sleep(0.1)
      samples = scrape(server.url)
    finally:
      server.close()
  assert value(samples, "jaxfeed_journal_replay_records") > 0
  assert value(samples, "jaxfeed_journal_replay_seconds") > 0
  assert value(samples, "jaxfeed_pool_workers") == 1
  assert value(samples, "jaxfeed_pool_scaling_decisions_total", direction="hold") >= 1
  assert value(samples, "jaxfeed_pool_scaling_decisions_total", direction="up") == 0
