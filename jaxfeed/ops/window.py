"""`window`: overlapping or strided windows of consecutive elements.

tf.data's `window(size, shift=None, stride=1, drop_remainder=False)` yields a
dataset per window; jaxfeed yields each window as one element instead:

- `stack=True` (the default): the window's elements stacked like `batch`
  does (a leading window dimension on every leaf);
- `stack=False`: a Python list of the window's elements.

Window `i` holds the input elements `i * shift + k * stride` for
`k = 0 .. size - 1` that exist; windows start at every `i * shift` before the
end of the input, so the last ones may be shorter, unless `drop_remainder`
drops every window with fewer than `size` elements (tf.data's rules).

State: the input's position at the current window's first element (through
`InputReplay`) and that element's index; restoring reads the window again.
"""

from __future__ import annotations

from typing import Any

from jaxfeed.ops import stacking
from jaxfeed.ops.base import (
  InputReplay,
  Node,
  OpIterator,
  PipelineStateError,
  check_positive_int,
  state_int,
  to_node,
)

__all__ = ["WindowNode", "WindowIterator"]

_OP = "window"


class WindowNode(Node):
  """Windows of `size` elements every `shift`, taking every `stride`-th."""

  op_name = _OP

  def __init__(
    self,
    parent: Any,
    size: int,
    shift: int | None = None,
    stride: int = 1,
    drop_remainder: bool = False,
    stack: bool = True,
  ):
    super().__init__([to_node(parent, _OP, "input")])
    self.size = check_positive_int(size, _OP, "size")
    self.shift = self.size if shift is None else check_positive_int(shift, _OP, "shift")
    self.stride = check_positive_int(stride, _OP, "stride")
    for name, value in (("drop_remainder", drop_remainder), ("stack", stack)):
      if not isinstance(value, bool):
        raise TypeError(f"{_OP}: {name} must be a bool, got {value!r}.")
    self.drop_remainder = drop_remainder
    self.stack = stack

  def spec_params(self) -> dict:
    return {
      "size": self.size,
      "shift": self.shift,
      "stride": self.stride,
      "drop_remainder": self.drop_remainder,
      "stack": self.stack,
    }

  def cardinality(self) -> int | None:
    n = self.parents[0].cardinality()
    if n is None or n < 0:
      return n
    if not self.drop_remainder:
      return -(-n // self.shift)
    span = (self.size - 1) * self.stride + 1
    return 0 if n < span else (n - span) // self.shift + 1

  def make_iterator(self) -> "WindowIterator":
    return WindowIterator(self.parents[0].make_iterator(), self)


class WindowIterator(OpIterator):
  """Keeps the input elements from the current window's start."""

  op_name = _OP

  def __init__(self, parent: OpIterator, node: WindowNode):
    super().__init__([parent])
    self._size, self._shift, self._stride = node.size, node.shift, node.stride
    self._drop_remainder = node.drop_remainder
    self._stack = node.stack
    self._start = 0  # input index of the current window's first element
    self._buffer: list = []  # input elements from `_start` on
    self._seeds: list = []
    self._ended = False
    self._last_seed = 0
    self._input = InputReplay(parent, _OP, oldest_needed=lambda: self._start)

  @property
  def last_seed(self) -> int:
    return self._last_seed

  def _fill(self, count: int) -> None:
    """Reads until the buffer holds `count` elements or the input ends."""
    while not self._ended and len(self._buffer) < count:
      try:
        element = self._input.read()
      except StopIteration:
        self._ended = True
        return
      if self._input.num_read - 1 >= self._start:
        self._buffer.append(element)
        self._seeds.append(self.parents[0].last_seed)

  def __next__(self) -> Any:
    span = (self._size - 1) * self._stride + 1
    self._fill(span)
    if not self._buffer:
      raise StopIteration
    window = self._buffer[: span : self._stride]
    if len(window) < self._size and self._drop_remainder:
      raise StopIteration
    self._last_seed = self._seeds[0]
    # Next window: drop what it no longer needs (reading past a gap).
    self._start += self._shift
    del self._buffer[: self._shift], self._seeds[: self._shift]
    return stacking.stack(window, _OP) if self._stack else list(window)

  def _get_own_state(self) -> dict:
    return {"input": self._input.get_state(self._start), "start": self._start, "ended": self._ended}

  def _set_own_state(self, state: dict) -> None:
    start = state_int(state, "start", _OP)
    self._start, self._buffer, self._seeds = start, [], []
    ended = state.get("ended")
    if not isinstance(ended, bool):
      raise PipelineStateError(
        f"Cannot restore op {_OP!r}: own state needs a bool 'ended', got {state!r:.200}."
      )
    input_state = state.get("input")
    self._input.set_state(input_state, start, self._keep)
    self._ended = ended

  def _keep(self, index: int, element: Any, seed: int) -> None:
    del index
    self._buffer.append(element)
    self._seeds.append(seed)
