"""The dispatcher's durable state: a write-ahead journal compacted by snapshots.

The files in the work_dir: a snapshot, journal generations G, G+1, ... and
a lock (`journal_files`). Every line of these files is checked: it carries a
rolling CRC-32C (`journal_lines`). A journal file starts with a header line; each line after
it is one batch, the JSON list of the records of one state change. A restart
replays the snapshot, then every generation from G on, oldest first
(`journal_replay`: a torn last line is cut off; damage anywhere else refuses
to start, or with `--journal_damage=truncate` is cut with what follows).

Writing. A batch is written (`os.write`, into the page cache) while the
state's lock is held, so a crash of the process never loses a change once
the lock is released; it is made durable (fsync) after the lock is
released, and nothing holds the state's lock across an fsync. One fsync
covers every batch written before it, so changes that commit at once share
it (group commit). What an answer waits for is its `JournalLock` holder's
choice: by default every change it may have seen is durable before it goes
out; heartbeats, reads and a repeated split answer that was durable already
wait for no fsync (see `JournalLock.answer_without_fsync`). A thread makes
what nobody waits for durable within about LAZY_SYNC_S, and writes the
snapshots.

A full disk (`journal_health`): a batch the disk refused waits in memory, in
order, and the journal is unhealthy until the thread could write it; a failed
fsync, or more than MAX_UNWRITTEN_BYTES waiting, fail it for good.

A snapshot is taken in three steps; a crash between any two of them replays
the same state:

  1. Under the state's lock: start generation G+1 (new records go there,
     behind its header), take the live state's records.
  2. On the journal's thread: fsync generation G; write the records to
     `snapshot.json.tmp`, fsync it, rename it to `snapshot.json`, fsync the
     folder (`journal_files.write_snapshot`). Until the rename the old
     snapshot and generations up to G+1 describe the state; a leftover tmp
     file is ignored and removed.
  3. Delete generations up to G (a restart also deletes any left over).

Cost of fsync (`DispatcherConfig.journal_fsync`, on by default), measured with
`python -m benchmarks.journal_restart` on an ext4 virtual disk: one journaled
change (a GetSplits) takes 1.7 ms with fsync and 0.013 ms without (470 against
13.9k changes/s from one thread); with 8 threads committing at once, changes
share fsyncs (group commit) and reach 5.6k/s. The same run: a restart after
10k jobs and 1M exactly-once splits replays 2.1M records in 18 s without
snapshots, and 69k (39k of live state, 30k of journal) in 1.6 s with them.

Test hook: `journal_files.FSYNC_DELAY_ENV` gives the journal a slow disk.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import pathlib
import threading
import time
from typing import Any, Callable

from jaxfeed.service.storage import journal_files
from jaxfeed.service.storage import journal_lines
from jaxfeed.service.storage import journal_replay
from jaxfeed.service.storage.journal_files import LOCK_NAME
from jaxfeed.service.storage.journal_health import RETRY_S, JournalHealth, JournalUnavailableError
from jaxfeed.service.storage.journal_lines import JournalDamageError
from jaxfeed.service.storage.journal_replay import (
  REFUSE,
  SNAPSHOT_NAME,
  TMP_SUFFIX,
  ReplayStats,
  journal_name,
)

__all__ = [
  "Journal",
  "JournalDamageError",
  "JournalUnavailableError",
  "ReplayStats",
  "journal_name",
  "SNAPSHOT_NAME",
  "LOCK_NAME",
  "TMP_SUFFIX",
  "FATAL_EXIT_STATUS",
]

LAZY_SYNC_S = 0.02  # what nobody waits for is fsynced after about this long
MAX_UNWRITTEN_BYTES = 64 << 20  # batches a failing disk may leave in memory
FATAL_EXIT_STATUS = 75  # the command-line dispatcher's, once its journal failed


class Journal:
  """The journal and snapshots in one work_dir.

  `replay` must run (once) before the first `write`. Writes come from one
  thread at a time (the state's lock); `sync` may run from any thread.

  Args:
    work_dir: the folder of the files.
    fsync: make every batch durable before `sync` returns (power loss);
      without it a batch survives a crash of the process only.
    snapshot_every_records: take a snapshot once the journal holds this many
      records since the last one; 0: never by count.
    snapshot_every_bytes: take a snapshot once the journal holds this many
      bytes since the last one; 0: never by size.
    damage: what replay does with damage before valid records
      (`journal_replay.DAMAGE_POLICIES`).
  """

  def __init__(
    self,
    work_dir: str | os.PathLike,
    fsync: bool = True,
    snapshot_every_records: int = 50_000,
    snapshot_every_bytes: int = 32 << 20,
    damage: str = REFUSE,
  ):
    self.work_dir = pathlib.Path(work_dir)
    self.work_dir.mkdir(parents=True, exist_ok=True)
    self._fsync = fsync
    self._every_records = snapshot_every_records
    self._every_bytes = snapshot_every_bytes
    self._damage = damage
    self._replayed = False
    self._lock_fd: int | None = None
    # Guards everything below; held for writes (page cache), never during an fsync.
    lock = threading.Lock()
    self._cond = threading.Condition(lock)  # an fsync round ended
    self._work = threading.Condition(lock)  # the journal's thread has work
    self._generation = 0
    self._fd: int | None = None
    self._crc = 0  # of the current generation's last line
    self._retired: list[int] = []  # descriptors of finished generations, to fsync
    self._folder_dirty = False  # a file was created since the folder's last fsync
    # Batches accepted, written and durable: numbers counted from 1 over all
    # generations; accepted ones not yet written wait in _unwritten, in order.
    self._accepted = self._written = self._synced = 0
    self._unwritten: collections.deque[tuple[int, bytes]] = collections.deque()
    self._unwritten_bytes = 0
    self._partial = 0  # bytes of the first unwritten batch already written
    self._syncing = False  # a thread is in fsync
    self._health = JournalHealth(self.work_dir)
    self._records_since_snapshot = 0
    self._bytes_since_snapshot = 0
    self._force_snapshot = False
    self._snapshot_in_flight = False
    self._snapshots: collections.deque[tuple[int, list]] = collections.deque()
    self._closed = False
    self._thread: threading.Thread | None = None
    # What was written waits for the thread's fsync (nobody may wait for it).
    self._sync_due = False

  @property
  def path(self) -> pathlib.Path:
    """The journal file new batches go to."""
    return self.work_dir / journal_name(self._generation)

  @property
  def snapshot_path(self) -> pathlib.Path:
    return self.work_dir / SNAPSHOT_NAME

  # -- restart ---------------------------------------------------------------
  def replay(self, apply: Callable[[dict[str, Any]], None]) -> ReplayStats:
    """Calls `apply` on every record of the snapshot and journal, in order,
    then opens the journal for writing (see `journal_replay.replay`).

    Raises:
      JournalDamageError: a file is damaged (the message names it and the offset).
      ValueError: `apply` failed on a record.
    """
    if self._replayed:
      raise RuntimeError(f"Journal {self.work_dir} was already replayed.")
    self._lock_fd = journal_files.lock_folder(self.work_dir)
    self._replayed = True
    try:
      result = journal_replay.replay(self.work_dir, apply, self._damage, self._fsync)
    except BaseException:
      self.close()
      raise
    self._generation, self._crc = result.generation, result.last_crc
    self._records_since_snapshot, self._bytes_since_snapshot = result.records, result.bytes
    if result.legacy:
      # Never append to a file of the previous release: the state goes to a
      # new generation and, at the first chance, a snapshot (see JournalLock).
      logging.warning(
        "Dispatcher work_dir %s holds files of the previous release, "
        "without checksums: read once, written again as a checked "
        "snapshot now.",
        self.work_dir,
      )
      self._generation += 1
      self._crc = 0
      self._force_snapshot = True
      result_size = 0
    else:
      result_size = result.size
    with self._cond:
      if result_size == 0:
        self._queue_header()
      self._flush()
    self._thread = threading.Thread(target=self._run, name="jaxfeed-journal", daemon=True)
    self._thread.start()
    return result.stats

  # -- health ----------------------------------------------------------------
  @property
  def healthy(self) -> bool:
    """Whether every batch accepted could be written (a full disk: not)."""
    return self._health.healthy

  @property
  def failed(self) -> bool:
    """Whether the journal gave up (a failed fsync, too much waiting in
    memory): only a restart serves again."""
    return self._health.failed

  def add_listener(self, listener: Callable[[bool], None]) -> None:
    """Calls `listener(healthy)` whenever `healthy` changes (from the thread
    that noticed)."""
    self._health.add_listener(listener)

  def check_writable(self) -> None:
    """Raises JournalUnavailableError unless changes can be made durable now."""
    self._health.check_writable()

  # -- writing ---------------------------------------------------------------
  def write(self, records: list[dict[str, Any]]) -> int:
    """Writes one batch (one line), or keeps it in memory while the disk
    refuses writes; returns its number (for `sync` and `durable`)."""
    if not self._replayed:
      raise RuntimeError(f"Journal {self.work_dir}: replay it before writing.")
    payload = json.dumps(records, separators=(",", ":")).encode()
    with self._cond:
      if self._health.failure is not None:
        raise JournalUnavailableError(self._health.failure_message())
      line, self._crc = journal_lines.encode(payload, self._crc)
      self._accepted += 1
      self._unwritten.append((self._accepted, line))
      self._unwritten_bytes += len(line)
      self._records_since_snapshot += len(records)
      self._bytes_since_snapshot += len(line)
      was_healthy = self._health.write_error is None
      if was_healthy:
        self._flush()
      if self._unwritten_bytes > MAX_UNWRITTEN_BYTES:
        self._health.fail(
          OSError(
            f"more than {MAX_UNWRITTEN_BYTES} bytes of changes waited for the disk "
            f"(last error: {self._health.write_error})"
          )
        )
      changed = was_healthy != self.healthy
      number = self._accepted
      if changed or (self._fsync and not self._sync_due):
        # Once per fsync of the thread, not at every write: a wake-up takes
        # the interpreter lock from the handlers.
        self._sync_due = self._sync_due or self._fsync
        self._work.notify()
    if changed:
      self._health.notify()
    return number

  def _queue_header(self) -> None:
    """Starts the current generation's file with its header (lock held)."""
    line, self._crc = journal_lines.encode_json(journal_replay.header(self._generation), 0)
    self._unwritten.append((self._accepted, line))
    self._unwritten_bytes += len(line)

  def _flush(self) -> bool:
    """Writes what waits, in order; False if the disk refused (lock held)."""
    try:
      if self._fd is None:
        self._fd = self._open(self.path)
      while self._unwritten:
        number, line = self._unwritten[0]
        self._partial += os.write(self._fd, memoryview(line)[self._partial :])
        if self._partial == len(line):
          self._unwritten.popleft()
          self._unwritten_bytes -= len(line)
          self._partial = 0
          self._written = number
    except OSError as e:
      self._health.write_failed(self.path, e)
      return False
    self._health.wrote(self.path)
    return True

  def _open(self, path: pathlib.Path) -> int:
    existed = path.exists()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    if not existed:
      self._folder_dirty = True  # its name must survive a power loss too
    return fd

  @property
  def written(self) -> int:
    """The number of the last batch accepted."""
    return self._accepted

  def durable(self, batch: int) -> bool:
    """Whether batch `batch` (and every one before it) survives a power
    loss (with fsync off: a crash of the process)."""
    return batch <= (self._synced if self._fsync else self._written)

  def sync(self, batch: int) -> None:
    """Returns once batches up to `batch` are durable (with fsync on: after
    an fsync; off: once written).

    One fsync covers every batch written before it, so changes that commit
    at the same time share it.

    Raises:
      JournalUnavailableError: the batch is not written (the disk refuses
        writes) or the journal failed.
    """
    while True:
      with self._cond:
        # Callers that find an fsync under way wait for its end together and
        # are woken at once; one of those it did not cover starts the next.
        # (Queuing them on a plain lock woke one at a time, each waiting for a
        # core and the interpreter lock before passing on: under a burst of
        # commits that chain, not the disk, was most of a call's time.)
        while not self.durable(batch) and self._syncing and self._health.failure is None:
          self._cond.wait()
        if self.durable(batch):
          return
        if self._health.failure is None and batch > self._written:
          self.check_writable()
          raise JournalUnavailableError(f"Dispatcher journal batch {batch} was never written.")
      self._fsync_round()

  def _fsync_round(self) -> None:
    """Fsyncs every open file of the journal once, the older generations
    first, after the round under way if any (called without the lock).

    Raises:
      JournalUnavailableError: the journal failed (now, or before).
    """
    with self._cond:
      while self._syncing and self._health.failure is None:
        self._cond.wait()
      if self._health.failure is not None:
        raise JournalUnavailableError(self._health.failure_message())
      self._syncing = True
      target, folder, retired = self._written, self._folder_dirty, list(self._retired)
      fds = [*retired, *([self._fd] if self._fd is not None else [])]
    error = None
    try:
      for fd in fds:  # a later generation never outlives an earlier one
        journal_files.fsync(fd)
      if folder:
        journal_files.fsync_folder(self.work_dir)
    except OSError as e:
      error = e
    with self._cond:
      self._syncing = False
      if error is None:
        for fd in retired:  # one retired during the round may hold a write it missed
          self._retired.remove(fd)
          os.close(fd)
        self._folder_dirty = self._folder_dirty and not folder
        self._synced = max(self._synced, target)
      else:
        self._health.fail(error)
      self._cond.notify_all()
    if error is not None:
      self._health.notify()
      raise JournalUnavailableError(self._health.failure_message())

  # -- the journal's thread ------------------------------------------------------
  def _run(self) -> None:
    """Retries refused writes, syncs what nobody waits for, writes snapshots."""
    while True:
      with self._cond:
        while not self._has_work():
          self._work.wait()
        snapshot = self._snapshots.popleft() if self._snapshots else None
        if snapshot is None and (self._closed or self._health.failure is not None):
          return  # a snapshot taken is written first, even when closing
        retry = self._health.write_error is not None
        if snapshot is None and not retry:
          self._sync_due = False  # a write from now on sets it again
      if snapshot is not None:
        self._finish_snapshot(*snapshot)
      elif retry:
        self._sleep(RETRY_S)
        with self._cond:
          if self._closed or not self._flush():
            continue
          self._sync_due = self._fsync  # what waited is written: fsync it
        self._health.notify()
      else:
        time.sleep(LAZY_SYNC_S)  # more commits share the fsync
        try:
          self.sync(self._written)
        except JournalUnavailableError:
          pass  # failed: noted, and told to every call

  def _has_work(self) -> bool:
    return bool(self._closed or not self._health.healthy or self._snapshots or self._sync_due)

  def _sleep(self, seconds: float) -> None:
    with self._cond:
      self._work.wait_for(lambda: self._closed, seconds)

  # -- snapshots ---------------------------------------------------------------
  def wants_snapshot(self) -> bool:
    """Whether the journal grew past a snapshot threshold (or the state must
    be written again in the checked format)."""
    if self._snapshot_in_flight or not self._replayed or not self.healthy:
      return False
    return bool(
      self._force_snapshot
      or (self._every_records and self._records_since_snapshot >= self._every_records)
      or (self._every_bytes and self._bytes_since_snapshot >= self._every_bytes)
    )

  def start_snapshot(self) -> int | None:
    """Step 1 (under the state's lock, after its last write): starts the
    next journal generation and returns it, or None if the disk refused;
    pass it to `finish_snapshot` (or `queue_snapshot`) with the state's
    records as of now."""
    with self._cond:
      if self._unwritten or self._health.failure is not None:
        return None
      try:
        fd = self._open(self.work_dir / journal_name(self._generation + 1))
      except OSError as e:
        logging.error(
          "Starting journal generation %d in %s failed (%s): no snapshot now.",
          self._generation + 1,
          self.work_dir,
          e,
        )
        return None
      if self._fd is not None:
        self._retired.append(self._fd)
      self._fd = fd
      self._generation += 1
      self._queue_header()
      self._flush()
      self._snapshot_in_flight = True
      self._force_snapshot = False
      self._records_since_snapshot = self._bytes_since_snapshot = 0
      return self._generation

  def queue_snapshot(self, generation: int, records: list[dict[str, Any]]) -> None:
    """Steps 2 and 3 on the journal's thread."""
    with self._cond:
      self._snapshots.append((generation, records))
      self._work.notify()

  def finish_snapshot(self, generation: int, records: list[dict[str, Any]]) -> None:
    """Steps 2 and 3 here and now."""
    self._finish_snapshot(generation, records)

  def _finish_snapshot(self, generation: int, records: list[dict[str, Any]]) -> None:
    """Writes the snapshot atomically and deletes the journal generations it
    replaces. A failure is logged: the journal still holds everything, and
    the next threshold tries again."""
    try:
      self._fsync_round()  # generation G: a crash must not tear it after this
      journal_files.write_snapshot(self.work_dir, generation, records)
    except (OSError, JournalUnavailableError):
      logging.exception(
        "Dispatcher snapshot in %s failed; the journal keeps growing until the next one succeeds.",
        self.work_dir,
      )
    finally:
      with self._cond:
        self._snapshot_in_flight = False

  def close(self) -> None:
    """Writes a snapshot under way, stops the journal's thread and closes
    its files. Batches a full disk still refused are lost (they were never
    acknowledged as durable)."""
    with self._cond:
      self._closed = True
      self._cond.notify_all()
      self._work.notify()
    if self._thread is not None and self._thread is not threading.current_thread():
      self._thread.join(timeout=30)
    with self._cond:
      while self._syncing:
        self._cond.wait()
      if self._unwritten:
        logging.error(
          "Dispatcher journal %s closed with %d batches the disk refused: they are lost.",
          self.path,
          len(self._unwritten),
        )
      for fd in [*self._retired, self._fd, self._lock_fd]:
        if fd is not None:
          os.close(fd)  # closing the lock's file releases it
      self._retired, self._fd, self._lock_fd = [], None, None
