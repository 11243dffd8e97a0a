"""Finding the records of a plain TFRecord file, damaged or not.

`scan_frames` indexes a file by its frame headers. Where a frame is damaged
(its length CRC fails, its length runs past the end of the file, the file
ends inside its header, or, when asked, its data CRC fails), the damaged
bytes become one entry of the index, a `DamagedRange`, and the scan
resynchronizes: `next_frame` searches forward, byte by byte, for the next
offset where a whole frame verifies (its length CRC and its data CRC), as
TFRecord recovery tools do. A false match needs two 32-bit CRCs to pass by
chance (and a plausible length).

What a resync cannot tell apart: a record whose data holds a whole TFRecord
frame (a TFRecord file stored as one record) looks like a frame when the
search starts inside it.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import google_crc32c
import numpy as np

from jaxfeed.sources.base import CorruptRecordError
from jaxfeed.sources.tfrecord_format import (
  BEYOND_END,
  CRC,
  DATA_CRC,
  FOOTER_BYTES,
  FRAME_OVERHEAD,
  HEADER,
  HEADER_BYTES,
  LENGTH_CRC,
  MASK_DELTA,
  TRUNCATED,
  data_crc_message,
  length_crc_message,
  mask_crc,
  masked_crc32c,
)

__all__ = ["DamagedRange", "next_frame", "scan_frames"]

Pread = Callable[[int, int], bytes]  # pread(size, offset), as os.pread

# Scan reads in chunks this big while records are small; for large records
# it reads only the 12 header bytes of each, skipping the data.
_SCAN_CHUNK_BYTES = 1 << 20
_LARGE_RECORD_BYTES = 1 << 16
# The resync search looks at this many bytes at once, and checks the data
# CRC of a candidate frame in pieces of at most this size.
_SEARCH_CHUNK_BYTES = 4 << 20
_VERIFY_PIECE_BYTES = 4 << 20
# The 4 stored CRC bytes of a header of length 0.
_CRC_OF_ZERO_LENGTH = tuple(masked_crc32c(bytes(8)).to_bytes(4, "little"))


@dataclasses.dataclass(frozen=True)
class DamagedRange:
  """Bytes of a record file that hold no readable record.

  Attributes:
    path: The file.
    start: Byte offset where the damage was found (a frame's start).
    end: Where reading goes on (the next frame that verifies, or the end of
      the file); None where unknown (a compressed file that cannot be
      decompressed past the damage).
    kind: "length_crc", "data_crc", "truncated", "beyond_end",
      "decompress" or "compression" (`CorruptRecordError.kind`).
    reason: What is wrong, in words.
    record_index: The index entry the damage takes among the file's records
      (the number of records and damaged ranges before it).
  """

  path: str
  start: int
  end: int | None
  kind: str
  reason: str
  record_index: int

  @property
  def num_bytes(self) -> int | None:
    return None if self.end is None else self.end - self.start

  def error(self) -> CorruptRecordError:
    """A new error that names the file, the offset and what is wrong."""
    return CorruptRecordError(
      self.path, self.start, self.reason, self.record_index, self.end, self.kind
    )

  @classmethod
  def from_error(cls, error: CorruptRecordError) -> "DamagedRange":
    return cls(
      error.path,
      error.offset or 0,
      error.end,
      error.kind or TRUNCATED,
      error.reason,
      error.record_index or 0,
    )


@functools.cache
def _length_crc_tables() -> tuple[np.ndarray, int]:
  """CRC-32C of 8 bytes as an affine function of the bytes: crc(m) equals
  crc(zeros) ^ tables[0][m[0]] ^ ... ^ tables[7][m[7]] (the CRC is linear
  over GF(2) for a fixed length)."""
  zero = google_crc32c.value(bytes(8))
  tables = np.zeros((8, 256), np.uint32)
  for j in range(8):
    for b in range(1, 256):
      message = bytearray(8)
      message[j] = b
      tables[j, b] = google_crc32c.value(bytes(message)) ^ zero
  return tables, zero


def _header_candidates(chunk: bytes, room: int) -> np.ndarray:
  """Offsets in `chunk` where a frame header verifies.

  Args:
    chunk: Bytes of the file.
    room: Bytes of the file from the start of `chunk` to its end; a header
      whose frame would run past it is no candidate.

  Returns:
    Ascending int64 offsets q (q + 12 <= len(chunk)) whose 12 bytes are a
    header with a matching length CRC and a frame that fits in the file.
  """
  data = np.frombuffer(chunk, np.uint8)
  n = len(data) - HEADER_BYTES + 1
  if n <= 0:
    return np.zeros(0, np.int64)
  byte = [data[j : j + n] for j in range(HEADER_BYTES)]
  # Cheap filters on whole slices first. A frame that fits in the file has a
  # length below 2**40 (its high 3 bytes are zero), and a zero length has
  # one valid CRC, so runs of zeros (a zero-filled tail) drop out here.
  keep = (byte[5] | byte[6] | byte[7]) == 0
  zero_length = (byte[0] | byte[1] | byte[2] | byte[3] | byte[4]) == 0
  zero_length_crc = byte[8] == _CRC_OF_ZERO_LENGTH[0]
  for j in range(1, 4):
    zero_length_crc &= byte[8 + j] == _CRC_OF_ZERO_LENGTH[j]
  keep &= ~zero_length | zero_length_crc
  at = np.flatnonzero(keep)
  if not len(at):
    return at
  length = np.zeros(len(at), np.int64)
  for j in range(5):
    length |= data[at + j].astype(np.int64) << (8 * j)
  at = at[length <= room - at - FRAME_OVERHEAD]
  if not len(at):
    return at
  tables, zero = _length_crc_tables()
  crc = np.full(len(at), zero, np.uint32)
  for j in range(8):
    crc ^= tables[j][data[at + j]]
  masked = ((crc >> np.uint32(15)) | (crc << np.uint32(17))) + np.uint32(MASK_DELTA)
  stored = np.zeros(len(at), np.uint32)
  for j in range(4):
    stored |= data[at + 8 + j].astype(np.uint32) << np.uint32(8 * j)
  return at[masked == stored].astype(np.int64)


def _data_crcs(pread: Pread, start: int, length: int) -> tuple[int, int] | None:
  """(stored, computed) data CRC of the frame at `start` with `length` data
  bytes, read in pieces (a candidate's length may be large); None where the
  file ends first."""
  crc = 0
  offset = start + HEADER_BYTES
  remaining = length
  while remaining:
    piece = pread(min(remaining, _VERIFY_PIECE_BYTES), offset)
    if not piece:
      return None
    crc = google_crc32c.extend(crc, piece)
    offset += len(piece)
    remaining -= len(piece)
  footer = pread(FOOTER_BYTES, offset)
  if len(footer) < FOOTER_BYTES:
    return None
  return CRC.unpack(footer)[0], mask_crc(crc)


def _data_crc_matches(pread: Pread, start: int, length: int) -> bool:
  crcs = _data_crcs(pread, start, length)
  return crcs is not None and crcs[0] == crcs[1]


def next_frame(pread: Pread, start: int, file_size: int) -> int | None:
  """The first offset at or after `start` where a whole frame verifies.

  Args:
    pread: `pread(size, offset)` returns up to `size` bytes at `offset`.
    start: Where to begin the search.
    file_size: Size of the file in bytes.

  Returns:
    The offset of the first frame at or after `start` whose length CRC and
    data CRC both verify and which ends inside the file, or None.
  """
  pos = start
  while pos + FRAME_OVERHEAD <= file_size:
    chunk = pread(min(_SEARCH_CHUNK_BYTES, file_size - pos), pos)
    if len(chunk) < FRAME_OVERHEAD:
      return None  # the file is shorter than its reported size
    for q in _header_candidates(chunk, file_size - pos).tolist():
      length = HEADER.unpack_from(chunk, q)[0]
      end = q + FRAME_OVERHEAD + length
      if end <= len(chunk):
        data = chunk[q + HEADER_BYTES : end - FOOTER_BYTES]
        if CRC.unpack_from(chunk, end - FOOTER_BYTES)[0] == masked_crc32c(data):
          return pos + q
      elif _data_crc_matches(pread, pos + q, length):
        return pos + q
    # The next chunk starts where a header would no longer fit in this one.
    pos += len(chunk) - HEADER_BYTES + 1
  return None


def scan_frames(
  pread: Pread, file_size: int, path: str, verify_data: bool = False
) -> tuple[np.ndarray, tuple[DamagedRange, ...]]:
  """Finds every frame of a TFRecord file, and every damaged range.

  Args:
    pread: `pread(size, offset)` returns up to `size` bytes at `offset`
      (the argument order of `os.pread` after its file descriptor).
    file_size: Size of the file in bytes.
    path: The file, for error messages.
    verify_data: Also check every frame's data CRC (reads the whole file);
      otherwise only the headers are read and checked.

  Returns:
    (offsets, damage): an int64 array of num_entries + 1 offsets, the last
    one the file size, and the damaged ranges. Entry i spans bytes
    [offsets[i], offsets[i + 1]); it is a record (its data is bytes
    [offsets[i] + 12, offsets[i + 1] - 4)) unless a damaged range has
    record_index i.
  """
  offsets: list[int] = []
  damage: list[DamagedRange] = []
  append = offsets.append
  unpack_header = HEADER.unpack_from
  chunk, chunk_start, chunk_end = b"", 0, 0
  read_size = _SCAN_CHUNK_BYTES
  pos = 0
  while pos < file_size:
    problem = None
    if pos + HEADER_BYTES > chunk_end:
      if pos + HEADER_BYTES > file_size:
        problem = (
          TRUNCATED,
          f"truncated file: {file_size - pos} bytes left where a "
          f"{HEADER_BYTES}-byte record header starts (file size "
          f"{file_size})",
        )
      else:
        chunk = pread(max(HEADER_BYTES, min(read_size, file_size - pos)), pos)
        chunk_start, chunk_end = pos, pos + len(chunk)
        if chunk_end < pos + HEADER_BYTES:
          problem = (
            TRUNCATED,
            "the file ended while reading a record header (it is shorter than its reported size)",
          )
    if problem is None:
      at = pos - chunk_start
      length, length_crc = unpack_header(chunk, at)
      end = pos + FRAME_OVERHEAD + length
      computed = masked_crc32c(chunk[at : at + 8])
      if computed != length_crc:
        problem = (LENGTH_CRC, length_crc_message(length_crc, computed))
      elif end > file_size:
        problem = (
          BEYOND_END,
          f"truncated file: the record header says {length} data "
          f"bytes, so the record ends at byte {end}, but the file has "
          f"{file_size} bytes",
        )
      elif verify_data:
        problem = _data_problem(pread, chunk, chunk_start, chunk_end, pos, length)
    if problem is None:
      append(pos)
      read_size = HEADER_BYTES if length >= _LARGE_RECORD_BYTES else (_SCAN_CHUNK_BYTES)
      pos = end
      continue
    resume = next_frame(pread, pos + 1, file_size)
    stop = file_size if resume is None else resume
    kind, reason = problem
    damage.append(DamagedRange(path, pos, stop, kind, reason, len(offsets)))
    append(pos)
    pos = stop
  append(file_size)
  return np.asarray(offsets, dtype=np.int64), tuple(damage)


def _data_problem(
  pread: Pread, chunk: bytes, chunk_start: int, chunk_end: int, pos: int, length: int
) -> tuple[str, str] | None:
  """(kind, reason) where the data CRC of the frame at `pos` fails."""
  end = pos + FRAME_OVERHEAD + length
  if end <= chunk_end:
    at = pos - chunk_start
    data = chunk[at + HEADER_BYTES : at + HEADER_BYTES + length]
    stored = CRC.unpack_from(chunk, at + HEADER_BYTES + length)[0]
    computed = masked_crc32c(data)
    if stored == computed:
      return None
    return DATA_CRC, data_crc_message(stored, computed, length)
  crcs = _data_crcs(pread, pos, length)
  if crcs is None:
    return TRUNCATED, ("the file ended inside this record (it is shorter than its reported size)")
  if crcs[0] == crcs[1]:
    return None
  return DATA_CRC, data_crc_message(crcs[0], crcs[1], length)
