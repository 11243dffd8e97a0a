"""Tests of the prefetch op: tf.data equality, bounded buffer, exact resume."""

import gc
import json
import threading
import traceback
import weakref

import numpy as np
import pytest

import jaxfeed
from jaxfeed.dataset import Dataset
from jaxfeed.ops.base import PipelineStateError
from jaxfeed.ops.prefetch import DEFAULT_AUTOTUNE_BUFFER_SIZE, PrefetchNode
import op_testing
from op_testing import (
  INPUT_KINDS,
  ListNode,
  assert_matches_tf_data,
  assert_same_values,
  check_close,
  check_resume,
  elements_and_seeds,
  graph_iterator,
  new_threads,
  wait_until,
)

tf = op_testing.import_tensorflow()

BUFFER_SIZES = [0, 1, 3, jaxfeed.AUTOTUNE]


@pytest.mark.parametrize("buffer_size", BUFFER_SIZES)
@pytest.mark.parametrize("kind", sorted(INPUT_KINDS))
def test_prefetch_matches_tf_data(kind, buffer_size):
  make = lambda D: INPUT_KINDS[kind](D).prefetch(buffer_size)
  assert_matches_tf_data(make, make_iterator=graph_iterator, same=assert_same_values)
  assert make(Dataset).cardinality() == int(make(tf.data.Dataset).cardinality())


@pytest.mark.parametrize("buffer_size", [1, 2, 5])
def test_buffer_is_bounded_while_the_consumer_stalls(buffer_size):
  node = ListNode(range(100))
  with PrefetchNode(node, buffer_size).make_iterator() as it:
    returned = 0
    for target in (1, 4, 9):
      while returned < target:
        next(it)
        returned += 1
      # The consumer stalls: the producer fills the buffer, then stops pulling.
      wait_until(lambda: it.num_buffered == buffer_size)
      assert node.pulls == returned + buffer_size


def test_autotune_starts_at_the_default_and_the_tuner_can_resize_the_buffer():
  node = ListNode(range(100))
  with PrefetchNode(node, jaxfeed.AUTOTUNE).make_iterator() as it:
    [knob] = it.tunables()
    assert knob.kind == "buffer" and knob.get() == DEFAULT_AUTOTUNE_BUFFER_SIZE
    next(it)
    wait_until(lambda: it.num_buffered == DEFAULT_AUTOTUNE_BUFFER_SIZE)
    assert node.pulls == 1 + DEFAULT_AUTOTUNE_BUFFER_SIZE
    knob.set(7)
    wait_until(lambda: it.num_buffered == 7)
    assert node.pulls == 8 and it.buffer_size == 7
    assert knob.unit_bytes() > 0
  assert PrefetchNode(node, 3).make_iterator().tunables() == []


@pytest.mark.parametrize("buffer_size", BUFFER_SIZES)
def test_resume_at_every_cut_point_is_exact(buffer_size):
  column = np.arange(10, dtype=np.int32)
  ds = Dataset.from_tensor_slices({"x": column, "y": column * 3}).prefetch(buffer_size)
  resumed = check_resume(
    lambda: ds, make_iterator=graph_iterator, same=assert_same_values, pause_s=0.001
  )
  assert len(resumed.states) == len(column) + 1


def test_resume_of_parallel_map_under_prefetch_is_exact():
  ds = (
    Dataset.range(40)
    .map(lambda x: x * x, num_parallel_calls=4)
    .prefetch(3)
    .map(lambda x: x + 1, num_parallel_calls=2)
    .prefetch(2)
  )
  expected = [i * i + 1 for i in range(40)]
  for cut in range(0, 41, 3):
    with graph_iterator(ds) as it:
      head = [int(next(it)) for _ in range(cut)]
      state = json.loads(json.dumps(it.get_state()))
      # Restoring into the same, running iterator also works.
      it.set_state(state)
      assert head + [int(x) for x in it] == expected
    with graph_iterator(ds) as restored:
      restored.set_state(state)
      assert head + [int(x) for x in restored] == expected


def test_seeds_travel_with_their_elements():
  node = ListNode(range(6))
  with PrefetchNode(node, 4).make_iterator() as it:
    _, seeds = elements_and_seeds(it)
  assert seeds == [1000, 1001, 1002, 1003, 1004, 1005]


def test_end_and_errors_pass_through_in_order_and_iteration_continues():
  node = ListNode([0, 1, KeyError("broken record"), 3])
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
  with graph_iterator(ds) as it:
    next(it), next(it)
    with pytest.raises(ArithmeticError) as info:
      next(it)
  names = [f.name for f in traceback.extract_tb(info.value.__traceback__)]
  assert "explode" in names


def test_close_stops_a_producer_blocked_on_a_full_buffer():
  before = threading.enumerate()
  node = ListNode(range(1000))
  it = PrefetchNode(node, 2).make_iterator()
  next(it)
  wait_until(lambda: it.num_buffered == 2)
  assert len(new_threads(before)) == 1
  check_close(it, before)


def test_close_stops_a_producer_waiting_on_a_slow_input():
  before = threading.enumerate()
  gate = threading.Event()
  node = ListNode(range(10), gate=gate)
  it = PrefetchNode(node, 4).make_iterator()
  assert next(it) == 0
  node.waiting.wait()  # the producer is inside the input's next()
  buffer = it._buffer
  closer = threading.Thread(target=it.close)
  closer.start()
  wait_until(lambda: buffer.stop)  # close() has asked the producer to stop
  gate.set()  # the input returns its element; the producer must stop then
  closer.join()
  assert new_threads(before) == []
  assert node.pulls == 2  # nothing pulled after the close


def test_garbage_collection_stops_the_producer():
  before = threading.enumerate()
  it = graph_iterator(Dataset.range(1000).map(lambda x: x, num_parallel_calls=2).prefetch(3))
  next(it)
  ref = weakref.ref(it)
  del it
  gc.collect()
  assert ref() is None
  assert new_threads(before) == []


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
  assert PrefetchNode(*node.parents, **node.spec_params()).fingerprint() == (node.fingerprint())
