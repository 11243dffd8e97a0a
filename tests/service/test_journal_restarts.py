"""A real dispatcher process, killed and restarted on its work_dir: torn journal
writes, kills while it snapshots, compaction, and collected jobs and datasets."""

from __future__ import annotations

import collections
import re
import threading
import time

import grpc
import numpy as np
import pytest

import jaxfeed
from jaxfeed import service
from jaxfeed.service.dispatcher import server as dispatcher_lib
from jaxfeed.service.protocol import rpc
from jaxfeed.service.protocol.protos import service_pb2 as pb
from service_cluster import free_port

pytestmark = pytest.mark.timeout(180)

HEARTBEAT = ("--heartbeat_interval_s=0.2",)
WAIT_S = 60


def call(address: str, method: str, request, response_cls):
  """One dispatcher RPC, waiting for the dispatcher to be up."""
  channel = rpc.make_channel(address)
  try:
    caller = rpc.Caller(channel, f"/{dispatcher_lib.SERVICE_NAME}/{method}", response_cls, None)
    return caller(request, timeout=WAIT_S, wait_for_ready=True)
  finally:
    channel.close()


def pipeline(num_records: int) -> jaxfeed.Dataset:
  """A pipeline per size: each has its own fingerprint."""
  source = jaxfeed.ArraySource(np.arange(num_records, dtype=np.int64))
  return jaxfeed.Dataset.from_source(source).batch(5)


def read_values(dataset: jaxfeed.Dataset) -> list:
  with dataset.make_iterator() as iterator:
    return sorted(np.concatenate(list(iterator)).tolist())


def start_dispatcher(cluster, port: int, work_dir, *flags: str):
  return cluster(
    "dispatcher", f"--port={port}", f"--work_dir={work_dir}", "--heartbeat_timeout_s=2", *flags
  )


def test_a_dispatcher_restarts_twice_after_a_torn_journal_write(cluster, tmp_path):
  port = free_port()
  dispatcher = start_dispatcher(cluster, port, tmp_path)
  first = service.register_dataset(dispatcher.address, pipeline(10))
  job = call(
    dispatcher.address,
    "GetOrCreateJob",
    pb.GetOrCreateJobRequest(dataset_id=first, sharding_policy="parallel_epochs", job_name="kept"),
    pb.GetOrCreateJobResponse,
  )
  dispatcher.kill()
  (journal,) = tmp_path.glob("journal*.jsonl")
  with open(journal, "ab") as f:
    f.write(b'[{"kind":"dataset","id":"9","dataset_id":"9","def":"Cs0')  # killed mid-write

  dispatcher = start_dispatcher(cluster, port, tmp_path)
  second = service.register_dataset(dispatcher.address, pipeline(20))  # after the torn tail
  dispatcher.kill()
  dispatcher = start_dispatcher(cluster, port, tmp_path)

  assert service.register_dataset(dispatcher.address, pipeline(10)) == first
  assert service.register_dataset(dispatcher.address, pipeline(20)) == second
  call(
    dispatcher.address,
    "ClientHeartbeat",
    pb.ClientHeartbeatRequest(job_id=job.job_id, client_id=job.client_id),
    pb.ClientHeartbeatResponse,
  )
  cluster("worker", f"--dispatcher_address={dispatcher.address}", *HEARTBEAT)
  assert read_values(
    service.from_dataset_id("distributed_epoch", dispatcher.address, second)
  ) == list(range(20))


def test_a_dispatcher_killed_while_it_snapshots_keeps_every_acknowledged_change(cluster, tmp_path):
  port = free_port()
  flags = ("--snapshot_every_records=2",)  # snapshots all the time
  dispatcher = start_dispatcher(cluster, port, tmp_path, *flags)
  address = dispatcher.address
  acknowledged: dict[int, str] = {}
  errors: list[BaseException] = []
  lock = threading.Lock()
  stop = threading.Event()

  def register(first: int, step: int) -> None:
    size = first
    try:
      while not stop.is_set():
        dataset_id = service.register_dataset(address, pipeline(size), timeout_s=WAIT_S)
        with lock:
          acknowledged[size] = dataset_id
        size += step
    except BaseException as e:  # pylint: disable=broad-except
      errors.append(e)

  threads = [threading.Thread(target=register, args=(1 + i, 3)) for i in range(3)]
  for thread in threads:
    thread.start()
  try:
    for kill in range(1, 4):
      deadline = time.monotonic() + WAIT_S
      while len(acknowledged) < 15 * kill and time.monotonic() < deadline and not errors:
        time.sleep(0.02)
      dispatcher.kill()  # while the clients register
      if kill == 2:  # a snapshot that never got renamed: torn, from a later generation
        (tmp_path / "snapshot.json.tmp").write_bytes(
          b'{"format":"jaxfeed-dispatcher-snapshot","version":1,"journal":99,"rec'
        )
      dispatcher = start_dispatcher(cluster, port, tmp_path, *flags)
  finally:
    stop.set()
    for thread in threads:
      thread.join(timeout=WAIT_S)
  assert not errors, errors
  assert len(acknowledged) >= 45
  assert (tmp_path / "snapshot.json").exists()
  deadline = time.monotonic() + WAIT_S  # the snapshot under way, if any, finishes
  while (tmp_path / "snapshot.json.tmp").exists() and time.monotonic() < deadline:
    time.sleep(0.05)
  assert not (tmp_path / "snapshot.json.tmp").exists()
  dispatcher.kill()
  dispatcher = start_dispatcher(cluster, port, tmp_path, *flags)
  for size, dataset_id in sorted(acknowledged.items()):
    assert service.register_dataset(dispatcher.address, pipeline(size)) == dataset_id, size


def test_a_restart_after_compaction_reads_the_live_state_not_the_history(cluster, tmp_path):
  port = free_port()
  every = 40
  flags = (f"--snapshot_every_records={every}",)
  dispatcher = start_dispatcher(cluster, port, tmp_path, *flags)
  dataset_id = service.register_dataset(dispatcher.address, pipeline(10))
  replayed = []
  for rounds in (25, 250):  # 100, then 1000 more records of jobs come and gone
    for _ in range(rounds):
      job = call(
        dispatcher.address,
        "GetOrCreateJob",
        pb.GetOrCreateJobRequest(dataset_id=dataset_id, sharding_policy="parallel_epochs"),
        pb.GetOrCreateJobResponse,
      )
      call(
        dispatcher.address,
        "ReleaseJobClient",
        pb.ReleaseJobClientRequest(job_id=job.job_id, client_id=job.client_id),
        pb.ReleaseJobClientResponse,
      )
    dispatcher.kill()
    restarted = dispatcher_lib.DispatcherState(
      dispatcher_lib.DispatcherConfig(work_dir=str(tmp_path))
    )
    replayed.append(restarted.replay_stats.records)
    restarted.close()
    dispatcher = start_dispatcher(cluster, port, tmp_path, *flags)
  live = 2  # the id counter and the dataset
  # A snapshot is written after the call that started it answered: a kill
  # in between replays the one before it and two generations of journal.
  assert all(count < live + 2 * every for count in replayed), replayed
  assert service.register_dataset(dispatcher.address, pipeline(10)) == dataset_id


def test_finished_jobs_and_unread_datasets_are_collected(cluster, tmp_path):
  port = free_port()
  flags = ("--job_gc_timeout_s=0.5", "--dataset_gc_timeout_s=3")
  dispatcher = start_dispatcher(cluster, port, tmp_path, *flags)
  address = dispatcher.address
  cluster("worker", f"--dispatcher_address={address}", *HEARTBEAT)
  node = pipeline(30).distribute(address, "distributed_epoch", job_name="shared")
  assert read_values(node) == list(range(30))
  dataset_id = node.node.dataset_id

  # A finished named job outlives its clients for job_gc_timeout_s (a late
  # consumer gets its end); once collected, the same name starts a new job.
  deadline = time.monotonic() + WAIT_S
  while True:
    time.sleep(2.5)
    values = read_values(node)
    if values:
      break
    assert time.monotonic() < deadline, "the finished job was never collected"
  assert values == list(range(30))

  held_dataset = service.register_dataset(address, pipeline(40))
  held = call(
    address,
    "GetOrCreateJob",
    pb.GetOrCreateJobRequest(
      dataset_id=held_dataset, sharding_policy="parallel_epochs", job_name="held"
    ),
    pb.GetOrCreateJobResponse,
  )
  call(
    address,
    "ReleaseJobClient",
    pb.ReleaseJobClientRequest(job_id=held.job_id, client_id=held.client_id),
    pb.ReleaseJobClientResponse,
  )
  errors = collections.defaultdict(str)
  deadline = time.monotonic() + WAIT_S
  while not (errors["job"] and errors["dataset"]) and time.monotonic() < deadline:
    time.sleep(0.2)
    for what, method, request, response_cls in (
      (
        "job",
        "ClientHeartbeat",
        pb.ClientHeartbeatRequest(job_id=held.job_id, client_id=held.client_id),
        pb.ClientHeartbeatResponse,
      ),
      (
        "dataset",
        "GetDatasetDef",
        pb.GetDatasetDefRequest(dataset_id=dataset_id),
        pb.GetDatasetDefResponse,
      ),
    ):
      try:
        call(address, method, request, response_cls)
      except grpc.RpcError as e:
        assert e.code() == grpc.StatusCode.NOT_FOUND, e
        errors[what] = e.details()
  assert f"Unknown job id {held.job_id}" in errors["job"]
  assert f"Unknown dataset id {dataset_id!r}" in errors["dataset"]

  dispatcher.kill()  # collected for good: journaled
  dispatcher = start_dispatcher(cluster, port, tmp_path, *flags)
  with pytest.raises(
    rpc.ServiceError, match=f"NOT_FOUND: .*Unknown dataset id {re.escape(repr(dataset_id))}"
  ):
    read_values(service.from_dataset_id("distributed_epoch", address, dataset_id, timeout_s=WAIT_S))
  assert read_values(node) == list(range(30))  # the pipeline registers again


def _worker_heartbeat(address: str, incarnation: str, current=()) -> pb.WorkerHeartbeatResponse:
  """A heartbeat as a worker process at 127.0.0.1:1 with `incarnation` sends it."""
  return call(
    address,
    "WorkerHeartbeat",
    pb.WorkerHeartbeatRequest(
      worker_address="127.0.0.1:1",
      data_address="127.0.0.1:1",
      incarnation=incarnation,
      current_tasks=list(current),
    ),
    pb.WorkerHeartbeatResponse,
  )


def _get_splits(address: str, task: pb.TaskInfo, request_seq: int) -> list:
  response = call(
    address,
    "GetSplits",
    pb.GetSplitsRequest(
      job_id=task.job_id, task_id=task.task_id, max_ranges=2, request_seq=request_seq
    ),
    pb.GetSplitsResponse,
  )
  return [(r.start, r.stop) for r in response.ranges]


def _dynamic_task(address: str, exactly_once: bool) -> pb.TaskInfo:
  """The task of worker "a" in a new DYNAMIC job, as its heartbeat hands it out."""
  dataset_id = service.register_dataset(address, pipeline(100_000))
  _worker_heartbeat(address, "a")
  call(
    address,
    "GetOrCreateJob",
    pb.GetOrCreateJobRequest(
      dataset_id=dataset_id, sharding_policy="distributed_epoch", exactly_once=exactly_once
    ),
    pb.GetOrCreateJobResponse,
  )
  (task,) = _worker_heartbeat(address, "a").new_tasks
  return task


@pytest.mark.parametrize("exactly_once", [True, False], ids=["exactly_once", "at_most_once"])
def test_a_repeated_get_splits_gets_the_same_ranges_also_after_restarts(
  cluster, tmp_path, exactly_once
):
  # A worker whose GetSplits reply was lost asks again with the same number:
  # the ranges it was given must not be lost, before or after the dispatcher
  # restarts, or compacts its journal (every 10 records here).
  port = free_port()
  flags = ("--snapshot_every_records=10",)
  dispatcher = start_dispatcher(cluster, port, tmp_path, *flags)
  task = _dynamic_task(dispatcher.address, exactly_once)
  given = []
  for seq in range(1, 6):  # enough records for compactions in between
    ranges = _get_splits(dispatcher.address, task, seq)
    assert ranges and not set(ranges) & set(given)
    given += ranges
    assert _get_splits(dispatcher.address, task, seq) == ranges
    dispatcher.kill()
    dispatcher = start_dispatcher(cluster, port, tmp_path, *flags)
    _worker_heartbeat(dispatcher.address, "a", [task.task_id])
    assert _get_splits(dispatcher.address, task, seq) == ranges


@pytest.mark.parametrize("exactly_once", [True, False], ids=["exactly_once", "at_most_once"])
def test_the_first_splits_handed_with_a_task_are_its_first_get_splits_answer(
  cluster, tmp_path, exactly_once
):
  # An old worker ignores TaskInfo.first_splits and asks GetSplits with
  # request_seq 1: it gets those ranges, also after a dispatcher restart. A
  # worker whose heartbeat answer was lost gets the task again with them; one
  # restarted loses the task, and (exactly-once) its splits go to its new one.
  port = free_port()
  dispatcher = start_dispatcher(cluster, port, tmp_path)
  task = _dynamic_task(dispatcher.address, exactly_once)
  first = [(r.start, r.stop) for r in task.first_splits.ranges]
  assert task.HasField("first_splits") and len(first) == 2  # the default of 2 ranges
  (again,) = _worker_heartbeat(dispatcher.address, "a").new_tasks  # not listed: lost
  assert [(r.start, r.stop) for r in again.first_splits.ranges] == first
  assert _get_splits(dispatcher.address, task, 1) == first
  dispatcher.kill()
  dispatcher = start_dispatcher(cluster, port, tmp_path)
  assert not _worker_heartbeat(dispatcher.address, "a", [task.task_id]).new_tasks
  assert _get_splits(dispatcher.address, task, 1) == first
  later = _get_splits(dispatcher.address, task, 2)
  assert later and not set(later) & set(first)
  (new,) = _worker_heartbeat(dispatcher.address, "b").new_tasks  # a new process
  assert new.task_id != task.task_id
  new_first = [(r.start, r.stop) for r in new.first_splits.ranges]
  if exactly_once:
    assert new_first == first  # issued again, first come first
  else:
    assert new_first and not set(new_first) & set(first + later)


@pytest.mark.parametrize("restart_dispatcher", [False, True], ids=["live", "restarted"])
def test_a_worker_restarted_on_its_address_gets_new_tasks(cluster, tmp_path, restart_dispatcher):
  # The new process has none of its predecessor's tasks or streams: those are
  # lost (their clients move to the new task ids) even when it comes back
  # before its heartbeats time out, or the dispatcher restarted meanwhile.
  port = free_port()
  dispatcher = start_dispatcher(cluster, port, tmp_path)
  dataset_id = service.register_dataset(dispatcher.address, pipeline(10))
  _worker_heartbeat(dispatcher.address, "a")
  job = call(
    dispatcher.address,
    "GetOrCreateJob",
    pb.GetOrCreateJobRequest(dataset_id=dataset_id, sharding_policy="parallel_epochs"),
    pb.GetOrCreateJobResponse,
  )
  (old,) = _worker_heartbeat(dispatcher.address, "a").new_tasks
  assert not _worker_heartbeat(dispatcher.address, "a", [old.task_id]).new_tasks
  if restart_dispatcher:
    dispatcher.kill()
    dispatcher = start_dispatcher(cluster, port, tmp_path)
  (new,) = _worker_heartbeat(dispatcher.address, "b").new_tasks
  assert new.task_id != old.task_id
  listed = call(
    dispatcher.address,
    "ClientHeartbeat",
    pb.ClientHeartbeatRequest(job_id=job.job_id, client_id=job.client_id),
    pb.ClientHeartbeatResponse,
  ).tasks
  assert [t.task_id for t in listed] == [new.task_id]
