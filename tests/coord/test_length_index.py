"""Tests for jaxfeed.coord.compute_lengths."""

from __future__ import annotations

import numpy as np
import pytest

from jaxfeed.coord import LengthIndexError, compute_lengths


def _tokens_length(record):
  return len(record["tokens"])


@pytest.mark.parametrize("with_get_many", [True, False])
def test_lengths_are_one_per_record(sequence_source_cls, make_lengths, with_get_many):
  lengths = make_lengths(9000, seed=1)  # more than one get_many chunk
  source = sequence_source_cls(lengths, with_get_many=with_get_many)
  computed = compute_lengths(source, _tokens_length)
  assert computed.dtype == np.int64
  np.testing.assert_array_equal(computed, lengths)
  if with_get_many:
    assert 1 < source.get_many_calls <= 3 and source.getitem_calls == 0
  else:
    assert source.getitem_calls == len(lengths)


def test_index_is_saved_and_reused_without_reading_the_source(
  sequence_source_cls, make_lengths, tmp_path
):
  lengths = make_lengths(500)
  path = tmp_path / "sub" / "lengths.npy"
  first = compute_lengths(sequence_source_cls(lengths), _tokens_length, path)
  assert path.exists()
  np.testing.assert_array_equal(np.load(path), lengths)
  untouched = sequence_source_cls(lengths)
  second = compute_lengths(untouched, _tokens_length, str(path))
  np.testing.assert_array_equal(second, first)
  assert untouched.get_many_calls == untouched.getitem_calls == 0
  assert [p.name for p in path.parent.iterdir()] == ["lengths.npy"]


def test_stored_index_of_another_record_count_is_recomputed(
  sequence_source_cls, make_lengths, tmp_path
):
  path = tmp_path / "lengths.npy"
  np.save(path, np.arange(7))
  lengths = make_lengths(300)
  source = sequence_source_cls(lengths)
  computed = compute_lengths(source, _tokens_length, path)
  np.testing.assert_array_equal(computed, lengths)
  assert source.get_many_calls == 1
  np.testing.assert_array_equal(np.load(path), lengths)


@pytest.mark.parametrize("bad_length", [-3, 2.5, "7", None, True])
def test_length_fn_returning_a_non_length_names_the_record(sequence_source_cls, bad_length):
  source = sequence_source_cls([4, 5, 6, 7])

  def length_fn(record):
    return bad_length if int(record["id"]) == 2 else len(record["tokens"])

  with pytest.raises(LengthIndexError, match=f"returned {bad_length!r} for record 2"):
    compute_lengths(source, length_fn)


def test_numpy_scalar_lengths_are_accepted(sequence_source_cls):
  source = sequence_source_cls([4, 0, 6])
  computed = compute_lengths(source, lambda r: np.int32(r["tokens"].shape[0]))
  np.testing.assert_array_equal(computed, [4, 0, 6])
