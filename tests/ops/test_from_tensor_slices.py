"""Tests of from_tensor_slices against tf.data.Dataset.from_tensor_slices."""

import collections

import numpy as np
import pytest

from jaxfeed.dataset import Dataset
from jaxfeed.ops.base import PipelineStateError, mix_seed
from jaxfeed.ops.from_tensor_slices import TensorSlicesNode
import op_testing
from op_testing import (
  assert_same_element,
  assert_same_stream,
  check_next_batch,
  check_resume,
  elements_and_seeds,
  leaves,
)

tf = op_testing.import_tensorflow()

Point = collections.namedtuple("Point", ["x", "y"])


def _inputs():
  """Fresh test inputs (tf may hold on to arrays it was given)."""
  return {
    "int64_array": np.arange(5),
    "empty_2d_array": np.zeros((0, 3)),
    "single_element": np.array([7], np.uint8),
    "float16_3d": np.arange(24, dtype=np.float16).reshape(4, 3, 2),
    "python_ints": [1, 2, 3],
    "python_big_ints": [1, 2**40],
    "python_negative_big_ints": [-(2**31) - 1, 0],
    "python_floats": [1.5, 2.0],
    "python_ints_and_floats": [1, 2.5],
    "python_bools": [True, False, True],
    "python_strings": ["a", "bc"],
    "python_bytes": [b"x", b"yz"],
    "numpy_strings": np.array(["a", "bc"]),
    "nested_python_list": [[1, 2], [3, 4], [5, 6]],
    "empty_python_list": [],
    "tuple_of_lists": ([1, 2], [3.0, 4.0]),
    "dict": {"a": [1, 2], "b": (np.arange(2), [b"x", b"y"])},
    "dict_of_dicts": {
      "outer": {"inner": np.ones((3, 2), np.float32)},
      "label": np.array([0, 1, 2], np.int32),
    },
    "namedtuple": Point(np.arange(2), np.ones(2)),
    "string_matrix": np.array([["a", "b"], ["c", "d"]]),
    "list_of_numpy_int_scalars": [np.int64(3), np.uint8(4)],
    "list_of_numpy_float_and_int": [np.float64(1), 2],
    "list_of_numpy_int_and_float": [np.int32(1), 2.5],
    "list_of_numpy_float16": [np.float16(1), np.float16(2)],
    "list_of_int8_arrays": [np.arange(2, dtype=np.int8)] * 3,
    "numpy_bools_2d": np.array([[True, False], [False, True]]),
  }


@pytest.mark.parametrize("name", sorted(_inputs()))
def test_elements_match_tf_data(name):
  ours = Dataset.from_tensor_slices(_inputs()[name])
  theirs = tf.data.Dataset.from_tensor_slices(_inputs()[name])
  assert_same_stream(ours, theirs.as_numpy_iterator())
  assert ours.cardinality() == int(theirs.cardinality())


@pytest.mark.parametrize(
  "tensors, pattern",
  [
    (1, "rank >= 1.*'<root>'"),
    ((), "empty"),
    ({}, "empty"),
    (([1, 2], [1, 2, 3]), "same size in dimension 0.*'0': 2, '1': 3"),
    ({"a": np.zeros(4), "b": {"c": np.zeros(3)}}, "'a': 4, 'b/c': 3"),
    ({"a": 1}, "rank >= 1.*'a'"),
    ([[1, 2], [3]], "cannot be converted"),
    ({"x": [object(), object()]}, "'x' must be numeric"),
    ([2**70, 1], "'<root>'"),
  ],
)
def test_invalid_tensors_raise_value_error_like_tf(tensors, pattern):
  with pytest.raises(ValueError, match=pattern):
    TensorSlicesNode(tensors)
  if not isinstance(tensors, dict) or "x" not in tensors:
    with pytest.raises((ValueError, TypeError)):
      tf.data.Dataset.from_tensor_slices(tensors)


def test_top_level_list_is_one_tensor_and_tuple_is_structure():
  as_list = list(Dataset.from_tensor_slices([[1, 2], [3, 4]]))
  as_tuple = list(Dataset.from_tensor_slices(([1, 2], [3, 4])))
  assert [x.tolist() for x in as_list] == [[1, 2], [3, 4]]
  assert [tuple(int(v) for v in x) for x in as_tuple] == [(1, 3), (2, 4)]


def test_yielded_slices_are_read_only_and_the_input_stays_writable():
  data = np.arange(6).reshape(3, 2)
  first = next(iter(Dataset.from_tensor_slices(data)))
  assert np.shares_memory(first, data)
  with pytest.raises(ValueError, match="read-only"):
    first[0] = 100
  data[0, 0] = -1  # The caller's array keeps its flags.
  assert first[0] == -1


def test_dict_keys_keep_the_callers_order():
  element = next(iter(Dataset.from_tensor_slices({"z": [1], "a": [2], "m": [3]})))
  assert list(element) == ["z", "a", "m"]


@pytest.mark.parametrize(
  "tensors",
  [
    {"a": np.arange(6), "b": np.arange(12).reshape(6, 2)},
    np.zeros((0, 2)),
    [5],
  ],
)
def test_state_resumes_exactly_at_every_cut(tensors):
  resumed = check_resume(lambda: Dataset.from_tensor_slices(tensors), into_same_iterator=True)
  assert [state["own"] for state in resumed.states] == [
    {"index": cut} for cut in range(len(resumed.expected) + 1)
  ]


def test_last_seed_is_the_default_sampler_seed_of_the_index():
  iterator = Dataset.from_tensor_slices(np.arange(4)).make_iterator()
  assert iterator.last_seed == 0  # Nothing returned yet.
  assert elements_and_seeds(iterator)[1] == [mix_seed(0, 0, i) for i in range(4)]


def test_skip_elements_moves_the_index_without_building_elements():
  iterator = Dataset.from_tensor_slices(np.arange(10)).make_iterator()
  assert iterator.skip_elements(7) == 7
  assert next(iterator) == 7
  assert iterator.skip_elements(5) == 2
  assert list(iterator) == []


def test_spec_params_rebuild_an_equal_node():
  tensors = {"a": np.arange(3), "b": [1.0, 2.0, 3.0]}
  node = TensorSlicesNode(tensors)
  rebuilt = TensorSlicesNode(**node.spec_params())
  assert rebuilt.fingerprint() == node.fingerprint()
  assert (
    TensorSlicesNode({"a": np.arange(3), "b": [1.0, 2.0, 4.0]}).fingerprint() != node.fingerprint()
  )


@pytest.mark.parametrize(
  "state",
  [
    {"op": "range", "own": {"index": 0}, "parents": []},
    {"op": "from_tensor_slices", "own": {"index": 4}, "parents": []},
    {"op": "from_tensor_slices", "own": {"index": "1"}, "parents": []},
    {"op": "from_tensor_slices", "own": {}, "parents": []},
  ],
)
def test_foreign_or_corrupt_state_raises_pipeline_state_error(state):
  iterator = Dataset.from_tensor_slices([1, 2, 3]).make_iterator()
  with pytest.raises(PipelineStateError):
    iterator.set_state(state)


def test_array_likes_keep_their_dtype():
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  elements = list(Dataset.from_tensor_slices({"a": jnp.arange(3, dtype=jnp.int16)}))
  assert [e["a"].dtype for e in elements] == [np.int16] * 3
  assert [int(e["a"]) for e in elements] == [0, 1, 2]


# ---------------------------------------------------------------------------
# the batched-read protocol (next_batch)
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(_inputs()))
@pytest.mark.parametrize("sizes", [[1], [2], [100], [2, 0, 1]])
def test_next_batch_equals_stacked_next_calls_with_seeds_and_state(name, sizes):
  tensors = _inputs()[name]
  check_next_batch(
    lambda: TensorSlicesNode(tensors).make_iterator(),
    sizes,
    [np.asarray(leaf) for leaf in leaves(tensors)],
    same_element=assert_same_element,
  )


def test_batch_of_slices_reads_with_next_batch_and_equals_tf_data():
  tensors = {
    "image": np.arange(7 * 6, dtype=np.uint8).reshape(7, 2, 3),
    "label": np.arange(7, dtype=np.int32),
    "name": np.array([b"n%d" % i for i in range(7)]),
  }
  ours = list(Dataset.from_tensor_slices(tensors).batch(3))
  theirs = list(tf.data.Dataset.from_tensor_slices(tensors).batch(3).as_numpy_iterator())
  assert len(ours) == len(theirs) == 3
  for a, b in zip(ours, theirs):
    assert list(a) == list(tensors)
    assert_same_element(a, b)
