"""The iterator of an autocache op pointed at a folder: `cache`'s, plus the
folder's bookkeeping (see `jaxfeed.ops.autocache_folder`).

From its first element to its end (or close) it holds its entry in use, so
no process evicts or removes the entry it reads or writes. While it writes,
it reserves the bytes it is about to write before they reach the disk,
evicting least recently used entries to make room; when the folder's byte
limit leaves no room it stops writing and its pass goes on without the
cache. A write that completes is followed by an eviction, so the folder is
back within its limits.
"""

from __future__ import annotations

import os
from typing import Any

from jaxfeed.ops import tree
from jaxfeed.ops.autocache_folder import AutocacheFolder, EntryHold, WriteReservation
from jaxfeed.ops.base import OpIterator
from jaxfeed.ops.cache import CacheIterator

__all__ = ["AutocacheEntryIterator", "element_bytes"]

# A reservation grows by at least this factor at a time, so that a pass
# locks the folder O(log size) times; the slack covers the chunk files'
# headers (`jaxfeed.ops.cache`'s npz format).
_GROWTH = 2
_SLACK_BYTES = 64 << 10
_SLACK_FRACTION = 0.02


def element_bytes(element: Any) -> int:
  """About the bytes an element takes in an on-disk cache."""
  total = 8  # its seed
  for leaf in tree.flatten(element):
    nbytes = getattr(leaf, "nbytes", None)
    if nbytes is None:
      nbytes = (
        len(leaf) * 4 if isinstance(leaf, str) else (len(leaf) if isinstance(leaf, bytes) else 16)
      )
    total += int(nbytes) + 8 * (1 + getattr(leaf, "ndim", 0))  # shape of a ragged leaf
  return total


class AutocacheEntryIterator(CacheIterator):
  """`CacheIterator` over entry `name` of `folder`."""

  def __init__(self, parent: OpIterator, store: Any, folder: AutocacheFolder, name: str):
    super().__init__(parent, store)
    self._folder = folder
    self._name = name
    self._hold: EntryHold | None = None
    self._reservation: WriteReservation | None = None
    self._written = 0  # estimated bytes of the elements written
    self._accounted = 0  # elements counted in _written

  def __next__(self) -> Any:
    if self._hold is None:
      self._hold = self._folder.hold(self._name)
    try:
      element = super().__next__()
    except StopIteration:
      self._release(evict=True)
      raise
    except BaseException:
      self._release(evict=False)
      raise
    # `CacheIterator.__next__` calls itself once when it starts: count each
    # element once.
    if self._writer is not None and self._count > self._accounted:
      self._accounted = self._count
      self._written += element_bytes(element)
      self._reserve()
    return element

  def _reserve(self) -> None:
    limit = self._folder.limits.max_bytes
    if limit is None:
      return
    reservation = self._reservation
    if reservation is None:
      # The temporary folder the pass writes (`jaxfeed.ops.cache`'s writer).
      temporary = os.fspath(self._writer._tmp)  # pylint: disable=protected-access
      reservation = self._reservation = self._folder.reservation(temporary)
    needed = int(self._written * (1 + _SLACK_FRACTION)) + _SLACK_BYTES
    if needed <= reservation.reserved:
      return
    wanted = min(limit, max(needed, reservation.reserved * _GROWTH))
    if needed > limit or not reservation.grow(wanted, needed):
      # No room: the pass goes on from the input, without writing.
      self._abort_writer()
      self._drop_reservation()

  def _drop_reservation(self) -> None:
    reservation, self._reservation = self._reservation, None
    if reservation is not None:
      reservation.release()

  def _release(self, evict: bool) -> None:
    """Ends the pass's use of the entry: published or not, its reservation
    goes; the entry is no longer held; then, after a write, the folder is
    brought back within its limits."""
    wrote = self._reservation is not None
    self._drop_reservation()
    hold, self._hold = self._hold, None
    if hold is not None:
      hold.release()
    if evict and wrote:
      self._folder.evict()

  def skip_elements(self, count: int) -> int:
    if self._hold is None:
      self._hold = self._folder.hold(self._name)
    return super().skip_elements(count)

  def set_state(self, state: dict) -> None:
    super().set_state(state)
    self._release(evict=False)
    self._written = self._accounted = 0

  def _close_own(self) -> None:
    super()._close_own()
    self._release(evict=False)
