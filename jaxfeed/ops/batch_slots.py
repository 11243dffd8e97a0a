"""The memory a fused chain's batches are written to and handed out from.

A `Slot` is a memfd (`jaxfeed.ops.memfd`): worker processes map it when they
first get it (the descriptor travels over their pipe), worker threads and the
consumer's thread write into the parent's own mapping. A chunk's batches lie
in one slot, one after the other; the consumer hands out arrays that are
views of it (`Slot.unpack`), and the slot is reused only once no view of its
earlier batches is alive, so a batch a user holds never changes. Slots whose
views users keep are retired past a few (`SlotPool.release`): their memory
then goes with their last view.

A `SlotPool` belongs to a dataset's fused node and outlives its iterators, so
an epoch's batches go to memory that is already there (a new 77 MB slot costs
~30 ms of page zeroing).
"""

from __future__ import annotations

import itertools
import mmap
import os
import threading
import weakref
from typing import Any, Callable

import numpy as np

from jaxfeed.ops import memfd, tree
from jaxfeed.ops.memfd import ArrayRef

__all__ = ["Slot", "SlotPool"]


class Slot:
  """One memfd batches are written to (see the module docstring)."""

  __slots__ = ("fd", "id", "map", "size", "guard", "taken", "mapped_by", "__weakref__")
  _ids = itertools.count()

  def __init__(self, size: int):
    self.fd = memfd.anonymous_file("process_batch", size)
    self.id = next(self._ids)
    self.map: mmap.mmap | None = None  # see `mapping`
    self.size = size
    self.guard: weakref.ref | None = None  # the views' buffer
    self.taken = True  # by a chunk in flight or not yet returned
    self.mapped_by: set[int] = set()  # the worker processes that mapped it

  def spec(self, worker: int) -> tuple[int, int, bool]:
    """(id, size, whether its descriptor follows) for worker process
    `worker`."""
    return self.id, self.size, worker not in self.mapped_by

  def mapping(self) -> mmap.mmap:
    """The parent's mapping of the slot, made when first needed: when a
    worker process's first batches are back (the worker made the pages,
    which are then mapped at once instead of a fault each as the consumer
    reads them), or for a thread to write into. The views handed out hold
    it, so after the slot is retired its memory lives exactly as long as
    they do."""
    if self.map is None:
      self.map = memfd.map_file(self.fd, self.size)
    return self.map

  def in_use(self) -> bool:
    """Whether a chunk or a view handed out uses the slot."""
    return self.taken or (self.guard is not None and self.guard() is not None)

  def unpack(self, headers: list, copy: bool) -> list:
    """The chunk's items with their batches' `ArrayRef`s replaced by views of
    the slot (copies with `copy`); the slot stays in use while a view lives."""
    # Every array is a view of `whole`, whose buffer (the memoryview numpy
    # made of the mapping) lives exactly as long as some view does.
    whole = np.frombuffer(self.mapping(), np.uint8)

    def restore(leaf: Any) -> Any:
      if type(leaf) is ArrayRef:
        dtype = np.dtype(leaf.dtype)
        size = int(np.prod(leaf.shape)) * dtype.itemsize
        array = whole[leaf.offset : leaf.offset + size].view(dtype).reshape(leaf.shape)
        return array.copy() if copy else array
      return leaf

    items = []
    for header in headers:
      if header[0] == "batch":
        header = ("batch", tree.map_structure(restore, header[1])) + header[2:]
      items.append(header)
    if not copy:
      self.guard = weakref.ref(whole.base)
    return items

  def retire(self) -> None:
    """Closes the descriptor; the memory goes with the last view."""
    if self.fd >= 0:
      os.close(self.fd)
      self.fd = -1
    if self.map is not None and not self.in_use():
      try:
        self.map.close()
      except BufferError:
        pass  # a writer's memoryview lives on: unmapped when it goes
    self.map = None


class SlotPool:
  """The slots of one fused node's batches (see the module docstring).

  Used by one iterator at a time (its consumer thread), except `take`,
  which worker threads call when they grow a slot (under a lock).

  Args:
    on_retire: called with the id of each slot retired (worker processes
      unmap it).
  """

  def __init__(self, on_retire: Callable[[int], None] | None = None):
    self.slots: list[Slot] = []
    self._lock = threading.Lock()
    self._on_retire = on_retire
    self.held_limit = 4  # slots users hold views of, before the oldest go

  def take(self, size: int, worker: int | None = None) -> Slot:
    """A slot of `size` bytes or more that no chunk or live view uses: one
    worker process `worker` mapped already if there is one."""
    with self._lock:
      free = []
      for slot in list(self.slots):
        if not slot.in_use():
          if slot.size >= size:
            free.append(slot)
          else:
            self._retire(slot)  # outgrown
      if free:
        slot = next((s for s in free if worker in s.mapped_by), free[0])
        slot.taken, slot.guard = True, None
        return slot
      slot = Slot(size)
      self.slots.append(slot)
      return slot

  def release(self, slot: Slot) -> None:
    """The chunk using `slot` is done (its views may live on)."""
    with self._lock:
      slot.taken = False
      # Slots whose batches users still hold are not reused; past a few, the
      # oldest are retired, so that memory is bounded by what users hold.
      held = [s for s in self.slots if s.in_use() and not s.taken]
      for old in held[: max(0, len(held) - self.held_limit)]:
        self._retire(old)

  def retire(self, slot: Slot) -> None:
    with self._lock:
      self._retire(slot)

  def _retire(self, slot: Slot) -> None:
    slot.retire()
    if slot in self.slots:
      self.slots.remove(slot)
    if self._on_retire is not None:
      self._on_retire(slot.id)

  def forget_worker(self, worker: int) -> None:
    """Worker process `worker` was replaced: its successor maps slots anew."""
    with self._lock:
      for slot in self.slots:
        slot.mapped_by.discard(worker)

  def free_all(self) -> None:
    """Marks every slot free of chunks (an iterator ended)."""
    with self._lock:
      for slot in self.slots:
        slot.taken = False

  def close(self) -> None:
    """Retires every slot (those in use go with their last view)."""
    with self._lock:
      for slot in list(self.slots):
        slot.taken = False
        self._retire(slot)
