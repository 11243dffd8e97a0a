"""What a record store's lookups cost, for the autocache policy: seconds
per record read (a whole block, or one record alone), computed and
written, and the bytes per record (see `jaxfeed.ops.record_store`)."""

from __future__ import annotations

import collections
import time
from typing import Any, Callable

__all__ = ["READ", "READ_ONE", "StoreCosts"]

READ, READ_ONE = "read", "read one"
"""A whole block read, and one record read alone."""


class StoreCosts:
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
    if kind in (READ, READ_ONE) and result is None:
      return None  # a look for a missing block is no read
    self.seconds[kind] += time.perf_counter() - started
    self.records[kind] += records
    if kind in (READ, READ_ONE):
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
    reader's memory is read once a block. A larger one is read a record at
    a time (those reads give its cost); a block read there (one written
    meanwhile by another reader) serves the records of it used while it
    stays in memory (few, in a shuffled order), so its seconds are spread
    over those."""

    def rate(kind: str) -> float | None:
      return self.seconds[kind] / self.records[kind] if self.records[kind] else None

    read_s = rate(READ)
    if read_s is not None and self.served and not fits_in_memory:
      kept_share = self.read_share() if self.reads < self.lookups else 1.0
      served_from_reads = max(1.0, self.served * kept_share)
      read_s = max(read_s, self.seconds[READ] / served_from_reads)
    if self.records[READ_ONE]:
      read_s = rate(READ_ONE)
    writes = self.records["write"]
    return {
      "compute_s": rate("compute"),
      "read_s": read_s,
      "write_s": rate("write"),
      "bytes": self.bytes / writes if writes else None,
    }
