"""`ConcatSource`: several sources read as one, one after another."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from jaxfeed.sources.base import RecordSource, source_identity

__all__ = ["ConcatSource"]


class ConcatSource(RecordSource):
  """The records of `sources` one after another: record `offset_c + r` is
  record `r` of `sources[c]`, where `offset_c` counts the records before it.

  Args:
    sources: random-access sources (`len`, `[i]`, optionally `get_many`).
  """

  def __init__(self, sources: Sequence[Any]):
    if isinstance(sources, (str, bytes)) or not isinstance(sources, Sequence) or not sources:
      raise TypeError(
        f"ConcatSource: sources must be a non-empty list of sources, got {sources!r:.200}."
      )
    for i, source in enumerate(sources):
      if not (hasattr(source, "__len__") and hasattr(source, "__getitem__")):
        raise TypeError(
          f"ConcatSource: sources[{i}] must be a random-access source with "
          f"__len__ and __getitem__, got {type(source).__name__}."
        )
    self._sources = list(sources)
    self._offsets = np.cumsum([0] + [len(s) for s in self._sources])

  @property
  def sources(self) -> list[Any]:
    return list(self._sources)

  def __len__(self) -> int:
    return int(self._offsets[-1])

  def _read(self, index: int) -> Any:
    c = int(np.searchsorted(self._offsets, index, side="right")) - 1
    return self._sources[c][index - int(self._offsets[c])]

  def _read_many(self, indices: np.ndarray) -> list[Any]:
    which_source = np.searchsorted(self._offsets, indices, side="right") - 1
    records: list[Any] = [None] * indices.size
    for c in np.unique(which_source).tolist():
      where = np.flatnonzero(which_source == c)
      source = self._sources[c]
      local = indices[where] - self._offsets[c]
      get_many = getattr(source, "get_many", None)
      read = get_many(local) if callable(get_many) else [source[i] for i in local.tolist()]
      for slot, record in zip(where.tolist(), read):
        records[slot] = record
    return records

  def spec_params(self) -> dict[str, Any]:
    return {"sources": list(self._sources)}

  def fingerprint_params(self) -> dict[str, Any]:
    return {"sources": [getattr(s, "fingerprint_params", dict)() for s in self._sources]}

  def identity(self) -> dict[str, Any]:
    """The type, length and identity of each source, in order."""
    return {"sources": [source_identity(s) for s in self._sources]}

  def close(self) -> None:
    for source in self._sources:
      close = getattr(source, "close", None)
      if callable(close):
        close()

  def __repr__(self) -> str:
    return f"ConcatSource({self._sources!r})"
