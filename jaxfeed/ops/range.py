"""`range`: the integers start, start+step, ... before stop (tf.data.Dataset.range)."""

from __future__ import annotations

from typing import Any

import numpy as np

from jaxfeed.ops.base import Node, OpIterator, mix_seed, state_int

_OP = "range"


def _check_int(value: Any, name: str) -> int:
  if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
    raise ValueError(
        f"{_OP}: {name} must be an integer, got {type(value).__name__}: "
        f"{value!r}.")
  return int(value)


class RangeNode(Node):
  """Like `tf.data.Dataset.range`: `range(stop)` or `range(start, stop[, step])`.

  Elements are numpy scalars of `dtype` (int64 by default). The arguments may
  also be given by keyword (`start`, `stop`, `step`), as `spec_params` does.
  """

  op_name = _OP

  def __init__(self, *args: int, dtype: Any = None, start: int | None = None,
               stop: int | None = None, step: int | None = None):
    super().__init__()
    if args and (start is not None or stop is not None or step is not None):
      raise TypeError(
          f"{_OP}: pass start/stop/step either positionally or by keyword, "
          f"got args={args!r} and start={start!r}, stop={stop!r}, step={step!r}.")
    if not args:
      if stop is None:
        raise TypeError(f"{_OP}: missing the required argument stop.")
      args = (0 if start is None else start, stop, 1 if step is None else step)
    if len(args) == 1:
      args = (0, args[0], 1)
    elif len(args) == 2:
      args = (args[0], args[1], 1)
    elif len(args) != 3:
      raise TypeError(
          f"{_OP}: expected range(stop) or range(start, stop[, step]), got "
          f"{len(args)} arguments: {args!r}.")
    self.start, self.stop, self.step = (
        _check_int(v, n) for v, n in zip(args, ("start", "stop", "step")))
    if self.step == 0:
      raise ValueError(f"{_OP}: step must be a non-zero integer, got 0.")
    dtype = getattr(dtype, "as_numpy_dtype", dtype)  # Accepts tf.DType too.
    try:
      self.dtype = np.dtype(np.int64 if dtype is None else dtype)
    except TypeError as e:
      raise ValueError(
          f"{_OP}: dtype must be a numpy dtype or its name, got {dtype!r}.") from e
    if self.dtype.kind not in "iuf":
      raise ValueError(
          f"{_OP}: dtype must be an integer or floating dtype, got {self.dtype}.")

  def spec_params(self) -> dict:
    return {"start": self.start, "stop": self.stop, "step": self.step,
            "dtype": self.dtype.name}

  def cardinality(self) -> int:
    return len(range(self.start, self.stop, self.step))

  def make_iterator(self) -> "RangeIterator":
    return RangeIterator(self)

  def __repr__(self) -> str:
    return (f"RangeNode(start={self.start}, stop={self.stop}, step={self.step}, "
            f"dtype={self.dtype.name})")


class RangeIterator(OpIterator):
  """Yields the range's elements; state is the index of the next one."""

  op_name = _OP

  def __init__(self, node: RangeNode):
    super().__init__()
    self._start = node.start
    self._step = node.step
    self._length = node.cardinality()
    self._scalar = node.dtype.type
    if self._length and node.dtype.kind in "iu":
      info = np.iinfo(node.dtype)
      last = self._start + (self._length - 1) * self._step
      if not info.min <= min(self._start, last) <= max(self._start,
                                                        last) <= info.max:
        # Like tf.data: values computed in int64, cast with wrap-around.
        dtype = node.dtype
        self._scalar = lambda value: np.int64(value).astype(dtype)
    self._index = 0

  def __next__(self) -> Any:
    index = self._index
    if index >= self._length:
      raise StopIteration
    self._index = index + 1
    return self._scalar(self._start + index * self._step)

  @property
  def last_seed(self) -> int:
    # Seed 0, epoch 0 and the element's index, as a default IndexSampler
    # gives the same element of a source.
    return mix_seed(0, 0, self._index - 1) if self._index else 0

  def skip_elements(self, count: int) -> int:
    """Skips up to `count` elements without producing them; returns how many."""
    skipped = max(0, min(count, self._length - self._index))
    self._index += skipped
    return skipped

  def _get_own_state(self) -> dict:
    return {"index": self._index}

  def _set_own_state(self, state: dict) -> None:
    self._index = state_int(state, "index", _OP, 0, self._length)

