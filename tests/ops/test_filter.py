"""Tests of the filter op against tf.data's Dataset.filter."""

import json
import os

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import tensorflow as tf  # pylint: disable=g-import-not-at-top

tf.get_logger().setLevel("ERROR")
tf.autograph.set_verbosity(0)

from jaxfeed.dataset import Dataset
from jaxfeed.ops.filter import FilterNode


def _ours(ds):
  return ds.node.make_iterator()


def _canonical(element):
  if isinstance(element, dict):
    return tuple(sorted((k, _canonical(v)) for k, v in element.items()))
  if isinstance(element, (tuple, list)):
    return tuple(_canonical(v) for v in element)
  array = np.asarray(element)
  return (str(array.dtype), array.shape, array.tobytes())


A = np.arange(15, dtype=np.int64)
B = np.arange(15, dtype=np.float32) * 0.5

CASES = {
    "every_third": (lambda: Dataset.range(30), lambda: tf.data.Dataset.range(30),
                    lambda x: x % 3 == 0),
    "none_kept": (lambda: Dataset.range(10), lambda: tf.data.Dataset.range(10),
                  lambda x: x > 100),
    "all_kept": (lambda: Dataset.range(10), lambda: tf.data.Dataset.range(10),
                 lambda x: x >= 0),
    "empty_input": (lambda: Dataset.range(0), lambda: tf.data.Dataset.range(0),
                    lambda x: x >= 0),
    "tuple_unpacked": (lambda: Dataset.from_tensor_slices((A, B)),
                       lambda: tf.data.Dataset.from_tensor_slices((A, B)),
                       lambda a, b: a % 2 == 1),
    "dict_one_argument": (lambda: Dataset.from_tensor_slices({"a": A, "b": B}),
                          lambda: tf.data.Dataset.from_tensor_slices(
                              {"a": A, "b": B}),
                          lambda d: d["b"] > 3.0),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_filter_matches_tf_data(case):
  make_ours, make_tf, predicate = CASES[case]
  ours = [_canonical(e) for e in _ours(make_ours().filter(predicate))]
  theirs = [_canonical(e) for e in
            make_tf().filter(predicate).as_numpy_iterator()]
  assert ours == theirs


def test_cardinality_is_unknown_like_tf_data():
  assert int(tf.data.Dataset.range(5).filter(lambda x: True).cardinality()) == (
      tf.data.UNKNOWN_CARDINALITY)
  assert Dataset.range(5).filter(lambda x: True).cardinality() is None


@pytest.mark.parametrize("result", [True, np.bool_(True), np.array(True),
                                    np.array([True])[0]])
def test_boolean_scalars_are_accepted(result):
  assert len(list(_ours(Dataset.range(3).filter(lambda x: result)))) == 3


def _returns_one(x):
  return 1


@pytest.mark.parametrize("result, shown", [
    (1, "int"), (np.int64(1), "int64"), (np.array([True, False]), "shape (2,)"),
    (None, "NoneType"), ("yes", "str"), (np.array(1.0), "float64")])
def test_non_boolean_predicate_result_raises_type_error_naming_op_and_predicate(
    result, shown):
  def not_a_bool(x):
    return result
  with pytest.raises(TypeError) as info:
    next(_ours(Dataset.range(3).filter(not_a_bool)))
  message = str(info.value)
  assert message.startswith("filter: predicate")
  assert "not_a_bool" in message and shown in message


@pytest.mark.parametrize("case", ["every_third", "tuple_unpacked",
                                  "dict_one_argument"])
def test_filter_resumes_exactly_at_every_cut_point(case):
  make_ours, _, predicate = CASES[case]
  ds = make_ours().filter(predicate)
  expected = [_canonical(e) for e in _ours(ds)]
  for cut in range(len(expected) + 1):
    it = _ours(ds)
    head = [_canonical(next(it)) for _ in range(cut)]
    state = json.loads(json.dumps(it.get_state()))
    restored = _ours(ds)
    restored.set_state(state)
    assert head + [_canonical(e) for e in restored] == expected


def test_last_seed_is_the_kept_elements_seed():
  with _ours(Dataset.range(12)) as it:
    seeds = {}
    for x in it:
      seeds[int(x)] = it.last_seed
  with _ours(Dataset.range(12).filter(lambda x: x % 4 == 1)) as it:
    got = {}
    for x in it:
      got[int(x)] = it.last_seed
  assert got == {k: seeds[k] for k in (1, 5, 9)}


def test_predicate_exception_propagates():
  def picky(x):
    if x == 2:
      raise ValueError("two")
    return True
  it = _ours(Dataset.range(5).filter(picky))
  assert [int(next(it)) for _ in range(2)] == [0, 1]
  with pytest.raises(ValueError, match="two"):
    next(it)
  assert [int(x) for x in it] == [3, 4]


def test_spec_params_and_validation():
  node = FilterNode(Dataset.range(3).node, _returns_one)
  assert node.spec_params() == {"predicate": _returns_one}
  assert FilterNode(*node.parents, **node.spec_params()).fingerprint() == (
      node.fingerprint())
  with pytest.raises(TypeError, match="filter: predicate must be callable"):
    FilterNode(node.parents[0], 3)
