"""A dispatcher process and its disk: a work_dir that fills up while an
exactly-once read runs, and an fsync that takes long.

A full disk refuses the changes that must be durable (UNAVAILABLE, retried
by their callers) while heartbeats go on; health (grpc.health.v1 and
jaxfeed_dispatcher_journal_healthy) says NOT_SERVING until space returns,
and then the same process serves again. A slow fsync delays only the
answers that must be durable first, never a heartbeat.
"""

from __future__ import annotations

import collections
import re
import threading
import time
import urllib.request

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2
from grpc_health.v1 import health_pb2_grpc

import dispatcher_parties
import jaxfeed
import service_udfs
from jaxfeed.service.protocol import rpc
from jaxfeed.service.protocol.protos import service_pb2 as pb
from jaxfeed.service.storage import journal_files
from service_cluster import free_port
from small_disk import SmallDisk

pytestmark = pytest.mark.timeout(240)

NUM_RECORDS = 3000
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@pytest.fixture
def small_disk(tmp_path):
  try:
    disk = SmallDisk(tmp_path / "disk", "2m")
  except OSError as e:
    pytest.skip(f"a full disk needs a tmpfs: {e}")
  yield disk
  disk.close()


def health(address: str) -> int:
  """The dispatcher's overall status (grpc.health.v1)."""
  with grpc.insecure_channel(address) as channel:
    stub = health_pb2_grpc.HealthStub(channel)
    return stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=10).status


def healthy_gauge(url: str) -> float:
  with urllib.request.urlopen(url, timeout=10) as response:
    text = response.read().decode()
  return float(re.search(r"^jaxfeed_dispatcher_journal_healthy (\S+)$", text, re.M).group(1))


def wait_for(condition, what: str, timeout_s: float = 30.0) -> None:
  deadline = time.monotonic() + timeout_s
  while not condition():
    assert time.monotonic() < deadline, f"not within {timeout_s} s: {what}"
    time.sleep(0.1)


def register(address: str, num_records: int) -> pb.RegisterDatasetResponse:
  """One RegisterDataset call (no retries)."""
  parties = dispatcher_parties.Parties(address)
  try:
    dataset = dispatcher_parties.pipeline(num_records)
    from jaxfeed.service.protocol import spec  # pylint: disable=g-import-not-at-top

    definition = spec.to_dataset_def(dataset.node)
    return rpc.Caller(
      parties.channel,
      "/jaxfeed.service.Dispatcher/RegisterDataset",
      pb.RegisterDatasetResponse,
      None,
    )(pb.RegisterDatasetRequest(dataset=definition), timeout=10)
  finally:
    parties.close()


def test_a_full_disk_keeps_the_read_going_and_the_dispatcher_serves_again_once_freed(
  small_disk, cluster
):  # the cluster stops before the disk is unmounted
  work_dir = small_disk.path / "work"
  metrics_port = free_port()
  dispatcher = cluster(
    "dispatcher",
    "--port=0",
    f"--work_dir={work_dir}",
    "--split_size=20",
    f"--metrics_port={metrics_port}",
  )
  metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
  cluster("worker", f"--dispatcher_address={dispatcher.address}", "--heartbeat_interval_s=0.2")
  source = jaxfeed.ArraySource({"x": np.arange(NUM_RECORDS, dtype=np.int64)})
  dataset = jaxfeed.Dataset.from_source(source).map(service_udfs.slow_add_one_to_x).batch(10)
  counts: collections.Counter = collections.Counter()
  errors: list[BaseException] = []

  def consume():
    try:
      with dataset.distribute(
        dispatcher.address, "distributed_epoch", visitation="exactly_once", timeout_s=60
      ).make_iterator() as it:
        for batch in it:
          counts.update(batch["x"].tolist())
    except BaseException as e:  # pylint: disable=broad-except
      errors.append(e)

  consumer = threading.Thread(target=consume)
  consumer.start()
  try:
    wait_for(lambda: sum(counts.values()) >= 500 or errors, "500 elements read")
    assert health(dispatcher.address) == SERVING and healthy_gauge(metrics_url) == 1
    small_disk.fill()
    wait_for(lambda: health(dispatcher.address) == NOT_SERVING, "NOT_SERVING on a full disk")
    assert healthy_gauge(metrics_url) == 0
    with pytest.raises(grpc.RpcError) as refused:
      register(dispatcher.address, 17)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "cannot write its journal" in refused.value.details()
    time.sleep(2)  # the read goes on as far as its splits go; heartbeats need no disk
    assert not errors, errors
    small_disk.free()
    wait_for(lambda: health(dispatcher.address) == SERVING, "SERVING once space returned")
    assert healthy_gauge(metrics_url) == 1
    assert register(dispatcher.address, 17).dataset_id
  finally:
    consumer.join(timeout=120)
  assert not errors, errors
  assert dispatcher.proc.poll() is None  # the same process, serving again
  assert sorted(counts) == list(range(1, NUM_RECORDS + 1))
  assert set(counts.values()) == {1}, [v for v, n in counts.items() if n > 1][:10]


def test_heartbeats_wait_for_no_fsync(cluster, tmp_path, monkeypatch):
  # The test hook gives the dispatcher process a disk whose every fsync takes 1 s.
  monkeypatch.setenv(journal_files.FSYNC_DELAY_ENV, "1.0")
  dispatcher = cluster(
    "dispatcher", "--port=0", f"--work_dir={tmp_path}", *dispatcher_parties.FLAGS
  )
  parties = dispatcher_parties.Parties(dispatcher.address)
  timed = collections.defaultdict(list)

  def timing(kind, call, *args, **kwargs):
    started = time.monotonic()
    result = call(*args, **kwargs)
    timed[kind].append(time.monotonic() - started)
    return result

  try:
    dataset_id = timing("RegisterDataset", parties.register, 1000)
    parties.worker("127.0.0.1:1", "w")
    job_id, client_id = timing(
      "GetOrCreateJob", parties.job, dataset_id, "distributed_epoch", exactly_once=True
    )
    (task,) = timing("WorkerHeartbeat with a task", parties.worker, "127.0.0.1:1", "w").new_tasks
    pending = []
    for seq in range(2, 7):
      ranges, _ = timing("GetSplits", parties.splits, task, seq)
      acked = [start for start, _ in ranges]
      response = timing(
        "ClientHeartbeat",
        parties.call,
        "ClientHeartbeat",
        pb.ClientHeartbeatRequest(job_id=job_id, client_id=client_id, acked_splits=acked),
        pb.ClientHeartbeatResponse,
      )
      pending.append(getattr(response, "acks_pending", False))
      timing(
        "WorkerHeartbeat",
        parties.worker,
        "127.0.0.1:1",
        "w",
        current=[task.task_id],
        held=[(task.task_id, client_id, acked)],
      )
    timing("GetSplits repeated", parties.splits, task, 6)  # its batch is durable by now
    # The acknowledgments become durable a fsync later: the client stops sending them.
    wait_for(
      lambda: (
        not getattr(
          parties.call(
            "ClientHeartbeat",
            pb.ClientHeartbeatRequest(job_id=job_id, client_id=client_id, acked_splits=acked),
            pb.ClientHeartbeatResponse,
          ),
          "acks_pending",
          False,
        )
      ),
      "acknowledgments durable",
    )
  finally:
    parties.close()
  slow = {
    kind: min(times)
    for kind, times in timed.items()
    if kind in ("RegisterDataset", "GetOrCreateJob", "GetSplits", "WorkerHeartbeat with a task")
  }
  fast = {
    kind: max(times)
    for kind, times in timed.items()
    if kind in ("ClientHeartbeat", "WorkerHeartbeat", "GetSplits repeated")
  }
  assert all(t >= 0.9 for t in slow.values()), slow  # they wait for their fsync
  assert all(t < 0.5 for t in fast.values()), fast  # never
  assert pending[0]  # not durable when answered
