"""Tests of the map op against tf.data's Dataset.map."""

import collections
import gc
import json
import threading
import traceback

import numpy as np
import pytest

import jaxfeed
from jaxfeed.dataset import Dataset
from jaxfeed.ops.map import MapNode
import op_testing
from op_testing import (
  NUM_PARALLEL_CALLS,
  assert_matches_tf_data,
  assert_same_multiset,
  assert_same_values,
  check_resume,
  graph_iterator,
  new_threads,
  run,
  seeds_of,
)

# A fixture, requested by name.
from op_testing import work_mode  # noqa: F401

tf = op_testing.import_tensorflow()

A = np.arange(12, dtype=np.int32)
B = np.linspace(0.0, 1.0, 12)

# name -> (input from a Dataset class, fn working on numpy and tf values)
CASES = {
  "range_scalar": (lambda D: D.range(17), lambda x: x * 3 + 1),
  "tuple_unpacked": (lambda D: D.from_tensor_slices((A, B)), lambda a, b: (b * 2.0, a + 1)),
  "dict_one_argument": (
    lambda D: D.from_tensor_slices({"a": A, "b": B}),
    lambda d: {"sum": d["b"] + 1.0, "a": d["a"] * 2},
  ),
  "scalar_to_tuple": (lambda D: D.range(9), lambda x: (x, x * x)),
  "empty": (lambda D: D.range(0), lambda x: x + 1),
}


@pytest.mark.parametrize("deterministic", [True, False])
@pytest.mark.parametrize("num_parallel_calls", NUM_PARALLEL_CALLS)
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.usefixtures("work_mode")
def test_map_matches_tf_data(case, num_parallel_calls, deterministic):
  make_input, fn = CASES[case]
  ours_ds = make_input(Dataset).map(
    fn, num_parallel_calls=num_parallel_calls, deterministic=deterministic
  )
  # tf.data only takes `deterministic` together with `num_parallel_calls`.
  theirs_ds = make_input(tf.data.Dataset).map(
    fn,
    num_parallel_calls=num_parallel_calls,
    deterministic=deterministic if num_parallel_calls else None,
  )
  same = assert_same_values if deterministic else assert_same_multiset
  same(run(ours_ds, graph_iterator), run(theirs_ds))
  tf_cardinality = int(make_input(tf.data.Dataset).map(fn).cardinality())
  assert ours_ds.cardinality() == tf_cardinality


def test_map_through_the_facade_with_default_options_matches_tf_data():
  ours = list(Dataset.range(50).map(lambda x: x + 1, num_parallel_calls=3).map(lambda x: x * 2))
  theirs = run(tf.data.Dataset.range(50).map(lambda x: x + 1).map(lambda x: x * 2))
  assert_same_values(ours, theirs)


def test_namedtuple_elements_are_passed_whole_like_tf_data():
  pair = collections.namedtuple("Pair", "a b")
  assert_matches_tf_data(
    lambda D: D.from_tensor_slices(pair(A, B)).map(lambda p: p.a * 2),
    make_iterator=graph_iterator,
    same=assert_same_values,
  )


@pytest.mark.parametrize("deterministic", [True, False])
@pytest.mark.parametrize("num_parallel_calls", NUM_PARALLEL_CALLS)
@pytest.mark.usefixtures("work_mode")
def test_map_resumes_exactly_at_every_cut_point(num_parallel_calls, deterministic):
  ds = Dataset.from_tensor_slices({"a": A, "b": B}).map(
    lambda d: {"a": d["a"] * 2, "b": d["b"]},
    num_parallel_calls=num_parallel_calls,
    deterministic=deterministic,
  )
  resumed = check_resume(
    lambda: ds,
    make_iterator=graph_iterator,
    same=assert_same_values if deterministic else assert_same_multiset,
  )
  assert len(resumed.states) == len(A) + 1


def test_map_restores_into_the_same_running_iterator():
  ds = Dataset.range(30).map(lambda x: x * 2, num_parallel_calls=4)
  with graph_iterator(ds) as it:
    head = [int(next(it)) for _ in range(11)]
    state = it.get_state()
    middle = [int(next(it)) for _ in range(9)]  # work in flight beyond this
    it.set_state(state)
    assert [int(e) for e in it] == list(range(22, 60, 2))
  assert head == list(range(0, 22, 2)) and middle == list(range(22, 40, 2))


@pytest.mark.parametrize("num_parallel_calls", NUM_PARALLEL_CALLS)
def test_map_passes_each_element_seed_through(num_parallel_calls):
  source = Dataset.range(15)
  mapped = source.map(lambda x: -x, num_parallel_calls=num_parallel_calls)
  assert seeds_of(mapped) == seeds_of(source)


def _explode_on_five(x):
  if x == 5:
    raise ZeroDivisionError("no fives")
  return x


@pytest.mark.parametrize("num_parallel_calls", NUM_PARALLEL_CALLS)
def test_fn_exception_surfaces_with_type_and_traceback_then_iteration_continues(num_parallel_calls):
  ds = Dataset.range(8).map(_explode_on_five, num_parallel_calls=num_parallel_calls)
  with graph_iterator(ds) as it:
    assert [int(next(it)) for _ in range(5)] == [0, 1, 2, 3, 4]
    with pytest.raises(ZeroDivisionError, match="no fives") as info:
      next(it)
    names = [f.name for f in traceback.extract_tb(info.value.__traceback__)]
    assert "_explode_on_five" in names
    assert [int(e) for e in it] == [6, 7]


@pytest.mark.parametrize("num_parallel_calls", [4, jaxfeed.AUTOTUNE])
def test_no_threads_leak_after_close_or_garbage_collection(num_parallel_calls):
  before = threading.enumerate()
  ds = Dataset.range(1000).map(lambda x: x, num_parallel_calls=num_parallel_calls)
  it = graph_iterator(ds)
  next(it)
  assert new_threads(before)
  it.close()
  assert not new_threads(before)
  it = graph_iterator(ds)
  next(it)
  del it
  gc.collect()
  assert not new_threads(before)


def test_sequential_map_starts_no_thread():
  before = threading.enumerate()
  with graph_iterator(Dataset.range(5).map(lambda x: x, num_parallel_calls=1)) as it:
    next(it)
    assert not op_testing.new_threads(before)


def test_spec_params_rebuild_an_equal_node_and_keep_batched():
  node = MapNode(
    Dataset.range(4).node,
    _explode_on_five,
    num_parallel_calls=3,
    deterministic=False,
    batched=True,
    backend="thread",
  )
  params = node.spec_params()
  assert params == {
    "fn": _explode_on_five,
    "num_parallel_calls": 3,
    "deterministic": False,
    "batched": True,
    "backend": "thread",
  }
  rebuilt = MapNode(*node.parents, **params)
  assert rebuilt.fingerprint() == node.fingerprint()
  other = MapNode(Dataset.range(4).node, _explode_on_five, batched=False)
  assert other.fingerprint() != node.fingerprint()


def test_batched_flag_does_not_change_map_output():
  plain = list(graph_iterator(Dataset.range(6).map(lambda x: x * 2)))
  batched = list(graph_iterator(Dataset.range(6).map(lambda x: x * 2, batched=True)))
  assert plain == batched


def test_invalid_arguments_are_rejected_with_clear_errors():
  node = Dataset.range(3).node
  with pytest.raises(TypeError, match="map: fn must be callable"):
    MapNode(node, "not a function")
  with pytest.raises(ValueError, match="num_parallel_calls"):
    MapNode(node, abs, num_parallel_calls=0)
  with pytest.raises(ValueError, match="backend must be one of"):
    MapNode(node, abs, backend="gpu")
  with pytest.raises(TypeError, match="batched must be a bool"):
    MapNode(node, abs, batched="yes")


class _Counting:
  def __init__(self):
    self.calls = 0

  def __call__(self, x):
    self.calls += 1
    return x * 2


@pytest.mark.parametrize("num_parallel_calls", NUM_PARALLEL_CALLS)
def test_skip_after_map_matches_tf_data_without_calling_fn_on_skipped(num_parallel_calls):
  fn = _Counting()
  ds = Dataset.range(20).map(fn, num_parallel_calls=num_parallel_calls).skip(7)
  assert_same_values(
    run(ds, graph_iterator), run(tf.data.Dataset.range(20).map(lambda x: x * 2).skip(7))
  )
  assert fn.calls == 13  # the skipped elements never reached fn


@pytest.mark.parametrize("num_parallel_calls", [None, 4])
def test_skip_elements_in_the_middle_of_a_map_keeps_order_and_state(num_parallel_calls):
  ds = Dataset.range(40).map(lambda x: x, num_parallel_calls=num_parallel_calls)
  with graph_iterator(ds) as it:
    head = [int(next(it)) for _ in range(3)]  # work may be in flight now
    assert it.skip_elements(10) == 10
    state = json.loads(json.dumps(it.get_state()))
    rest = [int(x) for x in it]
    assert it.skip_elements(5) == 0
  assert head + rest == [0, 1, 2] + list(range(13, 40))
  with graph_iterator(ds) as restored:
    restored.set_state(state)
    assert [int(x) for x in restored] == list(range(13, 40))
