"""`concatenate`: the elements of one dataset, then those of another.

As in tf.data, both datasets must yield elements of the same structure and
dtypes (shapes may differ). jaxfeed elements carry no static types, so this is
checked on the first element of `other` against the first element of the
input, with an error naming both datasets.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from jaxfeed.ops import base
from jaxfeed.ops import index_ranges

__all__ = ["ConcatenateNode", "ConcatenateIterator", "element_signature"]

_OP = "concatenate"


def element_signature(element: Any) -> str:
  """An element's structure and leaf dtypes (not shapes), e.g. "{'x': int64}"."""
  if isinstance(element, dict):
    inner = ", ".join(f"{k!r}: {element_signature(element[k])}" for k in sorted(element, key=repr))
    return "{" + inner + "}"
  if isinstance(element, (tuple, list)):
    inner = ", ".join(element_signature(v) for v in element)
    return f"({inner})" if isinstance(element, tuple) else f"[{inner}]"
  if isinstance(element, bytes):
    return "bytes"
  if isinstance(element, str):
    return "str"
  dtype = np.asarray(element).dtype
  if dtype.kind == "S":
    return "bytes"
  if dtype.kind == "U":
    return "str"
  return str(dtype)


class ConcatenateNode(base.Node):
  """All elements of `parent`, then all elements of `other`."""

  op_name = _OP

  def __init__(self, parent: base.Node, other: Any):
    super().__init__([base.to_node(parent, _OP, "input"), base.to_node(other, _OP, "other")])

  def cardinality(self) -> int | None:
    first, second = (p.cardinality() for p in self.parents)
    if first == -1 or second == -1:
      return -1
    if first is None or second is None:
      return None
    return first + second

  def make_iterator(self) -> "ConcatenateIterator":
    return ConcatenateIterator(
      self.parents[0].make_iterator(),
      self.parents[1].make_iterator(),
      repr(self.parents[0]),
      repr(self.parents[1]),
    )

  # Index addressing (see jaxfeed.ops.index_ranges): the input's positions,
  # then those of `other`.
  def index_addressable(self) -> bool:
    return all(index_ranges.is_index_addressable(p) for p in self.parents)

  def num_positions(self) -> int | None:
    first, second = (index_ranges.num_positions(p) for p in self.parents)
    return None if first is None or second is None else first + second

  def range_iterator(self, start: int, stop: int) -> "ConcatenateIterator":
    first, second = self.parents
    count = index_ranges.num_positions(first)
    if count is None:  # `other` is never reached
      count = stop
    return ConcatenateIterator(
      index_ranges.range_iterator(first, min(start, count), min(stop, count)),
      index_ranges.range_iterator(second, max(start - count, 0), max(stop - count, 0)),
      repr(first),
      repr(second),
    )


class ConcatenateIterator(base.OpIterator):
  """Reads the input to its end, then `other`."""

  op_name = _OP

  def __init__(
    self, first: base.OpIterator, second: base.OpIterator, first_name: str, second_name: str
  ):
    super().__init__([first, second])
    self._names = (first_name, second_name)
    self._index = 0
    self._signature: str | None = None  # of the input's first element
    self._checked = False  # whether `other`'s first element was checked

  @property
  def last_seed(self) -> int:
    seed = self.parents[self._index].last_seed
    # Distinct seeds for `ds.concatenate(ds)`'s second half.
    return seed if self._index == 0 else base.mix_seed(seed, 1)

  def __next__(self) -> Any:
    if self._index == 0:
      try:
        element = next(self.parents[0])
      except StopIteration:
        self._index = 1
      else:
        if self._signature is None:
          self._signature = element_signature(element)
        return element
    element = next(self.parents[1])
    if not self._checked:
      self._check(element)
    return element

  def _check(self, element: Any) -> None:
    signature = element_signature(element)
    if self._signature is not None and signature != self._signature:
      raise TypeError(
        f"{_OP}: the datasets are not compatible: the input "
        f"{self._names[0]} has elements {self._signature}, the other "
        f"dataset {self._names[1]} has elements {signature}. Structures "
        f"and dtypes must match (cast with a map first)."
      )
    self._checked = True

  def _get_own_state(self) -> dict:
    return {"index": self._index, "signature": self._signature, "checked": self._checked}

  def _set_own_state(self, state: dict) -> None:
    self._index = base.state_int(state, "index", _OP, high=1)
    signature = state.get("signature")
    checked = state.get("checked")
    if not (signature is None or isinstance(signature, str)) or not isinstance(checked, bool):
      raise base.PipelineStateError(
        f"Cannot restore op {_OP!r}: own state needs 'signature' (str or "
        f"None) and 'checked' (bool), got {state!r:.200}."
      )
    self._signature = signature
    self._checked = checked
