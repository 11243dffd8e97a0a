"""`rebatch`: re-splits batches into batches of other sizes (tf.data semantics).

`rebatch(N)` yields what `unbatch().batch(N)` would, without splitting
batches into elements: output batches are row slices of the input batches
(views when they come from one input batch, one concatenation per leaf
otherwise). As in tf.data, `batch_size` may also be a list of sizes used in
turn. The state is the input's position before the current batch, the rows
already taken from it and the number of batches returned.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from jaxfeed.ops import base
from jaxfeed.ops import stacking
from jaxfeed.ops.unbatch import batch_rows

__all__ = ["RebatchNode", "RebatchIterator"]

_OP = "rebatch"


def _check_batch_sizes(batch_size: Any) -> tuple[int, ...]:
  if isinstance(batch_size, (list, tuple, np.ndarray)):
    sizes = list(batch_size)
    if not sizes:
      raise ValueError(f"{_OP}: batch_size must not be an empty list.")
    return tuple(base.check_positive_int(s, _OP, "every batch_size entry") for s in sizes)
  return (base.check_positive_int(batch_size, _OP, "batch_size"),)


class RebatchNode(base.Node):
  """Batches of `batch_size` rows (cycling through a list of sizes)."""

  op_name = _OP

  def __init__(
    self, parent: base.Node, batch_size: int | Sequence[int], drop_remainder: bool = False
  ):
    super().__init__([base.to_node(parent, _OP, "input")])
    self.batch_sizes = _check_batch_sizes(batch_size)
    self.drop_remainder = bool(drop_remainder)

  def spec_params(self) -> dict:
    sizes = self.batch_sizes
    return {
      "batch_size": sizes[0] if len(sizes) == 1 else list(sizes),
      "drop_remainder": self.drop_remainder,
    }

  def cardinality(self) -> int | None:
    return 0 if self.parents[0].cardinality() == 0 else None

  def make_iterator(self) -> "RebatchIterator":
    return RebatchIterator(self.parents[0].make_iterator(), self.batch_sizes, self.drop_remainder)


class RebatchIterator(base.OpIterator):
  """Slices and joins input batches into batches of the requested sizes."""

  op_name = _OP

  def __init__(self, parent: base.OpIterator, batch_sizes: tuple[int, ...], drop_remainder: bool):
    super().__init__([parent])
    self._batch_sizes = batch_sizes
    self._drop_remainder = drop_remainder
    self._input = base.InputReplay(parent, _OP, interval=1)
    self._batch: Any = None
    self._rows = 0
    self._offset = 0
    self._batch_seed = 0
    self._num_out = 0
    self._ended = False
    self._last_seed = 0

  @property
  def last_seed(self) -> int:
    """Derived from the input batch and row the returned batch starts at."""
    return self._last_seed

  def _take_batch(self, batch: Any, seed: int) -> None:
    self._rows = batch_rows(batch, _OP)
    self._batch = batch
    self._offset = 0
    self._batch_seed = seed

  def __next__(self) -> Any:
    if self._ended:
      raise StopIteration
    size = self._batch_sizes[self._num_out % len(self._batch_sizes)]
    pieces = []
    need = size
    first_seed = None
    while need:
      if self._offset >= self._rows:
        self._batch = None
        try:
          batch = self._input.read()
        except StopIteration:
          self._ended = True
          break
        self._take_batch(batch, self.parents[0].last_seed)
        continue
      take = min(need, self._rows - self._offset)
      if first_seed is None:
        first_seed = base.mix_seed(self._batch_seed, self._offset)
      pieces.append(stacking.slice_batch(self._batch, self._offset, self._offset + take))
      self._offset += take
      need -= take
    if not pieces or (need and self._drop_remainder):
      raise StopIteration
    self._num_out += 1
    self._last_seed = first_seed
    if len(pieces) == 1:
      return pieces[0]
    return stacking.concatenate(pieces, _OP)

  def _get_own_state(self) -> dict:
    partial = self._batch is not None and self._offset < self._rows
    num_read = self._input.num_read
    return {
      "input": self._input.get_state(num_read - 1 if partial else num_read),
      "offset": self._offset if partial else 0,
      "num_out": self._num_out,
      "ended": self._ended,
    }

  def _set_own_state(self, state: dict) -> None:
    offset = base.state_int(state, "offset", _OP)
    self._num_out = base.state_int(state, "num_out", _OP)
    input_state = state.get("input")
    num_read = base.state_int(input_state, "num_read", _OP)
    self._batch, self._rows, self._offset = None, 0, 0
    self._input.set_state(
      input_state,
      num_read - 1 if offset else num_read,
      lambda index, batch, seed: self._take_batch(batch, seed),
    )
    if offset:
      if offset >= self._rows:
        raise base.PipelineStateError(
          f"Cannot restore op {_OP!r}: the state is at row {offset} of a "
          f"batch that has {self._rows} rows; it belongs to other data."
        )
      self._offset = offset
    self._ended = bool(state.get("ended"))
