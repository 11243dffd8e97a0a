"""`padded_batch`: batches elements of different shapes by padding them.

tf.data semantics: each leaf is padded to its entry of `padded_shapes` (None
or -1 dimensions, or no `padded_shapes` at all, pad to the longest element of
the batch) with its entry of `padding_values` (0 / False for numbers, b'' or ''
for strings by default; one scalar pads every leaf). An element longer than an
explicit padded size is an error. See `jaxfeed.ops.padding.pad_and_stack`.

Several JAX processes: padding to the batch's longest element gives each
process its own shape, and the processes' batches of a step must have equal
shapes to form one global array (`jaxfeed.Loader` raises a ValueError naming
the leaf and each process's shape otherwise). Give fixed `padded_shapes` (every
process pads to the same sizes), or let the Loader zero-pad to the largest size
any process has at that step with `Loader(..., pad_to_common_shape=True)`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from jaxfeed.ops import base
from jaxfeed.ops import batch
from jaxfeed.ops import padding
from jaxfeed.ops import tree


class PaddedBatchNode(base.Node):
  """Padded batches of `batch_size` consecutive elements of `parent`."""

  op_name = "padded_batch"

  def __init__(
    self,
    parent: base.Node,
    batch_size: int,
    padded_shapes: Any = None,
    padding_values: Any = None,
    drop_remainder: bool = False,
  ):
    super().__init__([base.to_node(parent, self.op_name, "input")])
    self.batch_size = base.check_positive_int(batch_size, self.op_name, "batch_size")
    self.padded_shapes = _normalize_shapes(padded_shapes)
    _check_padded_sizes(self.padded_shapes)
    _check_padding_values(padding_values)
    self.padding_values = padding_values
    self.drop_remainder = bool(drop_remainder)

  def spec_params(self) -> dict:
    return {
      "batch_size": self.batch_size,
      "padded_shapes": self.padded_shapes,
      "padding_values": self.padding_values,
      "drop_remainder": self.drop_remainder,
    }

  def cardinality(self) -> int | None:
    return batch.batched_cardinality(
      self.parents[0].cardinality(), self.batch_size, self.drop_remainder
    )

  def make_iterator(self) -> "PaddedBatchIterator":
    return PaddedBatchIterator(self.parents[0].make_iterator(), self)


class PaddedBatchIterator(batch.BatchIterator):
  """Reads `batch_size` elements per `next()`, pads and stacks them."""

  op_name = "padded_batch"
  _use_batched_reads = False

  def __init__(self, parent: base.OpIterator, node: PaddedBatchNode):
    super().__init__(parent, node.batch_size, node.drop_remainder)
    self._padded_shapes = node.padded_shapes
    self._padding_values = node.padding_values

  def _assemble(self, elements: list) -> Any:
    return padding.pad_and_stack(elements, self._padded_shapes, self._padding_values, self.op_name)


def _normalize_shapes(padded_shapes: Any) -> Any:
  """TensorShape-like leaves (with `as_list()`) become plain lists."""
  if padded_shapes is None:
    return None
  if hasattr(padded_shapes, "as_list"):
    return padded_shapes.as_list()
  if isinstance(padded_shapes, dict):
    return {k: _normalize_shapes(v) for k, v in padded_shapes.items()}
  if isinstance(padded_shapes, (tuple, list)):
    return type(padded_shapes)(_normalize_shapes(v) for v in padded_shapes)
  return padded_shapes


def _check_padded_sizes(padded_shapes: Any) -> None:
  for leaf in tree.flatten(padded_shapes):
    sizes = leaf.tolist() if isinstance(leaf, np.ndarray) else [leaf]
    for size in sizes:
      ok = size is None or (
        isinstance(size, (int, np.integer)) and not isinstance(size, bool) and size >= -1
      )
      if not ok:
        raise ValueError(
          f"padded_batch: padded_shapes holds size {size!r}; allowed are "
          f"ints >= 0, or None / -1 to pad to the batch maximum."
        )


def _check_padding_values(padding_values: Any) -> None:
  for leaf in tree.flatten(padding_values):
    if leaf is not None and np.ndim(leaf) != 0:
      raise ValueError(
        f"padded_batch: padding_values must be scalars (one per leaf, or "
        f"one for all leaves), got {leaf!r}."
      )
