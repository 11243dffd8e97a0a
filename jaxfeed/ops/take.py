"""`take`: the first `count` elements of a dataset (tf.data.Dataset.take)."""

from __future__ import annotations

from typing import Any

from jaxfeed.ops.base import Node, OpIterator, check_count, state_int, to_node

_OP = "take"


class TakeNode(Node):
  """At most `count` elements of `parent`; a negative count takes them all."""

  op_name = _OP

  def __init__(self, parent: Any, count: int):
    super().__init__([to_node(parent, _OP, "input")])
    self.count = check_count(count, _OP)

  def spec_params(self) -> dict:
    return {"count": self.count}

  def cardinality(self) -> int | None:
    parent = self.parents[0].cardinality()
    if self.count < 0:
      return parent
    if parent is None:
      return 0 if self.count == 0 else None
    return self.count if parent == -1 else min(parent, self.count)

  def make_iterator(self) -> "TakeIterator":
    return TakeIterator(self.parents[0].make_iterator(), self.count)

  def __repr__(self) -> str:
    return f"TakeNode(count={self.count})"


class TakeIterator(OpIterator):
  """Passes elements through until `count` are taken; state: how many so far."""

  op_name = _OP

  def __init__(self, parent: OpIterator, count: int):
    super().__init__([parent])
    self._parent = parent
    self._count = count
    self._taken = 0

  def __next__(self) -> Any:
    if 0 <= self._count <= self._taken:
      raise StopIteration
    element = next(self._parent)
    self._taken += 1
    return element

  def _get_own_state(self) -> dict:
    return {"taken": self._taken}

  def _set_own_state(self, state: dict) -> None:
    self._taken = state_int(state, "taken", _OP, 0, self._count if self._count >= 0 else None)
