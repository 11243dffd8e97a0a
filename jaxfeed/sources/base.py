"""The random-access record source protocol shared by every source.

A source is a fixed-length, random-access sequence of records: `len(src)`,
`src[i]` and the batched `src.get_many(indices)`. Records are `bytes` for the
file formats and pytrees of numpy arrays for in-memory data. Sources are
picklable: file handles are never pickled, they are opened lazily in whichever
process reads (a forked or unpickled copy opens its own).
"""

from __future__ import annotations

import json
import operator
import os
import threading
import weakref
from typing import Any, Callable, Iterable, Sequence

from etils import epath
import numpy as np

__all__ = ["CorruptRecordError", "RecordSource"]


class CorruptRecordError(ValueError):
  """A record file is corrupt or truncated.

  Attributes:
    path: The file, as a string.
    offset: Byte offset in the file where the damage was found (the start of
      the damaged record or chunk), or None when the reader cannot tell.
    record_index: Index of the damaged record within the file, if known.
    reason: What is wrong, without the path and offset.
    end: Where the damaged bytes end: bytes [offset, end) hold no readable
      record and reading goes on at `end` (None where unknown, e.g. a
      compressed stream that cannot be decompressed further).
    kind: What is wrong, as one word where the reader knows it:
      "length_crc", "data_crc", "truncated", "beyond_end", "decompress" or
      "compression" (TFRecord).
  """

  def __init__(
    self,
    path: Any,
    offset: int | None,
    reason: str,
    record_index: int | None = None,
    end: int | None = None,
    kind: str | None = None,
  ):
    self.path = os.fspath(path)
    self.offset = None if offset is None else int(offset)
    self.record_index = None if record_index is None else int(record_index)
    self.reason = reason
    self.end = None if end is None else int(end)
    self.kind = kind
    where = "at an unknown byte offset" if offset is None else (f"at byte offset {self.offset}")
    if record_index is not None:
      where += f" (record {self.record_index} of the file)"
    message = f"Corrupt record file {self.path} {where}: {reason}"
    if self.damaged_bytes is not None:
      message += (
        f" [bytes {self.offset} to {self.end} ({self.damaged_bytes} bytes) hold no readable record]"
      )
    super().__init__(message)

  @property
  def damaged_bytes(self) -> int | None:
    """How many bytes the damage spans, where known."""
    if self.offset is None or self.end is None:
      return None
    return self.end - self.offset

  def __reduce__(self):
    # Exceptions pickle their `args` by default, which would lose the fields;
    # worker processes send these errors to the consumer.
    return (
      type(self),
      (self.path, self.offset, self.reason, self.record_index, self.end, self.kind),
    )


class RecordSource:
  """Base class of random-access record sources.

  Subclasses implement `__len__`, `_read(index)` (index already validated)
  and `spec_params()`; they override `_read_many(indices)` with a faster
  batched read. Sources over files derive from `HandleSource`, which closes
  their handles.

  Contract:
    * `len(src)` is the number of records, fixed for the source's lifetime.
    * `src[i]` returns record `i` for `0 <= i < len(src)`; any other index
      (negative ones included) raises IndexError naming the index and length.
    * `src.get_many(indices)` returns `[src[i] for i in indices]` (a list, in
      the requested order, duplicates allowed), reading in storage order.
    * `close()` releases file handles; it is idempotent and a later read
      reopens the files. Sources are context managers.
    * Sources pickle without their open handles.
    * `spec_params()` returns the constructor keyword arguments, JSON-able
      (paths as strings), so `type(src)(**src.spec_params())` rebuilds it.
    * `fingerprint_params()` returns JSON-able values that, with
      `spec_params()`, identify the records (sources over files: each file's
      size and modification time), so graph fingerprints change when a file
      is rewritten at the same path.
    * `identity()` returns cheap JSON-able facts (file names, array shapes)
      that pipeline states record and check on restore.
    * `repr(src)` is stable across processes and runs: no memory addresses.
  """

  def __len__(self) -> int:
    raise NotImplementedError

  def _read(self, index: int) -> Any:
    raise NotImplementedError

  def _read_many(self, indices: np.ndarray) -> list:
    """Reads validated int64 indices; subclasses batch and sort the reads."""
    return [self._read(i) for i in indices.tolist()]

  def spec_params(self) -> dict:
    raise NotImplementedError

  def fingerprint_params(self) -> dict:
    """What identifies the records beyond `spec_params()` (see the contract)."""
    return {}

  def identity(self) -> dict:
    """Cheap JSON-able facts that tell these records from others' without
    reading any: a pipeline state records them and a restore checks them.
    Sources over files give their file names (not directories, so data
    copied elsewhere still matches)."""
    paths = getattr(self, "paths", None)
    if paths is None:
      return {}
    return {"files": [os.path.basename(os.fspath(p).rstrip("/")) for p in paths]}

  def __getitem__(self, index: int) -> Any:
    return self._read(check_index(index, len(self), type(self).__name__))

  def get_many(self, indices: Sequence[int] | np.ndarray) -> list:
    """Records at `indices`, in the requested order."""
    return self._read_many(check_indices(indices, len(self), type(self).__name__))

  def __iter__(self):
    for i in range(len(self)):
      yield self._read(i)

  def close(self) -> None:
    """Releases open file handles. Idempotent; later reads reopen them."""

  def __enter__(self) -> "RecordSource":
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  def __repr__(self) -> str:
    params = json.dumps(self.spec_params(), sort_keys=True)
    return f"{type(self).__name__}({params})"


def source_identity(source: Any) -> dict:
  """A source's type, number of records and `identity()` (for any object
  with `__len__`; no record is read)."""
  identity = {"type": type(source).__name__, "num_records": len(source)}
  facts = getattr(source, "identity", None)
  if callable(facts):
    identity.update(facts())
  return identity


def check_index(index: Any, length: int, source_name: str) -> int:
  """Returns `index` as an int, or raises IndexError / TypeError."""
  if isinstance(index, (bool, np.bool_)):
    raise TypeError(f"{source_name}: record index must be an integer, got {index!r}.")
  try:
    i = operator.index(index)
  except TypeError:
    raise TypeError(
      f"{source_name}: record index must be an integer, got {type(index).__name__}: {index!r}."
    ) from None
  if i < 0 or i >= length:
    raise IndexError(
      f"{source_name}: record index {i} is out of range for a source of "
      f"{length} records (allowed: 0 <= index < {length})."
    )
  return i


def check_indices(indices: Any, length: int, source_name: str) -> np.ndarray:
  """Returns `indices` as a 1-D int64 array, or raises IndexError/TypeError."""
  array = np.asarray(indices)
  if array.size == 0:
    return np.zeros(0, np.int64)
  if array.ndim != 1 or array.dtype.kind not in "iu":
    raise TypeError(
      f"{source_name}: get_many needs a 1-D sequence of integer indices, "
      f"got an array of dtype {array.dtype} and shape {array.shape}."
    )
  low, high = array.min(), array.max()
  if low < 0 or high >= length:
    bad = int(low) if low < 0 else int(high)
    raise IndexError(
      f"{source_name}: record index {bad} is out of range for a source of "
      f"{length} records (allowed: 0 <= index < {length})."
    )
  return array.astype(np.int64, copy=False)


def as_path_list(paths: Any, source_name: str) -> list[epath.Path]:
  """One path or a sequence of paths (str / os.PathLike) as epath Paths."""
  if isinstance(paths, (str, os.PathLike)):
    paths = [paths]
  elif not isinstance(paths, Iterable):
    raise TypeError(
      f"{source_name}: paths must be a path or a sequence of paths, got "
      f"{type(paths).__name__}: {paths!r}."
    )
  paths = list(paths)
  if not paths:
    raise ValueError(f"{source_name}: paths is empty; give at least one file.")
  out = []
  for p in paths:
    if not isinstance(p, (str, os.PathLike)):
      raise TypeError(
        f"{source_name}: every path must be a str or os.PathLike, got {type(p).__name__}: {p!r}."
      )
    out.append(epath.Path(p))
  return out


def check_files_exist(paths: Sequence[epath.Path], source_name: str) -> None:
  for p in paths:
    if not p.exists():
      raise FileNotFoundError(f"{source_name}: file {p} does not exist.")
    if p.is_dir():
      raise IsADirectoryError(f"{source_name}: {p} is a directory; give record files.")


def is_local(path: epath.Path) -> bool:
  """True for paths on the local filesystem (no URI scheme like gs://)."""
  return "://" not in os.fspath(path)


def file_stamp(path: epath.Path) -> tuple[int, int]:
  """(size, mtime in ns) of a file; remote filesystems give whole seconds."""
  if is_local(path):
    st = os.stat(path)
    return st.st_size, st.st_mtime_ns
  st = path.stat()
  return int(st.length), int(st.mtime) * 1_000_000_000


def files_fingerprint_params(paths: Sequence[Any]) -> dict:
  """`fingerprint_params()` of a source over `paths`: each file's stamp."""
  return {"file_stamps": [list(file_stamp(epath.Path(p))) for p in paths]}


def split_by_file(indices: np.ndarray, file_starts: np.ndarray):
  """Groups global record indices by file, in storage order.

  Args:
    indices: validated int64 global indices.
    file_starts: int64 array of length num_files + 1; file f holds global
      indices [file_starts[f], file_starts[f + 1]).

  Yields:
    (file_number, positions_in_file, output_slots): positions sorted
    ascending, `output_slots[k]` is where the record at `positions[k]` goes.
  """
  order = np.argsort(indices, kind="stable")
  ordered = indices[order]
  bounds = np.searchsorted(ordered, file_starts, side="left")
  for f in range(len(file_starts) - 1):
    lo, hi = bounds[f], bounds[f + 1]
    if lo < hi:
      yield f, ordered[lo:hi] - file_starts[f], order[lo:hi]


def file_of(index: int, file_starts: np.ndarray) -> int:
  """The file number that holds global record `index`."""
  return int(np.searchsorted(file_starts, index, side="right")) - 1


class LazyHandle:
  """A file handle opened on first use in each process.

  `get()` opens it (thread-safely) on first use; a copy inherited through
  fork or pickle opens its own instead of sharing the parent's. `close()`
  releases it; a later `get()` reopens. Pickles without the handle, so
  `opener` and `closer` must be picklable (module-level functions or
  `functools.partial` of them).
  """

  def __init__(self, opener: Callable[[], Any], closer: Callable[[Any], None]):
    self._opener = opener
    self._closer = closer
    self._handle = None
    self._pid = os.getpid()
    self._lock = threading.Lock()

  def get(self) -> Any:
    handle = self._handle
    if handle is not None and self._pid == os.getpid():
      return handle
    if self._pid != os.getpid():
      self._forget_inherited()
    with self._lock:
      if self._handle is None:
        self._handle = self._opener()
      return self._handle

  def _forget_inherited(self) -> None:
    # The parent's lock may have been held by one of its threads at fork
    # time, so it is replaced, never acquired.
    inherited, self._handle = self._handle, None
    self._lock = threading.Lock()
    self._pid = os.getpid()
    if inherited is not None:
      try:
        self._closer(inherited)  # closes this process's copy only
      except Exception:  # pylint: disable=broad-except
        pass  # it belonged to the parent; nothing to report here

  @property
  def is_open(self) -> bool:
    return self._handle is not None and self._pid == os.getpid()

  def close(self) -> None:
    if self._pid != os.getpid():
      self._forget_inherited()
      return
    with self._lock:
      handle, self._handle = self._handle, None
    if handle is not None:
      self._closer(handle)

  def __getstate__(self) -> dict:
    return {"_opener": self._opener, "_closer": self._closer}

  def __setstate__(self, state: dict) -> None:
    self.__init__(state["_opener"], state["_closer"])


def close_handles(handles: Iterable[LazyHandle]) -> None:
  """Closes every handle (used by sources' close() and finalizers)."""
  for handle in handles:
    handle.close()


class HandleSource(RecordSource):
  """A source over files opened through `LazyHandle`s.

  Subclasses return their handles from `_handles()` and call
  `_track_handles()` once they exist: `close()`, garbage collection and
  unpickling then all treat them alike.
  """

  def _handles(self) -> list[LazyHandle]:
    raise NotImplementedError

  def _track_handles(self) -> None:
    self._finalizer = weakref.finalize(self, close_handles, self._handles())

  def close(self) -> None:
    close_handles(self._handles())

  def __getstate__(self) -> dict:
    state = self.__dict__.copy()
    del state["_finalizer"]
    return state

  def __setstate__(self, state: dict) -> None:
    self.__dict__.update(state)
    self._track_handles()


def as_record_bytes(record: Any, writer_name: str, path: Any, index: int) -> bytes:
  """A bytes-like record (bytes, bytearray, memoryview, ndarray) as bytes."""
  if isinstance(record, bytes):
    return record
  if isinstance(record, (bytearray, memoryview)):
    return bytes(record)
  if isinstance(record, np.ndarray):
    return record.tobytes()
  raise TypeError(
    f"{writer_name}({os.fspath(path)}): record {index} must be bytes-like "
    f"(bytes, bytearray, memoryview, numpy array), got "
    f"{type(record).__name__}."
  )
