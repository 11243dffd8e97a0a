"""The dispatcher's write-ahead log: one JSON record per state change."""

from __future__ import annotations

import json
import os
import pathlib
import threading
from typing import Any, Iterator


class Journal:
  """Appends JSON records to `<work_dir>/journal.jsonl`; replays them in order.

  A record is written (and flushed, optionally fsynced) before the change it
  describes is acknowledged, so a restarted dispatcher sees every change a
  client or worker was told about. A torn last line (a crash mid-write) is
  ignored on replay.
  """

  FILE_NAME = "journal.jsonl"

  def __init__(self, work_dir: str | os.PathLike, fsync: bool = False):
    self.path = pathlib.Path(work_dir) / self.FILE_NAME
    self.path.parent.mkdir(parents=True, exist_ok=True)
    self._fsync = fsync
    self._lock = threading.Lock()
    self._file = None

  def replay(self) -> Iterator[dict[str, Any]]:
    if not self.path.exists():
      return
    with open(self.path, "rb") as f:
      lines = f.read().split(b"\n")
    for number, line in enumerate(lines):
      if not line.strip():
        continue
      try:
        yield json.loads(line)
      except (ValueError, RecursionError) as e:  # too deep a nesting recurses too far
        if number == len(lines) - 1:
          return  # torn final write
        raise ValueError(
            f"Journal {self.path} is corrupt at line {number + 1}: {e}") from e

  def append(self, record: dict[str, Any]) -> None:
    data = json.dumps(record, separators=(",", ":")).encode() + b"\n"
    with self._lock:
      if self._file is None:
        self._file = open(self.path, "ab")
      self._file.write(data)
      self._file.flush()
      if self._fsync:
        os.fsync(self._file.fileno())

  def close(self) -> None:
    with self._lock:
      if self._file is not None:
        self._file.close()
        self._file = None
