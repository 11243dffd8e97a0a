"""`batch` and the stacking helpers, element by element against tf.data."""

import collections

import numpy as np
import pytest

from jaxfeed.dataset import Dataset
from jaxfeed.ops import base
from jaxfeed.ops import batch as batch_op
from jaxfeed.ops import stacking
from jaxfeed.ops import tree as tree_lib
from jaxfeed.sampler import IndexSampler
from jaxfeed.sources import ArraySource
import op_testing
from op_testing import assert_same_element, assert_same_stream, check_resume, elements_dataset

tf = op_testing.import_tensorflow()


# ---------------------------------------------------------------------------
# element kinds: element i of each kind, built the same way for both libraries
# ---------------------------------------------------------------------------
ELEMENT_KINDS = {
  "int64_scalar": lambda i: np.int64(i),
  "float32_scalar": lambda i: np.float32(i / 2),
  "bool_scalar": lambda i: np.bool_(i % 2),
  "uint8_vector": lambda i: np.full(3, i, np.uint8),
  "float64_matrix": lambda i: np.arange(6.0).reshape(2, 3) + i,
  "bytes_scalar": lambda i: b"s%d" % i,
  "bytes_vector": lambda i: np.array([b"a%d" % i, b"b"], dtype=object),
  "dict": lambda i: {"label": np.int32(i), "x": np.full(2, i, np.float32)},
  "tuple": lambda i: (np.int64(i), np.full((2, 2), i, np.int16)),
  "nested": lambda i: {"a": (np.int64(i), {"b": np.float32(i)}), "s": b"t%d" % i},
}


def make_elements(kind, n):
  return [ELEMENT_KINDS[kind](i) for i in range(n)]


def tf_dataset(elements, example):
  """The elements as a tf.data pipeline (sliced from stacked columns)."""
  if not elements:
    return op_testing.tf_elements_dataset(elements, example)
  columns = tf.nest.map_structure(lambda *xs: np.array(xs), *elements)
  return tf.data.Dataset.from_tensor_slices(columns)


# ---------------------------------------------------------------------------
# against tf.data
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("kind", sorted(ELEMENT_KINDS))
@pytest.mark.parametrize(
  "n,batch_size", [(0, 3), (1, 1), (1, 3), (7, 1), (7, 3), (7, 7), (7, 9), (9, 3)]
)
@pytest.mark.parametrize("drop_remainder", [False, True])
def test_batches_equal_tf_data(kind, n, batch_size, drop_remainder):
  elements = make_elements(kind, n)
  ours = list(elements_dataset(elements).batch(batch_size, drop_remainder))
  example = ELEMENT_KINDS[kind](0)
  theirs = list(tf_dataset(elements, example).batch(batch_size, drop_remainder).as_numpy_iterator())
  assert_same_stream(ours, theirs)


@pytest.mark.parametrize(
  "arrays",
  [
    np.arange(10, dtype=np.int32),
    {
      "image": np.arange(10 * 4, dtype=np.uint8).reshape(10, 2, 2),
      "label": np.arange(10, dtype=np.int64),
    },
    (
      np.linspace(0, 1, 10, dtype=np.float32),
      np.array([b"w%d" % i for i in range(10)], dtype=object),
    ),
  ],
)
@pytest.mark.parametrize("batch_size", [1, 3, 10, 12])
def test_batches_of_tensor_slices_equal_tf_data(arrays, batch_size):
  ours = list(Dataset.from_tensor_slices(arrays).batch(batch_size))
  theirs = list(tf.data.Dataset.from_tensor_slices(arrays).batch(batch_size).as_numpy_iterator())
  assert_same_stream(ours, theirs)


@pytest.mark.parametrize(
  "n,batch_size,drop_remainder,expected",
  [
    (10, 3, False, 4),
    (10, 3, True, 3),
    (9, 3, False, 3),
    (0, 2, False, 0),
    (2, 5, True, 0),
    (2, 5, False, 1),
  ],
)
def test_cardinality_matches_tf_data(n, batch_size, drop_remainder, expected):
  ours = Dataset.range(n).batch(batch_size, drop_remainder).cardinality()
  theirs = int(tf.data.Dataset.range(n).batch(batch_size, drop_remainder).cardinality())
  assert ours == theirs == expected


def test_python_scalars_batch_to_numpy_default_dtypes():
  elements = [
    {"i": 1, "f": 0.5, "b": True, "s": "text"},
    {"i": 2, "f": 1.5, "b": False, "s": "more"},
  ]
  out = stacking.stack(elements)
  assert out["i"].dtype == np.int64 and out["i"].tolist() == [1, 2]
  assert out["f"].dtype == np.float64 and out["f"].tolist() == [0.5, 1.5]
  assert out["b"].dtype == np.bool_ and out["b"].tolist() == [True, False]
  assert out["s"].dtype == object and out["s"].tolist() == ["text", "more"]


def test_numpy_string_rows_batch_to_object_arrays_of_bytes():
  rows = np.array([b"ab", b"c"])  # dtype S2: rows are np.bytes_ scalars
  out = stacking.stack([rows[0], rows[1]])
  assert out.dtype == object and out.tolist() == [b"ab", b"c"]
  assert all(type(v) is bytes for v in out)
  unicode_rows = np.array(["ab", "c"])  # dtype U2: rows are np.str_ scalars
  out = stacking.stack([unicode_rows[0], unicode_rows[1]])
  assert out.tolist() == ["ab", "c"] and all(type(v) is str for v in out)
  zero_d = [np.array(b"xy"), np.array(b"z")]
  out = stacking.stack(zero_d)
  assert out.dtype == object and out.tolist() == [b"xy", b"z"]
  assert all(type(v) is bytes for v in out)


def test_dict_key_order_of_first_element_is_kept():
  out = stacking.stack([{"z": 1, "a": 2}, {"a": 4, "z": 3}])
  assert list(out) == ["z", "a"]
  assert out["z"].tolist() == [1, 3] and out["a"].tolist() == [2, 4]


# ---------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------
def test_ragged_elements_raise_error_naming_leaf_shapes_and_positions():
  elements = [{"tokens": np.zeros(3)}, {"tokens": np.zeros(3)}, {"tokens": np.zeros(5)}]
  it = elements_dataset(elements).batch(3).make_iterator()
  with pytest.raises(ValueError) as info:
    next(it)
  message = str(info.value)
  for part in ("batch", "'tokens'", "(3,)", "(5,)", "[0, 1]", "[2]", "padded_batch"):
    assert part in message, (part, message)


def test_different_structures_raise_error_naming_both():
  with pytest.raises(ValueError) as info:
    stacking.stack([{"a": np.int64(1)}, {"a": np.int64(1)}, {"a": np.int64(1), "b": np.float32(2)}])
  message = str(info.value)
  assert "element 0" in message and "element 2" in message
  assert "'b'" in message and "structure" in message


@pytest.mark.parametrize(
  "elements",
  [
    [(1, 2), (1, 2, 3)],
    [(1, 2), [1, 2]],
    [{"a": 1}, {"a": (1, 2)}],
    [{"a": (1, 2)}, {"a": 1}],
  ],
)
def test_structure_mismatch_of_any_kind_is_a_value_error(elements):
  with pytest.raises(ValueError, match="same structure"):
    stacking.stack(elements)


def test_different_dtypes_raise_error_naming_dtypes():
  with pytest.raises(ValueError) as info:
    stacking.stack([np.zeros(2, np.int32), np.zeros(2, np.float32)])
  assert "int32" in str(info.value) and "float32" in str(info.value)


def test_strings_mixed_with_numbers_raise_error():
  with pytest.raises(ValueError, match="dtypes"):
    stacking.stack([b"a", 3])


def test_stack_of_no_elements_raises():
  with pytest.raises(ValueError, match="no elements"):
    stacking.stack([])


@pytest.mark.parametrize("batch_size", [0, -1, 2.5, True, None])
def test_invalid_batch_size_raises(batch_size):
  with pytest.raises(ValueError, match="batch_size"):
    Dataset.range(3).batch(batch_size)


# ---------------------------------------------------------------------------
# seeds and state
# ---------------------------------------------------------------------------
def test_last_seed_is_seed_of_first_element_of_batch():
  it = Dataset.range(10).batch(3).make_iterator()
  firsts = []
  for _ in it:
    firsts.append(it.last_seed)
  reference = Dataset.range(10).make_iterator()
  seeds = []
  for _ in reference:
    seeds.append(reference.last_seed)
  assert firsts == [seeds[0], seeds[3], seeds[6], seeds[9]]
  assert len(set(firsts)) == 4


@pytest.mark.parametrize(
  "n,batch_size,drop_remainder",
  [(10, 3, False), (10, 3, True), (9, 3, False), (4, 5, False), (0, 2, False)],
)
def test_resume_at_every_cut_point_after_json_round_trip(n, batch_size, drop_remainder):
  elements = make_elements("dict", n)
  check_resume(lambda: elements_dataset(elements).batch(batch_size, drop_remainder))


def _fails_on_four(x):
  if x == 4:
    raise ValueError("element 4 is bad")
  return x


@pytest.mark.parametrize("drop_remainder", [False, True])
def test_input_error_mid_batch_is_raised_and_the_next_batch_follows_it(drop_remainder):
  it = Dataset.range(12).map(_fails_on_four).batch(3, drop_remainder).make_iterator()
  assert next(it).tolist() == [0, 1, 2]
  with pytest.raises(ValueError, match="element 4 is bad"):
    next(it)  # Elements 3 and 4 were read for this batch.
  assert next(it).tolist() == [5, 6, 7]
  assert next(it).tolist() == [8, 9, 10]
  if not drop_remainder:
    assert next(it).tolist() == [11]
  with pytest.raises(StopIteration):
    next(it)


@pytest.mark.parametrize("n,batch_size", [(10, 4), (8, 4), (3, 5), (1, 1)])
def test_short_last_batch_is_kept_or_dropped(n, batch_size):
  kept = [b.tolist() for b in Dataset.range(n).map(int).batch(batch_size)]
  dropped = [b.tolist() for b in Dataset.range(n).map(int).batch(batch_size, drop_remainder=True)]
  expected = [list(range(i, min(i + batch_size, n))) for i in range(0, n, batch_size)]
  assert kept == expected
  assert dropped == [b for b in expected if len(b) == batch_size]


@pytest.mark.parametrize(
  "dataset",
  [
    lambda: Dataset.range(50),
    lambda: Dataset.from_tensor_slices({"x": np.arange(50), "y": np.ones(50)}),
    lambda: Dataset.from_source(
      ArraySource({"x": np.arange(50)}), IndexSampler(50, shuffle=True, seed=2)
    ),
  ],
)
@pytest.mark.parametrize(
  "batch_size,drop_remainder", [(7, False), (7, True), (50, False), (64, True)]
)
def test_batches_read_with_next_batch_equal_element_wise_batches(
  dataset, batch_size, drop_remainder
):
  fast = dataset().batch(batch_size, drop_remainder).node.make_iterator()
  assert hasattr(fast.parents[0], "next_batch")
  identity = lambda e: e
  plain = dataset().map(identity).batch(batch_size, drop_remainder).node
  plain = plain.make_iterator()
  while (both := op_testing.next_of_both(fast, plain)) is not None:
    assert_same_element(*both)
    assert fast.last_seed == plain.last_seed
    assert fast.get_state()["parents"] == plain.get_state()["parents"][0]["parents"]


def test_exhausted_iterator_keeps_raising_stop_iteration():
  it = Dataset.range(5).batch(2).make_iterator()
  assert len(list(it)) == 3
  with pytest.raises(StopIteration):
    next(it)
  with pytest.raises(StopIteration):
    next(it)


def test_state_of_other_op_raises_pipeline_state_error():
  state = Dataset.range(5).shuffle(2, seed=1).make_iterator().get_state()
  it = Dataset.range(5).batch(2).make_iterator()
  with pytest.raises(base.PipelineStateError):
    it.set_state(state)


def test_node_spec_params_rebuild_an_equal_node():
  node = Dataset.range(5).batch(2, drop_remainder=True).node
  rebuilt = type(node)(*node.parents, **node.spec_params())
  assert rebuilt.fingerprint() == node.fingerprint()
  other = Dataset.range(5).batch(3, drop_remainder=True).node
  assert other.fingerprint() != node.fingerprint()


# ---------------------------------------------------------------------------
# the batched-read protocol
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("drop_remainder", [False, True])
@pytest.mark.parametrize("batch_size", [1, 3, 10, 11])
def test_next_batch_protocol_gives_same_batches_seeds_and_states(batch_size, drop_remainder):
  data = np.array([b"r%d" % i for i in range(10)])
  results = []
  for with_next_batch in (False, True):
    it = batch_op.BatchNode(
      op_testing.ListNode(data, with_next_batch=with_next_batch), batch_size, drop_remainder
    ).make_iterator()
    batches, seeds, states = [], [], []
    for b in it:
      batches.append(b)
      seeds.append(it.last_seed)
      states.append(it.get_state())
    results.append((batches, seeds, states, it.parents[0].batched_calls))
  plain, plain_seeds, plain_states, plain_calls = results[0]
  fast, fast_seeds, fast_states, fast_calls = results[1]
  assert_same_stream(fast, plain)
  assert fast_seeds == plain_seeds and fast_states == plain_states
  assert plain_calls == 0 and fast_calls == len(fast) + (
    1 if drop_remainder and 10 % batch_size else 0
  )


# ---------------------------------------------------------------------------
# the other stacking helpers
# ---------------------------------------------------------------------------
def test_unstack_concatenate_and_slice_invert_stack():
  elements = make_elements("nested", 5)
  batch = stacking.stack(elements)
  assert stacking.batch_length(batch) == 5
  for ours, original in zip(stacking.unstack(batch), elements):
    assert ours["a"][0] == original["a"][0]
    assert ours["a"][1]["b"] == original["a"][1]["b"]
    assert ours["s"] == original["s"]
  head = stacking.slice_batch(batch, 0, 2)
  tail = stacking.slice_batch(batch, 2, 5)
  assert stacking.batch_length(head) == 2
  joined = stacking.concatenate([head, tail])
  assert_same_element(joined, batch)


def test_concatenate_rejects_other_shapes():
  with pytest.raises(ValueError, match="'x'"):
    stacking.concatenate([{"x": np.zeros((2, 3))}, {"x": np.zeros((2, 4))}])


@pytest.mark.parametrize("kind", sorted(ELEMENT_KINDS))
def test_as_batch_of_gathered_leaves_equals_stack_of_their_rows(kind):
  elements = make_elements(kind, 4)
  stacked = stacking.stack(elements)
  # `stacked` is a pytree of gathered leaves; numpy string leaves are what a
  # source of string arrays gathers.
  gathered = tree_lib.map_structure(
    lambda leaf: leaf.astype(bytes) if leaf.dtype == object else leaf, stacked
  )
  ours = stacking.as_batch(gathered)
  assert_same_element(ours, stacked)
  for a, b in zip(tree_lib.flatten(ours), tree_lib.flatten(stacked)):
    assert [type(v) for v in a.flat] == [type(v) for v in b.flat]


def test_as_batch_turns_namedtuples_into_tuples_like_stack():
  point = collections.namedtuple("Point", ["x", "y"])
  gathered = point(np.arange(3), np.ones(3))
  rows = [point(gathered.x[i], gathered.y[i]) for i in range(3)]
  ours, expected = stacking.as_batch(gathered), stacking.stack(rows)
  assert type(ours) is type(expected) is tuple
  assert_same_element(ours, expected)


def test_as_batch_copies_only_when_asked():
  leaf = np.arange(4)
  assert stacking.as_batch({"x": leaf})["x"] is leaf
  copied = stacking.as_batch({"x": leaf}, copy=True)["x"]
  assert not np.shares_memory(copied, leaf) and copied.tolist() == [0, 1, 2, 3]


@pytest.mark.parametrize(
  "gathered",
  [
    {"x": np.array([1, b"a"], dtype=object)},  # not only strings
    {"x": [1, 2]},  # a Python list of scalars is not a leaf array
    (np.arange(2), np.float32(3)),  # a scalar has no rows
    np.zeros(2, dtype=[("a", np.int32)]),  # structured rows
  ],
)
def test_as_batch_leaves_what_only_stack_knows_to_stack(gathered):
  assert stacking.as_batch(gathered) is None
