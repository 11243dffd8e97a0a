"""`unique`: drops elements seen before (tf.data's `unique`).

As in tf.data, elements must be scalars: integers or strings (bytes/str). The
values seen so far are kept in memory and in the state, so the state grows with
the number of distinct elements.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from jaxfeed.ops import jsonable
from jaxfeed.ops.base import Node, OpIterator, PipelineStateError, to_node

__all__ = ["UniqueNode", "UniqueIterator"]

_OP = "unique"


def _key(element: Any) -> Any:
  array = np.asarray(element)
  if array.ndim != 0 or array.dtype.kind not in "iuSUO":
    raise TypeError(
      f"{_OP}: elements must be integer or string scalars, as in "
      f"tf.data, got {type(element).__name__}: {element!r:.80}."
    )
  value = array.item()
  if isinstance(value, str):
    return value.encode()
  if not isinstance(value, (int, bytes)):
    raise TypeError(f"{_OP}: elements must be integer or string scalars, got {element!r:.80}.")
  return value


class UniqueNode(Node):
  """The first occurrence of each distinct element, in input order."""

  op_name = _OP

  def __init__(self, parent: Any):
    super().__init__([to_node(parent, _OP, "input")])

  def make_iterator(self) -> "UniqueIterator":
    return UniqueIterator(self.parents[0].make_iterator())


class UniqueIterator(OpIterator):
  """State: the values seen so far."""

  op_name = _OP

  def __init__(self, parent: OpIterator):
    super().__init__([parent])
    self._seen: set = set()

  def __next__(self) -> Any:
    parent = self.parents[0]
    while True:
      element = next(parent)
      key = _key(element)
      if key not in self._seen:
        self._seen.add(key)
        return element

  def _get_own_state(self) -> dict:
    return {"seen": jsonable.encode(sorted(self._seen, key=repr))}

  def _set_own_state(self, state: dict) -> None:
    seen = jsonable.decode(state.get("seen") if isinstance(state, dict) else None)
    if not isinstance(seen, list):
      raise PipelineStateError(
        f"Cannot restore op {_OP!r}: own state needs a list 'seen', got {state!r:.200}."
      )
    self._seen = set(seen)
