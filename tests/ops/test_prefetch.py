"""Tests of the prefetch op: tf.data equality, bounded buffer, exact resume."""

import gc
import json
import os
import threading
import time
import weakref

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import tensorflow as tf  # pylint: disable=g-import-not-at-top

import jaxfeed
from jaxfeed.dataset import Dataset
from jaxfeed.ops.base import Node, OpIterator, PipelineStateError
from jaxfeed.ops.prefetch import (DEFAULT_AUTOTUNE_BUFFER_SIZE, PrefetchNode)

BUFFER_SIZES = [0, 1, 3, jaxfeed.AUTOTUNE]


class CountingNode(Node):
  """A test input of `items` (Exception items are raised) counting pulls."""

  op_name = "counting"

  def __init__(self, items, gate=None):
    """`gate`: an Event that pulls after the first one wait for."""
    super().__init__()
    self.items, self.gate = list(items), gate
    self.pulls = 0
    self.waiting = threading.Event()  # set while a pull waits on the gate

  def make_iterator(self):
    return CountingIterator(self)


class CountingIterator(OpIterator):
  op_name = "counting"

  def __init__(self, node):
    super().__init__()
    self.node = node
    self.index = 0

  def __next__(self):
    node = self.node
    if node.gate is not None and self.index >= 1:
      node.waiting.set()
      node.gate.wait()
    if self.index >= len(node.items):
      raise StopIteration
    item = node.items[self.index]
    self.index += 1
    node.pulls += 1
    if isinstance(item, Exception):
      raise item
    return item

  @property
  def last_seed(self):
    return 500 + self.index

  def _get_own_state(self):
    return {"index": self.index}

  def _set_own_state(self, state):
    self.index = state["index"]


def _ours(ds):
  return ds.node.make_iterator()


def _canonical(element):
  if isinstance(element, dict):
    return tuple(sorted((k, _canonical(v)) for k, v in element.items()))
  if isinstance(element, (tuple, list)):
    return tuple(_canonical(v) for v in element)
  array = np.asarray(element)
  return (str(array.dtype), array.shape, array.tobytes())


def _new_threads(before):
  return [t for t in threading.enumerate() if t not in before and t.is_alive()]


def _wait_until(condition):
  deadline = time.monotonic() + 30
  while not condition():
    assert time.monotonic() < deadline, "condition not reached"
    time.sleep(0.005)


A = np.arange(10, dtype=np.int32)
CASES = {
    "range": (lambda: Dataset.range(20), lambda: tf.data.Dataset.range(20)),
    "tuple": (lambda: Dataset.from_tensor_slices((A, A * 2.5)),
              lambda: tf.data.Dataset.from_tensor_slices((A, A * 2.5))),
    "dict": (lambda: Dataset.from_tensor_slices({"x": A, "y": A[:, None]}),
             lambda: tf.data.Dataset.from_tensor_slices(
                 {"x": A, "y": A[:, None]})),
    "empty": (lambda: Dataset.range(0), lambda: tf.data.Dataset.range(0)),
}


@pytest.mark.parametrize("buffer_size", BUFFER_SIZES)
@pytest.mark.parametrize("case", sorted(CASES))
def test_prefetch_matches_tf_data(case, buffer_size):
  make_ours, make_tf = CASES[case]
  ds = make_ours().prefetch(buffer_size)
  with _ours(ds) as it:
    ours = [_canonical(e) for e in it]
  theirs = [_canonical(e) for e in
            make_tf().prefetch(buffer_size).as_numpy_iterator()]
  assert ours == theirs
  assert ds.cardinality() == int(make_tf().prefetch(buffer_size).cardinality())


@pytest.mark.parametrize("buffer_size", [1, 2, 5])
def test_buffer_is_bounded_while_the_consumer_stalls(buffer_size):
  node = CountingNode(range(100))
  with PrefetchNode(node, buffer_size).make_iterator() as it:
    returned = 0
    for target in (1, 4, 9):
      while returned < target:
        next(it)
        returned += 1
      # The consumer stalls: the producer fills the buffer, then stops pulling.
      _wait_until(lambda: it.num_buffered == buffer_size)
      assert node.pulls == returned + buffer_size


def test_autotune_starts_at_the_default_and_the_tuner_can_resize_the_buffer():
  node = CountingNode(range(100))
  with PrefetchNode(node, jaxfeed.AUTOTUNE).make_iterator() as it:
    [knob] = it.tunables()
    assert knob.kind == "buffer" and knob.get() == DEFAULT_AUTOTUNE_BUFFER_SIZE
    next(it)
    _wait_until(lambda: it.num_buffered == DEFAULT_AUTOTUNE_BUFFER_SIZE)
    assert node.pulls == 1 + DEFAULT_AUTOTUNE_BUFFER_SIZE
    knob.set(7)
    _wait_until(lambda: it.num_buffered == 7)
    assert node.pulls == 8 and it.buffer_size == 7
    assert knob.unit_bytes() > 0
  assert PrefetchNode(node, 3).make_iterator().tunables() == []


@pytest.mark.parametrize("buffer_size", BUFFER_SIZES)
def test_resume_at_every_cut_point_is_exact(buffer_size):
  ds = Dataset.from_tensor_slices({"x": A, "y": A * 3}).prefetch(buffer_size)
  with _ours(ds) as it:
    expected = [_canonical(e) for e in it]
  for cut in range(len(A) + 1):
    with _ours(ds) as it:
      head = [_canonical(next(it)) for _ in range(cut)]
      time.sleep(0.001)  # let the producer run ahead of the consumer
      state = json.loads(json.dumps(it.get_state()))
    with _ours(ds) as restored:
      restored.set_state(state)
      assert head + [_canonical(e) for e in restored] == expected


def test_resume_of_parallel_map_under_prefetch_is_exact():
  ds = (Dataset.range(40).map(lambda x: x * x, num_parallel_calls=4)
        .prefetch(3).map(lambda x: x + 1, num_parallel_calls=2).prefetch(2))
  expected = [i * i + 1 for i in range(40)]
  for cut in range(0, 41, 3):
    with _ours(ds) as it:
      head = [int(next(it)) for _ in range(cut)]
      state = json.loads(json.dumps(it.get_state()))
      # Restoring into the same, running iterator also works.
      it.set_state(state)
      assert head + [int(x) for x in it] == expected
    with _ours(ds) as restored:
      restored.set_state(state)
      assert head + [int(x) for x in restored] == expected


def test_seeds_travel_with_their_elements():
  node = CountingNode(range(6))
  with PrefetchNode(node, 4).make_iterator() as it:
    seeds = []
    for _ in it:
      seeds.append(it.last_seed)
  assert seeds == [501, 502, 503, 504, 505, 506]


def test_end_and_errors_pass_through_in_order_and_iteration_continues():
  node = CountingNode([0, 1, KeyError("broken record"), 3])
  with PrefetchNode(node, 2).make_iterator() as it:
    assert [next(it), next(it)] == [0, 1]
    with pytest.raises(KeyError, match="broken record"):
      next(it)
    assert next(it) == 3
    with pytest.raises(StopIteration):
      next(it)
    with pytest.raises(StopIteration):
      next(it)


def test_producer_traceback_is_kept():
  def explode(x):
    if x == 2:
      raise ArithmeticError("in the producer")
    return x

  ds = Dataset.range(5).map(explode).prefetch(2)
  with _ours(ds) as it:
    next(it), next(it)
    with pytest.raises(ArithmeticError) as info:
      next(it)
  import traceback
  names = [f.name for f in traceback.extract_tb(info.value.__traceback__)]
  assert "explode" in names


def test_close_stops_a_producer_blocked_on_a_full_buffer():
  before = threading.enumerate()
  node = CountingNode(range(1000))
  it = PrefetchNode(node, 2).make_iterator()
  next(it)
  _wait_until(lambda: it.num_buffered == 2)
  assert len(_new_threads(before)) == 1
  it.close()
  it.close()
  assert _new_threads(before) == []
  with pytest.raises(RuntimeError, match="closed"):
    next(it)


def test_close_stops_a_producer_waiting_on_a_slow_input():
  before = threading.enumerate()
  gate = threading.Event()
  node = CountingNode(range(10), gate=gate)
  it = PrefetchNode(node, 4).make_iterator()
  assert next(it) == 0
  node.waiting.wait()  # the producer is inside the input's next()
  buffer = it._buffer
  closer = threading.Thread(target=it.close)
  closer.start()
  _wait_until(lambda: buffer.stop)  # close() has asked the producer to stop
  gate.set()  # the input returns its element; the producer must stop then
  closer.join()
  assert _new_threads(before) == []
  assert node.pulls == 2  # nothing pulled after the close


def test_garbage_collection_stops_the_producer():
  before = threading.enumerate()
  it = _ours(Dataset.range(1000).map(lambda x: x, num_parallel_calls=2)
             .prefetch(3))
  next(it)
  ref = weakref.ref(it)
  del it
  gc.collect()
  assert ref() is None
  assert _new_threads(before) == []


def test_invalid_buffer_size_and_state_are_rejected():
  with pytest.raises(ValueError, match="prefetch: buffer_size must be"):
    PrefetchNode(Dataset.range(3).node, -5)
  with pytest.raises(ValueError, match="prefetch: buffer_size must be"):
    PrefetchNode(Dataset.range(3).node, 1.5)
  it = PrefetchNode(Dataset.range(3).node, 2).make_iterator()
  state = it.get_state()
  state["own"] = {}
  with pytest.raises(PipelineStateError, match="prefetch"):
    it.set_state(state)
  it.close()


def test_spec_params_rebuild_an_equal_node():
  node = PrefetchNode(Dataset.range(3).node, jaxfeed.AUTOTUNE)
  assert node.spec_params() == {"buffer_size": jaxfeed.AUTOTUNE}
  assert PrefetchNode(*node.parents, **node.spec_params()).fingerprint() == (
      node.fingerprint())
