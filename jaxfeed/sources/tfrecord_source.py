"""`TFRecordSource`: random access to TFRecord files without TensorFlow.

Random access needs the byte offset of every record. It is found once per
file by scanning the record headers and cached beside the file as
`<file>.idx`, an .npy int64 array:

    [MAGIC, VERSION, file_size, mtime_ns, num_records, offset_0, ...,
     offset_{num_records - 1}, file_size]

The cache is used only while the file's size and mtime match; otherwise it is
rebuilt. Where the directory is not writable the index stays in memory.

Compressed files (`compression_type="GZIP"` or `"ZLIB"`) have no random
access: a deflate stream is read from its start. Their index (the record
count and the offsets in the uncompressed stream) costs one pass that
decompresses each whole file, cached the same way. Records are then served
in order: a read at or after the current position decompresses forward to it,
a read of a file's first record starts that file again (a new epoch), and any
other backward read raises `SequentialReadError`. So read them with an
unshuffled sampler; for shuffled access write the file uncompressed.
"""

from __future__ import annotations

import functools
import os
import struct
import threading
import uuid
from typing import Any, Callable

from etils import epath
import numpy as np

from jaxfeed.sources.base import (CorruptRecordError, HandleSource, LazyHandle,
                                  as_path_list, check_files_exist, file_of,
                                  file_stamp, files_fingerprint_params, is_local,
                                  split_by_file)
from jaxfeed.sources.tfrecord_format import (FOOTER_BYTES, FRAME_OVERHEAD,
                                             HEADER_BYTES, RecordStream,
                                             compression_wbits, masked_crc32c,
                                             scan_record_offsets)

__all__ = ["TFRecordSource", "SequentialReadError"]

INDEX_SUFFIX = ".idx"
_INDEX_MAGIC = int.from_bytes(b"JFTFRIDX", "little")
_INDEX_VERSION = 1
_COMPRESSED_INDEX_VERSION = 2  # offsets in the uncompressed stream
_INDEX_HEADER = 5  # magic, version, file_size, mtime_ns, num_records

# get_many merges reads of adjacent small records into one read of at most
# this many bytes (one syscall instead of many for sequential access).
_MAX_SPAN_BYTES = 1 << 20
# Frames this large are read straight into their own bytes object (data,
# then the 4-byte CRC): one copy instead of two, worth the extra syscall.
_DIRECT_READ_BYTES = 4096

_CRC = struct.Struct("<I")
_LENGTH = struct.Struct("<Q")


class SequentialReadError(ValueError):
  """A compressed TFRecord file was asked for a record behind its position."""


class TFRecordSource(HandleSource):
  """Records (bytes) of one or more TFRecord files, concatenated in order.

  Args:
    paths: One path or a sequence of paths (str or os.PathLike; anything
      `etils.epath` opens).
    verify_crc: Check each record's data CRC on read (record headers are
      checked when the index is built).
    cache_index: Store each file's record index beside it as `<file>.idx`
      (when the directory is writable) and reuse it while it is fresh.
    compression_type: None (or "") for plain files; "GZIP" or "ZLIB" for
      files written compressed (as `tf.io.TFRecordOptions` names them). These
      are read in order only (see the module docstring): indexing them
      decompresses each file once, and a read behind a file's position (other
      than its first record) raises `SequentialReadError`.

  Raises:
    FileNotFoundError: a file does not exist.
    CorruptRecordError: a file is truncated or a record header is damaged
      (found while indexing); damaged record data is reported on read.
  """

  def __init__(self, paths: Any, verify_crc: bool = True,
               cache_index: bool = True,
               compression_type: str | None = None):
    if not isinstance(verify_crc, bool) or not isinstance(cache_index, bool):
      raise TypeError(
          "TFRecordSource: verify_crc and cache_index must be bools, got "
          f"verify_crc={verify_crc!r}, cache_index={cache_index!r}.")
    wbits = compression_wbits(compression_type, "TFRecordSource")
    path_list = as_path_list(paths, "TFRecordSource")
    check_files_exist(path_list, "TFRecordSource")
    self._verify_crc = verify_crc
    self._cache_index = cache_index
    self._compression_type = compression_type or None
    if wbits is None:
      self._files = [_TFRecordFile(p, cache_index) for p in path_list]
    else:
      self._files = [_CompressedTFRecordFile(p, cache_index, wbits,
                                             compression_type)
                     for p in path_list]
    counts = [f.load_index() for f in self._files]
    self._file_starts = np.zeros(len(counts) + 1, np.int64)
    np.cumsum(counts, out=self._file_starts[1:])
    self._track_handles()

  def __len__(self) -> int:
    return int(self._file_starts[-1])

  def _read(self, index: int) -> bytes:
    f = file_of(index, self._file_starts)
    return self._files[f].read_one(index - int(self._file_starts[f]),
                                   self._verify_crc)

  def _read_many(self, indices: np.ndarray) -> list:
    if self._compression_type is not None:
      # In the order asked: sorting a chunk that spans two epochs would
      # read the second epoch's first records before the first one's last.
      return [self._read(i) for i in indices.tolist()]
    out = [None] * len(indices)
    for f, positions, slots in split_by_file(indices, self._file_starts):
      self._files[f].read_sorted(positions, slots, out, self._verify_crc)
    return out

  @property
  def paths(self) -> list[str]:
    return [f.name for f in self._files]

  def spec_params(self) -> dict:
    params = {"paths": self.paths, "verify_crc": self._verify_crc,
              "cache_index": self._cache_index}
    if self._compression_type is not None:
      params["compression_type"] = self._compression_type
    return params

  def fingerprint_params(self) -> dict:
    return files_fingerprint_params(self.paths)

  def _handles(self) -> list[LazyHandle]:
    return [f.handle for f in self._files]


class _TFRecordFile:
  """One TFRecord file: its record offsets and a lazily opened handle."""

  index_version = _INDEX_VERSION

  def __init__(self, path: epath.Path, cache_index: bool):
    self.path = path
    self.name = os.fspath(path)
    self.cache_index = cache_index
    self.local = is_local(path)
    if self.local:
      self.handle = LazyHandle(functools.partial(_open_fd, self.name),
                               os.close)
    else:
      self.handle = LazyHandle(
          functools.partial(_open_stream, path), _close_stream)
    self.offsets: np.ndarray | None = None
    self.stamp: tuple[int, int] | None = None  # (size, mtime_ns) indexed
    self.index_on_disk = False
    self.num_records = -1
    # The first reads of an unpickled copy (a worker process's) load the
    # index once, not once per thread (see `_opening_lock`).
    self._opening = (os.getpid(), threading.Lock())

  # -- index ---------------------------------------------------------------
  def load_index(self) -> int:
    """Loads (or builds and caches) the offsets; returns the record count."""
    stamp = file_stamp(self.path)
    offsets = self._load_cached(stamp) if self.cache_index else None
    self.index_on_disk = offsets is not None
    if offsets is None:
      offsets = self._scan(stamp[0])
      if self.cache_index:
        self.index_on_disk = self._store_cached(stamp, offsets)
    if self.num_records >= 0 and len(offsets) - 1 != self.num_records:
      raise CorruptRecordError(
          self.name, None,
          f"the file changed while in use: it now holds {len(offsets) - 1} "
          f"records, the source was built with {self.num_records}")
    self.offsets, self.stamp = offsets, stamp
    self.num_records = len(offsets) - 1
    return self.num_records

  def _index_path(self) -> epath.Path:
    return epath.Path(self.name + INDEX_SUFFIX)

  def _load_cached(self, stamp: tuple[int, int]) -> np.ndarray | None:
    try:
      with self._index_path().open("rb") as f:
        table = np.load(f, allow_pickle=False)
    except (OSError, ValueError, EOFError):
      return None  # missing or unreadable: rebuilt by the caller
    if (table.dtype != np.int64 or table.ndim != 1
        or len(table) < _INDEX_HEADER + 1):
      return None
    magic, version, size, mtime_ns, count = table[:_INDEX_HEADER].tolist()
    offsets = table[_INDEX_HEADER:]
    if (magic != _INDEX_MAGIC or version != self.index_version
        or (size, mtime_ns) != stamp or count != len(offsets) - 1
        or not self._offsets_fit(offsets, size)):
      return None
    return offsets

  def _offsets_fit(self, offsets: np.ndarray, size: int) -> bool:
    return offsets[-1] == size

  def _store_cached(self, stamp: tuple[int, int],
                    offsets: np.ndarray) -> bool:
    table = np.concatenate([
        np.array([_INDEX_MAGIC, self.index_version, stamp[0], stamp[1],
                  len(offsets) - 1], np.int64), offsets])
    final = self._index_path()
    temporary = epath.Path(f"{final}.tmp-{uuid.uuid4().hex}")
    try:
      with temporary.open("wb") as f:
        np.save(f, table, allow_pickle=False)
      temporary.replace(final)  # atomic: readers never see a partial index
      return True
    except OSError:
      # Not writable (read-only dataset directory): keep it in memory.
      try:
        temporary.unlink(missing_ok=True)
      except OSError:
        pass
      return False

  def __getstate__(self) -> dict:
    state = self.__dict__.copy()
    del state["_opening"]
    if self.index_on_disk:
      state["offsets"] = None  # reloaded from the cache file where needed
    return state

  def __setstate__(self, state: dict) -> None:
    self.__dict__.update(state)
    self._opening = (os.getpid(), threading.Lock())

  def _opening_lock(self) -> threading.Lock:
    """This process's lock around the first open. A forked child makes its
    own: a thread of the parent may have held the parent's at the fork (as
    `LazyHandle` does with its lock)."""
    pid, lock = self._opening
    if pid != os.getpid():
      self._opening = (os.getpid(), threading.Lock())
      pid, lock = self._opening
    return lock

  def _ensure_index(self) -> None:
    if self.offsets is None:  # dropped when pickled: the cache is on disk
      self.load_index()

  # -- reads ---------------------------------------------------------------
  def _scan(self, file_size: int) -> np.ndarray:
    """Scans the file for its offsets through a handle closed when done."""
    if self.local:
      fd = _open_fd(self.name)
      try:
        return scan_record_offsets(functools.partial(os.pread, fd), file_size,
                                   self.name)
      finally:
        os.close(fd)
    handle = _open_stream(self.path)
    try:
      return scan_record_offsets(functools.partial(_stream_read, handle),
                                 file_size, self.name)
    finally:
      _close_stream(handle)

  def _reader(self) -> Callable[[int, int], bytes]:
    """`pread(size, offset)` on this process's open handle."""
    handle = self.handle.get()
    if self.local:
      return functools.partial(os.pread, handle)  # all in C: no Python frame
    return functools.partial(_stream_read, handle)

  def _open_checked(self) -> None:
    """Opens the handle; on first open checks the file still matches."""
    if self.handle.is_open:
      return
    with self._opening_lock():
      if self.handle.is_open:
        return
      self._ensure_index()
      if file_stamp(self.path) != self.stamp:
        self.load_index()  # raises if the record count changed
      self.handle.get()

  def read_one(self, position: int, verify_crc: bool) -> bytes:
    self._open_checked()
    start = int(self.offsets[position])
    end = int(self.offsets[position + 1])
    pread = self._reader()
    if end - start >= _DIRECT_READ_BYTES:
      return self._read_direct(pread, start, end, position, verify_crc)
    return self._extract(pread(end - start, start), start, start, end,
                         position, verify_crc)

  def read_sorted(self, positions: np.ndarray, slots: np.ndarray, out: list,
                  verify_crc: bool) -> None:
    """Reads records at ascending `positions` into `out[slots]`."""
    self._open_checked()
    pread = self._reader()
    extract = self._extract
    starts = self.offsets[positions]
    ends = self.offsets[positions + 1]
    span_first, span_last = _spans(starts, ends)
    starts, ends = starts.tolist(), ends.tolist()
    slots, positions = slots.tolist(), positions.tolist()
    for first, last in zip(span_first.tolist(), span_last.tolist()):
      low = starts[first]
      if first == last and ends[last] - low >= _DIRECT_READ_BYTES:
        out[slots[first]] = self._read_direct(pread, low, ends[last],
                                              positions[first], verify_crc)
        continue
      buffer = pread(ends[last] - low, low)
      for k in range(first, last + 1):
        out[slots[k]] = extract(buffer, low, starts[k], ends[k], positions[k],
                                verify_crc)

  def _read_direct(self, pread: Callable[[int, int], bytes], start: int,
                   end: int, position: int, verify_crc: bool) -> bytes:
    """Reads a large record's data straight into its own bytes object."""
    data = pread(end - start - FRAME_OVERHEAD, start + HEADER_BYTES)
    footer = pread(FOOTER_BYTES, end - FOOTER_BYTES) if verify_crc else b""
    if len(data) < end - start - FRAME_OVERHEAD or (
        verify_crc and len(footer) < FOOTER_BYTES):
      raise CorruptRecordError(
          self.name, start,
          f"the file ended inside this record (it should end at byte {end}); "
          "the file was truncated after it was indexed", position)
    if verify_crc:
      self._check_crc(data, _CRC.unpack(footer)[0], start, position)
    return data

  def _extract(self, buffer: bytes, base: int, start: int, end: int,
               position: int, verify_crc: bool) -> bytes:
    """The data of the frame [start, end) from `buffer` read at `base`."""
    if len(buffer) < end - base:
      raise CorruptRecordError(
          self.name, start,
          f"the file ended inside this record (it holds {len(buffer)} of "
          f"{end - base} bytes read from offset {base}); the file was "
          "truncated after it was indexed", position)
    data = buffer[start - base + HEADER_BYTES:end - base - FOOTER_BYTES]
    if verify_crc:
      length = _LENGTH.unpack_from(buffer, start - base)[0]
      if length != end - start - FRAME_OVERHEAD:
        raise CorruptRecordError(
            self.name, start,
            f"the record header says {length} data bytes but the index says "
            f"{end - start - FRAME_OVERHEAD}; the file changed after it was "
            "indexed", position)
      self._check_crc(
          data, _CRC.unpack_from(buffer, end - base - FOOTER_BYTES)[0], start,
          position)
    return data

  def _check_crc(self, data: bytes, stored: int, start: int,
                 position: int) -> None:
    computed = masked_crc32c(data)
    if stored != computed:
      raise CorruptRecordError(
          self.name, start,
          f"data CRC mismatch (stored 0x{stored:08x}, computed "
          f"0x{computed:08x}) for the {len(data)}-byte record starting at "
          f"byte {start + HEADER_BYTES}", position)


class _CompressedTFRecordFile(_TFRecordFile):
  """A GZIP or ZLIB TFRecord file: indexed by one pass, read in order."""

  index_version = _COMPRESSED_INDEX_VERSION

  def __init__(self, path: epath.Path, cache_index: bool, wbits: int,
               compression_type: str):
    super().__init__(path, cache_index)
    self.wbits = wbits
    self.compression_type = compression_type
    self.handle = LazyHandle(
        functools.partial(_open_record_stream, path, wbits), _close_stream)

  def _offsets_fit(self, offsets: np.ndarray, size: int) -> bool:
    del size  # the offsets count uncompressed bytes
    return True

  def _scan(self, file_size: int) -> np.ndarray:
    del file_size
    stream = _open_record_stream(self.path, self.wbits)
    try:
      return stream[0].scan_offsets()
    finally:
      _close_stream(stream)

  def read_one(self, position: int, verify_crc: bool) -> bytes:
    self._open_checked()
    stream, lock = self.handle.get()
    with lock:
      if position == stream.position - 1 and stream.last is not None:
        return stream.last  # the same record again (a repeated index)
      self._seek(stream, position)
      record = stream.read(verify_crc)
      if record is None:
        raise CorruptRecordError(
            self.name, stream.offset,
            f"the file ended before record {position}; it changed after it "
            "was indexed", position)
      return record

  def _seek(self, stream: RecordStream, position: int) -> None:
    if position < stream.position:
      if position != 0:
        raise SequentialReadError(
            f"TFRecordSource: {self.name} is {self.compression_type}-"
            f"compressed, so its records are read in order only: record "
            f"{position} of the file was asked for after record "
            f"{stream.position - 1}. Read it with an unshuffled sampler "
            "(IndexSampler(n, shuffle=False)), or write it uncompressed "
            "(write_tfrecord without compression_type) for random access.")
      stream.rewind()  # the first record again: a new pass over the file
    while stream.position < position:
      if not stream.skip():
        raise CorruptRecordError(
            self.name, stream.offset,
            f"the file ended before record {position}; it changed after it "
            "was indexed", position)


def _open_record_stream(path: epath.Path, wbits: int):
  return RecordStream(path.open("rb"), wbits, os.fspath(path)), threading.Lock()


def _spans(starts: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray,
                                                          np.ndarray]:
  """Groups ascending frames into runs of adjacent small frames read at once.

  A run breaks at a gap between frames and every `_MAX_SPAN_BYTES` bytes;
  a frame of `_DIRECT_READ_BYTES` or more is a run of its own.

  Returns:
    (first, last): index of the first and last frame of each run.
  """
  n = len(starts)
  large = (ends - starts) >= _DIRECT_READ_BYTES
  new = np.ones(n, bool)
  new[1:] = (starts[1:] > ends[:-1]) | large[1:] | large[:-1]
  run_first = np.maximum.accumulate(np.where(new, np.arange(n), 0))
  chunk = (starts - starts[run_first]) // _MAX_SPAN_BYTES
  new[1:] |= chunk[1:] != chunk[:-1]
  first = np.flatnonzero(new)
  last = np.append(first[1:], n) - 1
  return first, last


def _open_fd(name: str) -> int:
  return os.open(name, os.O_RDONLY | os.O_CLOEXEC)


def _stream_read(handle, size: int, offset: int) -> bytes:
  stream, lock = handle
  with lock:  # seek + read must not interleave between threads
    stream.seek(offset)
    return stream.read(size)


def _open_stream(path: epath.Path):
  return path.open("rb"), threading.Lock()


def _close_stream(handle) -> None:
  handle[0].close()
