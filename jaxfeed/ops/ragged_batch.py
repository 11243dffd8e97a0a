"""`ragged_batch`: batches elements whose leaves differ in length.

tf.data's `ragged_batch(batch_size, drop_remainder=False)` makes every
component of rank >= 1 a RaggedTensor. jaxfeed has no ragged type, so such a
leaf becomes `{"values": <the rows concatenated along axis 0>,
"row_lengths": <int64 [batch]>}` (tf's `flat_values` for one ragged
dimension, and `row_lengths()`); scalar leaves are stacked as by `batch`. Row
`i` is `values[offsets[i]:offsets[i + 1]]` with `offsets` the cumulative sum
of `row_lengths`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from jaxfeed.ops import tree
from jaxfeed.ops.base import Node, OpIterator, check_positive_int, state_int, to_node

__all__ = ["RaggedBatchNode", "RaggedBatchIterator", "ragged_stack"]

_OP = "ragged_batch"


def ragged_stack(elements: list) -> Any:
  """The ragged batch of `elements` (see the module docstring)."""
  structure = elements[0]
  columns = [tree.flatten(e) for e in elements]
  leaves: list[Any] = []
  for i in range(len(columns[0])):
    rows = [np.asarray(c[i]) for c in columns]
    if rows[0].ndim == 0:
      leaves.append(np.stack(rows))
      continue
    try:
      values = np.concatenate(rows)
    except ValueError as e:
      raise ValueError(
        f"{_OP}: rows of component {i} differ beyond their first "
        f"dimension: {sorted({r.shape[1:] for r in rows})}."
      ) from e
    leaves.append({"values": values, "row_lengths": np.array([len(r) for r in rows], np.int64)})
  return tree.unflatten(structure, leaves)


class RaggedBatchNode(Node):
  """Batches of `batch_size` elements with ragged leaves."""

  op_name = _OP

  def __init__(self, parent: Any, batch_size: int, drop_remainder: bool = False):
    super().__init__([to_node(parent, _OP, "input")])
    self.batch_size = check_positive_int(batch_size, _OP, "batch_size")
    if not isinstance(drop_remainder, bool):
      raise TypeError(f"{_OP}: drop_remainder must be a bool, got {drop_remainder!r}.")
    self.drop_remainder = drop_remainder

  def spec_params(self) -> dict:
    return {"batch_size": self.batch_size, "drop_remainder": self.drop_remainder}

  def cardinality(self) -> int | None:
    n = self.parents[0].cardinality()
    if n is None or n < 0:
      return n
    return n // self.batch_size if self.drop_remainder else -(-n // self.batch_size)

  def make_iterator(self) -> "RaggedBatchIterator":
    return RaggedBatchIterator(
      self.parents[0].make_iterator(), self.batch_size, self.drop_remainder
    )


class RaggedBatchIterator(OpIterator):
  """Reads `batch_size` elements per batch; state: the input's."""

  op_name = _OP

  def __init__(self, parent: OpIterator, batch_size: int, drop_remainder: bool):
    super().__init__([parent])
    self._batch_size = batch_size
    self._drop_remainder = drop_remainder
    self._last_seed = 0

  @property
  def last_seed(self) -> int:
    return self._last_seed

  def __next__(self) -> Any:
    parent = self.parents[0]
    elements = []
    for _ in range(self._batch_size):
      try:
        elements.append(next(parent))
      except StopIteration:
        break
      if len(elements) == 1:
        self._last_seed = parent.last_seed
    if not elements or (self._drop_remainder and len(elements) < self._batch_size):
      raise StopIteration
    return ragged_stack(elements)

  def _get_own_state(self) -> dict:
    return {"last_seed": self._last_seed}

  def _set_own_state(self, state: dict) -> None:
    self._last_seed = state_int(state, "last_seed", _OP)
