"""`RecordStore`: preprocessed records kept by record index in a folder that
many readers share (processes of one host, or service workers over a shared
file system).

Records are kept in blocks of `BLOCK` consecutive indices, one file each,
written whole (to a temporary name, then renamed): a reader sees a block
complete or not at all. Each record of a block is pickled apart, and the
block's header gives each one's offset, length and CRC-32: a reader whose
store fits in its memory (`_CACHED_BLOCKS` blocks) loads whole blocks, and
one reading a larger store (in a shuffled order, mostly) reads only the
record it needs. The reader that first needs a block claims it (a
lock file made with O_EXCL, naming the host and process) and computes it;
others that need it meanwhile wait for the file instead of computing it
again. A claim whose process is gone (on this host), or older than
`CLAIM_STALE_S`, is taken over, so a reader killed mid-block holds nobody
up for long.

Blocks are pickled, and unpickling a file runs whatever its writer put in
it, so a store reads only what the user running it (or root) could have
written: before it unpickles a block, the store's folder and the block file
must both be owned by this user or root and writable by their owner alone
(no group or others write bit), and the block a regular file, not a link.
Otherwise the read fails with `UnsafeStoreError`, naming the file, its
owner and mode. The store makes its folder with mode 0o700 and its blocks
with 0o600; a folder shared by several users' processes is therefore not
one store for all of them (each user needs their own autocache folder).

A block file's table carries its own CRC-32. A block file whose header or
table, or a record whose length or CRC-32, does not match (a flipped bit, a
truncated copy, a file of an older format) is never unpickled: the block is
treated as missing, computed again and replaced, with a warning naming the
file.
"""

from __future__ import annotations

import collections
import errno
import io
import logging
import os
import pickle
import socket
import stat
import struct
import tempfile
import time
import zlib
from typing import Any, BinaryIO, Callable

from jaxfeed.ops import autocache_policy, store_costs

__all__ = ["RecordStore", "UnsafeStoreError", "BLOCK", "CLAIM_STALE_S"]

BLOCK = 64
"""Records per block file."""

CLAIM_STALE_S = 60.0
"""A claim on a block older than this is taken over."""

_WAIT_POLL_S = 0.005
_CACHED_BLOCKS = 32  # blocks kept in memory per store object
# A block file: this magic; its number of records and the CRC-32 of its
# table; the table, each record's offset, length and CRC-32; the records'
# pickles. (v1 files, one pickle a block, count as damaged.)
_MAGIC = b"JFRECv2\n"
_HEADER = struct.Struct("<II")
_ENTRY = struct.Struct("<QQI")
_OTHERS_WRITE = stat.S_IWGRP | stat.S_IWOTH


class UnsafeStoreError(PermissionError):
  """A store folder or block file that someone other than this user (or
  root) may have written: the store refuses to unpickle from it."""


class RecordStore:
  """The blocks of one preprocessing of one source, in `directory`.

  Args:
    directory: the store's folder (made with mode 0o700 if missing).
    num_records: records in the source.
    compute: compute(start, stop) -> the preprocessed records [start, stop).
    policy: the autocache policy (`jaxfeed.ops.autocache_policy.POLICIES`):
      whether blocks are kept, or computed and not kept.
    job: the job's name in the policy's decision counts.

  Raises:
    UnsafeStoreError: here or at a read, when the folder or a block file is
      one the store does not unpickle from (see the module docstring).
  """

  def __init__(
    self,
    directory: str,
    num_records: int,
    compute: Callable[[int, int], list],
    policy: str = "always",
    job: str = "",
  ):
    self.directory = directory
    self.num_records = num_records
    self._compute = compute
    self._blocks: collections.OrderedDict[int, list] = collections.OrderedDict()
    self.computed_blocks = 0  # by this object, for tests and stats
    self.read_blocks = 0
    self.read_records = 0  # read alone (the store does not fit in memory)
    self.unkept_records = 0  # computed and not kept (the policy's compute)
    self._policy, self._job = policy, job
    self._point = autocache_policy.point(
      os.path.dirname(os.path.abspath(directory)), os.path.basename(directory)
    )
    self._costs = store_costs.StoreCosts()
    self._fits_in_memory = -(-num_records // BLOCK) <= _CACHED_BLOCKS
    os.makedirs(directory, mode=0o700, exist_ok=True)
    os.close(_open_folder(directory))  # an unsafe folder fails here, not at a block

  def get(self, index: int) -> Any:
    """The preprocessed record `index`."""
    if not 0 <= index < self.num_records:
      raise IndexError(f"record {index} is outside [0, {self.num_records}).")
    costs = self._costs
    costs.served += 1
    block, position = divmod(index, BLOCK)
    records = self._blocks.get(block)
    if records is not None:
      self._blocks.move_to_end(block)
      return records[position]
    mode = self._point.block_mode(self._policy, self._job, costs.read_share())
    if mode == autocache_policy.COMPUTE:  # this record alone, not kept
      [record] = costs.timed("compute", 1, self._compute, index, index + 1)
      self.unkept_records += 1
      self._note(mode)
      return record
    if not self._fits_in_memory:  # in a shuffled order, few records of a block are used
      one = self._read_record(block, position)
      if one is not None:
        self.read_records += 1
        self._note(mode)
        return one[0]
    records = self._block(block, mode)  # also when that record is damaged
    self._blocks[block] = records
    if len(self._blocks) > _CACHED_BLOCKS:
      self._blocks.popitem(last=False)
    self._note(mode)
    return records[position]

  def _path(self, block: int) -> str:
    return os.path.join(self.directory, f"block-{block:09d}.pkl")

  def _size(self, block: int) -> int:
    return min(BLOCK, self.num_records - block * BLOCK)

  def _read_record(self, block: int, position: int) -> list | None:
    """[record `position` of `block`], read alone; None if its block file is
    missing or damaged."""
    path = self._path(block)
    return self._costs.timed(
      store_costs.READ_ONE, 1, _load_record, path, self._size(block), position
    )

  def _block(self, block: int, mode: str) -> list:
    costs = self._costs
    start = block * BLOCK
    stop = start + self._size(block)
    path = self._path(block)
    while True:
      # A damaged block is computed by its claimer.
      records = costs.timed(store_costs.READ, stop - start, _load, path, stop - start, False)
      if records is not None:
        self.read_blocks += 1
        return records
      if _claim(path + ".claim"):
        try:
          records = _load(path, stop - start, True)  # written between the look and the claim
          if records is None:
            records = costs.timed("compute", stop - start, self._compute, start, stop)
            costs.timed("write", stop - start, _write, path, records)
            costs.bytes += os.path.getsize(path)
            self.computed_blocks += 1
            if mode == autocache_policy.PROFILE:  # what a reader pays
              if self._fits_in_memory:
                costs.timed(store_costs.READ, stop - start, _load, path, stop - start, True)
              else:
                costs.timed(store_costs.READ_ONE, stop - start, _load_each, path, stop - start)
          else:
            self.read_blocks += 1
          return records
        finally:
          _unclaim(path + ".claim")
      time.sleep(_WAIT_POLL_S)  # another reader computes it

  def _note(self, mode: str) -> None:
    """Hands the policy what the records since its last look cost, when it
    next decides."""
    costs = self._costs
    costs.lookups += 1
    due = (
      costs.lookups >= autocache_policy.PROFILE_BLOCKS
      if mode == autocache_policy.PROFILE
      else self._point.blocks >= autocache_policy.REDECIDE_LOOKUPS
    )
    if due:
      fits = -(-self.num_records // BLOCK) <= _CACHED_BLOCKS
      m = self._point.measurements
      m.update(**costs.per_record(fits), read_passes=m.read_passes + (costs.reads > 0))
      self._costs = store_costs.StoreCosts(costs.read_share())


def _check_owner_and_mode(path: str, info: os.stat_result, what: str) -> None:
  """Refuses (UnsafeStoreError) a file or folder `info` of `path` that is
  not owned by this user or root, or that its group or others may write."""
  mode = oct(stat.S_IMODE(info.st_mode))
  wrong = []
  if info.st_uid not in (os.geteuid(), 0):
    wrong.append(f"is owned by uid {info.st_uid}, not this user (uid {os.geteuid()}) or root")
  if info.st_mode & _OTHERS_WRITE:
    wrong.append(f"has mode {mode}, which lets its group or others write it")
  if not wrong:
    return
  raise UnsafeStoreError(
    f"record store: refusing to unpickle from {path}: the {what} {' and '.join(wrong)}. "
    "A store's folder and block files must be owned by this user or root and "
    "writable by their owner only, since unpickling a file runs what its writer "
    "put in it. Remove the folder (it is computed again) or give each user "
    "their own autocache folder."
  )


def _open_folder(directory: str) -> int:
  """An fd of the store's folder, checked (see the module docstring)."""
  dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
  try:
    _check_owner_and_mode(directory, os.fstat(dir_fd), "folder")
  except BaseException:
    os.close(dir_fd)
    raise
  return dir_fd


def _open_checked(path: str) -> io.BufferedReader | None:
  """Block file `path` open for reading, once the folder and the file passed
  the checks of the module docstring; None if there is no such file."""
  dir_fd = _open_folder(os.path.dirname(path))
  try:
    fd = os.open(os.path.basename(path), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dir_fd)
  except FileNotFoundError:
    return None
  except OSError as exc:
    if exc.errno != errno.ELOOP:
      raise
    raise UnsafeStoreError(
      f"record store: refusing to unpickle from {path}: it is a symbolic link; "
      "block files must be regular files."
    ) from exc
  finally:
    os.close(dir_fd)
  f = os.fdopen(fd, "rb")
  try:
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
      raise UnsafeStoreError(
        f"record store: refusing to unpickle from {path}: it is not a regular "
        f"file (mode {oct(info.st_mode)})."
      )
    _check_owner_and_mode(path, info, "block file")
  except BaseException:
    f.close()
    raise
  return f


class _Damaged(Exception):
  """What is wrong with a block file, in its message."""


def _table_end(count: int) -> int:
  """Where the table of a block file of `count` records ends."""
  return len(_MAGIC) + _HEADER.size + count * _ENTRY.size


def _table(head: bytes | memoryview, count: int) -> memoryview:
  """The checked table of records of a block file of `count` records, from
  the file's first bytes `head` (at least `_table_end(count)` of them)."""
  if len(head) < len(_MAGIC) + _HEADER.size or head[: len(_MAGIC)] != _MAGIC:
    raise _Damaged("it does not start with a block header")
  records, crc = _HEADER.unpack_from(head, len(_MAGIC))
  if records != count:
    raise _Damaged(f"its header says {records} records where its block has {count}")
  if len(head) < _table_end(count):
    raise _Damaged("it ends inside its table of records")
  table = memoryview(head)[len(_MAGIC) + _HEADER.size : _table_end(count)]
  if zlib.crc32(table) != crc:
    raise _Damaged("its table of records does not match its CRC-32")
  return table


def _checked(payload: bytes | memoryview, table: memoryview, position: int) -> None:
  """Raises _Damaged unless `payload` is record `position` of `table`."""
  _, length, crc = _ENTRY.unpack_from(table, position * _ENTRY.size)
  if len(payload) != length:
    raise _Damaged(f"record {position} holds {len(payload)} bytes where its table says {length}")
  if zlib.crc32(payload) != crc:
    raise _Damaged(f"record {position} does not match its CRC-32")


def _unpickle(path: str, payload: bytes | memoryview) -> Any:
  try:
    return pickle.loads(payload)
  except Exception as exc:  # intact bytes: e.g. a class its records need is gone
    raise ValueError(
      f"record store: cannot unpickle block file {path}: {exc!r}. Remove it to compute it again."
    ) from exc


def _load(path: str, count: int, warn: bool) -> list | None:
  """The `count` records of block file `path`; None if it is missing or
  damaged (with a warning naming it if `warn`)."""
  f = _open_checked(path)
  if f is None:
    return None
  with f:
    data = memoryview(f.read())
  try:
    table = _table(data, count)
    payloads = [data[offset : offset + length] for offset, length, _ in _ENTRY.iter_unpack(table)]
    for position, payload in enumerate(payloads):
      _checked(payload, table, position)
    end = _table_end(count) + sum(len(payload) for payload in payloads)
    if len(data) != end:
      raise _Damaged(f"it holds {len(data)} bytes where its table says {end}")
  except _Damaged as damage:
    if warn:
      logging.warning(
        "record store: block file %s is damaged (%s); computing it again.", path, damage
      )
    return None
  return [_unpickle(path, payload) for payload in payloads]


def _load_record(path: str, count: int, position: int) -> list | None:
  """[record `position`] of block file `path` of `count` records, reading
  its table and that record only; None if it is missing or damaged."""
  f = _open_checked(path)
  if f is None:
    return None
  with f:
    try:
      table = _table(os.pread(f.fileno(), _table_end(count), 0), count)
      offset, length, _ = _ENTRY.unpack_from(table, position * _ENTRY.size)
      payload = os.pread(f.fileno(), length, offset)
      _checked(payload, table, position)
    except _Damaged:
      return None  # the reader that claims the block warns, and computes it
  return [_unpickle(path, payload)]


def _load_each(path: str, count: int) -> list | None:
  """The `count` records of block file `path`, read one at a time (as a
  reader of a store larger than its memory does); None if it is missing or
  damaged."""
  records = []
  for position in range(count):
    one = _load_record(path, count, position)
    if one is None:
      return None
    records += one
  return records


def _block_head(records: list[tuple[int, int]]) -> bytes:
  """The header and table of a block file of records whose pickles have
  these (length, CRC-32) and follow the table in this order."""
  offset = _table_end(len(records))
  table = bytearray()
  for length, crc in records:
    table += _ENTRY.pack(offset, length, crc)
    offset += length
  return _MAGIC + _HEADER.pack(len(records), zlib.crc32(table)) + bytes(table)


class _CountingWriter:
  """A file's `write` that keeps the length and CRC-32 of what went through."""

  def __init__(self, f: BinaryIO):
    self._f = f
    self.length = 0
    self.crc = 0

  def write(self, data: Any) -> int:
    self.length += memoryview(data).nbytes
    self.crc = zlib.crc32(data, self.crc)
    return self._f.write(data)


def _write(path: str, records: list) -> None:
  directory = os.path.dirname(path)
  fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-")
  try:
    with os.fdopen(fd, "wb") as f:  # mode 0o600, as mkstemp makes it
      f.write(bytes(_table_end(len(records))))  # filled in below
      pickled = []
      for record in records:  # pickled into the file, not copied first
        counted = _CountingWriter(f)
        pickle.dump(record, counted, protocol=pickle.HIGHEST_PROTOCOL)
        pickled.append((counted.length, counted.crc))
      f.seek(0)
      f.write(_block_head(pickled))
    os.replace(tmp, path)
  except BaseException:
    try:
      os.unlink(tmp)
    except FileNotFoundError:
      pass
    raise


def _claim(claim: str) -> bool:
  """Takes the claim on a block; False while another reader holds it."""
  try:
    fd = os.open(claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
  except FileExistsError:
    if not _stale(claim):
      return False
    try:
      os.unlink(claim)  # taken over; a race here is settled by O_EXCL below
    except FileNotFoundError:
      pass
    return False
  with os.fdopen(fd, "w") as f:
    f.write(f"{socket.gethostname()} {os.getpid()}")
  return True


def _unclaim(claim: str) -> None:
  try:
    os.unlink(claim)
  except FileNotFoundError:
    pass


def _stale(claim: str) -> bool:
  """Whether a claim's process is gone (this host) or the claim is old."""
  try:
    with open(claim, encoding="utf-8") as f:
      host, _, pid = f.read().partition(" ")
    age = time.time() - os.stat(claim).st_mtime
  except (FileNotFoundError, ValueError):
    return False  # released meanwhile, or being written: look again
  if age > CLAIM_STALE_S:
    return True
  if host == socket.gethostname() and pid.isdigit():
    try:
      os.kill(int(pid), 0)
    except ProcessLookupError:
      return True
    except PermissionError:
      return False
  return False
