"""`counter`: start, start + step, ... without end (tf.data's `Dataset.counter`).

As in tf.data, the value is a running sum in `dtype`: integers wrap around at
the dtype's bounds, floats accumulate their rounding (`counter(0.1, 0.1,
float32)` yields tf.data's values, not `0.1 * i`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from jaxfeed.ops import jsonable
from jaxfeed.ops.base import Node, OpIterator, PipelineStateError, mix_seed, state_int

__all__ = ["CounterNode", "CounterIterator"]

_OP = "counter"


def _as_dtype(dtype: Any) -> np.dtype:
  dtype = getattr(dtype, "as_numpy_dtype", dtype)  # Accepts tf.DType too.
  try:
    dtype = np.dtype(np.int64 if dtype is None else dtype)
  except TypeError as e:
    raise ValueError(f"{_OP}: dtype must be a numpy dtype or its name, got {dtype!r}.") from e
  if dtype.kind not in "iuf":
    raise ValueError(f"{_OP}: dtype must be an integer or floating dtype, got {dtype}.")
  return dtype


def _convert(value: Any, dtype: np.dtype, name: str) -> np.generic:
  """`value` as a scalar of `dtype`, refusing what does not fit (tf.data's
  conversion of start and step)."""
  if isinstance(value, bool) or not isinstance(value, (int, float, np.number)):
    raise ValueError(f"{_OP}: {name} must be a number, got {value!r}.")
  if dtype.kind in "iu":
    info = np.iinfo(dtype)
    if not float(value).is_integer() or not info.min <= int(value) <= info.max:
      raise ValueError(f"{_OP}: {name}={value!r} is not a value of {dtype}.")
    return dtype.type(int(value))
  return dtype.type(value)


class CounterNode(Node):
  """Endless scalars of `dtype`: start, start + step, ..."""

  op_name = _OP

  def __init__(self, start: Any = 0, step: Any = 1, dtype: Any = None):
    super().__init__()
    self.dtype = _as_dtype(dtype)
    self.start = _convert(start, self.dtype, "start").item()
    self.step = _convert(step, self.dtype, "step").item()

  def spec_params(self) -> dict:
    return {"start": self.start, "step": self.step, "dtype": self.dtype.name}

  def cardinality(self) -> int:
    return -1

  def make_iterator(self) -> "CounterIterator":
    return CounterIterator(self)

  def __repr__(self) -> str:
    return f"CounterNode(start={self.start}, step={self.step}, dtype={self.dtype.name})"


class CounterIterator(OpIterator):
  """State: how many values were returned, and the next value."""

  op_name = _OP

  def __init__(self, node: CounterNode):
    super().__init__()
    self._dtype = node.dtype
    self._step = self._dtype.type(node.step)
    self._next = self._dtype.type(node.start)
    self._count = 0
    if self._dtype.kind in "iu":
      # Python ints wrapped into the dtype's range: no overflow warnings.
      bits = self._dtype.itemsize * 8
      self._modulus = 1 << bits
      self._low = -(1 << (bits - 1)) if self._dtype.kind == "i" else 0
    else:
      self._modulus = 0

  def __next__(self) -> Any:
    value = self._next
    if self._modulus:
      total = int(value) + int(self._step) - self._low
      self._next = self._dtype.type(total % self._modulus + self._low)
    else:
      with np.errstate(over="ignore"):
        self._next = value + self._step
    self._count += 1
    return value

  @property
  def last_seed(self) -> int:
    # As `range`: seed 0, epoch 0 and the element's index.
    return mix_seed(0, 0, self._count - 1) if self._count else 0

  def _stats_fields(self) -> dict:
    return {"elements": self._count}

  def _get_own_state(self) -> dict:
    return {"count": self._count, "next": jsonable.encode(self._next)}

  def _set_own_state(self, state: dict) -> None:
    count = state_int(state, "count", _OP)
    value = jsonable.decode(state.get("next"))
    if not isinstance(value, np.generic) or value.dtype != self._dtype:
      raise PipelineStateError(
        f"Cannot restore op {_OP!r}: own state needs the next value as a "
        f"{self._dtype} scalar, got {state!r:.200}."
      )
    self._count, self._next = count, value
