"""Reading a dispatcher's work_dir back at a restart: the snapshot, then every
journal generation, each line checked (`journal_lines`).

What replay does with a bad line depends on where it is:

* A torn tail of the last generation (a crash in the middle of a write: that
  batch was never acknowledged) is cut off, as it always was.
* Anything else is damage: a flipped bit, a line lost, repeated or moved, a
  newline gone, a torn line with valid lines after it. With
  `--journal_damage=refuse` (the default) the dispatcher refuses to start,
  naming the file and the byte offset. With `--journal_damage=truncate` it
  cuts the journal at the damage, deletes what follows (later generations
  too) and logs what was lost: every change after the damage is forgotten,
  acknowledged or not, so exactly-once reads running then may deliver splits
  again, and ids handed out after it may be handed out again.
* A damaged snapshot is always refused: cutting one would leave half a state.

Journal files of the previous release (JSON lines without checksums) and its
version 1 snapshots are read once, as that release read them (a damaged line
is found only if it is no longer JSON); `ReplayResult.legacy` then asks the
journal to write the state again in the checked format at once.
"""

from __future__ import annotations

import collections
import dataclasses
import io
import itertools
import json
import logging
import os
import pathlib
import re
from typing import Any, Callable

from jaxfeed.service.storage import journal_lines
from jaxfeed.service.storage import state_snapshot
from jaxfeed.service.storage.journal_lines import JournalDamageError

SNAPSHOT_NAME = "snapshot.json"
TMP_SUFFIX = ".tmp"
FORMAT = "jaxfeed-dispatcher-journal"
VERSION = 2
REFUSE, TRUNCATE = "refuse", "truncate"
DAMAGE_POLICIES = (REFUSE, TRUNCATE)
_GENERATION_NAME = re.compile(r"journal(?:\.(\d+))?\.jsonl")
_LEGACY_START = (b"[", b"{")  # a line of the previous release: a JSON batch or record

Apply = Callable[[dict[str, Any]], None]


def journal_name(generation: int) -> str:
  """The file name of a journal generation."""
  return "journal.jsonl" if generation == 0 else f"journal.{generation}.jsonl"


def header(generation: int) -> dict[str, Any]:
  """The first line of a journal generation's file."""
  return {"format": FORMAT, "version": VERSION, "generation": generation}


def generations(work_dir: pathlib.Path) -> list[int]:
  """The journal generations whose files are in `work_dir`, sorted."""
  found = []
  for path in work_dir.iterdir():
    match = _GENERATION_NAME.fullmatch(path.name)
    if match:
      found.append(int(match.group(1) or 0))
  return sorted(found)


@dataclasses.dataclass(frozen=True)
class ReplayStats:
  """What a restart read.

  Attributes:
    snapshot_records: records read from the snapshot.
    journal_records: records read from the journal after the snapshot.
    torn_bytes: bytes of a torn last line that were cut off.
    cut_bytes: bytes cut at damage (`--journal_damage=truncate`), later
      generations included.
    records_lost: records still readable in what was cut at damage.
  """

  snapshot_records: int = 0
  journal_records: int = 0
  torn_bytes: int = 0
  cut_bytes: int = 0
  records_lost: int = 0

  @property
  def records(self) -> int:
    return self.snapshot_records + self.journal_records


@dataclasses.dataclass(frozen=True)
class ReplayResult:
  """A replay's stats and where writing goes on.

  Attributes:
    stats: what was read.
    generation: the journal generation new batches go to.
    last_crc: the CRC the next line of that generation continues.
    size: the bytes of that generation's file (0: it is empty or absent,
      and its next line is its header).
    legacy: a file of the previous release was read: write the state again.
    records: records of the journal since the snapshot.
    bytes: bytes of the journal since the snapshot.
  """

  stats: ReplayStats
  generation: int
  last_crc: int
  size: int
  legacy: bool
  records: int
  bytes: int


def replay(
  work_dir: pathlib.Path, apply: Apply, damage: str = REFUSE, fsync: bool = True
) -> ReplayResult:
  """Calls `apply` on every record of the snapshot and journal, in order.

  Cuts off a torn last line and removes files a crash left behind.

  Raises:
    JournalDamageError: a file is damaged and `damage` is REFUSE (the message
      names the file and the offset), or the snapshot is damaged.
    ValueError: `apply` failed on an intact record.
  """
  if damage not in DAMAGE_POLICIES:
    raise ValueError(f"journal_damage must be one of {DAMAGE_POLICIES}, got {damage!r}.")
  (work_dir / (SNAPSHOT_NAME + TMP_SUFFIX)).unlink(missing_ok=True)  # an unfinished snapshot
  first, snapshot_records, legacy = 0, 0, False
  snapshot_path = work_dir / SNAPSHOT_NAME
  if snapshot_path.exists():
    snapshot = state_snapshot.decode(snapshot_path.read_bytes(), str(snapshot_path))
    for record, offset in zip(snapshot.records, snapshot.offsets):
      _apply_one(apply, record, snapshot_path, 0, offset)
    first, snapshot_records, legacy = (
      snapshot.journal_generation,
      len(snapshot.records),
      snapshot.legacy,
    )
  found = generations(work_dir)
  for generation in [g for g in found if g < first]:
    (work_dir / journal_name(generation)).unlink()  # folded into the snapshot
  found = [g for g in found if g >= first]
  expected = list(range(first, first + len(found)))
  if found and found != expected:
    raise JournalDamageError(
      f"Journal files in {work_dir} do not continue the snapshot: found "
      f"generations {found}, expected {expected} (journal.jsonl is 0, "
      "journal.<N>.jsonl is N). A file is missing.",
      str(work_dir),
      0,
    )
  reader = _Reader(work_dir, apply, damage, fsync)
  for index, generation in enumerate(found):
    if not reader.read(generation, later=found[index + 1 :]):
      break  # cut at damage: the later generations are gone
  last = reader.generation if found else first
  stats = ReplayStats(snapshot_records, reader.records, reader.torn, reader.cut, reader.lost)
  return ReplayResult(
    stats,
    last,
    reader.last_crc,
    reader.size if found else 0,
    legacy or reader.legacy,
    reader.records,
    reader.bytes,
  )


class _Reader:
  """Replays journal generations one after another."""

  def __init__(self, work_dir: pathlib.Path, apply: Apply, damage: str, fsync: bool):
    self.work_dir = work_dir
    self.apply = apply
    self.damage = damage
    self.fsync = fsync
    self.records = self.bytes = self.torn = self.cut = self.lost = 0
    self.generation, self.last_crc, self.legacy, self.size = 0, 0, False, 0

  def read(self, generation: int, later: list[int]) -> bool:
    """Replays one generation; False if it was cut at damage (replay ends)."""
    path = self.work_dir / journal_name(generation)
    data = path.read_bytes()
    self.generation, self.last_crc = generation, 0
    if data[:1] in _LEGACY_START:
      self.legacy = True
      lines = _legacy_lines(data, path)
    else:
      lines = _checked_lines(data, path, generation)
      self.last_crc = lines.last_crc
    for line, offset, number in lines.batches:  # decoded one at a time: less memory
      try:
        value = json.loads(line) if isinstance(line, bytes) else line
      except (ValueError, RecursionError):  # a checksum that matches over no JSON
        lines = _Lines([], offset, 0, number, False, "its checksum matches but it is no JSON")
        break
      batch = value if isinstance(value, list) else [value]
      for record in batch:
        _apply_one(self.apply, record, path, number, offset)
      self.records += len(batch)
    self.bytes += lines.end
    self.size = lines.end
    if lines.end == len(data):
      return True
    if lines.torn and not later:
      logging.warning(
        "Journal %s ended in a torn line (%d bytes at byte %d, never acknowledged): cut off.",
        path,
        len(data) - lines.end,
        lines.end,
      )
      self.torn = len(data) - lines.end
      self._truncate(path, lines.end)
      return True
    self._damaged(path, data, lines, later)
    return False

  def _damaged(self, path: pathlib.Path, data: bytes, lines: "_Lines", later: list[int]) -> None:
    """Refuses, or cuts the journal at the damage and logs what was lost."""
    offset = lines.end
    after = _readable_records(data[offset:])
    later_records = sum(
      len(_readable_records((self.work_dir / journal_name(g)).read_bytes())) for g in later
    )
    what = (
      f"Journal {path} is damaged at byte {offset} (line {lines.bad_line}): "
      f"{lines.why}, and {len(data) - offset} bytes follow it"
      + (f", then journal generations {later}" if later else "")
      + "."
    )
    if self.damage == REFUSE:
      raise JournalDamageError(
        f"{what} The dispatcher refuses to start rather than forget changes it "
        "acknowledged. Restore the work_dir from a backup, or restart with "
        "--journal_damage=truncate to cut the journal at the damage and lose "
        f"every change after it ({len(after) + later_records} records can still "
        "be read there).",
        str(path),
        offset,
      )
    kinds = collections.Counter(r.get("kind", "?") for r in after if isinstance(r, dict))
    cut = len(data) - offset
    self._truncate(path, offset)
    if not self.legacy:  # writing goes on after the last valid line
      self.last_crc = journal_lines.check(data[:offset]).last_crc
    for generation in later:
      later_path = self.work_dir / journal_name(generation)
      cut += later_path.stat().st_size
      later_path.unlink()
    self.cut, self.lost = cut, len(after) + later_records
    logging.error(
      "%s --journal_damage=truncate: cut there. LOST: %d bytes, holding %d readable "
      "records (%s) and %d more in the later generations: every change after the "
      "damage is forgotten; exactly-once reads running then may deliver splits "
      "again.",
      what,
      cut,
      len(after),
      dict(kinds),
      later_records,
    )

  def _truncate(self, path: pathlib.Path, size: int) -> None:
    os.truncate(path, size)
    if self.fsync:
      fsync_path(path)


@dataclasses.dataclass(frozen=True)
class _Lines:
  """A journal file read: its batches (a line's JSON bytes, or its value
  decoded, with the line's offset and number), where its readable part
  ends, and what is wrong after it."""

  batches: list[tuple[Any, int, int]]
  end: int
  last_crc: int = 0
  bad_line: int = 0
  torn: bool = False
  why: str = ""


def _checked_lines(data: bytes, path: pathlib.Path, generation: int) -> _Lines:
  """A file of checked lines; its first line must be the header of `generation`."""
  checked = journal_lines.check(data)
  if checked.payloads:
    try:
      first = journal_lines.decode(checked.payloads[0])
    except (ValueError, RecursionError):
      first = None
    if first != header(generation):
      raise JournalDamageError(
        f"Journal {path} does not start with the header of generation {generation} "
        f"({first!r:.120}): it is not this file's journal.",
        str(path),
        0,
      )
  lines = list(zip(checked.payloads, checked.offsets, itertools.count(1)))[1:]
  return _Lines(
    lines,
    checked.valid_end,
    checked.last_crc,
    checked.bad_line,
    checked.torn,
    "its checksum does not match",
  )


def _legacy_lines(data: bytes, path: pathlib.Path) -> _Lines:
  """A file of the previous release: JSON lines without checksums."""
  del path
  batches: list[tuple[Any, int, int]] = []
  offset = 0
  for number, line in enumerate(io.BytesIO(data), 1):  # split at "\n" only
    if not line.endswith(b"\n"):
      return _Lines(batches, offset, bad_line=number, torn=True, why="the line is incomplete")
    if line.strip():
      try:
        decoded = json.loads(line)
      except (ValueError, RecursionError) as e:  # too deep a nesting recurses too far
        return _Lines(batches, offset, bad_line=number, why=f"it is no JSON ({e})")
      batches.append((decoded if isinstance(decoded, list) else [decoded], offset, number))
    offset += len(line)
  return _Lines(batches, offset)


def _readable_records(data: bytes) -> list[Any]:
  """The records that still parse in a stretch of journal (for reports)."""
  found = []
  for line in data.splitlines():
    payload = line[9:] if line[:1] not in _LEGACY_START else line
    try:
      value = json.loads(payload)
    except (ValueError, RecursionError, UnicodeDecodeError):
      continue
    if isinstance(value, list):
      found.extend(value)
    elif isinstance(value, dict) and value.get("format") != FORMAT:
      found.append(value)
  return found


def _apply_one(apply: Apply, record: Any, path: pathlib.Path, line: int, offset: int) -> None:
  """Applies a record read from `path` at `line` (0: a snapshot's) and `offset`."""
  if type(record) is dict and "kind" in record:  # pylint: disable=unidiomatic-typecheck
    try:
      apply(record)
      return
    except Exception as e:  # pylint: disable=broad-except
      error: Exception | None = e
  else:
    error = None
  where = (
    f"Journal {path} is corrupt at line {line} (byte {offset})"
    if line
    else f"Dispatcher snapshot {path}, record at byte {offset}"
  )
  if error is None:
    raise ValueError(
      f"{where}: expected a record (a JSON object with a 'kind'), got {str(record)[:80]!r}."
    )
  raise ValueError(
    f"{where}: record {str(record)[:200]} cannot be applied: {type(error).__name__}: {error}"
  ) from error


def fsync_path(path: pathlib.Path) -> None:
  """Fsyncs a file or folder by its path."""
  fd = os.open(path, os.O_RDONLY)
  try:
    os.fsync(fd)
  finally:
    os.close(fd)
