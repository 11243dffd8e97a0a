"""`flat_map`: tf.data's order, errors and exact resume."""

import numpy as np
import pytest

from jaxfeed.dataset import Dataset
from jaxfeed.ops.flat_map import FlatMapNode
import op_testing
from op_testing import assert_same_stream, check_resume

tf = op_testing.import_tensorflow()


def build(n=8):
  return Dataset.range(n).flat_map(
    lambda x: Dataset.range(int(x) % 4).map(lambda y, x=int(x): y * 10 + x)
  )


@pytest.mark.parametrize("n", [0, 1, 3, 8])
def test_matches_tf_data(n):
  theirs = tf.data.Dataset.range(n).flat_map(
    lambda x: tf.data.Dataset.range(x % 4).map(lambda y: y * 10 + x)
  )
  with build(n).make_iterator() as it:
    assert_same_stream(it, theirs.as_numpy_iterator())


def test_each_nested_dataset_is_read_to_its_end_before_the_next():
  ds = Dataset.range(3).flat_map(lambda x: Dataset.range(x * 10, x * 10 + 3))
  with ds.make_iterator() as it:
    assert [int(v) for v in it] == [0, 1, 2, 10, 11, 12, 20, 21, 22]


def test_dict_elements_flow_through():
  slices = {"a": np.arange(6).reshape(3, 2), "b": np.arange(3.0)}
  ds = Dataset.range(2).flat_map(lambda x: Dataset.from_tensor_slices(slices))
  with ds.make_iterator() as it:
    out = list(it)
  assert len(out) == 6
  np.testing.assert_array_equal(out[4]["a"], [2, 3])
  assert out[5]["b"] == 2.0


def test_fn_returning_a_non_dataset_is_a_type_error_naming_op_and_value():
  ds = Dataset.range(2).flat_map(lambda x: np.arange(3))
  with ds.make_iterator() as it:
    with pytest.raises(TypeError, match=r"flat_map.*ndarray"):
      next(it)


def test_fn_must_be_callable():
  with pytest.raises(TypeError, match="flat_map.*callable"):
    Dataset.range(2).flat_map("not a function")


@pytest.mark.parametrize("n", [0, 5, 9])
def test_resume_at_every_cut_is_exact(n):
  check_resume(lambda: build(n))


def test_state_is_that_of_flat_map_and_spec_rebuilds_the_node():
  with build().make_iterator() as it:
    next(it)
    assert it.get_state()["op"] == "flat_map"
  node = build().node
  assert isinstance(node, FlatMapNode)
  rebuilt = type(node)(*node.parents, **node.spec_params())
  assert rebuilt.fingerprint() == node.fingerprint()


def test_cardinality_is_unknown_except_for_an_empty_input():
  assert build(5).cardinality() is None
  assert build(0).cardinality() == 0
