"""Tests of the filter op against tf.data's Dataset.filter."""

import numpy as np
import pytest

from jaxfeed.dataset import Dataset
from jaxfeed.ops.filter import FilterNode
import op_testing
from op_testing import (
  assert_matches_tf_data,
  assert_same_values,
  check_resume,
  elements_and_seeds,
  graph_iterator,
)

tf = op_testing.import_tensorflow()

A = np.arange(15, dtype=np.int64)
B = np.arange(15, dtype=np.float32) * 0.5

# name -> (input from a Dataset class, predicate working on numpy and tf values)
CASES = {
  "every_third": (lambda D: D.range(30), lambda x: x % 3 == 0),
  "none_kept": (lambda D: D.range(10), lambda x: x > 100),
  "all_kept": (lambda D: D.range(10), lambda x: x >= 0),
  "empty_input": (lambda D: D.range(0), lambda x: x >= 0),
  "tuple_unpacked": (lambda D: D.from_tensor_slices((A, B)), lambda a, b: a % 2 == 1),
  "dict_one_argument": (lambda D: D.from_tensor_slices({"a": A, "b": B}), lambda d: d["b"] > 3.0),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_filter_matches_tf_data(case):
  make_input, predicate = CASES[case]
  assert_matches_tf_data(
    lambda D: make_input(D).filter(predicate), make_iterator=graph_iterator, same=assert_same_values
  )


def test_cardinality_is_unknown_like_tf_data():
  assert int(tf.data.Dataset.range(5).filter(lambda x: True).cardinality()) == (
    tf.data.UNKNOWN_CARDINALITY
  )
  assert Dataset.range(5).filter(lambda x: True).cardinality() is None


@pytest.mark.parametrize("result", [True, np.bool_(True), np.array(True), np.array([True])[0]])
def test_boolean_scalars_are_accepted(result):
  kept = list(graph_iterator(Dataset.range(3).filter(lambda x: result)))
  assert len(kept) == 3


def _returns_one(x):
  return 1


@pytest.mark.parametrize(
  "result, shown",
  [
    (1, "int"),
    (np.int64(1), "int64"),
    (np.array([True, False]), "shape (2,)"),
    (None, "NoneType"),
    ("yes", "str"),
    (np.array(1.0), "float64"),
  ],
)
def test_non_boolean_predicate_result_raises_type_error_naming_op_and_predicate(result, shown):
  def not_a_bool(x):
    return result

  with pytest.raises(TypeError) as info:
    next(graph_iterator(Dataset.range(3).filter(not_a_bool)))
  message = str(info.value)
  assert message.startswith("filter: predicate")
  assert "not_a_bool" in message and shown in message


@pytest.mark.parametrize("case", ["every_third", "tuple_unpacked", "dict_one_argument"])
def test_filter_resumes_exactly_at_every_cut_point(case):
  make_input, predicate = CASES[case]
  check_resume(
    lambda: make_input(Dataset).filter(predicate),
    make_iterator=graph_iterator,
    same=assert_same_values,
  )


def test_last_seed_is_the_kept_elements_seed():
  def seed_by_element(dataset):
    with graph_iterator(dataset) as it:
      elements, seeds = elements_and_seeds(it)
    return {int(x): seed for x, seed in zip(elements, seeds)}

  seeds = seed_by_element(Dataset.range(12))
  got = seed_by_element(Dataset.range(12).filter(lambda x: x % 4 == 1))
  assert got == {k: seeds[k] for k in (1, 5, 9)}


def test_predicate_exception_propagates():
  def picky(x):
    if x == 2:
      raise ValueError("two")
    return True

  it = graph_iterator(Dataset.range(5).filter(picky))
  assert [int(next(it)) for _ in range(2)] == [0, 1]
  with pytest.raises(ValueError, match="two"):
    next(it)
  assert [int(x) for x in it] == [3, 4]


def test_spec_params_and_validation():
  node = FilterNode(Dataset.range(3).node, _returns_one)
  assert node.spec_params() == {"predicate": _returns_one}
  assert FilterNode(*node.parents, **node.spec_params()).fingerprint() == (node.fingerprint())
  with pytest.raises(TypeError, match="filter: predicate must be callable"):
    FilterNode(node.parents[0], 3)
