"""Closes the reads whose iterators the garbage collector ended.

A `DistributedIterator` dropped without `close()` (say, by
`itertools.islice(ds, n)`) is ended by a `weakref.finalize`. That may run
inside the garbage collector, on whichever thread allocated when a
collection started: inside gRPC's own code, holding its locks, for one.
Closing a read there makes RPCs, joins its threads (for seconds, if one is
in a call) and closes its gRPC channel, possibly under a call of that very
channel on the same thread: a known way to deadlock or crash gRPC's Python
library. So a finalizer only appends the read to a deque (no lock, no call),
and one thread of this module, alive while any read is open, closes what it
finds there. A read that starts while more than MAX_DROPPED dropped reads
wait first closes the surplus itself: a loop that drops reads faster than
one thread closes them (each holds threads and a connection to every
worker of its job) is held back instead of piling them up.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
import weakref
from typing import Any

_POLL_S = 0.05
THREAD_NAME = "jaxfeed-read-reaper"
MAX_DROPPED = 4  # dropped reads waiting for the reaper before new reads help


class _Reaper:
  """Counts the open reads and closes the dropped ones on its own thread."""

  def __init__(self):
    self._lock = threading.Lock()
    self._dropped: collections.deque = collections.deque()
    self._open = 0
    self._thread: threading.Thread | None = None

  def opened(self) -> None:
    with self._lock:
      self._open += 1
      if self._thread is None or not self._thread.is_alive():
        self._thread = threading.Thread(target=self._run, name=THREAD_NAME, daemon=True)
        self._thread.start()
    while len(self._dropped) > MAX_DROPPED:  # a read starting: not inside the collector
      try:
        read = self._dropped.popleft()
      except IndexError:
        break  # the reaper took it
      self._close(read)

  def closed(self) -> None:
    with self._lock:
      self._open -= 1

  def dropped(self, read: Any) -> None:
    """A finalizer's part: takes no lock, makes no call."""
    if getattr(weakref.finalize, "_shutdown", False):
      # The interpreter exits (atexit, collector off, main thread): no
      # collector runs here, and the reaper may never run again.
      self._close(read)
      return
    self._dropped.append(read)

  def _close(self, read: Any) -> None:
    try:
      read.close()
    except Exception:  # pylint: disable=broad-except
      logging.exception("Closing a dropped service read failed")
    finally:
      self.closed()

  def _run(self) -> None:
    while True:
      while True:
        try:
          read = self._dropped.popleft()
        except IndexError:  # none left (a starting read may have taken the last)
          break
        self._close(read)
      with self._lock:
        if not self._open and not self._dropped:
          self._thread = None
          return
      time.sleep(_POLL_S)


_REAPER = _Reaper()


def track(owner: Any, read: Any) -> weakref.finalize:
  """Counts `read` (with `close()`) open; once the collector ends `owner`,
  the reaper thread closes it. Returns the finalizer for `close_now`."""
  _REAPER.opened()
  return weakref.finalize(owner, _REAPER.dropped, read)


def close_now(finalizer: weakref.finalize, read: Any) -> None:
  """Closes `read` on this thread (an explicit close), unless it was closed
  or handed to the reaper already."""
  if finalizer.detach() is not None:
    _REAPER._close(read)  # pylint: disable=protected-access
