"""`interleave`: tf.data's order, parallel reading, errors, threads and resume."""

import gc
import itertools
import json
import os
import threading
import time
import traceback

import numpy as np
import pytest

from jaxfeed import AUTOTUNE
from jaxfeed.dataset import Dataset
from jaxfeed.ops import interleave
import op_testing
from op_testing import assert_same_stream, check_resume, new_threads, wait_until

tf = op_testing.import_tensorflow()


def nested(x):
  """Nested dataset of input x: x % 5 elements tagged with x."""
  return Dataset.range(int(x) % 5).map(lambda y, x=int(x): y * 100 + x)


def build(n=14, cycle=3, block=2, parallel=None, deterministic=True):
  return Dataset.range(n).interleave(
    nested,
    cycle_length=cycle,
    block_length=block,
    num_parallel_calls=parallel,
    deterministic=deterministic,
  )


def values(dataset):
  with dataset.make_iterator() as it:
    return [int(v) for v in it]


def tf_values(n, cycle, block):
  ds = tf.data.Dataset.range(n).interleave(
    lambda x: tf.data.Dataset.range(x % 5).map(lambda y: y * 100 + x),
    cycle_length=cycle,
    block_length=block,
  )
  return [int(v) for v in ds.as_numpy_iterator()]


@pytest.mark.parametrize(
  "n,cycle,block", [(14, 3, 2), (20, 4, 1), (7, 10, 3), (11, 1, 2), (0, 2, 2)]
)
@pytest.mark.parametrize("parallel", [None, 1, 3, AUTOTUNE])
def test_order_is_tf_data_order_sequential_and_parallel(n, cycle, block, parallel):
  assert values(build(n, cycle, block, parallel)) == tf_values(n, cycle, block)


def test_cycle_length_none_uses_cpu_count_like_tf_autotune():
  cpus = os.cpu_count()
  assert interleave.default_cycle_length() == cpus
  ours = values(build(3 * cpus + 2, cycle=None, block=1))
  assert ours == values(build(3 * cpus + 2, cycle=cpus, block=1))
  assert ours == values(build(3 * cpus + 2, cycle=AUTOTUNE, block=1))
  assert ours == tf_values(3 * cpus + 2, cpus, 1)


def test_nondeterministic_keeps_each_nested_order_and_the_multiset():
  def slow_nested(x):
    # Input 0's dataset is slow, so its position is passed over.
    def slow(y, x=int(x)):
      if x == 0:
        time.sleep(0.01)
      return y * 100 + x

    return Dataset.range(5).map(slow)

  ds = Dataset.range(6).interleave(
    slow_nested, cycle_length=3, num_parallel_calls=3, deterministic=False
  )
  out = values(ds)
  expected = values(Dataset.range(6).interleave(slow_nested, cycle_length=3))
  assert sorted(out) == sorted(expected)
  for x in range(6):
    assert [v for v in out if v % 100 == x] == [y * 100 + x for y in range(5)]
  assert out != expected  # the slow position was passed over


def test_parallel_mode_opens_every_cycle_position_at_once():
  for parallel, opened in [(2, 4), (None, 1)]:
    ds = Dataset.range(20).interleave(
      lambda x: Dataset.range(3), cycle_length=4, num_parallel_calls=parallel
    )
    with ds.make_iterator() as it:
      next(it)
      assert it.get_state()["own"]["input"]["num_read"] == opened


def test_tuple_elements_are_unpacked_into_fn_arguments():
  ds = Dataset.zip((Dataset.range(4), Dataset.range(10, 14))).interleave(
    lambda a, b: Dataset.range(a, b, 5), cycle_length=2
  )
  assert values(ds) == [0, 1, 5, 6, 2, 3, 7, 8]


@pytest.mark.parametrize("parallel", [None, 2])
def test_fn_returning_a_non_dataset_is_a_type_error_naming_op_and_value(parallel):
  ds = Dataset.range(3).interleave(lambda x: [1, 2, 3], cycle_length=2, num_parallel_calls=parallel)
  with ds.make_iterator() as it:
    with pytest.raises(TypeError, match=r"interleave.*list.*\[1, 2, 3\]"):
      next(it)


@pytest.mark.parametrize("parallel", [None, 2])
def test_fn_error_surfaces_then_the_next_input_element_is_used(parallel):
  def fn(x):
    if x == 1:
      raise ValueError("bad element 1")
    return Dataset.range(x * 10, x * 10 + 2)

  ds = Dataset.range(4).interleave(fn, cycle_length=1, num_parallel_calls=parallel)
  with ds.make_iterator() as it:
    assert [int(next(it)) for _ in range(2)] == [0, 1]
    with pytest.raises(ValueError, match="bad element 1"):
      next(it)
    assert [int(v) for v in it] == [20, 21, 30, 31]


def _failing_map(y):
  if y == 2:
    raise RuntimeError("nested failure")
  return y


def test_parallel_worker_error_surfaces_in_next_with_worker_traceback():
  ds = Dataset.range(3).interleave(
    lambda x: Dataset.range(4).map(_failing_map),
    cycle_length=3,
    block_length=4,
    num_parallel_calls=3,
  )
  with ds.make_iterator() as it:
    got = []
    with pytest.raises(RuntimeError, match="nested failure") as info:
      while True:
        got.append(int(next(it)))
  assert got == [0, 1]
  frames = [f.name for f in traceback.extract_tb(info.value.__traceback__)]
  assert "_failing_map" in frames


@pytest.mark.parametrize(
  "bad,match",
  [
    ({"cycle_length": 0}, "cycle_length"),
    ({"cycle_length": 2.5}, "cycle_length"),
    ({"block_length": 0}, "block_length"),
    ({"num_parallel_calls": 0}, "num_parallel_calls"),
  ],
)
def test_invalid_options_are_rejected_with_their_names(bad, match):
  kwargs = {"cycle_length": 2, **bad}
  with pytest.raises(ValueError, match=f"interleave.*{match}"):
    Dataset.range(3).interleave(nested, **kwargs)


def test_fn_must_be_callable():
  with pytest.raises(TypeError, match="interleave.*callable"):
    Dataset.range(3).interleave(42, cycle_length=2)


def test_spec_params_rebuild_an_equal_node():
  node = build(parallel=2).node
  rebuilt = type(node)(*node.parents, **node.spec_params())
  assert rebuilt.fingerprint() == node.fingerprint()
  assert values(Dataset(rebuilt)) == values(Dataset(node))


@pytest.mark.parametrize("parallel", [None, 2])
@pytest.mark.parametrize("block", [1, 3])
def test_resume_at_every_cut_is_exact(parallel, block):
  check_resume(lambda: build(n=12, cycle=3, block=block, parallel=parallel))


def test_resume_with_a_random_map_in_the_nested_datasets_is_exact():
  def noisy(x):
    return Dataset.range(int(x) % 4 + 1).random_map(
      lambda y, rng: float(rng.random()) + float(y), seed=3
    )

  check_resume(lambda: Dataset.range(9).interleave(noisy, cycle_length=2), cuts=[0, 3, 7, 11])


def test_state_is_small_and_has_no_elements():
  with build(n=200, cycle=4, block=2).make_iterator() as it:
    for _ in range(150):
      next(it)
    state = it.get_state()
  assert len(json.dumps(state)) < 3000


@pytest.mark.parametrize("saved_parallel,restored_parallel", [(None, 2), (2, None)])
def test_states_move_between_sequential_and_parallel(saved_parallel, restored_parallel):
  expected = values(build(n=15, cycle=3, block=2))
  for cut in (1, 4, 9, 17):
    with build(n=15, cycle=3, block=2, parallel=saved_parallel).make_iterator() as it:
      head = [int(next(it)) for _ in range(cut)]
      state = json.loads(json.dumps(it.get_state()))
    with build(n=15, cycle=3, block=2, parallel=restored_parallel).make_iterator() as it:
      it.set_state(state)
      assert head + [int(v) for v in it] == expected


def test_restoring_a_state_of_another_op_fails_clearly():
  with Dataset.range(5).batch(2).make_iterator() as other:
    state = other.get_state()
  with build().make_iterator() as it:
    with pytest.raises(ValueError, match="different pipeline"):
      it.set_state(state)


def test_parallel_threads_stop_on_close_and_on_garbage_collection():
  before = threading.enumerate()
  it = build(n=30, cycle=4, parallel=3).make_iterator()
  next(it)
  assert len(new_threads(before, "jaxfeed-")) >= 1
  it.close()
  it.close()  # idempotent
  assert new_threads(before, "jaxfeed-") == []

  it = build(n=30, cycle=4, parallel=3).make_iterator()
  next(it)
  del it
  gc.collect()
  wait_until(lambda: not new_threads(before, "jaxfeed-"), timeout_s=10)


def test_sequential_mode_starts_no_thread():
  before = threading.enumerate()
  with build(n=10).make_iterator() as it:
    list(it)
    assert not new_threads(before)


def test_last_seed_differs_between_nested_datasets_of_different_inputs():
  ds = Dataset.range(4).interleave(lambda x: Dataset.range(3), cycle_length=2)
  with ds.make_iterator() as it:
    seeds = []
    for _ in itertools.islice(it, 12):
      seeds.append(it.last_seed)
  assert len(set(seeds)) == len(seeds)


def test_nested_elements_are_returned_unchanged():
  arrays = [np.full((2, 3), i, np.float32) for i in range(4)]
  ds = Dataset.range(4).interleave(
    lambda i: Dataset.from_tensor_slices(arrays[int(i)]), cycle_length=2, num_parallel_calls=2
  )
  with ds.make_iterator() as it:
    out = list(it)
  expected = [
    arrays[i][r] for i, r in [(0, 0), (1, 0), (0, 1), (1, 1), (2, 0), (3, 0), (2, 1), (3, 1)]
  ]
  assert_same_stream(out, expected)
