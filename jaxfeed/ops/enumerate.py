"""`enumerate`: pairs each element with its index (tf.data's `enumerate`)."""

from __future__ import annotations

from typing import Any

import numpy as np

from jaxfeed.ops.base import Node, OpIterator, state_int, to_node

__all__ = ["EnumerateNode", "EnumerateIterator"]

_OP = "enumerate"


class EnumerateNode(Node):
  """`(np.int64(start + i), element)` for the i-th element."""

  op_name = _OP

  def __init__(self, parent: Any, start: int = 0):
    super().__init__([to_node(parent, _OP, "input")])
    if not isinstance(start, (int, np.integer)) or isinstance(start, bool):
      raise TypeError(f"{_OP}: start must be an integer, got {start!r}.")
    self.start = int(start)

  def spec_params(self) -> dict:
    return {"start": self.start}

  def cardinality(self) -> int | None:
    return self.parents[0].cardinality()

  def make_iterator(self) -> "EnumerateIterator":
    return EnumerateIterator(self.parents[0].make_iterator(), self.start)


class EnumerateIterator(OpIterator):
  """State: how many elements were returned."""

  op_name = _OP

  def __init__(self, parent: OpIterator, start: int):
    super().__init__([parent])
    self._start = start
    self._count = 0

  def __next__(self) -> Any:
    element = next(self.parents[0])
    index = np.int64(self._start + self._count)
    self._count += 1
    return index, element

  def _get_own_state(self) -> dict:
    return {"count": self._count}

  def _set_own_state(self, state: dict) -> None:
    self._count = state_int(state, "count", _OP)
