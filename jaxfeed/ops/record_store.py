"""`RecordStore`: preprocessed records kept by record index in a folder that
many readers share (processes of one host, or service workers over a shared
file system).

Records are kept in blocks of `BLOCK` consecutive indices, one file each,
written whole (to a temporary name, then renamed): a reader sees a block
complete or not at all. The reader that first needs a block claims it (a
lock file made with O_EXCL, naming the host and process) and computes it;
others that need it meanwhile wait for the file instead of computing it
again. A claim whose process is gone (on this host), or older than
`CLAIM_STALE_S`, is taken over, so a reader killed mid-block holds nobody
up for long.
"""

from __future__ import annotations

import collections
import os
import pickle
import socket
import tempfile
import time
from typing import Any, Callable

__all__ = ["RecordStore", "BLOCK", "CLAIM_STALE_S"]

BLOCK = 64
"""Records per block file."""

CLAIM_STALE_S = 60.0
"""A claim on a block older than this is taken over."""

_WAIT_POLL_S = 0.005
_CACHED_BLOCKS = 32  # blocks kept in memory per store object


class RecordStore:
  """The blocks of one preprocessing of one source, in `directory`.

  Args:
    directory: the store's folder (made if missing).
    num_records: records in the source.
    compute: compute(start, stop) -> the preprocessed records [start, stop).
  """

  def __init__(self, directory: str, num_records: int, compute: Callable[[int, int], list]):
    self.directory = directory
    self.num_records = num_records
    self._compute = compute
    self._blocks: collections.OrderedDict[int, list] = collections.OrderedDict()
    self.computed_blocks = 0  # by this object, for tests and stats
    self.read_blocks = 0
    os.makedirs(directory, exist_ok=True)

  def get(self, index: int) -> Any:
    """The preprocessed record `index`."""
    if not 0 <= index < self.num_records:
      raise IndexError(f"record {index} is outside [0, {self.num_records}).")
    block = index // BLOCK
    records = self._blocks.get(block)
    if records is None:
      records = self._block(block)
      self._blocks[block] = records
      if len(self._blocks) > _CACHED_BLOCKS:
        self._blocks.popitem(last=False)
    else:
      self._blocks.move_to_end(block)
    return records[index - block * BLOCK]

  def _path(self, block: int) -> str:
    return os.path.join(self.directory, f"block-{block:09d}.pkl")

  def _block(self, block: int) -> list:
    path = self._path(block)
    while True:
      records = _load(path)
      if records is not None:
        self.read_blocks += 1
        return records
      if _claim(path + ".claim"):
        try:
          records = _load(path)  # written between the look and the claim
          if records is None:
            start = block * BLOCK
            records = self._compute(start, min(start + BLOCK, self.num_records))
            _write(path, records)
            self.computed_blocks += 1
          return records
        finally:
          _unclaim(path + ".claim")
      time.sleep(_WAIT_POLL_S)  # another reader computes it


def _load(path: str) -> list | None:
  try:
    with open(path, "rb") as f:
      return pickle.load(f)
  except FileNotFoundError:
    return None


def _write(path: str, records: list) -> None:
  directory = os.path.dirname(path)
  fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-")
  try:
    with os.fdopen(fd, "wb") as f:
      pickle.dump(records, f, protocol=pickle.HIGHEST_PROTOCOL)
    os.replace(tmp, path)
  except BaseException:
    try:
      os.unlink(tmp)
    except FileNotFoundError:
      pass
    raise


def _claim(claim: str) -> bool:
  """Takes the claim on a block; False while another reader holds it."""
  try:
    fd = os.open(claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
  except FileExistsError:
    if not _stale(claim):
      return False
    try:
      os.unlink(claim)  # taken over; a race here is settled by O_EXCL below
    except FileNotFoundError:
      pass
    return False
  with os.fdopen(fd, "w") as f:
    f.write(f"{socket.gethostname()} {os.getpid()}")
  return True


def _unclaim(claim: str) -> None:
  try:
    os.unlink(claim)
  except FileNotFoundError:
    pass


def _stale(claim: str) -> bool:
  """Whether a claim's process is gone (this host) or the claim is old."""
  try:
    with open(claim, encoding="utf-8") as f:
      host, _, pid = f.read().partition(" ")
    age = time.time() - os.stat(claim).st_mtime
  except (FileNotFoundError, ValueError):
    return False  # released meanwhile, or being written: look again
  if age > CLAIM_STALE_S:
    return True
  if host == socket.gethostname() and pid.isdigit():
    try:
      os.kill(int(pid), 0)
    except ProcessLookupError:
      return True
    except PermissionError:
      return False
  return False
