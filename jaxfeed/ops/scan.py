"""`scan`: a running state through the elements (tf.data's `scan`).

`scan_func(state, element) -> (new_state, output)`, starting from
`initial_state` (a tuple element is passed whole, as in tf.data). The
running state is saved with the iterator's state, so it must be a pytree of
numpy arrays, Python scalars, bytes or str.
"""

from __future__ import annotations

from typing import Any, Callable

from jaxfeed.ops import jsonable, parallel
from jaxfeed.ops.base import Node, OpIterator, PipelineStateError, to_node

__all__ = ["ScanNode", "ScanIterator"]

_OP = "scan"


class ScanNode(Node):
  """Outputs of `scan_func` threaded through a running state."""

  op_name = _OP

  def __init__(self, parent: Any, initial_state: Any, scan_func: Callable):
    super().__init__([to_node(parent, _OP, "input")])
    self.initial_state = initial_state
    self.scan_func = parallel.check_callable(scan_func, _OP)
    jsonable.encode(initial_state)  # fails early, naming the bad value

  def spec_params(self) -> dict:
    return {"initial_state": self.initial_state, "scan_func": self.scan_func}

  def cardinality(self) -> int | None:
    return self.parents[0].cardinality()

  def make_iterator(self) -> "ScanIterator":
    return ScanIterator(self.parents[0].make_iterator(), self)


class ScanIterator(OpIterator):
  """State: the running state."""

  op_name = _OP

  def __init__(self, parent: OpIterator, node: ScanNode):
    super().__init__([parent])
    self._fn = node.scan_func
    self._state = node.initial_state

  def __next__(self) -> Any:
    element = next(self.parents[0])
    result = self._fn(self._state, element)
    if not isinstance(result, tuple) or len(result) != 2:
      raise TypeError(
        f"{_OP}: scan_func must return (new_state, output), got "
        f"{type(result).__name__}: {result!r:.80}."
      )
    self._state, output = result
    return output

  def _get_own_state(self) -> dict:
    return {"state": jsonable.encode(self._state)}

  def _set_own_state(self, state: dict) -> None:
    if not isinstance(state, dict) or "state" not in state:
      raise PipelineStateError(
        f"Cannot restore op {_OP!r}: own state needs 'state', got {state!r:.200}."
      )
    self._state = jsonable.decode(state["state"])
