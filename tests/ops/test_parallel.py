"""Tests of the parallel-execution engine and the process backend.

TensorFlow is imported by a fixture (failing when it is missing), not at the
top: worker processes of the process backend import this module to load
its functions, and should not pay for TensorFlow.
"""

import gc
import json
import logging
import os
import random
import threading
import time
import traceback
import weakref

import numpy as np
import psutil
import pytest

import jaxfeed
from jaxfeed.dataset import Dataset
from jaxfeed.ops import parallel
from jaxfeed.ops import parallel_executor
from jaxfeed.ops.base import AUTOTUNE, PipelineStateError
from jaxfeed.ops.map import MapNode
from jaxfeed.ops.random_map import RandomMapNode
import op_testing
from op_testing import (
  ListNode,
  assert_same_multiset,
  check_close,
  check_resume,
  graph_iterator,
  new_threads,
  memfds,
  wait_until,
)


@pytest.fixture(autouse=True)
def work_on_threads(monkeypatch):
  """Tests of thread semantics keep cheap work off the consumer thread."""
  monkeypatch.setattr(parallel_executor, "INLINE_BELOW_S", 0.0)


@pytest.fixture(scope="module")
def tf():
  return op_testing.import_tensorflow()


def _jittered(fn):
  """fn with a small random delay, so workers finish out of order."""
  rng = random.Random(0)
  delays = [rng.random() * 0.002 for _ in range(64)]

  def run(element, seed):
    time.sleep(delays[hash(int(element)) % 64])
    return fn(element, seed)

  return run


def _blocked_on_zero(release):
  """Work that returns its element; on element 0 it first waits for `release`."""

  def work(x, seed):
    if x == 0:
      release.wait()
    return x

  return work


def _executor(items, work=None, parallelism=4, deterministic=True):
  """An executor over a `ListNode` of `items`; returns (node, executor)."""
  parent = ListNode(items)
  work = work or _jittered(lambda x, seed: (x, seed))
  return parent, parallel.ParallelExecutor(
    parent.make_iterator(), work, parallelism, deterministic, "test"
  )


def _drain(executor):
  out = []
  while True:
    try:
      out.append(next(executor))
    except StopIteration:
      return out


@pytest.mark.parametrize("parallelism", [1, 2, 4, 16])
def test_ordered_executor_keeps_input_order_and_seeds(parallelism):
  _, executor = _executor(range(40), parallelism=parallelism)
  out, seeds = [], []
  while True:
    try:
      out.append(next(executor))
    except StopIteration:
      break
    seeds.append(executor.last_seed)
  executor.close()
  assert out == [(i, 1000 + i) for i in range(40)]
  assert seeds == [1000 + i for i in range(40)]


@pytest.mark.parametrize("parallelism", [2, 4])
def test_unordered_executor_returns_every_element_once_with_its_seed(parallelism):
  _, executor = _executor(range(40), parallelism=parallelism, deterministic=False)
  pairs = []
  while True:
    try:
      value = next(executor)
    except StopIteration:
      break
    pairs.append((value, executor.last_seed))
  executor.close()
  assert sorted(pairs) == [((i, 1000 + i), 1000 + i) for i in range(40)]


def test_unordered_executor_does_not_wait_for_a_slow_head_element():
  release = threading.Event()
  _, executor = _executor(
    range(10), work=_blocked_on_zero(release), parallelism=3, deterministic=False
  )
  first = [next(executor) for _ in range(5)]  # element 0 is still running
  release.set()
  rest = _drain(executor)
  executor.close()
  assert 0 not in first
  assert sorted(first + rest) == list(range(10))


@pytest.mark.parametrize("deterministic", [True, False])
@pytest.mark.parametrize("parallelism", [1, 3])
def test_executor_never_has_more_than_parallelism_elements_in_flight(parallelism, deterministic):
  parent, executor = _executor(range(30), parallelism=parallelism, deterministic=deterministic)
  returned = 0
  while True:
    try:
      next(executor)
    except StopIteration:
      break
    returned += 1
    assert parent.pulls - returned <= parallelism
  executor.close()
  assert returned == 30


def test_ordered_executor_resumes_exactly_at_every_cut_point():
  items = list(range(25))
  _, reference = _executor(items)
  expected = _drain(reference)
  reference.close()
  for cut in range(len(items) + 1):
    _, executor = _executor(items)
    head = [next(executor) for _ in range(cut)]
    state = json.loads(json.dumps({"parent": executor.parent_state(), "own": executor.own_state()}))
    executor.close()
    assert state["own"]["consumed_ahead"] == []
    _, restored = _executor(items)
    restored.restore(state["parent"], state["own"])
    assert head + _drain(restored) == expected
    restored.close()


@pytest.mark.parametrize("seed", range(4))
def test_unordered_executor_resumes_exactly_at_every_cut_point(seed):
  items = list(range(20))
  rng = random.Random(seed)
  delays = {i: rng.random() * 0.003 for i in items}

  def work(x, s):
    time.sleep(delays[x])
    return x

  for cut in range(len(items) + 1):
    _, executor = _executor(items, work=work, deterministic=False)
    head = [next(executor) for _ in range(cut)]
    state = json.loads(json.dumps({"parent": executor.parent_state(), "own": executor.own_state()}))
    executor.close()
    _, restored = _executor(items, work=work, deterministic=False)
    restored.restore(state["parent"], state["own"])
    tail = _drain(restored)
    restored.close()
    assert sorted(head + tail) == items, (cut, head, tail, state)


def test_unordered_state_lists_elements_returned_ahead_of_a_slow_one():
  release = threading.Event()
  _, executor = _executor(
    range(10), work=_blocked_on_zero(release), parallelism=4, deterministic=False
  )
  head = [next(executor) for _ in range(3)]
  parent_state, own = executor.parent_state(), executor.own_state()
  release.set()
  executor.close()
  assert parent_state == {"op": "list", "own": {"index": 0}, "parents": []}
  assert own["consumed_ahead"] == sorted(head)

  _, restored = _executor(range(10), deterministic=False)
  restored.restore(parent_state, own)
  # Saving again before anything is pulled keeps the returned-ahead list.
  assert restored.own_state() == own
  assert restored.parent_state() == parent_state
  tail = [value for value, _ in _drain(restored)]
  restored.close()
  assert sorted(head + tail) == list(range(10))
  assert not set(head) & set(tail)


def test_worker_exception_surfaces_in_order_with_its_traceback_and_iteration_goes_on():

  def explode_on_three(x, seed):
    if x == 3:
      raise KeyError(f"bad element {x}")
    return x

  _, executor = _executor(range(6), work=explode_on_three, parallelism=3)
  assert [next(executor) for _ in range(3)] == [0, 1, 2]
  with pytest.raises(KeyError, match="bad element 3") as info:
    next(executor)
  frames = [frame.name for frame in traceback.extract_tb(info.value.__traceback__)]
  assert "explode_on_three" in frames
  assert _drain(executor) == [4, 5]
  executor.close()


@pytest.mark.parametrize("deterministic", [True, False])
def test_parent_exception_surfaces_at_its_position(deterministic):
  items = [0, 1, ValueError("input broke"), 3]
  _, executor = _executor(items, work=lambda x, s: x, parallelism=2, deterministic=deterministic)
  got = []
  for _ in range(4):
    try:
      got.append(next(executor))
    except ValueError as exc:
      got.append(str(exc))
  with pytest.raises(StopIteration):
    next(executor)
  executor.close()
  if deterministic:
    assert got == [0, 1, "input broke", 3]
  else:
    assert sorted(map(str, got)) == ["0", "1", "3", "input broke"]


def test_close_joins_every_worker_thread():
  before = threading.enumerate()
  _, executor = _executor(range(100), parallelism=5)
  for _ in range(10):
    next(executor)
  assert len(new_threads(before)) == 5
  check_close(executor, before)


def test_garbage_collecting_an_unclosed_iterator_stops_its_threads():
  before = threading.enumerate()
  ds = Dataset.range(100).map(lambda x: x + 1, num_parallel_calls=4)
  it = ds.node.make_iterator()
  for _ in range(10):
    next(it)
  assert len(new_threads(before)) == 4
  ref = weakref.ref(it)
  del it
  gc.collect()
  assert ref() is None  # threads hold no reference to the iterator
  assert new_threads(before) == []


def test_parallelism_can_grow_and_shrink_while_running():
  before = threading.enumerate()
  parent, executor = _executor(range(200), parallelism=2)
  out = [next(executor) for _ in range(5)]
  executor.parallelism = 6
  out.append(next(executor))
  assert executor.num_threads == 6
  returned = len(out)
  for _ in range(20):
    out.append(next(executor))
    returned += 1
    assert parent.pulls - returned <= 6
  executor.parallelism = 1
  out += _drain(executor)
  assert out == [(i, 1000 + i) for i in range(200)]
  executor.close()
  assert new_threads(before) == []
  with pytest.raises(ValueError, match="parallelism must be >= 1"):
    executor.parallelism = 0


def test_parallelism_shrink_retires_threads():
  _, executor = _executor(range(100), parallelism=4)
  next(executor)
  executor.parallelism = 1
  _drain(executor)
  wait_until(lambda: executor.num_threads <= 1)
  assert executor.num_threads == 1
  executor.close()


def test_autotune_starts_from_the_default_and_exposes_a_parallelism_knob():
  it = MapNode(Dataset.range(10).node, lambda x: x, num_parallel_calls=AUTOTUNE).make_iterator()
  assert it.parallelism == min(os.cpu_count(), 8)
  [knob] = it.tunables()
  assert knob.kind == "threads" and knob.get() == it.parallelism
  knob.set(3)
  assert it.parallelism == 3 and knob.get() == 3
  assert list(it) == list(range(10))
  assert knob.wait_s() >= 0.0 and knob.busy_s() >= 0.0
  it.close()
  fixed = MapNode(Dataset.range(3).node, lambda x: x, num_parallel_calls=3).make_iterator()
  assert fixed.tunables() == []
  fixed.close()


def test_sequential_state_restores_into_parallel_iterator_and_back():
  node = Dataset.range(20).node
  sequential = MapNode(node, lambda x: x * 3).make_iterator()
  head = [next(sequential) for _ in range(7)]
  state = json.loads(json.dumps(sequential.get_state()))
  par = MapNode(node, lambda x: x * 3, num_parallel_calls=4).make_iterator()
  par.set_state(state)
  assert head + list(par) == [i * 3 for i in range(20)]
  par.set_state(state)
  next(par)
  state2 = par.get_state()
  par.close()
  back = MapNode(node, lambda x: x * 3).make_iterator()
  back.set_state(state2)
  assert list(back) == [i * 3 for i in range(8, 20)]


def test_restoring_an_out_of_order_state_into_a_sequential_map_fails_clearly():
  node = Dataset.range(5).node
  it = MapNode(node, lambda x: x).make_iterator()
  state = it.get_state()
  state["own"] = {"consumed_ahead": [2]}
  with pytest.raises(PipelineStateError, match="out of order"):
    it.set_state(state)
  with pytest.raises(PipelineStateError, match="consumed_ahead"):
    par = MapNode(node, lambda x: x, num_parallel_calls=2).make_iterator()
    state["own"] = {"consumed_ahead": "x"}
    par.set_state(state)
  par.close()


@pytest.mark.parametrize("deterministic", [True, False])
def test_state_replays_from_a_recent_anchor_and_resumes_exactly(deterministic):
  items = list(range(150))
  _, reference = _executor(items, deterministic=deterministic)
  expected = sorted(_drain(reference))
  reference.close()
  for cut in (1, 31, 32, 33, 64, 100, 149, 150):
    _, executor = _executor(items, deterministic=deterministic)
    head = [next(executor) for _ in range(cut)]
    parent_state = json.loads(json.dumps(executor.parent_state()))
    own = json.loads(json.dumps(executor.own_state()))
    executor.close()
    assert own["skip"] < parallel.ANCHOR_INTERVAL + 4  # a bounded replay
    parent, restored = _executor(items, deterministic=deterministic)
    restored.restore(parent_state, own)
    tail = _drain(restored)
    restored.close()
    assert sorted(head + tail) == expected
    if deterministic:
      assert head + tail == [(i, 1000 + i) for i in items]


def _thread_recording(cost_s=lambda x: 0.0):
  threads = {}

  def work(x, seed):
    threads[x] = threading.current_thread()
    if cost_s(x):
      time.sleep(cost_s(x))
    return x

  return threads, work


def test_with_timing_off_all_work_runs_on_worker_threads():
  threads, work = _thread_recording()
  _, executor = _executor(range(300), work=work, parallelism=1)
  assert _drain(executor) == list(range(300))
  executor.close()
  assert threading.main_thread() not in threads.values()


def test_cheap_ordered_work_moves_into_the_consumer(monkeypatch):
  monkeypatch.setattr(parallel_executor, "INLINE_BELOW_S", 100e-6)
  threads, work = _thread_recording()
  _, executor = _executor(range(600), work=work, parallelism=3)
  assert _drain(executor) == list(range(600))
  executor.close()
  main = threading.main_thread()
  assert sum(t is main for t in threads.values()) >= 600 - parallel_executor.PROBE_INTERVAL


def test_expensive_work_stays_on_the_threads(monkeypatch):
  monkeypatch.setattr(parallel_executor, "INLINE_BELOW_S", 100e-6)
  threads, work = _thread_recording(lambda x: 0.0003)
  _, executor = _executor(range(40), work=work, parallelism=3)
  assert _drain(executor) == list(range(40))
  executor.close()
  in_consumer = [x for x, t in threads.items() if t is threading.main_thread()]
  assert in_consumer == list(range(parallel_executor.PROBE_LENGTH))  # the probe


def test_threads_reading_batches_take_runs_of_consecutive_elements():
  # One hand-off per run of CHUNK elements, not per element: each thread
  # works through consecutive elements.
  chunk = parallel_executor.CHUNK
  threads = {}

  def work(x, seed):
    threads[int(x)] = threading.current_thread()
    return np.full(1 << 14, x, np.float32)  # worth placing into the batch

  _, executor = _executor(range(256), work=work, parallelism=2)
  batches = [executor.next_batch(64)[0] for _ in range(4)]
  executor.close()
  np.testing.assert_array_equal(np.concatenate(batches)[:, 0], np.arange(256))
  runs, start = [], 0
  for x in range(1, 257):
    if x == 256 or threads[x] is not threads[start]:
      runs.append(x - start)
      start = x
  assert all(run % chunk == 0 for run in runs), runs
  assert len(set(threads.values())) == 2


def test_cheap_work_in_the_consumer_raises_input_errors_in_order_and_resumes(monkeypatch):
  # The consumer's fast path (nothing in flight, no anchors): an input
  # error is an element of its own, and a state taken there resumes exactly.
  monkeypatch.setattr(parallel_executor, "INLINE_BELOW_S", 100e-6)
  items = list(range(600))
  items[400] = ValueError("bad record 400")
  parent = ListNode(items)
  executor = parallel.ParallelExecutor(parent.make_iterator(), lambda x, seed: x, 2, True, "test")
  out = [next(executor) for _ in range(400)]
  state = (executor.parent_state(), executor.own_state())
  with pytest.raises(ValueError, match="bad record 400"):
    next(executor)
  out += _drain(executor)
  assert out == list(range(400)) + list(range(401, 600))
  again = parallel.ParallelExecutor(parent.make_iterator(), lambda x, seed: x, 2, True, "test")
  again.restore(*state)
  with pytest.raises(ValueError, match="bad record 400"):
    next(again)
  assert _drain(again) == list(range(401, 600))
  executor.close()
  again.close()


def test_unordered_work_never_runs_in_the_consumer(monkeypatch):
  monkeypatch.setattr(parallel_executor, "INLINE_BELOW_S", 100e-6)
  threads, work = _thread_recording()
  _, executor = _executor(range(300), work=work, deterministic=False)
  assert sorted(_drain(executor)) == list(range(300))
  executor.close()
  assert threading.main_thread() not in threads.values()


def test_work_getting_dearer_goes_back_to_threads_and_resume_stays_exact(monkeypatch):
  monkeypatch.setattr(parallel_executor, "INLINE_BELOW_S", 100e-6)
  threads, work = _thread_recording(lambda x: 0.0005 if x >= 300 else 0.0)
  items = list(range(360))
  _, executor = _executor(items, work=work, parallelism=3)
  assert _drain(executor) == items
  executor.close()
  main = threading.main_thread()
  assert threads[200] is main  # cheap: in the consumer
  assert any(threads[x] is not main for x in range(300, 360))
  for cut in (0, 150, 299, 300, 305, 359):
    _, executor = _executor(items, work=work, parallelism=3)
    head = [next(executor) for _ in range(cut)]
    parent_state = json.loads(json.dumps(executor.parent_state()))
    own = executor.own_state()
    executor.close()
    _, restored = _executor(items, work=work, parallelism=3)
    restored.restore(parent_state, own)
    assert head + _drain(restored) == items
    restored.close()


def test_unordered_upstream_makes_anchors_per_element():
  unordered = Dataset.range(30).map(lambda x: x, num_parallel_calls=3, deterministic=False)
  assert parallel.replays_identically(Dataset.range(3).node.make_iterator())
  it = unordered.node.make_iterator()
  assert not parallel.replays_identically(it)
  assert parallel.anchor_interval(it) == 1
  it.close()


@pytest.mark.parametrize("outer", ["map", "prefetch"])
def test_ops_over_an_unordered_map_resume_exactly_as_a_multiset(outer):
  inner = Dataset.range(40).map(_sleepy, num_parallel_calls=3, deterministic=False)
  ds = inner.map(lambda x: x + 1000, num_parallel_calls=2) if outer == "map" else inner.prefetch(3)
  offset = 1000 if outer == "map" else 0
  resumed = check_resume(
    lambda: ds, cuts=(0, 1, 5, 17, 39, 40), make_iterator=graph_iterator, same=assert_same_multiset
  )
  assert sorted(int(x) for x in resumed.expected) == [i + offset for i in range(40)]


def _sleepy(x):
  time.sleep(0.0005 * (int(x) % 3))
  return x


@pytest.mark.parametrize("value", [0, -2, 1.5, "4", True])
def test_invalid_num_parallel_calls_is_rejected(value):
  with pytest.raises(ValueError, match="num_parallel_calls"):
    parallel.check_num_parallel_calls(value, "map")


def test_validators_accept_what_tf_data_accepts(tf):
  assert parallel.check_num_parallel_calls(None, "map") is None
  assert parallel.check_num_parallel_calls(np.int64(3), "map") == 3
  assert parallel.check_num_parallel_calls(jaxfeed.AUTOTUNE, "map") == AUTOTUNE
  assert parallel.check_num_parallel_calls(tf.data.AUTOTUNE, "map") == AUTOTUNE
  assert parallel.check_deterministic(None, "map") is True
  with pytest.raises(TypeError, match="deterministic"):
    parallel.check_deterministic("yes", "map")
  with pytest.raises(TypeError, match="fn must be callable"):
    parallel.check_callable(3, "map")


def test_call_unpacked_unpacks_plain_tuples_only():
  import collections

  pair = collections.namedtuple("Pair", "a b")
  assert parallel.call_unpacked(lambda a, b: a + b, (1, 2)) == 3
  assert parallel.call_unpacked(lambda p: p.a, pair(1, 2)) == 1
  assert parallel.call_unpacked(lambda d: d["a"], {"a": 5}) == 5
  assert parallel.call_unpacked(lambda l: len(l), [1, 2, 3]) == 3


# -- process backend --------------------------------------------------------
# Module level, so that worker processes can import them.
def square_dict(d):
  return {"sq": d["v"] * d["v"], "id": d["id"]}


def add_pair(a, b):
  return a + b


def noisy(x, rng):
  return np.array([int(x), rng.integers(0, 1 << 30)])


def fails_on_two(d):
  if d["id"] == 2:
    raise FloatingPointError("bad two")
  return d


def _live_children():
  """This process's child processes that run."""
  return {
    p.pid
    for p in psutil.Process().children(recursive=True)
    if p.is_running() and p.status() != psutil.STATUS_ZOMBIE
  }


def _dict_source():
  return Dataset.from_tensor_slices(
    {"v": np.arange(12, dtype=np.float64).reshape(6, 2), "id": np.arange(6)}
  )


def _as_lists(elements):
  return [{k: np.asarray(v).tolist() for k, v in e.items()} for e in elements]


def test_process_backend_matches_threads_resumes_exactly_and_leaks_nothing():
  children_before, shared_before = _live_children(), memfds()
  ds = _dict_source().map(square_dict, num_parallel_calls=2, backend="process")
  expected = _as_lists(_dict_source().map(square_dict).node.make_iterator())
  it = ds.node.make_iterator()
  head = [next(it) for _ in range(3)]
  state = json.loads(json.dumps(it.get_state()))
  rest = list(it)
  assert _as_lists(head + rest) == expected
  it.set_state(state)  # same iterator: in-flight work is discarded
  assert _as_lists(head + list(it)) == expected
  pids, shared = it._pool.pids(), memfds()
  assert len(pids) == 2 and shared - shared_before  # a block per worker
  it.close()
  assert _live_children() == children_before
  assert memfds() <= shared_before

  pairs = Dataset.from_tensor_slices((np.arange(5), np.arange(5) * 10))
  with pairs.map(add_pair, backend="process").node.make_iterator() as seq:
    assert [int(x) for x in seq] == [11 * i for i in range(5)]
  assert _live_children() == children_before


def test_process_backend_random_map_gives_the_thread_backend_values():
  children_before = _live_children()
  threads = RandomMapNode(Dataset.range(8).node, noisy, seed=3, num_parallel_calls=2)
  processes = RandomMapNode(Dataset.range(8).node, noisy, seed=3, backend="process")
  with threads.make_iterator() as a, processes.make_iterator() as b:
    assert [x.tolist() for x in a] == [x.tolist() for x in b]
  assert _live_children() == children_before


def test_process_backend_errors_surface_and_garbage_collection_stops_workers():
  children_before, shared_before = _live_children(), memfds()
  ds = _dict_source().map(fails_on_two, num_parallel_calls=2, backend="process")
  it = ds.node.make_iterator()
  assert [int(next(it)["id"]) for _ in range(2)] == [0, 1]
  with pytest.raises(FloatingPointError, match="bad two"):
    next(it)
  assert [int(e["id"]) for e in it] == [3, 4, 5]
  del it
  gc.collect()
  assert _live_children() == children_before
  assert memfds() <= shared_before


def test_process_backend_runs_lambdas_and_keeps_unshippable_functions_on_threads(caplog):
  children_before = _live_children()
  factor = np.float64(1.5)
  with (
    Dataset.range(4)
    .map(lambda x: x * factor, num_parallel_calls=2, backend="process")
    .node.make_iterator() as it
  ):
    assert [float(x) for x in it] == [0.0, 1.5, 3.0, 4.5]
    assert len(it._pool.pids()) >= 1
  assert _live_children() == children_before
  lock = threading.Lock()
  with caplog.at_level(logging.WARNING, logger="jaxfeed"):
    with (
      Dataset.range(3)
      .map(lambda x: (lock, x)[1], num_parallel_calls=2, backend="process")
      .node.make_iterator() as it
    ):
      assert [int(x) for x in it] == [0, 1, 2]
      assert it._pool is None
  [line] = [r.getMessage() for r in caplog.records]
  assert "on threads" in line and "lock" in line
