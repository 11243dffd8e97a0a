"""`ElementChunk` messages written and read around their data bytes.

A worker streams a frame over gRPC as ElementChunk messages. Going through
protobuf objects would copy each chunk's data twice more on each side (into
the message, into its serialization; out of the parsed message), so the
worker writes the message bytes itself, joining the frame's array views into
them once, and the client reads the fields in place and keeps the data as a
view of the received bytes. Both produce and accept ordinary protobuf
encoding of `service.proto`'s ElementChunk, so either side may also use the
generated class.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from jaxfeed.service.protocol import wire
from jaxfeed.service.protocol.protos import service_pb2 as pb
from jaxfeed.service.protocol.wire import WireFormatError

_DATA_TAG = bytes([(1 << 3) | 2])  # field 1 (data), length-delimited
_INT64_FIELDS = {2: "frame_bytes", 4: "round", 7: "seq", 9: "split_stop"}


def varint(value: int) -> bytes:
  """`value` (>= 0) as a protobuf varint."""
  out = bytearray()
  while True:
    byte = value & 0x7F
    value >>= 7
    if value:
      out.append(byte | 0x80)
    else:
      out.append(byte)
      return bytes(out)


def encode(data_parts: list, frame_bytes: int = 0, round_index: int = 0, seq: int = 0) -> bytes:
  """An ElementChunk carrying the concatenation of `data_parts`."""
  head = pb.ElementChunk(frame_bytes=frame_bytes, round=round_index, seq=seq).SerializeToString()
  size = sum(memoryview(part).nbytes for part in data_parts)
  return b"".join([head, _DATA_TAG, varint(size), *data_parts])


@dataclasses.dataclass
class Chunk:
  data: memoryview
  frame_bytes: int = 0
  end_of_sequence: bool = False
  round: int = 0
  stats_json: str = ""
  split_end: bool = False
  seq: int = 0
  keepalive: bool = False
  split_stop: int = 0

  def end_stats(self) -> dict:
    """The task's round statistics sent with its end of sequence."""
    if not self.stats_json:
      return {}
    return wire.decode_json_object(self.stats_json.encode(), "End-of-sequence statistics")


def _read_varint(buf: memoryview, pos: int) -> tuple[int, int]:
  value = shift = 0
  while True:
    if pos >= buf.nbytes or shift > 63:
      raise WireFormatError("ElementChunk has a truncated or overlong varint.")
    byte = buf[pos]
    pos += 1
    value |= (byte & 0x7F) << shift
    if not byte & 0x80:
      return value, pos
    shift += 7


def parse(raw: bytes) -> Chunk:
  """Reads an ElementChunk; `data` is a view of `raw`, not a copy."""
  buf = memoryview(raw)
  chunk = Chunk(data=buf[0:0])
  pos = 0
  while pos < buf.nbytes:
    key, pos = _read_varint(buf, pos)
    field, wire_type = key >> 3, key & 7
    if wire_type == 0:
      value, pos = _read_varint(buf, pos)
      if field in _INT64_FIELDS:
        setattr(chunk, _INT64_FIELDS[field], value - (1 << 64) if value >> 63 else value)
      elif field == 3:
        chunk.end_of_sequence = bool(value)
      elif field == 6:
        chunk.split_end = bool(value)
      elif field == 8:
        chunk.keepalive = bool(value)
    elif wire_type == 2:
      length, pos = _read_varint(buf, pos)
      if pos + length > buf.nbytes:
        raise WireFormatError(
          f"ElementChunk field {field} of {length} bytes runs past the message "
          f"end ({buf.nbytes} bytes)."
        )
      value = buf[pos : pos + length]
      pos += length
      if field == 1:
        chunk.data = value
      elif field == 5:
        chunk.stats_json = bytes(value).decode("utf-8", errors="replace")
    elif wire_type in (1, 5):  # fixed64 / fixed32 fields of a newer peer
      pos += 8 if wire_type == 1 else 4
    else:
      raise WireFormatError(f"ElementChunk has field {field} of wire type {wire_type}.")
  if pos != buf.nbytes:
    raise WireFormatError("ElementChunk ends inside a field.")
  return chunk


class FrameAssembler:
  """Joins the data of a stream's chunks into frames.

  A frame's first chunk declares the frame's size; it is checked against
  `max_frame_bytes` before the frame's buffer is allocated, and later chunks
  must fill exactly that many bytes.
  """

  def __init__(self, max_frame_bytes: int = wire.DEFAULT_MAX_FRAME_BYTES):
    self._max_frame_bytes = max_frame_bytes
    self._buffer: np.ndarray | None = None
    self._filled = 0
    self._round = 0
    self._seq = 0

  def add(self, chunk: Chunk) -> tuple[Any, int, int] | None:
    """Takes a data chunk; returns (frame, round, seq) once a frame is complete."""
    size = chunk.data.nbytes
    if chunk.frame_bytes:
      if not 0 < chunk.frame_bytes <= self._max_frame_bytes:
        raise WireFormatError(
          f"Stream chunk starts a frame of {chunk.frame_bytes} bytes; allowed "
          f"are 1 to {self._max_frame_bytes} (max_frame_bytes)."
        )
      if self._buffer is not None:
        raise WireFormatError(
          f"Stream chunk starts a frame while {self._buffer.nbytes - self._filled} "
          "bytes of the previous one are missing."
        )
      if chunk.frame_bytes == size:
        return chunk.data, chunk.round, chunk.seq  # a view of the received message
      self._buffer, self._filled, self._round, self._seq = (
        np.empty(chunk.frame_bytes, np.uint8),
        0,
        chunk.round,
        chunk.seq,
      )
    if self._buffer is None:
      raise WireFormatError("Stream chunk arrived without a frame start.")
    if self._filled + size > self._buffer.nbytes:
      raise WireFormatError(f"Stream chunks overrun their {self._buffer.nbytes}-byte frame.")
    self._buffer[self._filled : self._filled + size] = np.frombuffer(chunk.data, np.uint8)
    self._filled += size
    if self._filled < self._buffer.nbytes:
      return None
    frame, self._buffer = self._buffer, None
    return frame, self._round, self._seq

  def check_ended(self) -> None:
    """Raises if the stream ended inside a frame."""
    if self._buffer is not None:
      raise WireFormatError(
        f"Stream ended {self._buffer.nbytes - self._filled} bytes before the end of its last frame."
      )
