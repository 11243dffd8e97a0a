"""`from_tensors`: a dataset of one element, the given structure
(tf.data's `Dataset.from_tensors`).

Leaves convert as in `from_tensor_slices` (Python ints to int32 when they
fit, floats to float32, strings to bytes; numpy values keep their dtype), but
are not sliced: the element is the whole structure. It is built as the
slices of the leaves with a new leading dimension of 1.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from jaxfeed.ops.from_tensor_slices import TensorSlicesIterator, TensorSlicesNode

__all__ = ["FromTensorsNode", "FromTensorsIterator"]

_OP = "from_tensors"


def _with_leading_one(value: Any) -> Any:
  """`value` with every leaf given a leading dimension of size 1, keeping
  the dtype tf.data would give the leaf on its own."""
  if isinstance(value, Mapping):
    return {k: _with_leading_one(v) for k, v in value.items()}
  if isinstance(value, tuple):
    items = [_with_leading_one(v) for v in value]
    return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
  if isinstance(value, (np.ndarray, np.generic)) or hasattr(value, "__array__"):
    return np.expand_dims(np.asarray(value), 0)
  return [value]  # Python values: converted like a list of them.


class FromTensorsNode(TensorSlicesNode):
  """Like `tf.data.Dataset.from_tensors(tensors)`: one element."""

  op_name = _OP

  def __init__(self, tensors: Any):
    super().__init__(_with_leading_one(tensors))
    self.tensors = tensors

  def make_iterator(self) -> "FromTensorsIterator":
    return FromTensorsIterator(self._build, 1)

  def range_iterator(self, start: int, stop: int) -> "FromTensorsIterator":
    return FromTensorsIterator(self._build, min(stop, 1), start)

  def __repr__(self) -> str:
    return "FromTensorsNode()"


class FromTensorsIterator(TensorSlicesIterator):
  """Yields the element once; state is whether it was returned."""

  op_name = _OP
