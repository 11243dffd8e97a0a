"""The lock of the dispatcher's journaled state (`JournalLock`): the records
of a holder become one batch of the journal, and its answer waits for what
must be durable first, and for nothing else."""

from __future__ import annotations

import threading
from typing import Any, Callable

from jaxfeed.service.storage.journal import Journal

_SEEN = object()  # an answer waits for every change its holder may have seen


class JournalLock:
  """The lock of journaled state.

  Records `add`ed while it is held are written to the journal as one batch
  when it is released. By default the holder's answer waits until every
  change it may have seen is durable (`release` returns then): a reply
  built under the lock goes out only after every change it may report
  survives a crash. A holder whose answer needs none of that says so with
  `answer_without_fsync`. A snapshot due after the batch is started too.

  Args:
    journal: the journal, replayed; None keeps the state in memory only.
    live_records: the records of the live state (for snapshots); called
      with the lock held.
  """

  def __init__(self, journal: Journal | None, live_records: Callable[[], list[dict[str, Any]]]):
    self._lock = threading.Lock()
    self._journal = journal
    self._live_records = live_records
    self._pending: list[dict[str, Any]] = []
    self._wait: Any = _SEEN

  def add(self, record: dict[str, Any]) -> None:
    """Adds a record to the batch of the current holder."""
    self._pending.append(record)

  def answer_without_fsync(self, batch: int = 0) -> None:
    """The current holder's answer waits for no fsync, but that of `batch`
    (0: none; heartbeats): its own records are written when the lock is
    released and made durable soon after."""
    self._wait = batch

  def answer_after_fsync(self) -> None:
    """The current holder's answer waits until every change it may have
    seen is durable (the default; undoes `answer_without_fsync`)."""
    self._wait = _SEEN

  @property
  def batch(self) -> int:
    """The number the current holder's records get (see `durable`)."""
    return self._journal.written + 1 if self._journal is not None else 0

  def durable(self, batch: int) -> bool:
    """Whether batch `batch` (a `batch` of an earlier holder) is durable."""
    return self._journal is None or self._journal.durable(batch)

  def check_writable(self) -> None:
    """Raises JournalUnavailableError (UNAVAILABLE) unless changes can be
    made durable now: call it before changing anything that must be."""
    if self._journal is not None:
      self._journal.check_writable()

  def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
    return self._lock.acquire(blocking, timeout)

  def locked(self) -> bool:
    return self._lock.locked()

  def release(self) -> None:
    journal, batch, snapshot = self._journal, self._pending, None
    wait, self._wait = self._wait, _SEEN
    self._pending = []
    try:
      if journal is None:
        return
      if batch:
        journal.write(batch)
      if wait is _SEEN:
        wait = journal.written  # the last change this holder may have seen
      if journal.wants_snapshot():
        generation = journal.start_snapshot()
        if generation is not None:
          snapshot = generation, self._live_records()
    finally:
      self._lock.release()
    if snapshot is not None:
      journal.queue_snapshot(*snapshot)
    if wait:
      journal.sync(wait)

  def snapshot_now(self) -> None:
    """Takes a snapshot and writes it before returning, if one is due (a
    restart that read the previous release's files)."""
    journal = self._journal
    if journal is None:
      return
    with self:
      self.answer_without_fsync()
      generation = journal.start_snapshot() if journal.wants_snapshot() else None
      records = self._live_records() if generation is not None else None
    if generation is not None:
      journal.finish_snapshot(generation, records)

  def __enter__(self) -> "JournalLock":
    self.acquire()
    return self

  def __exit__(self, *exc) -> None:
    self.release()
