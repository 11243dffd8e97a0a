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

from jaxfeed.ops import autocache_policy

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
    policy: the autocache policy (`jaxfeed.ops.autocache_policy.POLICIES`):
      whether blocks are kept, or computed and not kept.
    job: the job's name in the policy's decision counts.
  """

  def __init__(
    self,
    directory: str,
    num_records: int,
    compute: Callable[[int, int], list],
    policy: str = "always",
    job: str = "",
  ):
    self.directory = directory
    self.num_records = num_records
    self._compute = compute
    self._blocks: collections.OrderedDict[int, list] = collections.OrderedDict()
    self.computed_blocks = 0  # by this object, for tests and stats
    self.read_blocks = 0
    self.unkept_records = 0  # computed and not kept (the policy's compute)
    self._policy, self._job = policy, job
    self._point = autocache_policy.point(
      os.path.dirname(os.path.abspath(directory)), os.path.basename(directory)
    )
    self._costs = _Costs()
    os.makedirs(directory, exist_ok=True)

  def get(self, index: int) -> Any:
    """The preprocessed record `index`."""
    if not 0 <= index < self.num_records:
      raise IndexError(f"record {index} is outside [0, {self.num_records}).")
    costs = self._costs
    costs.served += 1
    block = index // BLOCK
    records = self._blocks.get(block)
    if records is not None:
      self._blocks.move_to_end(block)
      return records[index - block * BLOCK]
    mode = self._point.block_mode(self._policy, self._job, costs.read_share())
    if mode == autocache_policy.COMPUTE:  # this record alone, not kept
      [record] = costs.timed("compute", 1, self._compute, index, index + 1)
      self.unkept_records += 1
      self._note(mode)
      return record
    records = self._block(block, mode)
    self._blocks[block] = records
    if len(self._blocks) > _CACHED_BLOCKS:
      self._blocks.popitem(last=False)
    self._note(mode)
    return records[index - block * BLOCK]

  def _path(self, block: int) -> str:
    return os.path.join(self.directory, f"block-{block:09d}.pkl")

  def _block(self, block: int, mode: str) -> list:
    costs = self._costs
    start = block * BLOCK
    stop = min(start + BLOCK, self.num_records)
    path = self._path(block)
    while True:
      records = costs.timed("read", stop - start, _load, path)
      if records is not None:
        self.read_blocks += 1
        return records
      if _claim(path + ".claim"):
        try:
          records = _load(path)  # written between the look and the claim
          if records is None:
            records = costs.timed("compute", stop - start, self._compute, start, stop)
            costs.timed("write", stop - start, _write, path, records)
            costs.bytes += os.path.getsize(path)
            self.computed_blocks += 1
            if mode == autocache_policy.PROFILE:
              costs.timed("read", stop - start, _load, path)  # what a reader pays
          else:
            self.read_blocks += 1
          return records
        finally:
          _unclaim(path + ".claim")
      time.sleep(_WAIT_POLL_S)  # another reader computes it

  def _note(self, mode: str) -> None:
    """Hands the policy what the records since its last look cost, when it
    next decides."""
    costs = self._costs
    costs.lookups += 1
    due = (
      costs.lookups >= autocache_policy.PROFILE_BLOCKS
      if mode == autocache_policy.PROFILE
      else self._point.blocks >= autocache_policy.REDECIDE_LOOKUPS
    )
    if due:
      fits = -(-self.num_records // BLOCK) <= _CACHED_BLOCKS
      self._point.measurements.update(**costs.per_record(fits))
      self._costs = _Costs(costs.read_share())


class _Costs:
  """Seconds a store's lookups (records not in memory) cost, by kind, and
  the records they held."""

  def __init__(self, read_share: float = 0.0):
    self.seconds: dict[str, float] = collections.defaultdict(float)
    self.records: collections.Counter = collections.Counter()
    self.bytes = 0
    self.lookups = 0
    self.served = 0  # records handed out, from memory or not
    self.reads = self.computes = 0
    self._last_share = read_share

  def timed(self, kind: str, records: int, fn: Callable, *args: Any) -> Any:
    started = time.perf_counter()
    result = fn(*args)
    if kind == "read" and result is None:
      return None  # a look for a missing block is no read
    self.seconds[kind] += time.perf_counter() - started
    self.records[kind] += records
    if kind == "read":
      self.reads += 1
    elif kind == "compute":
      self.computes += 1
    return result

  def read_share(self) -> float:
    """Of the blocks looked up, the share that were read."""
    total = self.reads + self.computes
    return self.reads / total if total else self._last_share

  def per_record(self, fits_in_memory: bool) -> dict:
    """Seconds per record handed out. A store whose blocks all fit in a
    reader's memory is read once a block; in a larger one, a block read
    serves the records of it used while it stays in memory (few, in a
    shuffled order), so its seconds are spread over those."""

    def rate(kind: str) -> float | None:
      return self.seconds[kind] / self.records[kind] if self.records[kind] else None

    read_s = rate("read")
    if read_s is not None and self.served and not fits_in_memory:
      kept_share = self.read_share() if self.reads < self.lookups else 1.0
      served_from_reads = max(1.0, self.served * kept_share)
      read_s = max(read_s, self.seconds["read"] / served_from_reads)
    writes = self.records["write"]
    return {
      "compute_s": rate("compute"),
      "read_s": read_s,
      "write_s": rate("write"),
      "bytes": self.bytes / writes if writes else None,
    }


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
