"""`unbatch` and `rebatch`: tf.data semantics, slicing without copies, resume."""

import numpy as np
import pytest

from jaxfeed.dataset import Dataset
from op_testing import assert_matches_tf_data, assert_same_stream, check_resume, run

SLICES = {"x": np.arange(13, dtype=np.int32), "y": np.arange(26, dtype=np.float32).reshape(13, 2)}


# -- unbatch -------------------------------------------------------------------
@pytest.mark.parametrize("batch_size", [1, 4, 13, 20])
def test_unbatch_matches_tf_data_on_dicts(batch_size):
  assert_matches_tf_data(lambda D: D.from_tensor_slices(SLICES).batch(batch_size).unbatch())


def test_unbatch_skips_empty_batches():
  batches = [np.arange(3), np.arange(0), np.arange(2)]
  ds = Dataset.range(3).map(lambda i: batches[int(i)]).unbatch()
  assert [int(v) for v in run(ds)] == [0, 1, 2, 0, 1]


def test_unbatch_of_scalars_is_an_error_naming_the_op():
  with Dataset.range(3).unbatch().make_iterator() as it:
    with pytest.raises(ValueError, match="unbatch.*batch dimension"):
      next(it)


def test_unbatch_of_mismatched_batch_sizes_is_an_error_naming_both_sizes():
  ds = Dataset.range(1).map(lambda i: {"a": np.zeros(3), "b": np.zeros(2)})
  with ds.unbatch().make_iterator() as it:
    with pytest.raises(ValueError, match=r"unbatch.*'a': 3.*'b': 2"):
      next(it)


@pytest.mark.parametrize("batch_size", [1, 3, 5])
def test_unbatch_resume_at_every_cut_is_exact(batch_size):
  check_resume(lambda: Dataset.from_tensor_slices(SLICES).batch(batch_size).unbatch())


def test_unbatch_state_does_not_hold_the_batch():
  big = {"x": np.zeros((1000, 64), np.float32)}
  ds = Dataset.range(3).map(lambda i: big).unbatch()
  with ds.make_iterator() as it:
    for _ in range(500):
      next(it)
    assert len(str(it.get_state())) < 600


@pytest.mark.parametrize("op", ["unbatch", "rebatch"])
def test_saved_input_positions_stay_bounded_over_a_long_run(op):
  ds = Dataset.range(20000).batch(2)
  ds = ds.unbatch() if op == "unbatch" else ds.rebatch(3)
  with ds.make_iterator() as it:
    for _ in it:
      pass
    # The positions kept for restoring (InputReplay anchors) do not grow.
    assert len(it._input._anchors) <= 2  # pylint: disable=protected-access


# -- rebatch -------------------------------------------------------------------
@pytest.mark.parametrize(
  "n,first,sizes,drop",
  [
    (13, 3, 4, False),
    (13, 3, 4, True),
    (13, 5, 13, False),
    (13, 5, 20, False),
    (13, 5, 20, True),
    (13, 4, [2, 3], False),
    (13, 4, [2, 3], True),
    (0, 2, 3, False),
  ],
)
def test_rebatch_matches_tf_data(n, first, sizes, drop):
  assert_matches_tf_data(
    lambda D: D.from_tensor_slices(SLICES).take(n).batch(first).rebatch(sizes, drop_remainder=drop)
  )


def test_rebatch_equals_unbatch_then_batch():
  ours = run(Dataset.range(50).batch(7).rebatch(6))
  reference = run(Dataset.range(50).batch(7).unbatch().batch(6))
  assert_same_stream(ours, reference)


def test_rebatch_slices_input_batches_without_copying_rows():
  batch = np.arange(40).reshape(20, 2)
  ds = Dataset.range(1).map(lambda i: batch).rebatch(5)
  out = run(ds)
  assert len(out) == 4
  for part in out:
    assert np.shares_memory(part, batch)


def test_rebatch_joins_rows_of_consecutive_input_batches():
  ds = Dataset.range(10).batch(3).rebatch(4)
  assert [b.tolist() for b in run(ds)] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]


def test_rebatch_of_scalars_is_an_error_naming_the_op():
  with Dataset.range(3).rebatch(2).make_iterator() as it:
    with pytest.raises(ValueError, match="rebatch.*batch dimension"):
      next(it)


def test_rebatch_of_batches_with_other_trailing_shapes_is_an_error():
  parts = [np.zeros((2, 3)), np.zeros((2, 4))]
  ds = Dataset.range(2).map(lambda i: parts[int(i)]).rebatch(3)
  with ds.make_iterator() as it:
    with pytest.raises(ValueError, match="rebatch"):
      next(it)


@pytest.mark.parametrize("bad", [0, -1, [], [2, 0], 1.5])
def test_rebatch_rejects_invalid_batch_sizes(bad):
  with pytest.raises(ValueError, match="rebatch.*batch_size"):
    Dataset.range(3).batch(2).rebatch(bad)


@pytest.mark.parametrize("sizes,drop", [(4, False), ([1, 5], True), (2, True)])
def test_rebatch_resume_at_every_cut_is_exact(sizes, drop):
  check_resume(
    lambda: Dataset.from_tensor_slices(SLICES).batch(3).rebatch(sizes, drop_remainder=drop)
  )


def test_rebatch_spec_params_rebuild_an_equal_node():
  node = Dataset.range(9).batch(2).rebatch([2, 3], drop_remainder=True).node
  rebuilt = type(node)(*node.parents, **node.spec_params())
  assert rebuilt.fingerprint() == node.fingerprint()
