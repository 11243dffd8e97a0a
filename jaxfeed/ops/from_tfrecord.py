"""`from_tfrecord`: the records of TFRecord files read in order
(tf.data.TFRecordDataset).

Unlike `from_source(TFRecordSource(...))`, no record index is built: each
file is read once, front to back, so compressed files (GZIP, ZLIB), which
have no random access, stream at the speed of decompression.

Damage (a bad CRC, a truncated tail, garbage) raises `CorruptRecordError`
naming the file and byte offset where the read meets it, as tf.data's
DataLossError; the iterator is then past it (see
`jaxfeed.sources.tfrecord_stream`), so with `ignore_errors()` reading goes on
with the next record that verifies, or with the next file where nothing in
this one can be trusted any more.

Files are its positions (see `jaxfeed.ops.index_ranges`): position i is
every record of file i, so the service's DYNAMIC sharding hands out whole
files and FILE sharding gives each worker its own files.
"""

from __future__ import annotations

import os
from typing import Any

from etils import epath

from jaxfeed.ops.base import Node, OpIterator, PipelineStateError, state_int
from jaxfeed.sources.tfrecord_format import compression_wbits
from jaxfeed.sources.tfrecord_stream import RecordStream

_OP = "from_tfrecord"


def _paths(paths: Any) -> list[str]:
  if isinstance(paths, (str, os.PathLike)):
    paths = [paths]
  try:
    paths = [os.fspath(p) for p in paths]
  except TypeError:
    raise TypeError(f"{_OP}: paths must be a path or a sequence of paths, got {paths!r}.") from None
  if not paths:
    raise ValueError(f"{_OP}: paths is empty; give at least one file.")
  return paths


class TFRecordNode(Node):
  """The records (bytes) of `paths`: files in order, records in order.

  Args:
    paths: One file or a sequence of them (local or any epath, e.g. gs://).
    compression_type: None (or "") for plain files, "GZIP" or "ZLIB".
    verify_crc: Check each record's data CRC (headers are always checked).
  """

  op_name = _OP

  def __init__(self, paths: Any, compression_type: str | None = None, verify_crc: bool = True):
    super().__init__()
    self.paths = _paths(paths)
    self.wbits = compression_wbits(compression_type, _OP)
    self.compression_type = compression_type or None
    if not isinstance(verify_crc, bool):
      raise TypeError(f"{_OP}: verify_crc must be a bool, got {verify_crc!r}.")
    self.verify_crc = verify_crc

  def spec_params(self) -> dict:
    return {
      "paths": self.paths,
      "compression_type": self.compression_type,
      "verify_crc": self.verify_crc,
    }

  def cardinality(self) -> int | None:
    return None  # unknown without reading every file

  def make_iterator(self) -> "TFRecordIterator":
    return TFRecordIterator(self)

  # Index addressing (see jaxfeed.ops.index_ranges): position i is file i.
  def index_addressable(self) -> bool:
    return True

  def num_positions(self) -> int:
    return len(self.paths)

  def positions_are_files(self) -> bool:
    return True

  def range_iterator(self, start: int, stop: int) -> "TFRecordIterator":
    return TFRecordIterator(self, start, min(stop, len(self.paths)))

  def __repr__(self) -> str:
    return f"TFRecordNode({len(self.paths)} files, compression_type={self.compression_type!r})"


class TFRecordIterator(OpIterator):
  """Reads file after file; state: the file's index, the uncompressed byte
  offset of the next record in it, and that record's index in the file."""

  op_name = _OP

  def __init__(self, node: TFRecordNode, first: int = 0, stop: int | None = None):
    super().__init__()
    self._node = node
    self._first = first
    self._stop = len(node.paths) if stop is None else stop
    self._file = first
    self._stream: RecordStream | None = None
    # Where the next record is, until the stream is open (after set_state).
    self._offset = 0
    self._position = 0

  def _open(self) -> RecordStream:
    path = self._node.paths[self._file]
    try:
      handle = epath.Path(path).open("rb")
    except FileNotFoundError:
      raise FileNotFoundError(
        f"{_OP}: file {self._file} of {len(self._node.paths)}, {path!r}, does not exist."
      ) from None
    stream = RecordStream(handle, self._node.wbits, path)
    if self._offset or self._position:
      try:
        stream.seek_offset(self._offset, self._position)
      except BaseException:
        stream.close()
        raise
    return stream

  def __next__(self) -> bytes:
    while self._file < self._stop:
      if self._stream is None:
        self._stream = self._open()
      record = self._stream.read(self._node.verify_crc)
      if record is not None:
        return record
      self._stream.close()
      self._stream = None
      self._file += 1
      self._offset = self._position = 0
    raise StopIteration

  def _get_own_state(self) -> dict:
    if self._stream is not None and self._stream.ended:
      # Damage ended this file: a restore goes on with the next one.
      return {"file": self._file + 1, "offset": 0, "record": 0}
    if self._stream is not None:
      self._offset, self._position = (self._stream.offset, self._stream.position)
    return {"file": self._file, "offset": self._offset, "record": self._position}

  def _set_own_state(self, state: dict) -> None:
    files = self._stop
    file = state_int(state, "file", _OP, self._first, files)
    offset = state_int(state, "offset", _OP, 0)
    position = state_int(state, "record", _OP, 0)
    if file == files and (offset or position):
      raise PipelineStateError(
        f"Cannot restore op {_OP!r}: the state is past the last of the "
        f"{files} files, got {state!r}."
      )
    self._close_own()
    self._file, self._offset, self._position = file, offset, position

  def _close_own(self) -> None:
    if self._stream is not None:
      self._stream.close()
      self._stream = None
