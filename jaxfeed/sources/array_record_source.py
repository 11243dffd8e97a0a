"""`ArrayRecordSource` and `write_array_record`: the array_record format.

Damage detection: the array_record reader checks the hash of every block
header, chunk header and chunk, so a flipped byte inside a record chunk, the
record index or the footer is reported (as `CorruptRecordError`, with the
byte offset the reader names). A truncated or garbage file fails when the
footer is read, at construction. What it cannot catch: bytes that no read
touches (the file signature chunk at the start and block padding) and damage
that keeps every hash valid.
"""

from __future__ import annotations

from concurrent import futures
import functools
import os
import re
from typing import Any, Iterable

from array_record.python import array_record_module
from etils import epath
import numpy as np

from jaxfeed.sources.base import (
  CorruptRecordError,
  HandleSource,
  LazyHandle,
  as_path_list,
  as_record_bytes,
  check_files_exist,
  file_of,
  files_fingerprint_params,
  split_by_file,
)

__all__ = ["ArrayRecordSource", "write_array_record"]

# Random access: no readahead (it would read data that is never used).
DEFAULT_READER_OPTIONS = "readahead_buffer_size:0"
_FILE_READER_BUFFER_BYTES = 32768
_MAX_COUNTING_THREADS = 16
_OFFSET_PATTERNS = (
  re.compile(r"chunk at (\d+)"),
  re.compile(r"block at (\d+)"),
  re.compile(r"at byte (\d+)"),
)


class ArrayRecordSource(HandleSource):
  """Records (bytes) of one or more array_record files, concatenated in order.

  Args:
    paths: One path or a sequence of paths (str or os.PathLike).
    reader_options: Options string of `ArrayRecordReader`; the default is
      tuned for random access.

  Raises:
    FileNotFoundError: a file does not exist.
    CorruptRecordError: a file is truncated or its footer / index is damaged;
      damaged record chunks are reported on read.
  """

  def __init__(self, paths: Any, reader_options: str = DEFAULT_READER_OPTIONS):
    if not isinstance(reader_options, str):
      raise TypeError(
        "ArrayRecordSource: reader_options must be a string like "
        f"'readahead_buffer_size:0', got {reader_options!r}."
      )
    path_list = as_path_list(paths, "ArrayRecordSource")
    check_files_exist(path_list, "ArrayRecordSource")
    self._names = [os.fspath(p) for p in path_list]
    self._reader_options = reader_options
    num_threads = min(len(self._names), _MAX_COUNTING_THREADS)
    if num_threads > 1:
      with futures.ThreadPoolExecutor(num_threads) as pool:
        counts = list(pool.map(self._count_records, self._names))
    else:
      counts = [self._count_records(self._names[0])]
    self._file_starts = np.zeros(len(counts) + 1, np.int64)
    np.cumsum(counts, out=self._file_starts[1:])
    self._readers = [
      LazyHandle(functools.partial(_open_reader, name, reader_options), _close_reader)
      for name in self._names
    ]
    self._track_handles()

  def _count_records(self, name: str) -> int:
    reader = _open_reader(name, self._reader_options)
    try:
      return reader.num_records()
    finally:
      reader.close()

  def __len__(self) -> int:
    return int(self._file_starts[-1])

  def _read(self, index: int) -> bytes:
    f = file_of(index, self._file_starts)
    position = index - int(self._file_starts[f])
    reader = self._readers[f].get()
    try:
      return reader.read([position])[0]
    except RuntimeError as e:
      raise _corrupt(self._names[f], e, position) from e

  def _read_many(self, indices: np.ndarray) -> list:
    out = [None] * len(indices)
    for f, positions, slots in split_by_file(indices, self._file_starts):
      reader = self._readers[f].get()
      positions = positions.tolist()
      try:
        records = reader.read(positions)
      except RuntimeError as e:
        # The batched read does not say which record failed; find it.
        for position in positions:
          try:
            reader.read([position])
          except RuntimeError as single_error:
            raise _corrupt(self._names[f], single_error, position) from single_error
        raise _corrupt(self._names[f], e, None) from e
      for slot, record in zip(slots.tolist(), records):
        out[slot] = record
    return out

  @property
  def paths(self) -> list[str]:
    return list(self._names)

  def spec_params(self) -> dict:
    return {"paths": self.paths, "reader_options": self._reader_options}

  def fingerprint_params(self) -> dict:
    return files_fingerprint_params(self.paths)

  def _handles(self) -> list[LazyHandle]:
    return self._readers


def _open_reader(name: str, options: str):
  """An open ArrayRecordReader, or CorruptRecordError if it cannot read."""
  if not os.path.exists(name) and "://" not in name:
    raise FileNotFoundError(f"ArrayRecordSource: file {name} does not exist.")
  reader = array_record_module.ArrayRecordReader(
    name, options, file_reader_buffer_size=_FILE_READER_BUFFER_BYTES
  )
  if reader.ok():
    return reader
  # The reader keeps its failure status; a read reports it.
  try:
    reader.read()
    reason = "the reader failed to open it"
  except RuntimeError as e:
    reason = str(e) or "the footer could not be read"
  _close_reader(reader)
  offset = _offset_in(reason)
  if offset is None and "://" not in name:
    # The footer and the record index sit at the end of the file: without
    # them no record can be found (array_record has no recovery scan).
    reason += f" (the file has {os.path.getsize(name)} bytes)"
  raise CorruptRecordError(
    name,
    offset,
    f"not a readable array_record file (truncated, damaged footer, or another format): {reason}",
  )


def _close_reader(reader) -> None:
  try:
    reader.close()
  except RuntimeError:
    pass  # close() repeats a failure already raised by open or read


def _offset_in(message: str) -> int | None:
  for pattern in _OFFSET_PATTERNS:
    match = pattern.search(message)
    if match:
      return int(match.group(1))
  return None


def _corrupt(name: str, error: RuntimeError, position: int | None) -> CorruptRecordError:
  return CorruptRecordError(name, _offset_in(str(error)), f"damaged record data: {error}", position)


def write_array_record(
  path: epath.PathLike, records: Iterable[bytes], options: str = "group_size:1"
) -> int:
  """Writes `records` (bytes-like) to an array_record file; returns the count.

  `group_size:1` (one record per chunk) gives the fastest random access.
  """
  name = os.fspath(path)
  parent = epath.Path(path).parent
  if not parent.exists():
    raise FileNotFoundError(f"write_array_record: directory {parent} does not exist.")
  try:
    writer = array_record_module.ArrayRecordWriter(name, options)
  except ValueError as e:
    raise ValueError(f"write_array_record({name}): bad options {options!r}: {e}") from None
  if not writer.ok():
    try:
      writer.close()
      reason = "unknown error"
    except RuntimeError as e:
      reason = str(e)
    raise OSError(f"write_array_record: cannot write {name}: {reason}")
  count = 0
  try:
    for count, record in enumerate(records, start=1):
      writer.write(as_record_bytes(record, "write_array_record", name, count - 1))
  finally:
    writer.close()
  return count
