"""`batch`: combines consecutive elements into batches (tf.data semantics).

Each batch stacks `batch_size` consecutive elements along a new leading
dimension (see `jaxfeed.ops.stacking` for the batch layout). The last batch
holds the remaining elements unless `drop_remainder` drops it. Each `next()`
reads exactly the elements of one batch, so nothing is buffered between calls
and the iterator's state is its parent's.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

from jaxfeed.ops import base
from jaxfeed.ops import stacking


def batched_cardinality(
  parent_cardinality: int | None, batch_size: int, drop_remainder: bool
) -> int | None:
  """The number of batches of `batch_size` from that many elements."""
  if parent_cardinality is None or parent_cardinality < 0:
    return parent_cardinality
  if drop_remainder:
    return parent_cardinality // batch_size
  return math.ceil(parent_cardinality / batch_size)


class BatchNode(base.Node):
  """Batches of `batch_size` consecutive elements of `parent`."""

  op_name = "batch"

  def __init__(self, parent: base.Node, batch_size: int, drop_remainder: bool = False):
    super().__init__([base.to_node(parent, self.op_name, "input")])
    self.batch_size = base.check_positive_int(batch_size, self.op_name, "batch_size")
    self.drop_remainder = bool(drop_remainder)

  def spec_params(self) -> dict:
    return {"batch_size": self.batch_size, "drop_remainder": self.drop_remainder}

  def cardinality(self) -> int | None:
    return batched_cardinality(self.parents[0].cardinality(), self.batch_size, self.drop_remainder)

  def make_iterator(self) -> "BatchIterator":
    return BatchIterator(self.parents[0].make_iterator(), self.batch_size, self.drop_remainder)


class BatchIterator(base.OpIterator):
  """Reads `batch_size` elements per `next()` and stacks them.

  Uses the parent's `next_batch` (the batched-read protocol documented in
  `jaxfeed.ops.stacking`) when the parent has one. Subclasses that assemble
  batches differently override `_assemble` and set `_use_batched_reads`.
  """

  op_name = "batch"
  _use_batched_reads = True

  def __init__(self, parent: base.OpIterator, batch_size: int, drop_remainder: bool):
    super().__init__([parent])
    self._batch_size = batch_size
    self._drop_remainder = drop_remainder
    self._next_batch = getattr(parent, "next_batch", None) if self._use_batched_reads else None
    self._last_seed = 0
    self._batches = 0

  @property
  def last_seed(self) -> int:
    """The seed of the first element of the batch returned last."""
    return self._last_seed

  def _stats_fields(self) -> dict:
    return {"elements": self._batches}

  def __next__(self) -> Any:
    if self._next_batch is not None and not getattr(
      self.parents[0], "batched_reads_declined", False
    ):
      batch, seeds = self._next_batch(self._batch_size)
      if len(seeds) < self._batch_size and self._drop_remainder:
        raise StopIteration
      self._last_seed = int(seeds[0])
      self._batches += 1
      return batch
    parent = self.parents[0]
    elements = [next(parent)]  # StopIteration here ends the batches
    first_seed = parent.last_seed
    # islice pulls the rest in C and stops quietly at the parent's end.
    elements.extend(itertools.islice(parent, self._batch_size - 1))
    if len(elements) < self._batch_size and self._drop_remainder:
      raise StopIteration
    self._last_seed = first_seed
    self._batches += 1
    return self._assemble(elements)

  def _assemble(self, elements: list) -> Any:
    return stacking.stack(elements, self.op_name)
