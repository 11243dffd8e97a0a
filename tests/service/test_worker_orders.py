"""parallel_epochs with real worker processes: each worker streams a whole
epoch in its own order (derived from the pipeline's seed and its worker
index), or, on request, all the pipeline's own order."""

from __future__ import annotations

import collections

import numpy as np
import pytest

import jaxfeed
import service_udfs
from jaxfeed.service.worker import worker_orders

pytestmark = pytest.mark.timeout(120)

RECORDS = 1000
HEARTBEAT = ("--heartbeat_interval_s=0.2",)


def pipeline(seed: int = 0) -> jaxfeed.Dataset:
  source = jaxfeed.ArraySource({"x": np.arange(RECORDS, dtype=np.int64)})
  return jaxfeed.Dataset.from_source(
      source, jaxfeed.IndexSampler(RECORDS, shuffle=True, seed=seed))


def read(dispatcher: str, **options) -> list[tuple[int, int]]:
  """(worker pid, record) of every element of one parallel_epochs read, in
  the order the trainer got them."""
  dataset = pipeline().map(service_udfs.with_worker_pid).distribute(
      dispatcher, "parallel_epochs", **options)
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
  workers = [cluster("worker", f"--dispatcher_address={dispatcher.address}", *HEARTBEAT)
             for _ in range(2)]
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
  assert sorted(streams(read(two_workers)).values()) == sorted(
      streams(read(two_workers)).values())


def test_identical_worker_streams_gives_every_worker_the_pipelines_order(two_workers):
  got = read(two_workers, identical_worker_streams=True)
  by_worker = streams(got)
  local = [int(e["x"]) for e in pipeline()]
  assert list(by_worker.values()) == [local, local]
  first, second = occurrences(got)
  assert first == second == local


def test_identical_worker_streams_is_refused_outside_parallel_epochs():
  with pytest.raises(ValueError, match="identical_worker_streams=True applies to "
                                       "processing_mode='parallel_epochs'"):
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
  dataset = pipeline().map(service_udfs.with_worker_pid).distribute(
      two_workers, "parallel_epochs", timeout_s=20)
  with dataset.make_iterator() as iterator:
    next(iterator)
    state = iterator.get_state()
  state["own"]["streams"] = {"version": 2, "streams": [
      [RECORDS, True, 0], [300, False, 1], [50, False, 2]]}
  with dataset.make_iterator() as iterator:
    iterator.set_state(state)
    rest = [(int(e["pid"]), int(e["x"])) for e in iterator]
  assert sorted(streams(rest).values()) == sorted([order_of(1)[300:], order_of(2)[50:]])


def test_a_read_saved_with_identical_streams_resumes_only_with_them(two_workers):
  dataset = pipeline().distribute(two_workers, "parallel_epochs",
                                  identical_worker_streams=True)
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
