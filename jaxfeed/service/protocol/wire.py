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
import re
import struct
from typing import Any, Iterator

import numpy as np

from jaxfeed.ops import tree

MAGIC = b"JFB1"
_PREFIX = struct.Struct("<4sI")
_ALIGN = 64
COMPRESSIONS = ("", "lz4", "zstd")
# tf.data's "AUTO": the service picks per transport (`resolve_compression`).
COMPRESSION_AUTO = "AUTO"
# A received frame (its payload after decompression) may be at most this big
# unless the reader configures another limit: its length comes from the peer.
DEFAULT_MAX_FRAME_BYTES = 2 << 30
MAX_STRUCTURE_DEPTH = 64
_MAX_NDIM = 64  # numpy's own limit
_MAX_ARRAY_SPAN = 1 << 62
_DTYPE_STR = re.compile(r"[<>|=]?[a-zA-Z][0-9]{0,10}(\[[0-9]{0,3}[a-zA-Z]{1,2}\])?")


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


def _decode_structure(enc: Any, depth: int = 0) -> Any:
  if enc is None:
    return 0
  if depth >= MAX_STRUCTURE_DEPTH:
    raise WireFormatError(
      f"Frame header nests its tree structure deeper than {MAX_STRUCTURE_DEPTH} levels."
    )
  if not isinstance(enc, dict) or len(enc) != 1:
    raise WireFormatError(f"Bad tree structure in frame header: {enc!r:.100}.")
  ((kind, items),) = enc.items()
  if not isinstance(items, list):
    raise WireFormatError(f"Bad tree structure in frame header: {enc!r:.100}.")
  if kind == "d":
    if not all(
      isinstance(item, list) and len(item) == 2 and isinstance(item[0], (str, int))
      for item in items
    ):
      raise WireFormatError(
        f"Bad dict node in frame header: {enc!r:.100} (want [key, node] pairs)."
      )
    return {k: _decode_structure(v, depth + 1) for k, v in items}
  if kind == "t":
    return tuple(_decode_structure(v, depth + 1) for v in items)
  if kind == "l":
    return [_decode_structure(v, depth + 1) for v in items]
  raise WireFormatError(f"Unknown tree node kind {kind!r} in frame header.")


def _leaf_array(leaf: Any, path: str) -> np.ndarray:
  arr = np.asarray(leaf)
  if arr.dtype.hasobject:
    raise TypeError(
      f"Cannot send leaf {path or '<root>'!r} with dtype object over the "
      "service: only fixed-size numpy dtypes (numbers, bool, bytes 'S', "
      "str 'U') travel as raw bytes."
    )
  # np.ascontiguousarray would turn 0-d leaves into 1-d ones.
  return arr if arr.flags.c_contiguous else np.ascontiguousarray(arr)


def _read_only(arr: np.ndarray) -> np.ndarray:
  view = arr.view()
  view.flags.writeable = False
  return view


def _compressor(name: str):
  if name not in COMPRESSIONS:
    raise ValueError(f"Unknown compression {name!r}; allowed: None, 'lz4', 'zstd'.")
  try:
    if name == "lz4":
      import lz4.frame  # pylint: disable=g-import-not-at-top

      return lz4.frame.compress, lz4.frame.decompress
    if name == "zstd":
      import zstandard  # pylint: disable=g-import-not-at-top

      return (zstandard.ZstdCompressor(level=1).compress, zstandard.ZstdDecompressor().decompress)
  except ImportError as e:
    raise ImportError(
      f"compression={name!r} needs the optional package "
      f"{'lz4' if name == 'lz4' else 'zstandard'}; install jaxfeed[compression]."
    ) from e
  return None, None


def check_compression(name: str | None) -> str:
  """Validates a compression option (importing its codec; "AUTO" needs
  none) and returns it."""
  name = name or ""
  if name != COMPRESSION_AUTO:
    _compressor(name)
  return name


def resolve_compression(name: str, transport: str) -> str:
  """The compression a connection uses for option `name`: "AUTO" is lz4
  over gRPC when the lz4 package is installed, none on the data socket (its
  bytes are not worth the CPU on a data-center network, as tf.data decides
  for its own data transfer) and in memory; others are themselves.

  Args:
    name: "", "AUTO", "lz4" or "zstd".
    transport: "grpc", "socket" or "memory".
  """
  if name != COMPRESSION_AUTO:
    return name
  if transport != "grpc":
    return ""
  try:
    _compressor("lz4")
  except ImportError:
    return ""
  return "lz4"


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
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
      raise ValueError(f"A frame's chunk size must be an integer >= 1, got {size!r}.")
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

  def value(self) -> Any:
    """The pytree as `decode` rebuilds it (leaves read-only arrays), without
    encoding it: what an in-process reader takes (no copy of the arrays)."""
    if self._value is None:
      return decode(self.tobytes())
    value = self._value
    structure = _decode_structure(_encode_structure(value))
    return tree.unflatten(
      structure,
      [
        _read_only(_leaf_array(leaf, path))
        for leaf, path in zip(tree.flatten(value), tree.paths(value))
      ],
    )

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
  header = {
    "structure": _encode_structure(value),
    "paths": leaf_paths,
    "leaves": specs,
    "payload_bytes": offset,
    "compression": "",
  }
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
      view[offset : offset + nbytes] = arr.reshape(-1).view(np.uint8)
  body = compress(bytes(raw))
  header_bytes = json.dumps(header, separators=(",", ":")).encode()
  return _PREFIX.pack(MAGIC, len(header_bytes)) + header_bytes + body


def is_int(value: Any) -> bool:
  """Whether a value read from a peer or a file is an integer (a JSON true or
  false is a Python bool, an int too, and is not)."""
  return isinstance(value, int) and not isinstance(value, bool)


def decode_json_object(data: bytes | memoryview, what: str) -> dict:
  """A JSON object received from a peer; `what` names it in the error."""
  try:
    value = json.loads(bytes(data))
  except (ValueError, RecursionError) as e:  # nesting too deep recurses too far
    raise WireFormatError(f"{what} is not valid JSON: {e}") from e
  if not isinstance(value, dict):
    raise WireFormatError(f"{what} is a JSON {type(value).__name__}, not an object.")
  return value


def check_max_frame_bytes(value: Any) -> int:
  """Validates a frame size limit (an int >= 1024) and returns it."""
  if isinstance(value, bool) or not isinstance(value, int) or value < 1024:
    raise ValueError(f"max_frame_bytes must be an integer >= 1024, got {value!r}.")
  return value


def _decompress(name: str, data: memoryview, size: int) -> memoryview:
  """The payload of `data`, decompressed only up to `size` + 1 bytes: the
  codecs' own size fields come from the peer and are not trusted."""
  _compressor(name)  # a missing codec gets its install hint
  if name == "lz4":
    import lz4.frame  # pylint: disable=g-import-not-at-top

    decompressor = lz4.frame.LZ4FrameDecompressor()
    out = decompressor.decompress(data, max_length=size + 1)
    if len(out) <= size and not decompressor.eof:
      raise WireFormatError("lz4 payload is truncated.")
    if decompressor.unused_data:
      raise WireFormatError(f"lz4 payload has {len(decompressor.unused_data)} bytes after its end.")
  else:
    import zstandard  # pylint: disable=g-import-not-at-top

    with zstandard.ZstdDecompressor().stream_reader(data) as reader:
      out = reader.read(size + 1)
  return memoryview(out)


def dtype_from_str(dtype_str: Any) -> np.dtype:
  """The dtype of a `np.dtype(...).str` string received from a peer."""
  # np.dtype would parse much else too, and raise SyntaxError on some of it.
  if not isinstance(dtype_str, str) or not _DTYPE_STR.fullmatch(dtype_str):
    raise WireFormatError(f"{dtype_str!r:.80} is not a dtype string.")
  try:
    return np.dtype(dtype_str)
  except (TypeError, ValueError) as e:
    raise WireFormatError(f"{dtype_str!r} is not a valid dtype: {e}") from e


def _leaf_layout(spec: Any, payload_bytes: int) -> tuple[np.dtype, tuple, int, int]:
  """Checks one leaf description against the payload; returns (dtype, shape,
  count, offset)."""
  if not isinstance(spec, list) or len(spec) != 4:
    raise WireFormatError(
      f"Frame leaf description {spec!r:.100} is not [dtype, shape, offset, nbytes]."
    )
  dtype_str, shape, offset, nbytes = spec
  dtype = dtype_from_str(dtype_str)
  if dtype.hasobject or dtype.subdtype is not None or not dtype.itemsize:
    raise WireFormatError(
      f"Frame leaf has dtype {dtype_str!r}: only fixed-size numpy dtypes "
      "without objects travel as raw bytes."
    )
  if (
    not isinstance(shape, list)
    or len(shape) > _MAX_NDIM
    or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
  ):
    raise WireFormatError(
      f"Frame leaf shape {shape!r:.100} is not a list of at most {_MAX_NDIM} non-negative integers."
    )
  count = span = 1
  for dim in shape:  # Python ints: no overflow, unlike np.prod
    count *= dim
    span *= max(dim, 1)  # numpy refuses even an empty array this big
  if span * dtype.itemsize > _MAX_ARRAY_SPAN:
    raise WireFormatError(f"Frame leaf shape {shape} is too large for an array.")
  if not all(isinstance(v, int) and not isinstance(v, bool) for v in (offset, nbytes)) or (
    count * dtype.itemsize != nbytes or offset < 0 or offset + nbytes > payload_bytes
  ):
    raise WireFormatError(
      f"Frame leaf {dtype_str}{shape} at offset {offset!r} with {nbytes!r} "
      f"bytes does not fit the {payload_bytes}-byte payload."
    )
  return dtype, tuple(shape), count, offset


def decode(frame: bytes | bytearray | memoryview, max_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> Any:
  """Rebuilds the pytree of a frame; leaves are read-only views into it.

  Every field of the header is checked against the frame before any array is
  built, and a compressed payload is never decompressed past what the header
  declares, nor past `max_bytes`: a truncated, garbled or hostile frame raises
  `WireFormatError`.
  """
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
      f"({buf.nbytes} bytes): truncated frame."
    )
  header = decode_json_object(buf[_PREFIX.size : start], "Frame header")
  if not all(key in header for key in ("structure", "leaves", "payload_bytes")):
    raise WireFormatError("Frame header lacks one of 'structure', 'leaves', 'payload_bytes'.")
  structure = _decode_structure(header["structure"])
  specs = header["leaves"]
  payload_bytes = header["payload_bytes"]
  compression = header.get("compression", "")
  if (
    isinstance(payload_bytes, bool)
    or not isinstance(payload_bytes, int)
    or not (0 <= payload_bytes <= max_bytes)
  ):
    raise WireFormatError(
      f"Frame header declares a payload of {payload_bytes!r:.40} bytes; "
      f"allowed are 0 to {max_bytes} (max_frame_bytes)."
    )
  if not isinstance(compression, str) or compression not in COMPRESSIONS:
    raise WireFormatError(
      f"Frame has unknown compression {compression!r:.40}; allowed: {COMPRESSIONS}."
    )
  if not isinstance(specs, list):
    raise WireFormatError(f"Frame header's leaves are a {type(specs).__name__}, not a list.")
  try:
    num_leaves = len(tree.flatten(structure))
  except TypeError as e:  # dict keys of mixed types do not sort
    raise WireFormatError(f"Bad tree structure in frame header: {e}") from e
  if num_leaves != len(specs):
    raise WireFormatError(
      f"Frame header lists {len(specs)} leaves for a structure with {num_leaves}."
    )
  layout = [_leaf_layout(spec, payload_bytes) for spec in specs]
  payload: Any = buf[start:]
  if compression:
    try:
      payload = _decompress(compression, payload, payload_bytes)
    except WireFormatError:
      raise
    except Exception as e:  # codecs raise their own error types
      raise WireFormatError(f"Cannot {compression}-decompress frame payload: {e}") from e
  if payload.nbytes != payload_bytes:
    got = f"{payload.nbytes}" if payload.nbytes < payload_bytes else f"more than {payload_bytes}"
    raise WireFormatError(
      f"Frame payload has {got} bytes, header says {payload_bytes}: truncated or garbled frame."
    )
  leaves = [
    np.frombuffer(payload, dtype=dtype, count=count, offset=offset).reshape(shape)
    for dtype, shape, count, offset in layout
  ]
  return tree.unflatten(structure, leaves)
