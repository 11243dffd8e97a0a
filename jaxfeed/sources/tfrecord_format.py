"""The TFRecord file format, without TensorFlow: framing, CRCs, scan, writer.

A TFRecord file is a sequence of frames:

    uint64 length            (little endian)
    uint32 masked_crc32c(length bytes)
    byte   data[length]
    uint32 masked_crc32c(data)

with masked_crc(c) = ((c >> 15) | (c << 17)) + 0xa282ead8 (mod 2**32).

A compressed file ("GZIP" or "ZLIB", as `tf.io.TFRecordOptions` names them)
is that sequence of frames in one gzip or zlib (deflate) stream. A deflate
stream can only be read from its start, so compressed files are read in
order: `RecordStream`.
"""

from __future__ import annotations

import struct
import zlib
from typing import Any, BinaryIO, Callable, Iterable

from etils import epath
import google_crc32c
import numpy as np

from jaxfeed.sources.base import CorruptRecordError, as_record_bytes

__all__ = ["masked_crc32c", "scan_record_offsets", "write_tfrecord",
           "RecordStream", "compression_wbits"]

HEADER_BYTES = 12  # uint64 length + uint32 length crc
FOOTER_BYTES = 4  # uint32 data crc
FRAME_OVERHEAD = HEADER_BYTES + FOOTER_BYTES

_MASK_DELTA = 0xA282EAD8
_MASK32 = 0xFFFFFFFF
_HEADER = struct.Struct("<QI")
_LENGTH = struct.Struct("<Q")
_CRC = struct.Struct("<I")

# Scan reads in chunks this big while records are small; for large records
# it reads only the 12 header bytes of each, skipping the data.
_SCAN_CHUNK_BYTES = 1 << 20
_LARGE_RECORD_BYTES = 1 << 16

# zlib window bits of each compression type: 16 + 15 asks zlib for a gzip
# header and trailer, 15 for a zlib one (what TensorFlow's writer uses).
_WBITS = {None: None, "": None, "GZIP": 16 + zlib.MAX_WBITS,
          "ZLIB": zlib.MAX_WBITS}
# zlib's memory level in TensorFlow's writer (zlib's own default is 8): with
# the same level the compressed bytes are identical to TensorFlow's.
_MEM_LEVEL = 9
# Compressed bytes read per call while streaming.
_STREAM_CHUNK_BYTES = 1 << 20


def compression_wbits(compression_type: Any, where: str) -> int | None:
  """zlib window bits of `compression_type`, or None for no compression.

  Raises:
    ValueError: not one of None, "", "GZIP", "ZLIB".
  """
  try:
    return _WBITS[compression_type]
  except (KeyError, TypeError):
    raise ValueError(
        f'{where}: compression_type must be None, "", "GZIP" or "ZLIB", '
        f"got {compression_type!r}.") from None


def masked_crc32c(data: bytes) -> int:
  """The masked CRC-32C that TFRecord stores for `data`."""
  crc = google_crc32c.value(data)
  return (((crc >> 15) | (crc << 17)) + _MASK_DELTA) & _MASK32


def scan_record_offsets(pread: Callable[[int, int], bytes], file_size: int,
                        path: str) -> np.ndarray:
  """Finds the start of every frame of a TFRecord file, checking headers.

  Args:
    pread: `pread(size, offset)` returns up to `size` bytes at `offset`
      (the argument order of `os.pread` after its file descriptor).
    file_size: Size of the file in bytes.
    path: The file, for error messages.

  Returns:
    int64 array of num_records + 1 frame offsets; the last one is the file
    size. Record i's data is bytes [offsets[i] + 12, offsets[i + 1] - 4).

  Raises:
    CorruptRecordError: a length CRC does not match, or the file ends inside
      a frame (truncated file).
  """
  offsets = []
  append = offsets.append
  unpack_header = _HEADER.unpack_from
  chunk, chunk_start, chunk_end = b"", 0, 0
  read_size = _SCAN_CHUNK_BYTES
  pos = 0
  record = 0
  while pos < file_size:
    if pos + HEADER_BYTES > chunk_end:
      if pos + HEADER_BYTES > file_size:
        raise CorruptRecordError(
            path, pos,
            f"truncated file: {file_size - pos} bytes left where a "
            f"{HEADER_BYTES}-byte record header starts (file size "
            f"{file_size})", record)
      chunk = pread(max(HEADER_BYTES, min(read_size, file_size - pos)), pos)
      chunk_start, chunk_end = pos, pos + len(chunk)
      if chunk_end < pos + HEADER_BYTES:
        raise CorruptRecordError(
            path, pos, "the file ended while reading a record header "
            "(it is shorter than its reported size)", record)
    at = pos - chunk_start
    length, length_crc = unpack_header(chunk, at)
    computed = masked_crc32c(chunk[at:at + 8])
    if computed != length_crc:
      raise CorruptRecordError(
          path, pos,
          f"length CRC mismatch in the record header (stored "
          f"0x{length_crc:08x}, computed 0x{computed:08x}); the header or "
          "the file is damaged, or this is not a TFRecord file", record)
    end = pos + FRAME_OVERHEAD + length
    if end > file_size:
      raise CorruptRecordError(
          path, pos,
          f"truncated file: the record header says {length} data bytes, so "
          f"the record ends at byte {end}, but the file has {file_size} "
          "bytes", record)
    append(pos)
    read_size = HEADER_BYTES if length >= _LARGE_RECORD_BYTES else (
        _SCAN_CHUNK_BYTES)
    pos = end
    record += 1
  append(file_size)
  return np.asarray(offsets, dtype=np.int64)


def encode_frame_header(length: int) -> bytes:
  header = _LENGTH.pack(length)
  return header + _CRC.pack(masked_crc32c(header))


def write_tfrecord(path: epath.PathLike, records: Iterable[bytes],
                   compression_type: str | None = None) -> int:
  """Writes `records` (bytes-like) to a TFRecord file; returns the count.

  The file is readable by `tf.data.TFRecordDataset(path, compression_type)`.

  Args:
    path: The file (anything `etils.epath` opens).
    records: Bytes-like records.
    compression_type: None (or "") for a plain file, "GZIP" or "ZLIB" to
      compress it as TensorFlow does. Compressed files are read in order only.
  """
  path = epath.Path(path)
  wbits = compression_wbits(compression_type, f"write_tfrecord({path})")
  pack_crc = _CRC.pack
  count = 0
  with path.open("wb") as f:
    if wbits is None:
      write = f.write
    else:
      deflate = zlib.compressobj(zlib.Z_DEFAULT_COMPRESSION, zlib.DEFLATED,
                                 wbits, _MEM_LEVEL)
      write = lambda data: f.write(deflate.compress(data))
    for count, record in enumerate(records, start=1):
      if not isinstance(record, bytes):
        record = as_record_bytes(record, "write_tfrecord", path, count - 1)
      write(encode_frame_header(len(record)))
      write(record)
      write(pack_crc(masked_crc32c(record)))
    if wbits is not None:
      f.write(deflate.flush())
  return count


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

  Offsets in errors count bytes of the uncompressed stream.
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

  def close(self) -> None:
    self._stream.close()

  def rewind(self) -> None:
    """Starts again at the first record."""
    self._stream.seek(0)
    self._inflate = _inflater(self._wbits)
    self._buffer = bytearray()
    self._start = self.offset = self.position = 0
    self.last = None

  def seek_offset(self, offset: int, position: int) -> None:
    """Continues at the frame at uncompressed `offset`, record `position`.

    A plain file seeks there; a compressed one has no random access, so it is
    read again from its start up to there.

    Raises:
      CorruptRecordError: no frame starts at `offset` (the file changed).
    """
    if self._wbits is None:
      self._stream.seek(offset)
      self._buffer = bytearray()
      self._start, self.offset, self.position = 0, offset, position
      self.last = None
      return
    if offset < self.offset:
      self.rewind()
    while self.offset < offset and self.skip():
      pass
    if self.offset != offset:
      raise CorruptRecordError(
          self._path, self.offset,
          f"no record starts at uncompressed offset {offset} (the file ended "
          "or changed since that position was saved)", self.position)
    self.position = position

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
          raise CorruptRecordError(
              self._path, self.offset,
              "the compressed stream ends without its end marker (the file "
              "was truncated)", self.position)
        return False
      try:
        data = self._inflate.decompress(compressed, _STREAM_CHUNK_BYTES)
      except zlib.error as e:
        raise CorruptRecordError(
            self._path, self.offset,
            f"the compressed stream cannot be decompressed ({e}); the file is "
            "damaged or its compression_type is not the one it was written "
            "with", self.position) from None
      if self._start:
        del self._buffer[:self._start]  # drop what has been read
        self._start = 0
      self._buffer += data
    return True

  def _frame_length(self) -> int | None:
    """The data length of the next frame; None at the end of the stream."""
    if not self._fill(HEADER_BYTES):
      if len(self._buffer) == self._start:
        return None
      raise self._truncated(HEADER_BYTES)
    length, length_crc = _HEADER.unpack_from(self._buffer, self._start)
    computed = masked_crc32c(bytes(self._buffer[self._start:self._start + 8]))
    if computed != length_crc:
      raise CorruptRecordError(
          self._path, self.offset,
          f"length CRC mismatch in the record header (stored "
          f"0x{length_crc:08x}, computed 0x{computed:08x}); the file is "
          "damaged or is not a TFRecord file", self.position)
    if not self._fill(FRAME_OVERHEAD + length):
      raise self._truncated(FRAME_OVERHEAD + length)
    return length

  def _truncated(self, size: int) -> CorruptRecordError:
    return CorruptRecordError(
        self._path, self.offset,
        f"truncated file: the uncompressed stream ends {size} bytes into a "
        "frame", self.position)

  def _advance(self, length: int) -> None:
    self._start += FRAME_OVERHEAD + length
    self.offset += FRAME_OVERHEAD + length
    self.position += 1

  def read(self, verify_crc: bool = True) -> bytes | None:
    """The next record, or None after the last one."""
    length = self._frame_length()
    if length is None:
      return None
    start = self._start + HEADER_BYTES
    data = bytes(self._buffer[start:start + length])
    if verify_crc:
      stored = _CRC.unpack_from(self._buffer, start + length)[0]
      computed = masked_crc32c(data)
      if stored != computed:
        raise CorruptRecordError(
            self._path, self.offset,
            f"data CRC mismatch (stored 0x{stored:08x}, computed "
            f"0x{computed:08x}) for the {length}-byte record", self.position)
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

  def scan_offsets(self) -> np.ndarray:
    """Uncompressed frame offsets of the remaining records, plus the end."""
    offsets = [self.offset]
    while self.skip():
      offsets.append(self.offset)
    return np.asarray(offsets, dtype=np.int64)

