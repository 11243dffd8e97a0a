"""`zip` and `concatenate`: tf.data semantics, errors, cardinality and resume."""

import numpy as np
import pytest

from jaxfeed.dataset import Dataset
from jaxfeed.ops.zip import ZipNode
from op_testing import assert_matches_tf_data, assert_same_stream, check_resume, run


# -- zip -----------------------------------------------------------------------
def test_zip_of_a_nested_dict_matches_tf_data():
  def make(D):
    return D.zip({"z": D.range(4), "a": (D.range(10, 20), {"q": D.range(3, 9)})})

  assert_matches_tf_data(make)


def test_zip_ends_with_the_shortest_without_reading_later_inputs_further():
  reads = []

  def note(x):
    reads.append(int(x))
    return x

  ds = Dataset.zip((Dataset.range(2), Dataset.range(10).map(note)))
  assert [(int(a), int(b)) for a, b in run(ds)] == [(0, 0), (1, 1)]
  assert reads == [0, 1]


def test_zip_accepts_tf_style_positional_datasets():
  ds = Dataset(ZipNode(Dataset.range(2), Dataset.range(5, 7)))
  assert [(int(a), int(b)) for a, b in run(ds)] == [(0, 5), (1, 6)]


def test_zip_refuses_lists_and_non_datasets():
  with pytest.raises(TypeError, match="zip.*list.*tuple"):
    Dataset.zip([Dataset.range(2), Dataset.range(2)])
  with pytest.raises(TypeError, match="zip.*int"):
    Dataset.zip((Dataset.range(2), 5))
  with pytest.raises(ValueError, match="zip.*at least one"):
    Dataset.zip(())


@pytest.mark.parametrize("sizes,expected", [((3, 5), 3), ((0, 5), 0), ((4,), 4)])
def test_zip_cardinality_is_the_shortest(sizes, expected):
  ds = Dataset.zip(tuple(Dataset.range(n) for n in sizes))
  assert ds.cardinality() == expected


def test_zip_cardinality_with_infinite_and_unknown_inputs():
  infinite = Dataset.range(3).repeat()
  unknown = Dataset.range(9).filter(lambda x: x > 2)
  assert Dataset.zip((infinite, Dataset.range(4))).cardinality() == 4
  assert Dataset.zip((infinite, infinite)).cardinality() == -1
  assert Dataset.zip((unknown, Dataset.range(4))).cardinality() is None


def test_zip_spec_params_rebuild_an_equal_node():
  node = Dataset.zip({"b": Dataset.range(3), "a": (Dataset.range(4), Dataset.range(2))}).node
  rebuilt = type(node)(*node.parents, **node.spec_params())
  assert rebuilt.fingerprint() == node.fingerprint()
  assert_same_stream(run(Dataset(rebuilt)), run(Dataset(node)))


def test_zip_resume_at_every_cut_is_exact():
  check_resume(
    lambda: Dataset.zip({"a": Dataset.range(6).shuffle(3, seed=1), "b": Dataset.range(8)})
  )


# -- concatenate -----------------------------------------------------------------
def test_concatenate_dicts_matches_tf_data():
  slices = {"x": np.arange(4, dtype=np.int32), "y": np.ones((4, 2), np.float32)}

  def make(D):
    return D.from_tensor_slices(slices).concatenate(D.from_tensor_slices(slices).take(2))

  assert_matches_tf_data(make)


def test_concatenate_of_other_dtypes_is_a_type_error_naming_both_datasets():
  ds = Dataset.range(2).concatenate(Dataset.from_tensor_slices(np.array([1.5, 2.5])))
  with ds.make_iterator() as it:
    assert [int(next(it)) for _ in range(2)] == [0, 1]
    with pytest.raises(
      TypeError,
      match=r"concatenate.*RangeNode.*int64.*"
      r"TensorSlicesNode.*float64",
    ):
      next(it)


def test_concatenate_of_other_structures_is_a_type_error():
  ds = Dataset.range(2).concatenate(Dataset.zip((Dataset.range(2), Dataset.range(2))))
  with ds.make_iterator() as it:
    list(zip(range(2), it))
    with pytest.raises(TypeError, match=r"concatenate.*\(int64, int64\)"):
      next(it)


def test_concatenate_accepts_other_shapes_of_one_dtype():
  a = Dataset.range(2).map(lambda x: np.zeros(3, np.int64))
  b = Dataset.range(2).map(lambda x: np.zeros((2, 2), np.int64))
  assert len(run(a.concatenate(b))) == 4


@pytest.mark.parametrize(
  "first,second,expected", [(3, 4, 7), (0, 4, 4), (None, 4, None), (-1, 4, -1), (3, -1, -1)]
)
def test_concatenate_cardinality(first, second, expected):
  def make(n):
    if n is None:
      return Dataset.range(5).filter(lambda x: x > 1)
    if n == -1:
      return Dataset.range(2).repeat()
    return Dataset.range(n)

  assert make(first).concatenate(make(second)).cardinality() == expected


def test_concatenate_other_must_be_a_dataset():
  with pytest.raises(TypeError, match="concatenate.*other"):
    Dataset.range(2).concatenate([1, 2])


def test_concatenate_resume_at_every_cut_is_exact():
  check_resume(
    lambda: Dataset.range(4).concatenate(Dataset.range(10, 13)).concatenate(Dataset.range(0))
  )
