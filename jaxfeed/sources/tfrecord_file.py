"""One TFRecord file read at random: its index of record offsets (built by
one scan, cached beside the file as `<file>.idx` where it can be written)
and the reads of its records, plain or through a GZIP / ZLIB stream.

`TFRecordSource` (jaxfeed/sources/tfrecord_source.py) holds one per file.
"""

from __future__ import annotations

import functools
import os
import struct
import threading
import uuid
from typing import Callable

from etils import epath
import numpy as np

from jaxfeed.sources.base import CorruptRecordError, LazyHandle, file_stamp, is_local
from jaxfeed.sources.tfrecord_format import (
  DATA_CRC,
  FOOTER_BYTES,
  FORMAT_PROBE_BYTES,
  FRAME_OVERHEAD,
  HEADER_BYTES,
  compression_mismatch,
  data_crc_message,
  masked_crc32c,
)
from jaxfeed.sources.tfrecord_scan import DamagedRange, scan_frames
from jaxfeed.sources.tfrecord_stream import RecordStream

INDEX_SUFFIX = ".idx"
_INDEX_MAGIC = int.from_bytes(b"JFTFRIDX", "little")
# Index versions: (headers checked, every data CRC checked too).
_INDEX_VERSIONS = (1, 3)
_COMPRESSED_INDEX_VERSIONS = (2, 4)  # offsets in the uncompressed stream
_INDEX_HEADER = 5  # magic, version, file_size, mtime_ns, num_records
# get_many merges reads of adjacent small records into one read of at most
# this many bytes (one syscall instead of many for sequential access).
_MAX_SPAN_BYTES = 1 << 20
# Frames this large are read straight into their own bytes object (data,
# then the 4-byte CRC): one copy instead of two, worth the extra syscall.
_DIRECT_READ_BYTES = 4096
# Defined here, not imported: CPython 3.11 compiles a method call on an
# imported name as an attribute load, which costs ~15% of a small record's
# read.
_CRC = struct.Struct("<I")
_LENGTH = struct.Struct("<Q")


class SequentialReadError(ValueError):
  """A compressed TFRecord file was asked for a record behind its position."""


class TFRecordFile:
  """One TFRecord file: its record offsets and a lazily opened handle.

  The index has an entry per frame and per damaged range: `offsets` bounds
  them; `damaged_entries` maps the damaged ones to their `DamagedRange`
  (empty when skipped); with `on_damage="skip"` and damage, `record_entries`
  maps record positions to entries (None: position == entry).
  """

  index_versions = _INDEX_VERSIONS
  compression_type: str | None = None  # GZIP or ZLIB where compressed

  def __init__(self, path: epath.Path, cache_index: bool, skip_damage: bool):
    self.path = path
    self.name = os.fspath(path)
    self.cache_index = cache_index
    self.skip_damage = skip_damage
    self.local = is_local(path)
    if self.local:
      self.handle = LazyHandle(functools.partial(_open_fd, self.name), os.close)
    else:
      self.handle = LazyHandle(functools.partial(_open_stream, path), _close_stream)
    self.offsets: np.ndarray | None = None
    self.damage: tuple[DamagedRange, ...] = ()
    self.damaged_entries: dict[int, DamagedRange] = {}
    self.record_entries: np.ndarray | None = None
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
    damage: tuple[DamagedRange, ...] = ()
    if offsets is None:
      offsets, damage = self._scan(stamp[0])
      if damage and damage[0].start == 0:
        self._check_compression()
      if self.cache_index and not damage:  # a damaged index is not cached
        self.index_on_disk = self._store_cached(stamp, offsets)
    record_entries = None
    if damage and self.skip_damage:
      record_entries = np.delete(
        np.arange(len(offsets) - 1, dtype=np.int64), [d.record_index for d in damage]
      )
    count = len(offsets) - 1 if record_entries is None else len(record_entries)
    if self.num_records >= 0 and count != self.num_records:
      raise CorruptRecordError(
        self.name,
        None,
        f"the file changed while in use: it now holds {count} records, the "
        f"source was built with {self.num_records}",
      )
    self.offsets, self.stamp, self.damage = offsets, stamp, damage
    self.record_entries = record_entries
    self.damaged_entries = {} if self.skip_damage else {d.record_index: d for d in damage}
    self.num_records = count
    return count

  def _check_compression(self) -> None:
    """Refuses a file of another compression type than the source's."""
    with self.path.open("rb") as f:
      mismatch = compression_mismatch(f.read(FORMAT_PROBE_BYTES), self.compression_type)
    if mismatch is not None:
      raise CorruptRecordError(self.name, 0, mismatch)

  def _index_path(self) -> epath.Path:
    return epath.Path(self.name + INDEX_SUFFIX)

  def _load_cached(self, stamp: tuple[int, int]) -> np.ndarray | None:
    try:
      with self._index_path().open("rb") as f:
        table = np.load(f, allow_pickle=False)
    except (OSError, ValueError, EOFError):
      return None  # missing or unreadable: rebuilt by the caller
    if table.dtype != np.int64 or table.ndim != 1 or len(table) < _INDEX_HEADER + 1:
      return None
    magic, version, size, mtime_ns, count = table[:_INDEX_HEADER].tolist()
    offsets = table[_INDEX_HEADER:]
    # "skip" needs an index whose data CRCs were all checked.
    versions = self.index_versions[1:] if self.skip_damage else (self.index_versions)
    if (
      magic != _INDEX_MAGIC
      or version not in versions
      or (size, mtime_ns) != stamp
      or count != len(offsets) - 1
      or not self._offsets_fit(offsets, size)
    ):
      return None
    return offsets

  def _offsets_fit(self, offsets: np.ndarray, size: int) -> bool:
    return offsets[-1] == size

  def _store_cached(self, stamp: tuple[int, int], offsets: np.ndarray) -> bool:
    version = self.index_versions[1 if self.skip_damage else 0]
    table = np.concatenate(
      [np.array([_INDEX_MAGIC, version, stamp[0], stamp[1], len(offsets) - 1], np.int64), offsets]
    )
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
  def _scan(self, file_size: int) -> tuple[np.ndarray, tuple[DamagedRange, ...]]:
    """Scans the file for its entries through a handle closed when done."""
    if self.local:
      fd = _open_fd(self.name)
      try:
        return scan_frames(functools.partial(os.pread, fd), file_size, self.name, self.skip_damage)
      finally:
        os.close(fd)
    handle = _open_stream(self.path)
    try:
      return scan_frames(
        functools.partial(_stream_read, handle), file_size, self.name, self.skip_damage
      )
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

  def _entry(self, position: int) -> int:
    """The index entry of record `position`; raises where it is damaged."""
    if self.record_entries is not None:
      position = int(self.record_entries[position])
    if self.damaged_entries and position in self.damaged_entries:
      raise self.damaged_entries[position].error()
    return position

  def _entries(self, positions: np.ndarray) -> np.ndarray:
    """`_entry` of ascending positions, at once."""
    if self.record_entries is not None:
      positions = self.record_entries[positions]
    if self.damaged_entries:
      damaged = np.isin(positions, list(self.damaged_entries))
      if damaged.any():
        raise self.damaged_entries[int(positions[np.argmax(damaged)])].error()
    return positions

  def read_one(self, position: int, verify_crc: bool) -> bytes:
    self._open_checked()
    position = self._entry(position)
    start = int(self.offsets[position])
    end = int(self.offsets[position + 1])
    pread = self._reader()
    if end - start >= _DIRECT_READ_BYTES:
      return self._read_direct(pread, start, end, position, verify_crc)
    return self._extract(pread(end - start, start), start, start, end, position, verify_crc)

  def read_sorted(
    self, positions: np.ndarray, slots: np.ndarray, out: list, verify_crc: bool
  ) -> None:
    """Reads records at ascending `positions` into `out[slots]`."""
    self._open_checked()
    positions = self._entries(positions)
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
        out[slots[first]] = self._read_direct(pread, low, ends[last], positions[first], verify_crc)
        continue
      buffer = pread(ends[last] - low, low)
      for k in range(first, last + 1):
        out[slots[k]] = extract(buffer, low, starts[k], ends[k], positions[k], verify_crc)

  def _read_direct(
    self, pread: Callable[[int, int], bytes], start: int, end: int, position: int, verify_crc: bool
  ) -> bytes:
    """Reads a large record's data straight into its own bytes object."""
    data = pread(end - start - FRAME_OVERHEAD, start + HEADER_BYTES)
    footer = pread(FOOTER_BYTES, end - FOOTER_BYTES) if verify_crc else b""
    if len(data) < end - start - FRAME_OVERHEAD or (verify_crc and len(footer) < FOOTER_BYTES):
      raise CorruptRecordError(
        self.name,
        start,
        f"the file ended inside this record (it should end at byte {end}); "
        "the file was truncated after it was indexed",
        position,
      )
    if verify_crc:
      self._check_crc(data, _CRC.unpack(footer)[0], start, position)
    return data

  def _extract(
    self, buffer: bytes, base: int, start: int, end: int, position: int, verify_crc: bool
  ) -> bytes:
    """The data of the frame [start, end) from `buffer` read at `base`."""
    if len(buffer) < end - base:
      raise CorruptRecordError(
        self.name,
        start,
        f"the file ended inside this record (it holds {len(buffer)} of "
        f"{end - base} bytes read from offset {base}); the file was "
        "truncated after it was indexed",
        position,
      )
    data = buffer[start - base + HEADER_BYTES : end - base - FOOTER_BYTES]
    if verify_crc:
      length = _LENGTH.unpack_from(buffer, start - base)[0]
      if length != end - start - FRAME_OVERHEAD:
        raise CorruptRecordError(
          self.name,
          start,
          f"the record header says {length} data bytes but the index says "
          f"{end - start - FRAME_OVERHEAD}; the file changed after it was "
          "indexed",
          position,
        )
      self._check_crc(data, _CRC.unpack_from(buffer, end - base - FOOTER_BYTES)[0], start, position)
    return data

  def _check_crc(self, data: bytes, stored: int, start: int, position: int) -> None:
    computed = masked_crc32c(data)
    if stored != computed:
      raise CorruptRecordError(
        self.name,
        start,
        f"{data_crc_message(stored, computed, len(data))} starting at byte {start + HEADER_BYTES}",
        position,
        start + FRAME_OVERHEAD + len(data),
        DATA_CRC,
      )


class CompressedTFRecordFile(TFRecordFile):
  """A GZIP or ZLIB TFRecord file: indexed by one pass, read in order."""

  index_versions = _COMPRESSED_INDEX_VERSIONS

  def __init__(
    self, path: epath.Path, cache_index: bool, skip_damage: bool, wbits: int, compression_type: str
  ):
    super().__init__(path, cache_index, skip_damage)
    self.wbits = wbits
    self.compression_type = compression_type
    self.handle = LazyHandle(functools.partial(_open_record_stream, path, wbits), _close_stream)

  def _offsets_fit(self, offsets: np.ndarray, size: int) -> bool:
    del size  # the offsets count uncompressed bytes
    return True

  def _scan(self, file_size: int) -> tuple[np.ndarray, tuple[DamagedRange, ...]]:
    del file_size
    stream = _open_record_stream(self.path, self.wbits)
    try:
      return stream[0].scan(self.skip_damage)
    finally:
      _close_stream(stream)

  def read_one(self, position: int, verify_crc: bool) -> bytes:
    self._open_checked()
    position = self._entry(position)
    stream, lock = self.handle.get()
    with lock:
      if position == stream.position - 1 and stream.last is not None:
        return stream.last  # the same record again (a repeated index)
      self._seek(stream, position)
      record = stream.read(verify_crc)
      if record is None:
        raise CorruptRecordError(
          self.name,
          stream.offset,
          f"the file ended before record {position}; it changed after it was indexed",
          position,
        )
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
          "(write_tfrecord without compression_type) for random access."
        )
      stream.rewind()  # the first record again: a new pass over the file
    while stream.position < position:
      if not stream.skip():
        raise CorruptRecordError(
          self.name,
          stream.offset,
          f"the file ended before record {position}; it changed after it was indexed",
          position,
        )


def _open_record_stream(path: epath.Path, wbits: int):
  return RecordStream(path.open("rb"), wbits, os.fspath(path)), threading.Lock()


def _spans(starts: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
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
