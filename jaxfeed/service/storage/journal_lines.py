r"""Checked lines: the framing of the dispatcher's journal and snapshot files.

Every line of those files is

  CCCCCCCC JSON\n

where CCCCCCCC is a CRC-32C in lowercase hex of JSON's bytes, extended from
the CRC of the line before it (the first line of a file extends 0): a rolling
checksum, as etcd's write-ahead log keeps one. A flipped bit anywhere in a
line fails its check; and since each line continues its predecessor's stored
CRC, a line lost, repeated or moved fails too, while the lines after a
damaged one can still be checked (against the damaged line's stored CRC:
that is how replay tells damage before valid lines from a torn tail). The
first line of a file is a header, a JSON object that names its format.

`check` reads a file's bytes: the valid lines up to the first bad one, and
what follows it. A bad region is a torn tail only if nothing valid follows
it and it is what a crash in the middle of a write leaves: a last line
without its newline (but not a whole line whose newline was damaged), or
sectors the disk never wrote (runs of NUL bytes). Anything else is damage.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any, Iterable

import google_crc32c

_CRC_DIGITS = 8
_CRC_FIELD = re.compile(rb"[0-9a-fA-F]{8} ")
# A run this long of NUL bytes is a sector the disk never wrote (a flipped
# bit makes at most one NUL).
_UNWRITTEN_RUN = b"\0" * 8


class JournalDamageError(ValueError):
  """A file of the dispatcher's work_dir is damaged: `path` at byte `offset`."""

  def __init__(self, message: str, path: str, offset: int):
    super().__init__(message)
    self.path = path
    self.offset = offset


def encode(payload: bytes, previous_crc: int) -> tuple[bytes, int]:
  """The line of `payload` (JSON without newlines) after a line of CRC
  `previous_crc`, and its CRC."""
  crc = google_crc32c.extend(previous_crc, payload)
  return b"%08x %s\n" % (crc, payload), crc


def encode_json(value: Any, previous_crc: int) -> tuple[bytes, int]:
  """`encode` of a JSON value."""
  return encode(json.dumps(value, separators=(",", ":")).encode(), previous_crc)


def encode_all(payloads: Iterable[bytes], previous_crc: int = 0) -> tuple[bytes, int]:
  """The lines of `payloads`, one after another, after a line of CRC
  `previous_crc` (0: they start a file), and the last one's CRC."""
  lines, crc = [], previous_crc
  for payload in payloads:
    line, crc = encode(payload, crc)
    lines.append(line)
  return b"".join(lines), crc


def _stored_crc(line: bytes) -> int | None:
  """The CRC a line (without its newline) carries, or None if it has none."""
  return int(line[:_CRC_DIGITS], 16) if _CRC_FIELD.match(line) else None


def _valid(line: bytes, previous_crc: int | None) -> bool:
  stored = _stored_crc(line)
  return (
    stored is not None
    and previous_crc is not None
    and google_crc32c.extend(previous_crc, line[_CRC_DIGITS + 1 :]) == stored
  )


@dataclasses.dataclass(frozen=True)
class CheckedFile:
  """What `check` found in a file's bytes.

  Attributes:
    payloads: the JSON bytes of the valid lines before the first bad one.
    offsets: where each of those lines starts.
    valid_end: the offset where those lines end.
    last_crc: the CRC of the last valid line (0 if none): the next line
      written continues it.
    bad_offset: the offset of the first bad line (None: the file is intact).
    bad_line: its line number (1-based).
    valid_after: valid lines after the bad one.
    torn: the bad region is a torn tail (see the module docstring).
    size: the file's size.
  """

  payloads: list[bytes]
  offsets: list[int]
  valid_end: int
  last_crc: int
  bad_offset: int | None
  bad_line: int
  valid_after: int
  torn: bool
  size: int

  @property
  def damaged(self) -> bool:
    """A bad region that is not a torn tail."""
    return self.bad_offset is not None and not self.torn


def check(data: bytes) -> CheckedFile:
  """Checks every line of a file's bytes (see the module docstring)."""
  payloads: list[bytes] = []
  offsets: list[int] = []
  offset, crc, number = 0, 0, 0
  match, extend, size = _CRC_FIELD.match, google_crc32c.extend, len(data)
  while offset < size:  # the loop of `_valid`, inline: it is most of a replay
    end = data.find(b"\n", offset)
    number += 1
    if end < 0 or match(data, offset, end) is None:
      break
    payload = data[offset + _CRC_DIGITS + 1 : end]
    stored = int(data[offset : offset + _CRC_DIGITS], 16)
    if extend(crc, payload) != stored:
      break
    payloads.append(payload)
    offsets.append(offset)
    crc, offset = stored, end + 1
  else:
    return CheckedFile(payloads, offsets, offset, crc, None, 0, 0, False, size)
  valid_after = _valid_lines_after(data, offset, crc)
  region = data[offset:]
  torn = valid_after == 0 and (
    (b"\n" not in region and not _valid(region[:-1], crc))  # cut mid-line
    or _UNWRITTEN_RUN in region
  )
  return CheckedFile(payloads, offsets, offset, crc, offset, number, valid_after, torn, size)


def _valid_lines_after(data: bytes, offset: int, crc: int) -> int:
  """The valid lines after the bad line at `offset`, each checked against
  the CRC its predecessor carries."""
  previous: int | None = crc
  count = 0
  while offset < len(data):
    end = data.find(b"\n", offset)
    if end < 0:
      break
    line = data[offset:end]
    if _valid(line, previous):
      count += 1
    previous = _stored_crc(line)
    offset = end + 1
  return count


def decode(payload: bytes) -> Any:
  """The JSON value of a valid line's payload."""
  return json.loads(payload)
