"""The autocache folder: its entries, who uses them, and its capacity.

An entry is the cache of one autocache input (see `jaxfeed.ops.autocache`):
the folder `DIR/<fingerprint>` once complete (it holds `manifest.json`, see
`jaxfeed.ops.cache`), and `DIR/<fingerprint>.tmp-<pid>-<id>` while a pass
writes it; or a store of preprocessed records `DIR/records-<key>` (see
`jaxfeed.ops.shared_preprocessing`), which its readers fill block by block:
the byte limit is applied to it at the next eviction (a write elsewhere, or
the worker's periodic pass), not before each block, so while such stores
are being filled the folder may go past the limit by what they wrote since.
Beside the entries, `DIR/.jaxfeed/` holds the folder's bookkeeping:

- `locks/<fingerprint>`: the entry's lock file. Every process reading or
  writing the entry holds a shared `flock` on it for as long as it does;
  whatever removes an entry (the byte limit, the time limit, `jaxfeed cache
  rm`) first takes the lock exclusively without waiting, and leaves the entry
  alone when it cannot. So an entry in use is never removed, whichever
  process uses it. The lock file's modification time is the entry's last use
  (set when a read or a write starts and when it ends).
- `writes/<fingerprint>.tmp-<pid>-<id>`: the bytes a pass writing that
  temporary folder has reserved. A pass raises its reservation (evicting
  others to make room) before it writes more, so reservations plus complete
  entries stay within the byte limit. The writer holds it under an
  exclusive lock; one nobody holds belongs to a dead writer and counts for
  nothing.
- `trash/`: entries being deleted, renamed there under their lock first so
  that no reader finds half an entry.
- `folder.lock`: serializes reservations and evictions between processes.

`flock` works between the processes of one machine; a folder shared between
machines needs a filesystem whose locks do too (NFS v4's, for example). A
process that may not write the folder (a read-only copy) reads its entries
without marking them, with a warning.
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import logging
import os
import shutil
import time
import uuid

from jaxfeed.ops.shared_preprocessing import STORE_PREFIX

__all__ = [
  "AutocacheFolder",
  "EntryHold",
  "EntryInfo",
  "EntryInUseError",
  "FolderLimits",
  "WriteReservation",
]

_META = ".jaxfeed"
_MANIFEST = "manifest.json"
_TMP = ".tmp-"


class EntryInUseError(RuntimeError):
  """An entry that a process is reading or writing cannot be removed."""


@dataclasses.dataclass(frozen=True)
class FolderLimits:
  """How much an autocache folder keeps, and for how long.

  Attributes:
    max_bytes: Most bytes of files the folder's entries hold; least recently
      used entries not in use go first to make room, and a pass that cannot
      make room stops writing (its pipeline goes on without the cache).
      None: no limit.
    ttl_s: Entries nobody used for this many seconds are removed. None: kept.
  """

  max_bytes: int | None = None
  ttl_s: float | None = None

  def __post_init__(self) -> None:
    if self.max_bytes is not None and (
      not isinstance(self.max_bytes, int) or isinstance(self.max_bytes, bool) or self.max_bytes < 1
    ):
      raise ValueError(
        f"autocache_max_bytes must be an integer >= 1 (bytes), or None "
        f"(0 on the command line) for no limit, got {self.max_bytes!r}."
      )
    if self.ttl_s is not None and (
      not isinstance(self.ttl_s, (int, float))
      or isinstance(self.ttl_s, bool)
      or not 0 < self.ttl_s < float("inf")
    ):
      raise ValueError(
        f"autocache_ttl_s must be a number of seconds > 0, or None (0 "
        f"on the command line) to keep entries, got {self.ttl_s!r}."
      )


@dataclasses.dataclass(frozen=True)
class EntryInfo:
  """One entry of a folder, as `AutocacheFolder.entries` sees it.

  Attributes:
    name: The entry's name in the folder (its input's fingerprint).
    bytes: Bytes of its files, complete and being written.
    last_used: When a read or write of it last started or ended (seconds
      since the epoch).
    state: "idle" (complete, unused), "reading" (complete, in use),
      "writing" (being written) or "abandoned" (a write that never
      finished; removed by the next eviction).
  """

  name: str
  bytes: int
  last_used: float
  state: str


def _tree_bytes(path: str) -> int:
  total = 0
  for root, _, files in os.walk(path):
    for name in files:
      try:
        total += os.stat(os.path.join(root, name)).st_size
      except OSError:
        pass  # removed meanwhile
  return total


def _lock(path: str, mode: int, create: bool, write: bool = False) -> int | None:
  """An fd (writable if `write`) holding `flock(mode)` on the file at
  `path`; None where it is held elsewhere (with LOCK_NB) or, unless
  `create`, missing. Retries while the file at `path` is replaced (its
  remover unlinks it under the lock)."""
  while True:
    try:
      # Read-only unless written: flock needs no more, and `jaxfeed cache
      # ls` may look at a folder it cannot write.
      flags = (os.O_RDWR if write else os.O_RDONLY) | (os.O_CREAT if create else 0)
      fd = os.open(path, flags, 0o644)
    except FileNotFoundError:
      return None
    try:
      fcntl.flock(fd, mode)
    except BlockingIOError:
      os.close(fd)
      return None
    except OSError as e:
      os.close(fd)
      raise OSError(
        e.errno,
        f"cannot lock {path!r} ({e.strerror}): an autocache folder "
        "needs a filesystem with flock locks",
      ) from e
    try:
      if os.stat(path).st_ino == os.fstat(fd).st_ino:
        return fd
    except FileNotFoundError:
      pass
    os.close(fd)
    if not create:
      return None


def _touch(fd: int) -> None:
  try:
    os.utime(fd)
  except OSError:
    pass


class AutocacheFolder:
  """The entries of the autocache folder `path`, under `limits`.

  Several processes may share the folder, each with its own object.
  """

  def __init__(self, path: str, limits: FolderLimits | None = None):
    self.path = os.path.abspath(os.fspath(path))
    self.limits = limits or FolderLimits()
    self._meta = os.path.join(self.path, _META)

  def _meta_dir(self, part: str) -> str:
    path = os.path.join(self._meta, part)
    os.makedirs(path, exist_ok=True)
    return path

  def _lock_path(self, name: str) -> str:
    return os.path.join(self._meta_dir("locks"), name)

  # -- use -------------------------------------------------------------------
  def hold(self, name: str) -> "EntryHold":
    """Marks entry `name` in use until the hold is released."""
    return EntryHold(self, name)

  def reservation(self, temporary_folder: str) -> "WriteReservation":
    """The reservation of the pass writing `temporary_folder` (starts at 0)."""
    return WriteReservation(self, os.path.basename(temporary_folder))

  # -- what is there ---------------------------------------------------------
  def _names(self) -> dict[str, list[str]]:
    """Entry name -> its folders (complete first, then temporary ones)."""
    try:
      listed = sorted(os.scandir(self.path), key=lambda e: e.name)
    except FileNotFoundError:
      return {}
    names: dict[str, list[str]] = {}
    for item in listed:
      if item.name.startswith(".") or not item.is_dir(follow_symlinks=False):
        continue
      name, tmp, _ = item.name.partition(_TMP)
      folders = names.setdefault(name, [])
      if tmp:
        folders.append(item.name)
      else:
        folders.insert(0, item.name)
    return names

  def _is_complete(self, name: str) -> bool:
    # A store kept by record is whole at any time: its blocks are written
    # whole, one by one, while it is read.
    return name.startswith(STORE_PREFIX) or os.path.exists(os.path.join(self.path, name, _MANIFEST))

  def _in_use(self, name: str) -> bool:
    fd = _lock(os.path.join(self._meta, "locks", name), fcntl.LOCK_EX | fcntl.LOCK_NB, create=False)
    if fd is None:
      return os.path.exists(os.path.join(self._meta, "locks", name))
    os.close(fd)
    return False

  def _last_used(self, name: str, folders: list[str]) -> float:
    for path in [
      os.path.join(self._meta, "locks", name),
      *(os.path.join(self.path, f) for f in folders),
    ]:
      try:
        return os.stat(path).st_mtime
      except OSError:
        continue
    return 0.0

  def _reserved(self) -> dict[str, int]:
    """Temporary folder name -> bytes its live writer reserved; forgets the
    reservations of dead writers."""
    out: dict[str, int] = {}
    writes = os.path.join(self._meta, "writes")
    for name in sorted(os.listdir(writes)) if os.path.isdir(writes) else ():
      path = os.path.join(writes, name)
      fd = _lock(path, fcntl.LOCK_EX | fcntl.LOCK_NB, create=False)
      if fd is not None:  # nobody holds it: its writer is gone
        try:
          os.unlink(path)
        except OSError:
          pass  # a folder this process may not write: counted for nothing all the same
        os.close(fd)
        continue
      try:
        with open(path, "rb") as f:
          out[name] = int(f.read(20) or b"0")
      except (OSError, ValueError):
        continue
    return out

  def _entry_bytes(self, folders: list[str], reserved: dict[str, int]) -> int:
    return sum(max(_tree_bytes(os.path.join(self.path, f)), reserved.get(f, 0)) for f in folders)

  def entries(self) -> list[EntryInfo]:
    """The folder's entries, least recently used first."""
    reserved = self._reserved()
    out = []
    for name, folders in self._names().items():
      complete = self._is_complete(name)
      in_use = self._in_use(name)
      state = (
        {True: "reading", False: "idle"} if complete else {True: "writing", False: "abandoned"}
      )[in_use]
      out.append(
        EntryInfo(name, self._entry_bytes(folders, reserved), self._last_used(name, folders), state)
      )
    return sorted(out, key=lambda e: (e.last_used, e.name))

  def used_bytes(self, leave_out: str = "") -> int:
    """Bytes of the entries, reservations and trash, less the temporary
    folder `leave_out` (a writer's own)."""
    reserved = self._reserved()
    total = _tree_bytes(os.path.join(self._meta, "trash"))
    for folders in self._names().values():
      total += self._entry_bytes([f for f in folders if f != leave_out], reserved)
    return total

  # -- removal ---------------------------------------------------------------
  def _remove(self, name: str) -> bool:
    """Removes entry `name` unless it is in use; True if it is gone."""
    lock_path = self._lock_path(name)
    fd = _lock(lock_path, fcntl.LOCK_EX | fcntl.LOCK_NB, create=True)
    if fd is None:
      return False
    trash = self._meta_dir("trash")
    moved = []
    try:
      for folder in self._names().get(name, []):
        target = os.path.join(trash, f"{folder}.{uuid.uuid4().hex[:8]}")
        try:
          os.rename(os.path.join(self.path, folder), target)
          moved.append(target)
        except FileNotFoundError:
          pass
      os.unlink(lock_path)
    finally:
      os.close(fd)
    for target in moved:
      shutil.rmtree(target, ignore_errors=True)
    return True

  def remove(self, names: list[str] | None = None) -> list[str]:
    """Removes the named entries (all of them if None); returns those removed.

    Raises:
      KeyError: a name that is no entry of the folder (nothing removed).
      EntryInUseError: entries in use, named; the others were removed.
    """
    present = self._names()
    if names is None:
      names = list(present)
    missing = [n for n in names if n not in present]
    if missing:
      raise KeyError(
        f"no entry {', '.join(map(repr, missing))} in {self.path!r}; its "
        f"entries: {', '.join(present) or 'none'}"
      )
    removed: list[str] = []
    in_use: list[str] = []
    with self._folder_lock():
      for name in names:
        (removed if self._remove(name) else in_use).append(name)
    if in_use:
      raise EntryInUseError(
        f"{', '.join(map(repr, in_use))} in {self.path!r} "
        f"{'is' if len(in_use) == 1 else 'are'} being read or written by a process "
        f"using the folder; not removed (removed: {', '.join(removed) or 'none'})"
      )
    return removed

  def _folder_lock(self) -> "_FolderLock":
    return _FolderLock(os.path.join(self._meta_dir(""), "folder.lock"))

  def evict(self, need_bytes: int = 0, leave_out: str = "") -> list[str]:
    """Applies the limits: removes abandoned writes, entries unused for
    `ttl_s`, then least recently used entries until `need_bytes` more fit
    within `max_bytes` (counting everything but `leave_out`). Entries in
    use stay. Returns the names removed."""
    with self._folder_lock():
      return self._evict_locked(need_bytes, leave_out)

  def _evict_locked(self, need_bytes: int, leave_out: str) -> list[str]:
    limits = self.limits
    # Under the folder lock nobody is deleting: what trash holds was left
    # by a process that died deleting it.
    trash = os.path.join(self._meta, "trash")
    for item in os.listdir(trash) if os.path.isdir(trash) else ():
      shutil.rmtree(os.path.join(trash, item), ignore_errors=True)
    reserved = self._reserved()
    names = self._names()
    used = 0
    sizes = {}
    for name, folders in names.items():
      sizes[name] = self._entry_bytes([f for f in folders if f != leave_out], reserved)
      used += sizes[name]
    now = time.time()
    order = sorted(names, key=lambda n: (self._is_complete(n), self._last_used(n, names[n]), n))
    removed = []
    for name in order:
      if leave_out and leave_out in names[name]:
        continue
      expired = limits.ttl_s is not None and now - self._last_used(name, names[name]) > limits.ttl_s
      over = limits.max_bytes is not None and used + need_bytes > limits.max_bytes
      if (expired or over or not self._is_complete(name)) and self._remove(name):
        removed.append(name)
        used -= sizes[name]
    # The lock files of entries deleted by hand.
    locks = os.path.join(self._meta, "locks")
    for name in set(os.listdir(locks) if os.path.isdir(locks) else ()) - set(names):
      self._remove(name)
    return removed

  def fits(self, leave_out: str, total_bytes: int) -> bool:
    """Whether a write of `total_bytes` in `leave_out` fits under max_bytes
    now (call under the folder lock, after `evict`)."""
    limit = self.limits.max_bytes
    return limit is None or self.used_bytes(leave_out) + total_bytes <= limit


class _FolderLock:
  """An exclusive lock on the folder's bookkeeping, as a context manager."""

  def __init__(self, path: str):
    self._path = path
    self._fd = -1

  def __enter__(self) -> "_FolderLock":
    self._fd = os.open(self._path, os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(self._fd, fcntl.LOCK_EX)
    return self

  def __exit__(self, *exc: object) -> None:
    os.close(self._fd)


class EntryHold:
  """A shared lock on one entry: it is not removed while held."""

  def __init__(self, folder: AutocacheFolder, name: str):
    self._fd: int | None = None
    try:
      fd = _lock(folder._lock_path(name), fcntl.LOCK_SH, create=True)
    except OSError as e:
      if e.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
        raise
      # A folder this process may not write (a read-only copy) is read as
      # it is: this process could not remove or write entries either.
      logging.warning(
        "Reading autocache folder %s without marking entries in use: %s", folder.path, e
      )
      return
    assert fd is not None  # a blocking lock that may create its file
    self._fd = fd
    _touch(fd)

  def release(self) -> None:
    fd, self._fd = self._fd, None
    if fd is not None:
      _touch(fd)
      os.close(fd)


class WriteReservation:
  """The bytes one pass may write into its temporary folder `name`."""

  def __init__(self, folder: AutocacheFolder, name: str):
    self._folder = folder
    self._name = name
    self._path = os.path.join(folder._meta_dir("writes"), name)
    fd = _lock(self._path, fcntl.LOCK_EX, create=True, write=True)
    assert fd is not None
    self._fd: int | None = fd
    self.reserved = 0

  def grow(self, wanted: int, needed: int) -> bool:
    """Reserves `needed` bytes in all, evicting least recently used entries
    to make room, or up to `wanted` where that fits without evicting more;
    False if not even `needed` fits."""
    folder = self._folder
    with folder._folder_lock():
      folder._evict_locked(needed, self._name)
      for total in (wanted, needed):
        if folder.fits(self._name, total):
          self._write(total)
          return True
    return False

  def _write(self, total: int) -> None:
    assert self._fd is not None
    os.pwrite(self._fd, b"%020d" % total, 0)
    self.reserved = total

  def release(self) -> None:
    fd, self._fd = self._fd, None
    if fd is not None:
      try:
        os.unlink(self._path)
      except FileNotFoundError:
        pass
      os.close(fd)
