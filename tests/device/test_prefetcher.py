"""Tests of DevicePrefetcher: order, bounded read-ahead, exact state, errors, leaks.

Batches go to the default devices (`jax.devices()`: 8 CPU devices in CI, the
GPUs on a GPU host; BATCH rows split over 1, 2, 4 or 8 of them), except in
tests of CPU-only behaviour, which place on the 8 CPU devices tests/conftest.py
asks for; those exist next to any accelerator.
"""

import gc
import json
import threading
import time
import traceback

import jax
import numpy as np
import pytest

from cpu_mesh import cpu_batch_sharding
from jaxfeed.device import DevicePrefetcher, batch_sharding

BATCH = 8


class PipelineFailure(Exception):
  """Raised by the test iterator at a chosen batch."""


class CountingIterator:
  """Host batches with explicit state: batch i holds rows i*BATCH.. of a range."""

  def __init__(self, num_batches=6, fail_at=None, with_state=True):
    self.num_batches = num_batches
    self.fail_at = fail_at
    self.position = 0
    self.produced = 0
    self.closed = False
    if not with_state:
      self.get_state = None
      self.set_state = None

  def __iter__(self):
    return self

  def __next__(self):
    if self.position == self.fail_at:
      self.position += 1
      raise_pipeline_failure(self.position - 1)
    if self.position >= self.num_batches:
      raise StopIteration
    rows = np.arange(self.position * BATCH, (self.position + 1) * BATCH)
    self.position += 1
    self.produced += 1
    return {
      "x": rows.astype(np.float32)[:, None] * np.ones((1, 3), np.float32),
      "index": rows.astype(np.int32),
      "step": np.int32(self.position - 1),
    }

  def get_state(self):
    return {"position": self.position}

  def set_state(self, state):
    self.position = state["position"]

  def close(self):
    self.closed = True


def raise_pipeline_failure(step):
  raise PipelineFailure(f"bad record in batch {step}")


def expected_steps(start, stop):
  return list(range(start, stop))


def steps_of(batches):
  return [int(b["step"]) for b in batches]


def wait_until(condition, timeout_s=10.0):
  """Polls until `condition()` holds; fails the test if it never does."""
  deadline = time.monotonic() + timeout_s
  while not condition():
    assert time.monotonic() < deadline, "condition not reached"
    time.sleep(0.005)


def prefetch_threads():
  return [t for t in threading.enumerate() if t.name == "jaxfeed-device-prefetch"]


@pytest.fixture(autouse=True)
def no_leaked_threads():
  before = set(threading.enumerate())
  yield
  gc.collect()
  wait_until(lambda: not (set(threading.enumerate()) - before))


@pytest.mark.parametrize("prefetch", [0, 1, 2, 5])
def test_yields_every_batch_in_order_as_global_arrays(prefetch):
  with DevicePrefetcher(CountingIterator(6), None, prefetch=prefetch) as it:
    batches = list(it)
  assert steps_of(batches) == expected_steps(0, 6)
  for step, batch in enumerate(batches):
    assert isinstance(batch["x"], jax.Array)
    assert batch["x"].sharding == batch_sharding()
    np.testing.assert_array_equal(
      np.asarray(batch["index"]), np.arange(step * BATCH, (step + 1) * BATCH)
    )


@pytest.mark.parametrize("prefetch", [1, 2, 4])
def test_read_ahead_is_bounded_by_prefetch(prefetch):
  host = CountingIterator(20)
  with DevicePrefetcher(host, None, prefetch=prefetch) as it:
    wait_until(lambda: host.produced == prefetch)
    time.sleep(0.05)  # Room to overshoot if the bound were broken.
    assert host.produced == prefetch
    for consumed in range(1, 4):
      next(it)
      wait_until(lambda: host.produced == consumed + prefetch)
      time.sleep(0.05)
      assert host.produced == consumed + prefetch


def test_synchronous_mode_reads_nothing_ahead_and_starts_no_thread():
  host = CountingIterator(5)
  with DevicePrefetcher(host, None, prefetch=0) as it:
    assert not prefetch_threads()
    next(it)
    next(it)
    assert host.produced == 2


@pytest.mark.parametrize("prefetch", [0, 1, 3])
@pytest.mark.parametrize("consumed", [0, 1, 4])
def test_state_is_that_of_last_consumed_batch_despite_read_ahead(prefetch, consumed):
  host = CountingIterator(8)
  with DevicePrefetcher(host, None, prefetch=prefetch) as it:
    for _ in range(consumed):
      next(it)
    if prefetch:
      wait_until(lambda: host.produced == min(8, consumed + prefetch))
    state = it.get_state()
  assert state == {"position": consumed}
  json.dumps(state)
  with DevicePrefetcher(CountingIterator(8), None, prefetch=prefetch) as resumed:
    resumed.set_state(state)
    assert steps_of(resumed) == expected_steps(consumed, 8)


@pytest.mark.parametrize("prefetch", [0, 2])
def test_set_state_mid_iteration_rewinds_and_discards_read_ahead(prefetch):
  with DevicePrefetcher(CountingIterator(8), None, prefetch=prefetch) as it:
    next(it)
    saved = it.get_state()
    for _ in range(4):
      next(it)
    it.set_state(saved)
    assert it.get_state() == saved
    assert steps_of(it) == expected_steps(1, 8)


@pytest.mark.parametrize("prefetch", [0, 2])
def test_state_after_exhaustion_is_end_state(prefetch):
  with DevicePrefetcher(CountingIterator(3), None, prefetch=prefetch) as it:
    assert len(list(it)) == 3
    with pytest.raises(StopIteration):
      next(it)
    assert it.get_state() == {"position": 3}


@pytest.mark.parametrize("prefetch", [0, 1, 3])
def test_pipeline_exception_reaches_consumer_with_traceback(prefetch):
  with DevicePrefetcher(CountingIterator(6, fail_at=2), None, prefetch=prefetch) as it:
    assert steps_of([next(it), next(it)]) == [0, 1]
    with pytest.raises(PipelineFailure, match="bad record in batch 2") as info:
      next(it)
    formatted = "".join(traceback.format_exception(info.value))
    assert "raise_pipeline_failure" in formatted
    # The failure is sticky: the iterator does not skip the bad batch.
    with pytest.raises(PipelineFailure):
      next(it)
    assert it.get_state() == {"position": 2}


@pytest.mark.parametrize("prefetch", [0, 2])
def test_bad_batch_size_error_reaches_consumer(prefetch):
  class OddBatches(CountingIterator):
    def __next__(self):
      batch = super().__next__()
      return {"x": batch["x"][:6]}

  with DevicePrefetcher(OddBatches(3), cpu_batch_sharding(), prefetch=prefetch) as it:
    with pytest.raises(ValueError, match=r"\['x'\] has local batch size 6.*divisible by 8"):
      next(it)
    # Sticky like a pipeline exception.
    with pytest.raises(ValueError, match="divisible by 8"):
      next(it)


@pytest.mark.parametrize("prefetch", [0, 2])
def test_placement_error_on_default_devices_reaches_consumer(prefetch):
  # Fails on any number of default devices (a size check might not).
  class TextBatches(CountingIterator):
    def __next__(self):
      batch = super().__next__()
      return {**batch, "text": np.array(["row"] * BATCH)}

  with DevicePrefetcher(TextBatches(3), None, prefetch=prefetch) as it:
    with pytest.raises(TypeError, match=r"leaf \['text'\] has dtype <U3"):
      next(it)
    with pytest.raises(TypeError, match="has dtype"):
      next(it)


def test_close_stops_thread_and_closes_host_iterator_idempotently():
  host = CountingIterator(100)
  it = DevicePrefetcher(host, None, prefetch=3)
  next(it)
  assert len(prefetch_threads()) == 1
  it.close()
  it.close()
  assert not prefetch_threads()
  assert host.closed
  with pytest.raises(RuntimeError, match="after close"):
    next(it)


def test_context_manager_closes():
  host = CountingIterator(100)
  with DevicePrefetcher(host, None, prefetch=2) as it:
    next(it)
  assert host.closed
  assert not prefetch_threads()


def test_unclosed_prefetcher_is_stopped_by_gc():
  host = CountingIterator(100)
  it = DevicePrefetcher(host, None, prefetch=2)
  next(it)
  assert len(prefetch_threads()) == 1
  del it
  gc.collect()
  assert not prefetch_threads()
  assert host.closed


def test_iterator_without_state_iterates_but_cannot_checkpoint():
  with DevicePrefetcher(CountingIterator(2, with_state=False), None) as it:
    assert steps_of(it) == [0, 1]
    with pytest.raises(TypeError, match="has no get_state"):
      it.get_state()
    with pytest.raises(TypeError, match="has no set_state"):
      it.set_state({"position": 0})


def test_plain_python_iterator_is_accepted():
  batches = [{"x": np.full((8,), i, np.float32)} for i in range(3)]
  with DevicePrefetcher(iter(batches), None) as it:
    assert [float(b["x"][0]) for b in it] == [0.0, 1.0, 2.0]


@pytest.mark.parametrize("prefetch", [-1, 1.5, True, "2"])
def test_invalid_prefetch_is_rejected(prefetch):
  with pytest.raises(ValueError, match="prefetch must be an integer >= 0"):
    DevicePrefetcher(CountingIterator(), None, prefetch=prefetch)


def test_non_iterator_is_rejected():
  with pytest.raises(TypeError, match="must be an iterator"):
    DevicePrefetcher([1, 2, 3], None)


def test_host_that_reads_ahead_is_placed_inline_on_cpu_devices():
  host = CountingIterator(6)
  sharding = cpu_batch_sharding()
  with DevicePrefetcher(host, sharding, prefetch=2, host_reads_ahead=True) as it:
    assert it.places_inline
    assert not prefetch_threads()
    batches = [next(it), next(it)]
    # Nothing read beyond what next() returned: the host does the read-ahead.
    assert host.produced == 2
    assert it.get_state() == {"position": 2}
    batches += list(it)
  assert steps_of(batches) == expected_steps(0, 6)
  assert batches[0]["x"].sharding == sharding


def test_host_without_read_ahead_keeps_the_placement_thread():
  with DevicePrefetcher(CountingIterator(3), None, prefetch=2) as it:
    assert not it.places_inline
    assert len(prefetch_threads()) == 1
    assert steps_of(list(it)) == expected_steps(0, 3)


def test_sharding_function_keeps_the_placement_thread():
  # A sharding function may name any device, so it is not known to be CPU.
  with DevicePrefetcher(
    CountingIterator(3), lambda leaf: batch_sharding(), prefetch=2, host_reads_ahead=True
  ) as it:
    assert not it.places_inline
    assert steps_of(list(it)) == expected_steps(0, 3)
