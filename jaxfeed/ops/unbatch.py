"""`unbatch`: splits every input batch into its rows (tf.data's `unbatch`).

Every leaf of an input element must have a leading (batch) dimension of the
same size; row `i` of each leaf forms output element `i` (rows are views of the
batch, as `jaxfeed.ops.stacking.unstack` makes them). The state is the input's
position before the current batch plus the number of rows returned from it;
restoring reads that one batch again.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from jaxfeed.ops import base
from jaxfeed.ops import stacking
from jaxfeed.ops import tree

__all__ = ["UnbatchNode", "UnbatchIterator", "batch_rows"]

_OP = "unbatch"


def batch_rows(batch: Any, op_name: str) -> int:
  """The number of rows of a batch; every leaf must have that leading size.

  Raises:
    ValueError: A leaf is a scalar, or leaves disagree on the batch size.
  """
  leaves = tree.flatten(batch)
  if not leaves:
    raise ValueError(f"{op_name}: input elements need at least one array, got {batch!r:.200}.")
  sizes = []
  for leaf in leaves:
    shape = np.shape(leaf)
    if not shape:
      raise ValueError(
        f"{op_name}: every component of an input element must have a batch "
        f"dimension, but the element {tree.structure_str(batch)} has a "
        f"scalar component; batch the dataset first."
      )
    sizes.append(shape[0])
  if len(set(sizes)) > 1:
    paths = tree.paths(batch)
    detail = ", ".join(f"{p or '<element>'!r}: {s}" for p, s in zip(paths, sizes))
    raise ValueError(
      f"{op_name}: every component of an input element must have the same batch size, got {detail}."
    )
  return int(sizes[0])


class UnbatchNode(base.Node):
  """The rows of the input's batches, one element per row."""

  op_name = _OP

  def __init__(self, parent: base.Node):
    super().__init__([base.to_node(parent, _OP, "input")])

  def cardinality(self) -> int | None:
    return 0 if self.parents[0].cardinality() == 0 else None

  def make_iterator(self) -> "UnbatchIterator":
    return UnbatchIterator(self.parents[0].make_iterator())


class UnbatchIterator(base.OpIterator):
  """Returns the rows of one input batch after another."""

  op_name = _OP

  def __init__(self, parent: base.OpIterator):
    super().__init__([parent])
    self._input = base.InputReplay(parent, _OP, interval=1)
    self._rows: list = []
    self._pos = 0
    self._batch_seed = 0

  @property
  def last_seed(self) -> int:
    return base.mix_seed(self._batch_seed, self._pos - 1)

  def _take_batch(self, batch: Any, seed: int) -> None:
    batch_rows(batch, _OP)
    self._rows = stacking.unstack(batch)
    self._pos = 0
    self._batch_seed = seed

  def __next__(self) -> Any:
    while self._pos >= len(self._rows):
      self._rows = []  # Drop the finished batch before reading the next.
      batch = self._input.read()
      self._take_batch(batch, self.parents[0].last_seed)
    row = self._rows[self._pos]
    self._pos += 1
    return row

  def _get_own_state(self) -> dict:
    partial = 0 < self._pos < len(self._rows)
    num_read = self._input.num_read
    return {
      "input": self._input.get_state(num_read - 1 if partial else num_read),
      "pos": self._pos if partial else 0,
    }

  def _set_own_state(self, state: dict) -> None:
    pos = base.state_int(state, "pos", _OP)
    input_state = state.get("input") if isinstance(state, dict) else None
    num_read = base.state_int(input_state, "num_read", _OP)
    self._rows, self._pos = [], 0
    self._input.set_state(
      input_state,
      num_read - 1 if pos else num_read,
      lambda index, batch, seed: self._take_batch(batch, seed),
    )
    if pos:
      if pos > len(self._rows):
        raise base.PipelineStateError(
          f"Cannot restore op {_OP!r}: the state is at row {pos} of a batch "
          f"that has {len(self._rows)} rows; it belongs to other data."
        )
      self._pos = pos
