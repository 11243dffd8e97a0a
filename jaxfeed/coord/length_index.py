"""The per-record length index a `BucketPlan` is computed from."""

from __future__ import annotations

import os
from typing import Any, Callable

from etils import epath
import numpy as np

from jaxfeed import progress
from jaxfeed.ops import from_source

__all__ = ["LengthIndexError", "compute_lengths", "read_records"]

_CHUNK_SIZE = 4096  # records per get_many call: bounded memory, few calls


class LengthIndexError(ValueError):
  """A length function returned something that is not a length."""


def read_records(source: Any, indices: np.ndarray) -> list:
  """Records at `indices`, through `source.get_many` when the source has it."""
  return list(from_source.records_reader(source)(indices))


def compute_lengths(
  source: Any, length_fn: Callable[[Any], int], path: str | os.PathLike | None = None
) -> np.ndarray:
  """One length per record of `source`, computed once and cached as .npy.

  Args:
    source: A random-access source (`len`, `source[i]`, ideally `get_many`).
    length_fn: Maps one record to its non-negative integer length (e.g.
      `lambda r: len(r["tokens"])`).
    path: Optional `.npy` file (local or any `etils.epath` path). If it exists
      and holds one length per record of `source`, it is loaded instead of
      reading the source; otherwise the index is computed and written there.

  Returns:
    An int64 array of shape `(len(source),)`.

  Raises:
    LengthIndexError: `length_fn` returned a negative or non-integer value.
  """
  num_records = len(source)
  index_path = epath.Path(path) if path is not None else None
  if index_path is not None and index_path.exists():
    with index_path.open("rb") as f:
      stored = np.load(f, allow_pickle=False)
    if (
      stored.ndim == 1
      and stored.shape[0] == num_records
      and np.issubdtype(stored.dtype, np.integer)
    ):
      return stored.astype(np.int64, copy=False)
    # A stale index (the source changed size) is recomputed below.

  lengths = np.empty((num_records,), np.int64)
  with progress.Progress("length index", num_records) as bar:
    for start in range(0, num_records, _CHUNK_SIZE):
      indices = np.arange(start, min(start + _CHUNK_SIZE, num_records))
      for index, record in zip(indices, read_records(source, indices)):
        lengths[index] = _checked_length(length_fn(record), int(index), length_fn)
      bar.advance(len(indices))

  if index_path is not None:
    _write_atomically(index_path, lengths)
  return lengths


def _checked_length(value: Any, index: int, length_fn: Callable) -> int:
  if isinstance(value, np.ndarray) and value.ndim == 0:
    value = value.item()
  if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 0:
    raise LengthIndexError(
      f"compute_lengths: length_fn {getattr(length_fn, '__name__', length_fn)}"
      f" returned {value!r} for record {index}; a length must be an integer "
      f">= 0."
    )
  return int(value)


def _write_atomically(path: epath.Path, lengths: np.ndarray) -> None:
  """Writes the index so a concurrent reader never sees a partial file."""
  path.parent.mkdir(parents=True, exist_ok=True)
  temporary = path.parent / f"{path.name}.tmp-{os.getpid()}"
  with temporary.open("wb") as f:
    np.save(f, lengths, allow_pickle=False)
  temporary.replace(path)
