"""The journal's files in the dispatcher's work_dir, below `journal.Journal`:
the folder's lock, fsync of a file or the folder, and a snapshot written in
place of the journal generations it replaces.

Files in the work_dir:

  snapshot.json       the live state as of the start of journal generation G
                      (see `state_snapshot`); absent before the first snapshot.
  journal.jsonl       journal generation 0.
  journal.<G>.jsonl   journal generation G >= 1.
  LOCK                held (flock) by the dispatcher using the folder.

Test hook: with the environment variable JAXFEED_TEST_FSYNC_DELAY_S set (to
seconds), every fsync of the journal sleeps that long first: tests use it to
give a dispatcher process a slow disk.
"""

from __future__ import annotations

import fcntl
import os
import pathlib
import time
from typing import Any

from jaxfeed.service.storage import journal_replay
from jaxfeed.service.storage import state_snapshot
from jaxfeed.service.storage.journal_replay import SNAPSHOT_NAME, TMP_SUFFIX, journal_name

LOCK_NAME = "LOCK"
FSYNC_DELAY_ENV = "JAXFEED_TEST_FSYNC_DELAY_S"


def fsync(fd: int) -> None:
  """Makes what was written to `fd` durable (after the test hook's delay)."""
  delay = os.environ.get(FSYNC_DELAY_ENV)
  if delay:
    time.sleep(float(delay))
  os.fsync(fd)


def fsync_folder(path: pathlib.Path) -> None:
  """Makes the names of the folder's files durable."""
  fd = os.open(path, os.O_RDONLY)
  try:
    fsync(fd)
  finally:
    os.close(fd)


def lock_folder(work_dir: pathlib.Path) -> int:
  """Locks the work_dir for this process (two dispatchers appending to one
  journal would corrupt it); returns the descriptor whose closing unlocks it.

  Raises:
    RuntimeError: another process holds the lock.
  """
  fd = os.open(work_dir / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
  try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
  except BlockingIOError:
    os.close(fd)
    raise RuntimeError(
      f"Dispatcher work_dir {work_dir} is in use by another dispatcher (it "
      f"holds {work_dir / LOCK_NAME}): stop that one first, or give this "
      "one its own --work_dir."
    ) from None
  return fd


def write_snapshot(work_dir: pathlib.Path, generation: int, records: list[dict[str, Any]]) -> None:
  """Writes the state's `records` as the snapshot that generation
  `generation` starts from, atomically (a tmp file fsynced, renamed, the
  folder fsynced), then deletes the journal generations before it.

  Raises:
    OSError: the disk refused; the tmp file is removed, the old snapshot and
      the generations still describe the state.
  """
  tmp = work_dir / (SNAPSHOT_NAME + TMP_SUFFIX)
  try:
    data = state_snapshot.encode(records, generation)
    with open(tmp, "wb") as f:
      f.write(data)
      f.flush()
      fsync(f.fileno())
    os.replace(tmp, work_dir / SNAPSHOT_NAME)
    fsync_folder(work_dir)
  except OSError:
    tmp.unlink(missing_ok=True)
    raise
  for old in journal_replay.generations(work_dir):
    if old < generation:
      (work_dir / journal_name(old)).unlink(missing_ok=True)
