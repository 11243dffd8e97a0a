"""`padded_batch` against tf.data, errors, and exact resume."""

import numpy as np
import pytest

from jaxfeed.dataset import Dataset
from jaxfeed.ops import padding
import op_testing
from op_testing import assert_same_stream, check_resume, elements_dataset

tf = op_testing.import_tensorflow()


# Element i of each kind; lengths vary (zero included) so batches are ragged.
ELEMENT_KINDS = {
  "int32_vector": lambda i: np.arange(i % 5, dtype=np.int32) + i,
  "float32_matrix": lambda i: np.full((i % 3 + 1, (2 * i) % 4), i, np.float32),
  "bool_vector": lambda i: np.arange(i % 4) % 2 == 0,
  "bytes_vector": lambda i: np.array([b"w%d" % j for j in range(i % 3)], dtype=object).reshape(
    i % 3
  ),
  "features": lambda i: {
    "tokens": np.arange(i % 6, dtype=np.int64),
    "mask": np.ones(i % 6, np.bool_),
    "label": np.int32(i),
    "image": np.full((i % 2 + 1, 2), i, np.uint8),
  },
  "tuple": lambda i: (np.full(i % 3, i, np.int16), np.float64(i)),
}


def make_elements(kind, n):
  return [ELEMENT_KINDS[kind](i) for i in range(n)]


def tf_dataset(elements, kind):
  return op_testing.tf_elements_dataset(elements, ELEMENT_KINDS[kind](0))


def run_both(kind, n, batch_size, drop_remainder=False, **kwargs):
  elements = make_elements(kind, n)
  ours = list(
    elements_dataset(elements).padded_batch(batch_size, drop_remainder=drop_remainder, **kwargs)
  )
  theirs = list(
    tf_dataset(elements, kind)
    .padded_batch(batch_size, drop_remainder=drop_remainder, **kwargs)
    .as_numpy_iterator()
  )
  return ours, theirs


# ---------------------------------------------------------------------------
# against tf.data
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("kind", sorted(ELEMENT_KINDS))
@pytest.mark.parametrize(
  "n,batch_size,drop_remainder",
  [
    (0, 3, False),
    (1, 1, False),
    (11, 1, False),
    (11, 4, False),
    (11, 4, True),
    (11, 11, False),
    (11, 13, True),
    (11, 13, False),
  ],
)
def test_padding_to_batch_maximum_equals_tf_data(kind, n, batch_size, drop_remainder):
  ours, theirs = run_both(kind, n, batch_size, drop_remainder)
  assert_same_stream(ours, theirs)


@pytest.mark.parametrize(
  "kind,padded_shapes",
  [
    ("int32_vector", [6]),
    ("int32_vector", [None]),
    ("int32_vector", [-1]),
    ("float32_matrix", [4, 5]),
    ("float32_matrix", [None, 5]),
    ("float32_matrix", [3, None]),
    ("bytes_vector", [4]),
    ("features", {"tokens": [8], "mask": [None], "label": [], "image": [3, None]}),
    ("tuple", ([5], [])),
  ],
)
@pytest.mark.parametrize("batch_size", [3, 11])
def test_explicit_padded_shapes_equal_tf_data(kind, padded_shapes, batch_size):
  ours, theirs = run_both(kind, 11, batch_size, padded_shapes=padded_shapes)
  assert_same_stream(ours, theirs)


def test_tensor_shape_padded_shapes_are_accepted():
  ours, theirs = run_both("int32_vector", 11, 4, padded_shapes=tf.TensorShape([7]))
  assert_same_stream(ours, theirs)


@pytest.mark.parametrize(
  "kind,padding_values",
  [
    ("int32_vector", -1),
    ("float32_matrix", np.float32(0.5)),
    ("bool_vector", True),
    ("bytes_vector", b"<pad>"),
    (
      "features",
      {"tokens": np.int64(7), "mask": False, "label": np.int32(-1), "image": np.uint8(255)},
    ),
    ("tuple", (np.int16(9), np.float64(-2.0))),
  ],
)
def test_padding_values_equal_tf_data(kind, padding_values):
  ours, theirs = run_both(kind, 11, 4, padding_values=padding_values)
  assert_same_stream(ours, theirs)


def test_one_padding_value_pads_every_leaf():
  elements = [(np.arange(i, dtype=np.int32), np.ones(i + 1, np.float32)) for i in range(4)]
  out = padding.pad_and_stack(elements, padding_values=-3)
  assert out[0].dtype == np.int32 and out[0][0].tolist() == [-3, -3, -3]
  assert out[1].dtype == np.float32 and out[1][0].tolist() == [1, -3, -3, -3]


def test_none_entries_of_padding_values_use_defaults():
  elements = [{"a": np.arange(i), "s": np.array([b"x"] * i, dtype=object)} for i in (1, 3)]
  out = padding.pad_and_stack(elements, padding_values={"a": -1, "s": None})
  assert out["a"].tolist() == [[0, -1, -1], [0, 1, 2]]
  assert out["s"].tolist() == [[b"x", b"", b""], [b"x", b"x", b"x"]]


def test_str_leaves_pad_with_empty_str():
  elements = [np.array(["a"], dtype=object), np.array(["b", "c"], dtype=object)]
  out = padding.pad_and_stack(elements)
  assert out.dtype == object and out.tolist() == [["a", ""], ["b", "c"]]


def test_many_short_rows_pad_like_few_long_rows():
  # Many short rows take the vectorized path, few long ones the row loop.
  rng = np.random.default_rng(0)
  short = [np.arange(k, dtype=np.int32) for k in rng.integers(0, 20, 64)]
  long = [np.arange(k, dtype=np.int32) for k in rng.integers(100, 200, 4)]
  for elements in (short, long):
    out = padding.pad_and_stack(elements, padding_values=-1)
    for row, element in zip(out, elements):
      assert row[: len(element)].tolist() == element.tolist()
      assert (row[len(element) :] == -1).all()


def test_cardinality_matches_tf_data():
  for drop in (False, True):
    ours = (
      Dataset.range(10)
      .map(lambda i: np.arange(i))
      .padded_batch(3, drop_remainder=drop)
      .cardinality()
    )
    theirs = int(tf.data.Dataset.range(10).padded_batch(3, drop_remainder=drop).cardinality())
    assert ours == theirs


# ---------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------
def test_element_longer_than_padded_shape_raises_error_naming_sizes():
  elements = make_elements("int32_vector", 11)
  ds = elements_dataset(elements).padded_batch(5, padded_shapes=[3])
  it = ds.make_iterator()
  with pytest.raises(ValueError) as info:
    next(it)
  message = str(info.value)
  for part in ("padded_batch", "element 4", "size 4", "padded size 3"):
    assert part in message, (part, message)
  with pytest.raises(tf.errors.OpError, match="smaller size"):  # tf agrees
    list(tf_dataset(elements, "int32_vector").padded_batch(5, padded_shapes=[3]))


def test_padded_shape_of_wrong_rank_raises():
  elements = make_elements("float32_matrix", 4)
  with pytest.raises(ValueError, match="rank"):
    padding.pad_and_stack(elements, padded_shapes=[5])


def test_padded_shapes_of_wrong_structure_raise():
  elements = make_elements("features", 3)
  with pytest.raises(ValueError, match="padded_shapes"):
    padding.pad_and_stack(elements, padded_shapes={"tokens": [8]})


def test_elements_of_different_ranks_raise():
  with pytest.raises(ValueError, match="ranks"):
    padding.pad_and_stack([np.zeros(2), np.zeros((2, 2))])


def test_elements_of_different_structures_raise():
  with pytest.raises(ValueError, match="same structure"):
    padding.pad_and_stack([{"a": np.zeros(2)}, {"b": np.zeros(2)}])


def test_elements_of_different_dtypes_raise():
  with pytest.raises(ValueError, match="dtypes"):
    padding.pad_and_stack([np.zeros(2, np.int32), np.zeros(3, np.int64)])


@pytest.mark.parametrize("value", [1.5, "x", np.zeros(2)])
def test_padding_value_not_fitting_int_leaf_raises(value):
  with pytest.raises(ValueError, match="padding"):
    padding.pad_and_stack([np.zeros(2, np.int32), np.zeros(3, np.int32)], padding_values=value)


def test_nan_padding_value_is_accepted_for_floats():
  out = padding.pad_and_stack([np.zeros(1), np.zeros(2)], padding_values=np.nan)
  assert np.isnan(out[0, 1]) and out[1].tolist() == [0, 0]


@pytest.mark.parametrize("padded_shapes", [[-2], [1.5], ["a"]])
def test_invalid_padded_sizes_raise_at_construction(padded_shapes):
  with pytest.raises(ValueError, match="padded_shapes"):
    Dataset.range(3).padded_batch(2, padded_shapes=padded_shapes)


def test_non_scalar_padding_values_raise_at_construction():
  with pytest.raises(ValueError, match="padding_values"):
    Dataset.range(3).padded_batch(2, padding_values=np.zeros(2))


def test_invalid_batch_size_raises():
  with pytest.raises(ValueError, match="batch_size"):
    Dataset.range(3).padded_batch(0)


# ---------------------------------------------------------------------------
# state
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("drop_remainder", [False, True])
def test_resume_at_every_cut_point_after_json_round_trip(drop_remainder):
  elements = make_elements("features", 11)
  ds = elements_dataset(elements).padded_batch(
    3,
    padded_shapes={"tokens": [8], "mask": [None], "label": [], "image": [None, None]},
    padding_values={"tokens": -1, "mask": None, "label": None, "image": None},
    drop_remainder=drop_remainder,
  )
  check_resume(lambda: ds)


def test_node_spec_params_rebuild_an_equal_node():
  node = (
    Dataset.range(5).padded_batch(2, padded_shapes=[4], padding_values=-1, drop_remainder=True).node
  )
  rebuilt = type(node)(*node.parents, **node.spec_params())
  assert rebuilt.fingerprint() == node.fingerprint()
  other = (
    Dataset.range(5).padded_batch(2, padded_shapes=[5], padding_values=-1, drop_remainder=True).node
  )
  assert other.fingerprint() != node.fingerprint()
