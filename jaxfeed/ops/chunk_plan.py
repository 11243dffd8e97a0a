"""How a fused chain's iterator (`jaxfeed.ops.process_batch_iterator`) cuts
its input positions into chunks: the chunk itself, where one ends, and the
size that gives a worker about `CHUNK_WORK_S` of work.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Chunk", "CHUNK_WORK_S", "MIN_CHUNK_ELEMENTS", "chunk_stop", "tuned_size"]

CHUNK_WORK_S = 0.01
"""Worker time one chunk aims at: long enough to hide a hand-off."""

MAX_CHUNK_BATCHES = 16
MIN_CHUNK_ELEMENTS, MAX_CHUNK_ELEMENTS = 16, 4096


class Chunk:
  """Input positions [start, stop) sent to worker `worker`, whose outputs go
  to `slot`; `reply` is (headers, busy seconds) once done."""

  __slots__ = ("worker", "start", "stop", "slot", "reply")

  def __init__(self, worker: int, start: int, stop: int, slot: Any):
    self.worker, self.start, self.stop, self.slot = worker, start, stop, slot
    self.reply: tuple[list, float] | None = None

  def doing(self) -> str:
    return f"computing input positions [{self.start}, {self.stop})"


def chunk_stop(
  start: int, size: int, *, end: int | None, workers: int, sent: int, unit: int
) -> int:
  """Where the chunk from `start` ends: `size` on, except that each worker's
  first chunk is one `unit` (a batch: an epoch's first batches come sooner;
  the sent chunks number `sent`) and the last chunks before `end` share
  what is left among the `workers` (none idles while another computes a
  whole chunk)."""
  if sent < workers:
    size = min(size, unit)
  if end is not None and end - start < size * workers:
    share = -(-(end - start) // (workers * unit)) * unit
    size = min(size, max(unit, share))
  return start + size if end is None else min(start + size, end)


def tuned_size(per_position_s: float, batch_size: int, filters: bool) -> int:
  """The chunk size that takes a worker about `CHUNK_WORK_S`, at
  `per_position_s` seconds per input position: whole batches (up to
  `MAX_CHUNK_BATCHES`), or any number of positions in bounds when a filter
  makes batches end anywhere."""
  target = CHUNK_WORK_S / max(per_position_s, 1e-9)
  if filters:
    return int(min(max(target, MIN_CHUNK_ELEMENTS), MAX_CHUNK_ELEMENTS))
  return batch_size * int(min(max(target // batch_size, 1), MAX_CHUNK_BATCHES))
