"""`skip`: a dataset without its first `count` elements (tf.data.Dataset.skip)."""

from __future__ import annotations

from typing import Any

from jaxfeed.ops.base import Node, OpIterator, check_count, state_int, to_node

_OP = "skip"


class SkipNode(Node):
  """`parent` minus its first `count` elements; a negative count skips all."""

  op_name = _OP

  def __init__(self, parent: Any, count: int):
    super().__init__([to_node(parent, _OP, "input")])
    self.count = check_count(count, _OP)

  def spec_params(self) -> dict:
    return {"count": self.count}

  def cardinality(self) -> int | None:
    parent = self.parents[0].cardinality()
    if parent is None or parent == -1:
      return parent
    return 0 if self.count < 0 else max(0, parent - self.count)

  def make_iterator(self) -> "SkipIterator":
    return SkipIterator(self.parents[0].make_iterator(), self.count)

  def __repr__(self) -> str:
    return f"SkipNode(count={self.count})"


class SkipIterator(OpIterator):
  """Skips lazily on the first `next()`; state: how many are left to skip."""

  op_name = _OP

  def __init__(self, parent: OpIterator, count: int):
    super().__init__([parent])
    self._parent = parent
    # -1: skip everything (tf.data's skip(-1)).
    self._count = -1 if count < 0 else count
    self._remaining = self._count

  def __next__(self) -> Any:
    if self._remaining:
      self._skip()
    return next(self._parent)

  def _skip(self) -> None:
    parent = self._parent
    if self._remaining < 0:
      while True:  # Ends with the parent's StopIteration.
        next(parent)
    # Sources and slices can skip without producing the elements.
    skip_elements = getattr(parent, "skip_elements", None)
    if skip_elements is not None:
      self._remaining -= skip_elements(self._remaining)
      if self._remaining:
        raise StopIteration
      return
    while self._remaining:
      next(parent)  # Counted only once it succeeded, so the state stays exact.
      self._remaining -= 1

  def _get_own_state(self) -> dict:
    return {"remaining": self._remaining}

  def _set_own_state(self, state: dict) -> None:
    low, high = (-1, -1) if self._count < 0 else (0, self._count)
    self._remaining = state_int(state, "remaining", _OP, low, high)
