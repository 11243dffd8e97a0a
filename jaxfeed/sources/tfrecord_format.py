"""The TFRecord file format, without TensorFlow: framing, CRCs, writer.

A TFRecord file is a sequence of frames:

    uint64 length            (little endian)
    uint32 masked_crc32c(length bytes)
    byte   data[length]
    uint32 masked_crc32c(data)

with masked_crc(c) = ((c >> 15) | (c << 17)) + 0xa282ead8 (mod 2**32).

A compressed file ("GZIP" or "ZLIB", as `tf.io.TFRecordOptions` names them)
is that sequence of frames in one gzip or zlib (deflate) stream. A deflate
stream can only be read from its start, so compressed files are read in
order (`jaxfeed.sources.tfrecord_stream`). Plain files are indexed, damage
included, by `jaxfeed.sources.tfrecord_scan`.
"""

from __future__ import annotations

import struct
import zlib
from typing import Any, Iterable

from etils import epath
import google_crc32c

from jaxfeed.sources.base import as_record_bytes

__all__ = ["masked_crc32c", "write_tfrecord", "compression_wbits"]

HEADER_BYTES = 12  # uint64 length + uint32 length crc
FOOTER_BYTES = 4  # uint32 data crc
FRAME_OVERHEAD = HEADER_BYTES + FOOTER_BYTES

MASK_DELTA = 0xA282EAD8
_MASK32 = 0xFFFFFFFF
HEADER = struct.Struct("<QI")
LENGTH = struct.Struct("<Q")
CRC = struct.Struct("<I")

# What is wrong with a damaged frame (`CorruptRecordError.kind`).
LENGTH_CRC = "length_crc"  # the header's length CRC fails
DATA_CRC = "data_crc"  # the data CRC fails
TRUNCATED = "truncated"  # the file ends inside a frame's header
BEYOND_END = "beyond_end"  # a header's length runs past the end of the file
DECOMPRESS = "decompress"  # a compressed stream cannot be decompressed
COMPRESSION = "compression"  # the file has another compression type

# zlib window bits of each compression type: 16 + 15 asks zlib for a gzip
# header and trailer, 15 for a zlib one (what TensorFlow's writer uses).
_WBITS = {None: None, "": None, "GZIP": 16 + zlib.MAX_WBITS, "ZLIB": zlib.MAX_WBITS}
# zlib's memory level in TensorFlow's writer (zlib's own default is 8): with
# the same level the compressed bytes are identical to TensorFlow's.
_MEM_LEVEL = 9


def compression_wbits(compression_type: Any, where: str) -> int | None:
  """Zlib window bits of `compression_type`, or None for no compression.

  Raises:
    ValueError: not one of None, "", "GZIP", "ZLIB".
  """
  try:
    return _WBITS[compression_type]
  except (KeyError, TypeError):
    raise ValueError(
      f'{where}: compression_type must be None, "", "GZIP" or "ZLIB", got {compression_type!r}.'
    ) from None


def mask_crc(crc: int) -> int:
  """TFRecord's mask of an (unmasked) CRC-32C value."""
  return (((crc >> 15) | (crc << 17)) + MASK_DELTA) & _MASK32


def masked_crc32c(data: bytes) -> int:
  """The masked CRC-32C that TFRecord stores for `data`."""
  crc = google_crc32c.value(data)  # masked inline: this runs per record
  return (((crc >> 15) | (crc << 17)) + MASK_DELTA) & _MASK32


def length_crc_message(stored: int, computed: int) -> str:
  return (
    f"length CRC mismatch in the record header (stored 0x{stored:08x}, "
    f"computed 0x{computed:08x}); the header or the file is damaged, or "
    "this is not a TFRecord file"
  )


def data_crc_message(stored: int, computed: int, length: int) -> str:
  return (
    f"data CRC mismatch (stored 0x{stored:08x}, computed "
    f"0x{computed:08x}) for the {length}-byte record"
  )


def is_frame_header(data: bytes) -> bool:
  """Whether `data` starts with a TFRecord header whose length CRC holds."""
  if len(data) < HEADER_BYTES:
    return False
  return masked_crc32c(data[:8]) == CRC.unpack_from(data, 8)[0]


def identify_compression(head: bytes) -> str | None:
  """The compression of a TFRecord file that starts with `head`: "" (plain),
  "GZIP" or "ZLIB" where its first record header verifies that way, else
  None (not a TFRecord file, or its start is damaged)."""
  if is_frame_header(head):
    return ""
  for name in ("GZIP", "ZLIB"):
    try:
      start = zlib.decompressobj(_WBITS[name]).decompress(head, HEADER_BYTES)
    except zlib.error:
      continue
    if is_frame_header(start):
      return name
  return None


def compression_mismatch(head: bytes, compression_type: str | None) -> str | None:
  """Why a file that starts with `head` cannot be read with
  `compression_type`, where its start shows that it has another one (its
  start would read as damage, and a resync might find records in it, e.g.
  in the stored blocks of a gzip stream); else None."""
  found = identify_compression(head)
  expected = compression_type or ""
  if found is None or found == expected:
    return None
  what = f"{found}-compressed" if found else "not compressed"
  hint = f'compression_type="{found}"' if found else "no compression_type"
  return (
    f"this TFRecord file is {what}, but it is read as {expected or 'uncompressed'}; pass {hint}"
  )


# Bytes of a file's start that `compression_mismatch` needs at most.
FORMAT_PROBE_BYTES = 1 << 16


def encode_frame_header(length: int) -> bytes:
  header = LENGTH.pack(length)
  return header + CRC.pack(masked_crc32c(header))


def write_tfrecord(
  path: epath.PathLike, records: Iterable[bytes], compression_type: str | None = None
) -> int:
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
  pack_crc = CRC.pack
  count = 0
  with path.open("wb") as f:
    if wbits is None:
      write = f.write
    else:
      deflate = zlib.compressobj(zlib.Z_DEFAULT_COMPRESSION, zlib.DEFLATED, wbits, _MEM_LEVEL)

      def write(data: bytes) -> Any:
        return f.write(deflate.compress(data))

    for count, record in enumerate(records, start=1):
      if not isinstance(record, bytes):
        record = as_record_bytes(record, "write_tfrecord", path, count - 1)
      write(encode_frame_header(len(record)))
      write(record)
      write(pack_crc(masked_crc32c(record)))
    if wbits is not None:
      f.write(deflate.flush())
  return count
