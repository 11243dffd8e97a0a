"""The TFRecord file format, without TensorFlow: framing, CRCs, scan, writer.

A TFRecord file is a sequence of frames:

    uint64 length            (little endian)
    uint32 masked_crc32c(length bytes)
    byte   data[length]
    uint32 masked_crc32c(data)

with masked_crc(c) = ((c >> 15) | (c << 17)) + 0xa282ead8 (mod 2**32).
"""

from __future__ import annotations

import struct
from typing import Callable, Iterable

from etils import epath
import google_crc32c
import numpy as np

from jaxfeed.sources.base import CorruptRecordError, as_record_bytes

__all__ = ["masked_crc32c", "scan_record_offsets", "write_tfrecord"]

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


def write_tfrecord(path: epath.PathLike, records: Iterable[bytes]) -> int:
  """Writes `records` (bytes-like) to a TFRecord file; returns the count.

  The file is readable by `tf.data.TFRecordDataset` (uncompressed).
  """
  path = epath.Path(path)
  pack_crc = _CRC.pack
  count = 0
  with path.open("wb") as f:
    write = f.write
    for count, record in enumerate(records, start=1):
      if not isinstance(record, bytes):
        record = as_record_bytes(record, "write_tfrecord", path, count - 1)
      write(encode_frame_header(len(record)))
      write(record)
      write(pack_crc(masked_crc32c(record)))
  return count

