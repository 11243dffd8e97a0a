"""parallel_epochs with real worker processes: each worker streams a whole
epoch in its own order (derived from the pipeline's seed and its worker
index), or, on request, all the pipeline's own order."""

from __future__ import annotations

import collections

import numpy as np
import pytest

import jaxfeed
import service_udfs
from jaxfeed.service.dispatcher import server as dispatcher_lib
from jaxfeed.service.protocol import spec
from jaxfeed.service.protocol import split_failures
from jaxfeed.service.protocol.protos import service_pb2 as pb
from jaxfeed.service.worker import worker_orders

pytestmark = pytest.mark.timeout(120)

RECORDS = 1000
HEARTBEAT = ("--heartbeat_interval_s=0.2",)


def pipeline(seed: int = 0) -> jaxfeed.Dataset:
  source = jaxfeed.ArraySource({"x": np.arange(RECORDS, dtype=np.int64)})
  return jaxfeed.Dataset.from_source(source, jaxfeed.IndexSampler(RECORDS, shuffle=True, seed=seed))


def read(dispatcher: str, **options) -> list[tuple[int, int]]:
  """(worker pid, record) of every element of one parallel_epochs read, in
  the order the trainer got them."""
  dataset = (
    pipeline()
    .map(service_udfs.with_worker_pid)
    .distribute(dispatcher, "parallel_epochs", **options)
  )
  return [(int(e["pid"]), int(e["x"])) for e in dataset]


def streams(elements: list[tuple[int, int]]) -> dict[int, list[int]]:
  """Each worker's stream, in its order."""
  by_worker = collections.defaultdict(list)
  for pid, x in elements:
    by_worker[pid].append(x)
  return dict(by_worker)


def occurrences(elements: list[tuple[int, int]]) -> tuple[list[int], list[int]]:
  """The records in the order of their first and of their second arrival."""
  seen: collections.Counter = collections.Counter()
  first, second = [], []
  for _, x in elements:
    seen[x] += 1
    (first if seen[x] == 1 else second).append(x)
  return first, second


@pytest.fixture
def two_workers(cluster):
  dispatcher = cluster("dispatcher", "--port=0")
  workers = [
    cluster("worker", f"--dispatcher_address={dispatcher.address}", *HEARTBEAT) for _ in range(2)
  ]
  # A worker registers before it reports its address: a job gets a task on each.
  yield dispatcher.address
  for worker in workers:
    worker.stop()


def test_each_worker_streams_a_whole_epoch_in_its_own_order(two_workers):
  got = read(two_workers)
  by_worker = streams(got)
  assert len(by_worker) == 2, {pid: len(s) for pid, s in by_worker.items()}
  for stream in by_worker.values():  # each record once per worker
    assert sorted(stream) == list(range(RECORDS))
  first, second = occurrences(got)
  same = sum(a == b for a, b in zip(first, second)) / RECORDS
  assert same < 0.05, f"{same:.0%} of positions equal"  # 100% before
  # Worker 0's order is the pipeline's own; the other's derives from the seed and 1.
  local = [int(e["x"]) for e in pipeline()]
  derived = [int(e["x"]) for e in pipeline(worker_orders.worker_seed(0, 1))]
  assert sorted(by_worker.values()) == sorted([local, derived])


def test_the_orders_are_the_same_in_another_read(two_workers):
  assert sorted(streams(read(two_workers)).values()) == sorted(streams(read(two_workers)).values())


def test_identical_worker_streams_gives_every_worker_the_pipelines_order(two_workers):
  got = read(two_workers, identical_worker_streams=True)
  by_worker = streams(got)
  local = [int(e["x"]) for e in pipeline()]
  assert list(by_worker.values()) == [local, local]
  first, second = occurrences(got)
  assert first == second == local


def test_identical_worker_streams_is_refused_outside_parallel_epochs():
  with pytest.raises(
    ValueError, match="identical_worker_streams=True applies to processing_mode='parallel_epochs'"
  ):
    pipeline().distribute("127.0.0.1:1", "distributed_epoch", identical_worker_streams=True)


def test_worker_seeds_keep_index_0_and_differ_by_index():
  assert worker_orders.worker_seed(7, 0) == 7
  seeds = {worker_orders.worker_seed(7, i) for i in range(100)}
  assert len(seeds) == 100
  assert worker_orders.worker_seed(7, 3) == worker_orders.worker_seed(7, 3)
  assert worker_orders.worker_seed(7, 3) != worker_orders.worker_seed(8, 3)


def order_of(worker_index: int) -> list[int]:
  """Worker `worker_index`'s stream of `pipeline()`, computed locally."""
  return [int(e["x"]) for e in pipeline(worker_orders.worker_seed(0, worker_index))]


def test_a_resumed_read_continues_each_stream_on_a_worker_of_its_index(two_workers):
  """Saved: worker 0's stream over, worker 1's at 300, worker 2's at 50. The
  new job's two tasks get indices 1 and 2 and go on where those streams were."""
  dataset = (
    pipeline()
    .map(service_udfs.with_worker_pid)
    .distribute(two_workers, "parallel_epochs", timeout_s=20)
  )
  with dataset.make_iterator() as iterator:
    next(iterator)
    state = iterator.get_state()
  state["own"]["streams"] = {
    "version": 2,
    "streams": [[RECORDS, True, 0], [300, False, 1], [50, False, 2]],
  }
  with dataset.make_iterator() as iterator:
    iterator.set_state(state)
    rest = [(int(e["pid"]), int(e["x"])) for e in iterator]
  assert sorted(streams(rest).values()) == sorted([order_of(1)[300:], order_of(2)[50:]])


def test_a_read_saved_with_identical_streams_resumes_only_with_them(two_workers):
  dataset = pipeline().distribute(two_workers, "parallel_epochs", identical_worker_streams=True)
  taken = 0
  with dataset.make_iterator() as iterator:
    while len(iterator.get_state()["own"]["streams"]["streams"]) < 2:  # both tasks listed
      next(iterator)
      taken += 1
    state = iterator.get_state()
  assert [s[2] for s in state["own"]["streams"]["streams"]] == [0, 0]
  other = pipeline().distribute(two_workers, "parallel_epochs")
  with other.make_iterator() as iterator:
    with pytest.raises(ValueError, match="saved with identical worker streams"):
      iterator.set_state(state)
  with dataset.make_iterator() as iterator:
    iterator.set_state(state)
    assert len(list(iterator)) == 2 * RECORDS - taken


def _indices(state, job_id: int) -> dict[str, int]:
  return {t.worker_address: t.worker_index for t in state.jobs[job_id].tasks.values()}


@pytest.mark.parametrize("snapshot_every_records", [0, 1])
def test_worker_indices_fill_the_smallest_free_one_and_survive_a_restart(
  tmp_path, snapshot_every_records
):
  config = dispatcher_lib.DispatcherConfig(
    work_dir=str(tmp_path), heartbeat_timeout_s=60, snapshot_every_records=snapshot_every_records
  )
  state = dispatcher_lib.DispatcherState(config)
  dataset_id = state.register_dataset(spec.to_dataset_def(pipeline().node))
  for address in ("w1:1", "w2:1", "w3:1"):
    state.worker_heartbeat(pb.WorkerHeartbeatRequest(worker_address=address))

  def job(**request) -> int:
    return state.get_or_create_job(
      pb.GetOrCreateJobRequest(dataset_id=dataset_id, sharding_policy="OFF", **request)
    )[0]

  own, same, resumed = (
    job(),
    job(identical_worker_streams=True),
    job(resume_worker_indices=[2, 0]),
  )
  assert _indices(state, own) == {"w1:1": 0, "w2:1": 1, "w3:1": 2}
  assert _indices(state, same) == {"w1:1": 0, "w2:1": 0, "w3:1": 0}
  assert _indices(state, resumed) == {"w1:1": 2, "w2:1": 0, "w3:1": 1}
  with state.lock:  # w2 is lost; a new worker takes its index
    del state.workers["w2:1"]
    state._lose_tasks_of("w2:1", how=split_failures.LOST)  # pylint: disable=protected-access
  state.worker_heartbeat(pb.WorkerHeartbeatRequest(worker_address="w4:1"))
  with state.lock:
    state._assign_tasks(state.jobs[own])  # pylint: disable=protected-access
  assert _indices(state, own) == {"w1:1": 0, "w3:1": 2, "w4:1": 1}
  state.close()
  restarted = dispatcher_lib.DispatcherState(config)
  assert _indices(restarted, own) == {"w1:1": 0, "w3:1": 2, "w4:1": 1}
  assert restarted.jobs[same].identical_worker_streams
  assert not restarted.jobs[own].identical_worker_streams
  assert restarted.jobs[resumed].resume_orders == [2, 0]
  restarted.close()


@pytest.mark.parametrize(
  "request_fields,message",
  [
    ({"sharding_policy": "DYNAMIC", "identical_worker_streams": True}, "OFF sharding"),
    ({"sharding_policy": "OFF", "resume_worker_indices": [1, 1]}, "distinct"),
    ({"sharding_policy": "OFF", "resume_worker_indices": [-1]}, ">= 0"),
  ],
)
def test_a_job_request_with_bad_worker_order_fields_is_refused(request_fields, message):
  state = dispatcher_lib.DispatcherState(dispatcher_lib.DispatcherConfig())
  dataset_id = state.register_dataset(spec.to_dataset_def(pipeline().node))
  with pytest.raises(ValueError, match=message):
    state.get_or_create_job(pb.GetOrCreateJobRequest(dataset_id=dataset_id, **request_fields))
  state.close()


def test_consumers_of_a_named_job_pass_the_same_identical_worker_streams():
  state = dispatcher_lib.DispatcherState(dispatcher_lib.DispatcherConfig())
  dataset_id = state.register_dataset(spec.to_dataset_def(pipeline().node))
  state.get_or_create_job(
    pb.GetOrCreateJobRequest(dataset_id=dataset_id, sharding_policy="OFF", job_name="train")
  )
  with pytest.raises(ValueError, match="same identical_worker_streams"):
    state.get_or_create_job(
      pb.GetOrCreateJobRequest(
        dataset_id=dataset_id,
        sharding_policy="OFF",
        job_name="train",
        identical_worker_streams=True,
      )
    )
  state.close()


@pytest.mark.parametrize(
  "make",
  [
    lambda: pipeline(),
    lambda: jaxfeed.Dataset.range(50).shuffle(50, seed=3),
    lambda: jaxfeed.Dataset.sample_from_datasets(
      [jaxfeed.Dataset.range(20), jaxfeed.Dataset.range(100, 120)], seed=2
    ),
  ],
)
def test_a_worker_index_reorders_every_seeded_order_and_keeps_the_elements(make):
  dataset = make()
  dataset_def = spec.to_dataset_def(dataset.node)
  local = [int(e["x"] if isinstance(e, dict) else e) for e in dataset]
  streams_by_index = []
  for index in range(3):
    node = spec.from_dataset_def(dataset_def, None, worker_orders.reorder(index))
    streams_by_index.append(
      [int(e["x"] if isinstance(e, dict) else e) for e in jaxfeed.Dataset(node)]
    )
  assert streams_by_index[0] == local  # index 0: the pipeline's own order
  for stream in streams_by_index[1:]:
    assert sorted(stream) == sorted(local) and stream != local
  assert streams_by_index[1] != streams_by_index[2]


def test_a_mixtures_worker_reads_each_component_in_its_own_order_in_the_same_proportions():
  def component(offset: int, seed: int) -> jaxfeed.Dataset:
    source = jaxfeed.ArraySource({"x": np.arange(offset, offset + 100, dtype=np.int64)})
    return jaxfeed.Dataset.from_source(source, jaxfeed.IndexSampler(100, shuffle=True, seed=seed))

  mixture = jaxfeed.Dataset.mix([component(0, 1), component(1000, 2)], [0.3, 0.7], seed=3)
  dataset_def = spec.to_dataset_def(mixture.node)
  local, other = (
    [
      int(e["x"])
      for e in jaxfeed.Dataset(spec.from_dataset_def(dataset_def, None, worker_orders.reorder(i)))
    ]
    for i in (0, 1)
  )
  assert local == [int(e["x"]) for e in mixture]
  assert [x < 1000 for x in other] == [x < 1000 for x in local]  # each position's component
  assert other != local
  assert len(set(other)) == len(other)  # nothing twice
