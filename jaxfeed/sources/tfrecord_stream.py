"""`RecordStream`: the records of a TFRecord file read in order.

Compressed files (GZIP, ZLIB) have no random access, so they are always
read this way; `from_tfrecord` reads plain files this way too.

After damage the stream goes on where it can, so that a reader that skips
errors (`ignore_errors`) gets every record it can still trust: the read
that meets the damage raises `CorruptRecordError`, and the stream is then
past it. A plain file resynchronizes at the next frame that verifies (see
`jaxfeed.sources.tfrecord_scan`); in a compressed file a record whose data
CRC fails is passed (its header gave its length), and any other damage ends
the file, because the stream cannot be trusted past it.
"""

from __future__ import annotations

import os
import struct
import zlib
from typing import Any, BinaryIO

import numpy as np

from jaxfeed.sources.base import CorruptRecordError
from jaxfeed.sources.tfrecord_format import (
  BEYOND_END,
  COMPRESSION,
  DATA_CRC,
  DECOMPRESS,
  FORMAT_PROBE_BYTES,
  FRAME_OVERHEAD,
  HEADER_BYTES,
  LENGTH_CRC,
  TRUNCATED,
  compression_mismatch,
  compression_wbits,
  data_crc_message,
  length_crc_message,
  masked_crc32c,
)
from jaxfeed.sources.tfrecord_scan import DamagedRange, next_frame

__all__ = ["RecordStream"]

# Defined here, not imported (see tfrecord_source: method calls on imported
# names are slower per record).
_HEADER = struct.Struct("<QI")
_CRC = struct.Struct("<I")
# Compressed bytes read per call while streaming.
_STREAM_CHUNK_BYTES = 1 << 20
_COMPRESSION_TYPES = {
  compression_wbits(name, "RecordStream"): name for name in (None, "GZIP", "ZLIB")
}


class _PlainBytes:
  """Stands in for a zlib decompressor where the file is not compressed."""

  eof = False
  unconsumed_tail = b""

  def decompress(self, data: bytes, max_length: int) -> bytes:
    del max_length  # a read chunk is already bounded
    return data


def _inflater(wbits: int | None) -> Any:
  return _PlainBytes() if wbits is None else zlib.decompressobj(wbits)


class RecordStream:
  """Reads the records of a TFRecord file in order.

  Args:
    stream: The file, open for reading in binary (owned: closed by
      `close()`).
    wbits: `compression_wbits` of the file's compression type (None: not
      compressed).
    path: The file, for error messages.

  Offsets in errors count bytes of the uncompressed stream. A damaged range
  counts as one record in `position`.
  """

  def __init__(self, stream: BinaryIO, wbits: int | None, path: str):
    self._stream = stream
    self._wbits = wbits
    self._inflate = _inflater(wbits)
    self._path = path
    self._buffer = bytearray()
    self._start = 0  # next unread byte of _buffer
    self.offset = 0  # uncompressed offset of _buffer[_start]
    self.position = 0  # index of the next record
    self.last: bytes | None = None  # record position - 1, where just read
    self.ended = False  # damage that nothing can be read past ended the file

  def close(self) -> None:
    self._stream.close()

  def rewind(self) -> None:
    """Starts again at the first record."""
    self._stream.seek(0)
    self._inflate = _inflater(self._wbits)
    self._buffer = bytearray()
    self._start = self.offset = self.position = 0
    self.last = None
    self.ended = False

  def _reposition(self, offset: int, position: int) -> None:
    """Continues a plain file at the frame at `offset`."""
    self._stream.seek(offset)
    self._buffer = bytearray()
    self._start, self.offset, self.position = 0, offset, position
    self.last = None
    self.ended = False

  def seek_offset(self, offset: int, position: int) -> None:
    """Continues at the frame at uncompressed `offset`, record `position`.

    A plain file seeks there; a compressed one has no random access, so it is
    read again from its start up to there.

    Raises:
      CorruptRecordError: no frame starts at `offset` (the file changed).
    """
    if self._wbits is None:
      self._reposition(offset, position)
      return
    if offset < self.offset:
      self.rewind()
    while self.offset < offset and self.skip():
      pass
    if self.offset != offset:
      raise CorruptRecordError(
        self._path,
        self.offset,
        f"no record starts at uncompressed offset {offset} (the file ended "
        "or changed since that position was saved)",
        self.position,
      )
    self.position = position

  def _pread(self, size: int, offset: int) -> bytes:
    self._stream.seek(offset)
    return self._stream.read(size)

  def _damaged(self, kind: str, reason: str, frame_length: int | None = None) -> CorruptRecordError:
    """Moves past the damage found at `self.offset`; returns its error.

    Args:
      kind: What is wrong (`CorruptRecordError.kind`).
      reason: What is wrong, in words.
      frame_length: The data length of the damaged frame where its header
        is sound (a data CRC failure).
    """
    start, entry = self.offset, self.position
    self.last = None
    mismatch = self._compression_mismatch() if start == 0 else None
    if mismatch is not None:
      # A file of another compression type: nothing in it reads this way.
      kind, reason, end = COMPRESSION, mismatch, None
      self.ended = True
    elif self._wbits is None:
      size = self._stream.seek(0, os.SEEK_END)
      resume = next_frame(self._pread, start + 1, size)
      end = size if resume is None else resume
      self._reposition(end, entry + 1)
      self.ended = resume is None
    elif frame_length is not None:
      self._advance(frame_length)
      end = self.offset
    else:
      end = None  # a deflate stream cannot be trusted past the damage
      self.ended = True
    return CorruptRecordError(self._path, start, reason, entry, end, kind)

  def _compression_mismatch(self) -> str | None:
    """`compression_mismatch` of the file's first bytes."""
    resume = self._stream.tell()
    head = self._pread(FORMAT_PROBE_BYTES, 0)
    self._stream.seek(resume)
    return compression_mismatch(head, _COMPRESSION_TYPES[self._wbits])

  def _fill(self, size: int) -> bool:
    """Makes `size` bytes available; False where the stream ends first."""
    while len(self._buffer) - self._start < size:
      if self._inflate.eof:
        return False
      tail = self._inflate.unconsumed_tail
      compressed = tail or self._stream.read(_STREAM_CHUNK_BYTES)
      if not compressed:
        if self._wbits is None:
          return False  # a plain file just ends
        if len(self._buffer) == self._start:
          raise self._damaged(
            TRUNCATED, "the compressed stream ends without its end marker (the file was truncated)"
          )
        return False
      try:
        data = self._inflate.decompress(compressed, _STREAM_CHUNK_BYTES)
      except zlib.error as e:
        raise self._damaged(
          DECOMPRESS,
          f"the compressed stream cannot be decompressed ({e}); the file is "
          "damaged or its compression_type is not the one it was written "
          "with",
        ) from None
      if self._start:
        del self._buffer[: self._start]  # drop what has been read
        self._start = 0
      self._buffer += data
    return True

  def _frame_length(self) -> int | None:
    """The data length of the next frame; None at the end of the stream."""
    if self.ended:
      return None
    if not self._fill(HEADER_BYTES):
      if len(self._buffer) == self._start:
        return None
      raise self._damaged(TRUNCATED, self._truncated(HEADER_BYTES))
    length, length_crc = _HEADER.unpack_from(self._buffer, self._start)
    computed = masked_crc32c(bytes(self._buffer[self._start : self._start + 8]))
    if computed != length_crc:
      raise self._damaged(LENGTH_CRC, length_crc_message(length_crc, computed))
    if not self._fill(FRAME_OVERHEAD + length):
      raise self._damaged(BEYOND_END, self._truncated(FRAME_OVERHEAD + length))
    return length

  def _truncated(self, size: int) -> str:
    return f"truncated file: the uncompressed stream ends inside a {size}-byte frame"

  def _advance(self, length: int) -> None:
    self._start += FRAME_OVERHEAD + length
    self.offset += FRAME_OVERHEAD + length
    self.position += 1

  def read(self, verify_crc: bool = True) -> bytes | None:
    """The next record, or None after the last one.

    Raises:
      CorruptRecordError: the next bytes are damaged; the stream is then
        past the damage (or at the end of the file).
    """
    length = self._frame_length()
    if length is None:
      return None
    start = self._start + HEADER_BYTES
    data = bytes(self._buffer[start : start + length])
    if verify_crc:
      stored = _CRC.unpack_from(self._buffer, start + length)[0]
      computed = masked_crc32c(data)
      if stored != computed:
        raise self._damaged(DATA_CRC, data_crc_message(stored, computed, length), length)
    self._advance(length)
    self.last = data
    return data

  def skip(self) -> bool:
    """Passes the next record (its header checked); False at the end."""
    length = self._frame_length()
    if length is None:
      return False
    self._advance(length)
    self.last = None
    return True

  def scan(self, verify_data: bool) -> tuple[np.ndarray, tuple[DamagedRange, ...]]:
    """Offsets of the remaining frames plus the end, and the damage met.

    Each damaged range takes one entry (see `tfrecord_scan.scan_frames`).
    With `verify_data`, every record's data CRC is checked too.
    """
    offsets: list[int] = []
    damage: list[DamagedRange] = []
    while True:
      start = self.offset
      try:
        more = (self.read() is not None) if verify_data else self.skip()
      except CorruptRecordError as e:
        damage.append(DamagedRange.from_error(e))
        offsets.append(start)
        continue
      if not more:
        break
      offsets.append(start)
    offsets.append(max(self.offset, offsets[-1] if offsets else 0))
    return np.asarray(offsets, dtype=np.int64), tuple(damage)
