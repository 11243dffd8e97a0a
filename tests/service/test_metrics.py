"""Prometheus metrics of real dispatcher and worker processes, and the dashboard."""

from __future__ import annotations

import json
import pathlib
import re
import time
import urllib.request

import pytest

import jaxfeed
from jaxfeed.service import metrics
from jaxfeed.service import spec

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
  return {(s.name, tuple(sorted(s.labels.items()))): s.value
          for family in parser.text_string_to_metric_families(text) for s in family.samples}


def value(samples: dict, name: str, **labels: str) -> float:
  return samples[(name, tuple(sorted(labels.items())))]


def test_dispatcher_and_worker_export_what_they_serve(cluster, tmp_path):
  dispatcher = cluster("dispatcher", "--port=0", f"--work_dir={tmp_path}", "--metrics_port=0",
                       "--split_size=10", "--nojournal_fsync")
  dispatcher_url = _metrics_url(dispatcher)
  worker = cluster("worker", f"--dispatcher_address={dispatcher.address}", "--port=0",
                   "--metrics_port=0", "--heartbeat_interval_s=0.2", "--buffer_size=2")
  worker_url = _metrics_url(worker)
  dataset = jaxfeed.Dataset.range(200).batch(4)
  with dataset.distribute(dispatcher.address, "distributed_epoch",
                          visitation="exactly_once").make_iterator() as iterator:
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
  assert listed - {"jaxfeed_worker_errors_total"} <= exported, listed - exported


def _listed_metrics() -> set[str]:
  return set(re.findall(r"^  (jaxfeed_\w+)", metrics.__doc__, re.M))


def test_client_reports_reach_the_dispatchers_metrics():
  from jaxfeed import service  # pylint: disable=g-import-not-at-top
  with service.DispatchServer() as dispatcher, service.WorkerServer(service.WorkerConfig(
      dispatcher_address=dispatcher.target, heartbeat_interval_s=0.2)):
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
      work_dir=str(tmp_path), autoscale=service.AutoscaleConfig(
          min_workers=1, max_workers=1, interval_s=0.2))
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
