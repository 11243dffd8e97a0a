"""`take_while`: elements up to the first the predicate rejects
(tf.data's `Dataset.take_while`)."""

from __future__ import annotations

from typing import Any, Callable

from jaxfeed.ops import parallel
from jaxfeed.ops.base import Node, OpIterator, PipelineStateError, to_node
from jaxfeed.ops.filter import predicate_result

__all__ = ["TakeWhileNode", "TakeWhileIterator"]

_OP = "take_while"


class TakeWhileNode(Node):
  """The elements of `parent` while `predicate(element)` is true.

  As in tf.data, a tuple element is unpacked into the predicate's arguments,
  the predicate returns a boolean scalar, and the output ends at the first
  element it rejects (that element is not returned, and the input is not
  read any further).
  """

  op_name = _OP

  def __init__(self, parent: Any, predicate: Callable):
    super().__init__([to_node(parent, _OP, "input")])
    self.predicate = parallel.check_callable(predicate, _OP, "predicate")

  def spec_params(self) -> dict:
    return {"predicate": self.predicate}

  def cardinality(self) -> int | None:
    return None  # tf.data reports UNKNOWN for take_while, whatever its input.

  def make_iterator(self) -> "TakeWhileIterator":
    return TakeWhileIterator(self.parents[0].make_iterator(), self.predicate)


class TakeWhileIterator(OpIterator):
  """State: the parent's, and whether the predicate has rejected an element."""

  op_name = _OP
  stats_one_to_one = True

  def __init__(self, parent: OpIterator, predicate: Callable):
    super().__init__([parent])
    self._predicate = predicate
    self._done = False

  def __next__(self) -> Any:
    if self._done:
      raise StopIteration
    element = next(self.parents[0])
    keep = parallel.call_unpacked(self._predicate, element)
    if keep is True or (keep is not False and predicate_result(self._predicate, keep, _OP)):
      return element
    self._done = True
    raise StopIteration

  def _get_own_state(self) -> dict:
    return {"done": self._done}

  def _set_own_state(self, state: dict) -> None:
    done = state.get("done") if isinstance(state, dict) else None
    if not isinstance(done, bool):
      raise PipelineStateError(
        f"Cannot restore op {_OP!r}: own state needs a bool 'done', got {state!r:.200}."
      )
    self._done = done
