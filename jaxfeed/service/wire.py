"""The data-plane frame: a small header plus raw array bytes.

A frame carries one pytree of numpy arrays (usually a batch):

  b"JFB1" | uint32 header length | header (JSON) | payload

The header names the tree structure, every leaf's path, dtype, shape and byte
offset in the payload, and the payload's compression. Readers rebuild leaves
with `np.frombuffer` (zero-copy views of the received bytes). Nothing on this
path is pickled, and a frame is validated before any array is built, so a
malformed frame raises `WireFormatError` instead of reading out of bounds.
"""

from __future__ import annotations

import json
import struct
from typing import Any, Iterator

import numpy as np

from jaxfeed.ops import tree

MAGIC = b"JFB1"
_PREFIX = struct.Struct("<4sI")
_ALIGN = 64
COMPRESSIONS = ("", "lz4", "zstd")


class WireFormatError(ValueError):
  """A frame is truncated, garbled or describes impossible arrays."""


def _encode_structure(value: Any) -> Any:
  if isinstance(value, dict):
    return {"d": [[k, _encode_structure(v)] for k, v in value.items()]}
  if isinstance(value, tuple):
    return {"t": [_encode_structure(v) for v in value]}
  if isinstance(value, list):
    return {"l": [_encode_structure(v) for v in value]}
  return None


def _decode_structure(enc: Any) -> Any:
  if enc is None:
    return 0
  if not isinstance(enc, dict) or len(enc) != 1:
    raise WireFormatError(f"Bad tree structure in frame header: {enc!r:.100}.")
  (kind, items), = enc.items()
  if not isinstance(items, list):
    raise WireFormatError(f"Bad tree structure in frame header: {enc!r:.100}.")
  if kind == "d":
    return {k: _decode_structure(v) for k, v in items}
  if kind == "t":
    return tuple(_decode_structure(v) for v in items)
  if kind == "l":
    return [_decode_structure(v) for v in items]
  raise WireFormatError(f"Unknown tree node kind {kind!r} in frame header.")


def _leaf_array(leaf: Any, path: str) -> np.ndarray:
  arr = np.asarray(leaf)
  if arr.dtype.hasobject:
    raise TypeError(
        f"Cannot send leaf {path or '<root>'!r} with dtype object over the "
        "service: only fixed-size numpy dtypes (numbers, bool, bytes 'S', "
        "str 'U') travel as raw bytes.")
  # np.ascontiguousarray would turn 0-d leaves into 1-d ones.
  return arr if arr.flags.c_contiguous else np.ascontiguousarray(arr)


def _compressor(name: str):
  if name not in COMPRESSIONS:
    raise ValueError(
        f"Unknown compression {name!r}; allowed: None, 'lz4', 'zstd'.")
  try:
    if name == "lz4":
      import lz4.frame  # pylint: disable=g-import-not-at-top
      return lz4.frame.compress, lz4.frame.decompress
    if name == "zstd":
      import zstandard  # pylint: disable=g-import-not-at-top
      return (zstandard.ZstdCompressor(level=1).compress,
              zstandard.ZstdDecompressor().decompress)
  except ImportError as e:
    raise ImportError(
        f"compression={name!r} needs the optional package "
        f"{'lz4' if name == 'lz4' else 'zstandard'}; install jaxfeed[compression]."
    ) from e
  return None, None


def check_compression(name: str | None) -> str:
  """Validates a compression option (importing its codec) and returns it."""
  name = name or ""
  _compressor(name)
  return name


class Frame:
  """An uncompressed frame kept as its parts, so a socket can send it without
  first copying every leaf into one buffer.

  The parts are the prefix and header (padded so the payload starts
  64-byte aligned), then each leaf's bytes (views of the arrays) and the
  padding between them. A Frame holds the arrays it was made from; they must
  not change while it is alive, as for any element a pipeline has produced.
  """

  __slots__ = ("_value", "parts", "nbytes")

  def __init__(self, value: Any, parts: list, nbytes: int):
    self._value = value
    self.parts = parts
    self.nbytes = nbytes

  def tobytes(self) -> bytes:
    return b"".join(self.parts)

  def chunks(self, size: int) -> Iterator[list[memoryview]]:
    """The frame's bytes in pieces of `size` (the last may be shorter), each
    piece a list of views of the parts."""
    pending, filled = [], 0
    for part in self.parts:
      view = memoryview(part)
      while view.nbytes:
        take = min(size - filled, view.nbytes)
        pending.append(view[:take])
        filled += take
        view = view[take:]
        if filled == size:
          yield pending
          pending, filled = [], 0
    if pending:
      yield pending

  def encoded(self, compression: str | None) -> "Frame":
    """The frame with `compression` applied (itself when there is none)."""
    if not compression:
      return self
    data = encode(self._value, compression)
    return Frame(None, [data], len(data))


def _layout(value: Any) -> tuple[list[np.ndarray], dict]:
  leaves = tree.flatten(value)
  leaf_paths = tree.paths(value)
  arrays = [_leaf_array(x, p) for x, p in zip(leaves, leaf_paths)]
  specs, offset = [], 0
  for arr in arrays:
    offset = -(-offset // _ALIGN) * _ALIGN
    specs.append([arr.dtype.str, list(arr.shape), offset, arr.nbytes])
    offset += arr.nbytes
  header = {"structure": _encode_structure(value), "paths": leaf_paths,
            "leaves": specs, "payload_bytes": offset, "compression": ""}
  return arrays, header


def encode_frame(value: Any) -> Frame:
  """Encodes a pytree of arrays into an uncompressed `Frame` (no copy of the
  array bytes)."""
  arrays, header = _layout(value)
  header_bytes = json.dumps(header, separators=(",", ":")).encode()
  start = _PREFIX.size + len(header_bytes)
  start_aligned = -(-start // _ALIGN) * _ALIGN
  # Pad the header with spaces (valid JSON) so the payload starts aligned.
  header_bytes += b" " * (start_aligned - start)
  parts = [_PREFIX.pack(MAGIC, len(header_bytes)) + header_bytes]
  end = 0
  for arr, (_, _, offset, nbytes) in zip(arrays, header["leaves"]):
    if not nbytes:
      continue
    if offset > end:
      parts.append(bytes(offset - end))
    parts.append(memoryview(arr.reshape(-1).view(np.uint8)))
    end = offset + nbytes
  if header["payload_bytes"] > end:
    parts.append(bytes(header["payload_bytes"] - end))
  return Frame(value, parts, start_aligned + header["payload_bytes"])


def encode(value: Any, compression: str | None = None) -> bytes:
  """Encodes a pytree of arrays into one frame."""
  if not compression:
    return encode_frame(value).tobytes()
  compress, _ = _compressor(compression)
  arrays, header = _layout(value)
  header["compression"] = compression
  raw = bytearray(header["payload_bytes"])
  view = np.frombuffer(raw, dtype=np.uint8)
  for arr, (_, _, offset, nbytes) in zip(arrays, header["leaves"]):
    if nbytes:
      view[offset:offset + nbytes] = arr.reshape(-1).view(np.uint8)
  body = compress(bytes(raw))
  header_bytes = json.dumps(header, separators=(",", ":")).encode()
  return _PREFIX.pack(MAGIC, len(header_bytes)) + header_bytes + body


def decode(frame: bytes | bytearray | memoryview) -> Any:
  """Rebuilds the pytree of a frame; leaves are read-only views into it."""
  buf = memoryview(frame)
  if buf.nbytes < _PREFIX.size:
    raise WireFormatError(f"Frame of {buf.nbytes} bytes is shorter than its prefix.")
  magic, header_len = _PREFIX.unpack_from(buf, 0)
  if magic != MAGIC:
    raise WireFormatError(f"Frame starts with {bytes(magic)!r}, expected {MAGIC!r}.")
  start = _PREFIX.size + header_len
  if start > buf.nbytes:
    raise WireFormatError(
        f"Frame header of {header_len} bytes runs past the frame end "
        f"({buf.nbytes} bytes): truncated frame.")
  try:
    header = json.loads(bytes(buf[_PREFIX.size:start]))
    structure = _decode_structure(header["structure"])
    specs = header["leaves"]
    payload_bytes = int(header["payload_bytes"])
    compression = header.get("compression", "")
  except (ValueError, KeyError, TypeError) as e:
    raise WireFormatError(f"Frame header is not valid: {e}") from e
  payload: Any = buf[start:]
  if compression:
    _, decompress = _compressor(compression)
    try:
      payload = memoryview(decompress(bytes(payload)))
    except Exception as e:  # codecs raise their own error types
      raise WireFormatError(f"Cannot {compression}-decompress frame payload: {e}") from e
  if payload.nbytes != payload_bytes:
    raise WireFormatError(
        f"Frame payload has {payload.nbytes} bytes, header says "
        f"{payload_bytes}: truncated or garbled frame.")
  leaves = []
  try:
    for dtype_str, shape, offset, nbytes in specs:
      dtype = np.dtype(dtype_str)
      if dtype.hasobject:
        raise WireFormatError(f"Frame leaf has forbidden dtype {dtype_str!r}.")
      count = int(np.prod(shape, dtype=np.int64)) if shape else 1
      if (count < 0 or count * dtype.itemsize != nbytes or offset < 0
          or offset + nbytes > payload_bytes):
        raise WireFormatError(
            f"Frame leaf {dtype_str}{shape} at offset {offset} with {nbytes} "
            f"bytes does not fit the {payload_bytes}-byte payload.")
      leaves.append(np.frombuffer(payload, dtype=dtype, count=count,
                                  offset=offset).reshape(tuple(shape)))
  except (TypeError, ValueError) as e:
    if isinstance(e, WireFormatError):
      raise
    raise WireFormatError(f"Frame leaf description is not valid: {e}") from e
  num_leaves = len(tree.flatten(structure))
  if num_leaves != len(leaves):
    raise WireFormatError(
        f"Frame header lists {len(leaves)} leaves for a structure with {num_leaves}.")
  return tree.unflatten(structure, leaves)
