"""Shared fixtures for the coordinated-read tests."""

from __future__ import annotations

import numpy as np
import pytest


class SequenceSource:
  """Variable-length int32 token records; counts how it is read."""

  def __init__(self, lengths, with_get_many: bool = True):
    self.lengths = np.asarray(lengths)
    self.get_many_calls = 0
    self.getitem_calls = 0
    if not with_get_many:
      self.get_many = None

  def __len__(self) -> int:
    return len(self.lengths)

  def record(self, i: int) -> dict:
    # Every token of record i is i, so padded batches show which records
    # they hold and padding shows as the padding value.
    return {"tokens": np.full(int(self.lengths[i]), i, np.int32), "id": np.int64(i)}

  def __getitem__(self, i: int) -> dict:
    self.getitem_calls += 1
    return self.record(i)

  def get_many(self, indices):  # pylint: disable=method-hidden
    self.get_many_calls += 1
    return [self.record(int(i)) for i in indices]

  def __repr__(self) -> str:
    return f"SequenceSource({len(self)} records)"


def lognormal_lengths(num_records: int, seed: int = 0, low: int = 1, high: int = 200) -> np.ndarray:
  rng = np.random.default_rng(seed)
  return np.clip(rng.lognormal(3.5, 0.8, num_records), low, high).astype(np.int64)


@pytest.fixture
def sequence_source_cls():
  return SequenceSource


@pytest.fixture
def make_lengths():
  return lognormal_lengths
