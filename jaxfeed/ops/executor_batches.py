"""How `jaxfeed.ops.parallel_executor.ParallelExecutor` hands out whole
batches (`next_batch`, the batched-read protocol of `jaxfeed.ops.stacking`):
its workers write each output into its row of the batch
(`jaxfeed.ops.batch_placement`), and elements travel to them in runs.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from jaxfeed.ops import batch_placement, stacking
from jaxfeed.ops.executor_threads import BATCH_DEPTH, CHUNK

__all__ = ["BatchReads"]


class BatchReads:
  """`next_batch` for an ordered executor (mixed into `ParallelExecutor`,
  whose attributes it uses)."""

  placement: batch_placement.Placement | None
  placement_declined: bool
  writes_out: bool
  last_seed: int
  _parallelism: int
  _chunk: int
  _batch_depth: int
  _base_seq: int

  def next(self) -> Any:
    raise NotImplementedError

  def next_batch(self, batch_size: int) -> tuple[Any, np.ndarray]:
    """The next `batch_size` outputs as one batch (the batched-read protocol
    of `jaxfeed.ops.stacking`, for ordered executors).

    Rows the workers placed are handed out as they are when they form the
    whole batch in order; otherwise the outputs are stacked. An output's
    error ends the batch (the outputs before it are lost), as in `batch`.
    """
    self._chunk = max(1, min(CHUNK, batch_size // self._parallelism))
    self._batch_depth = min(batch_size, BATCH_DEPTH * self._chunk * self._parallelism)
    placement = self.placement
    start = self._base_seq
    if placement is not None:
      if placement.batch_size != batch_size:
        placement = self.placement = None
      elif start < placement.origin or (start - placement.origin) % batch_size:
        placement.realign(start)  # skipped or restored mid-batch
    outputs: list[Any] = []
    seeds: list[int] = []
    next_output, append, append_seed = self.next, outputs.append, seeds.append
    try:
      append(next_output())
      append_seed(self.last_seed)
      if placement is None:
        # From the first output on, elements pulled for the rest of this
        # batch and for the next ones are placed.
        self._adopt_template(outputs[0], batch_size, start)
      for _ in range(batch_size - 1):
        append(next_output())
        append_seed(self.last_seed)
    except StopIteration:
      if not outputs:
        raise
    except Exception:
      if self.placement is not None:
        self.placement.realign(self._base_seq)
      raise
    finally:
      if self.placement is not None:
        self.placement.close_before(self._base_seq)
    batch = None if placement is None else placement.batch(outputs)
    if batch is None:
      elements = [
        o.element(copy=False) if type(o) is batch_placement.Placed else o for o in outputs
      ]
      if self.placement is not None:
        # Not placed as a whole (the first batch, say): copied into a block
        # all the same, rather than onto fresh pages.
        batch = self.placement.assemble(elements)
      if batch is None:
        batch = stacking.stack(elements)
        if placement is not None:  # new shapes, say: place those from now on
          self._adopt_template(elements[0], batch_size, self._base_seq)
    return batch, np.array(seeds, dtype=np.uint64)

  def _adopt_template(self, element: Any, batch_size: int, origin: int) -> None:
    """Places rows like `element`'s, batches starting at element `origin`."""
    placement = self.placement
    if placement is not None and placement.template.leaves_of(element):
      return
    template = batch_placement.template_for(element)
    if template is None:
      self.placement = None
      self.placement_declined = placement is None  # the first batch decides
      return
    self.placement = batch_placement.Placement(
      batch_size, template, origin, hands_out_rows=self.writes_out
    )
