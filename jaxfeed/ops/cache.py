"""`cache`: keeps the elements of the first full pass, in memory or on disk.

tf.data semantics: the first pass that reaches the end of the input fills the
cache; later iterations of the same dataset (for example each epoch under
`repeat`) read from it instead of running the input again. A pass that stops
early, or whose input raises, leaves the cache empty.

On disk (`filename` given), the cache is a directory of chunk files and a
manifest, written under a temporary name and renamed into place once the
pass is complete (see `cache_disk`).

Elements handed out from the cache are shared with it (memory) or views of the
loaded chunk (disk): do not modify them in place.
"""

from __future__ import annotations

import os
import threading
from typing import Any

from jaxfeed.ops import cache_disk, parallel
from jaxfeed.ops.base import Node, OpIterator, PipelineStateError, check_state

__all__ = ["CacheNode", "CacheIterator"]


class CacheNode(Node):
  """The elements of its input, cached on the first complete pass.

  Args:
    parent: the input node.
    filename: "" caches in memory (shared by every iterator of this node);
      otherwise the directory of the on-disk cache (see the module docstring).
  """

  op_name = "cache"

  def __init__(self, parent: Node, filename: str | os.PathLike = ""):
    super().__init__([parent])
    if not isinstance(filename, (str, os.PathLike)):
      raise TypeError(
        f"cache: filename must be a str or path ('' for an in-memory "
        f"cache), got {type(filename).__name__}: {filename!r}."
      )
    self.filename = os.fspath(filename)
    self._store = cache_disk.DiskStore(self.filename) if self.filename else _MemoryStore()

  def make_iterator(self) -> "CacheIterator":
    return CacheIterator(self.parents[0].make_iterator(), self._store)

  def spec_params(self) -> dict:
    return {"filename": self.filename}

  def cardinality(self) -> int | None:
    return self.parents[0].cardinality()


# -- stores -------------------------------------------------------------------
class _MemoryStore:
  """The in-memory cache of one node."""

  def __init__(self):
    self._lock = threading.Lock()
    self._elements: list | None = None
    self._seeds: list | None = None

  def describe(self) -> str:
    return "in-memory cache"

  def is_complete(self) -> bool:
    return self._elements is not None

  def writer(self) -> "_MemoryWriter":
    return _MemoryWriter(self)

  def publish(self, elements: list, seeds: list) -> None:
    with self._lock:
      if self._elements is None:
        self._elements, self._seeds = elements, seeds

  def reader(self) -> "_MemoryReader":
    return _MemoryReader(self._elements, self._seeds)


class _MemoryWriter:
  def __init__(self, store: _MemoryStore):
    self._store = store
    self._elements: list = []
    self._seeds: list = []

  def add(self, element: Any, seed: int) -> None:
    self._elements.append(element)
    self._seeds.append(seed)

  def publish(self) -> None:
    self._store.publish(self._elements, self._seeds)

  def abort(self) -> None:
    self._elements = self._seeds = []


class _MemoryReader:
  def __init__(self, elements: list, seeds: list):
    self._elements = elements
    self._seeds = seeds
    self.num_elements = len(elements)

  def get(self, index: int) -> tuple[Any, int]:
    return self._elements[index], self._seeds[index]


# -- iterator -----------------------------------------------------------------
_START, _FILL, _READ = "start", "fill", "read"


class CacheIterator(OpIterator):
  """Iterator of `CacheNode`.

  State: `{"mode": "fill", "count": n}` with the parent's state while the
  input is being read (n elements returned), or `{"mode": "read", "index":
  i}` with the parent's untouched initial state while reading the cache. A
  "read" state restored where the cache is missing (an in-memory cache in a
  new process) rebuilds it first by running the input from that initial state.
  A "fill" state restored mid-pass continues from the input but does not fill
  the cache (the elements before the checkpoint are not available); the next
  complete pass does.
  """

  op_name = "cache"

  def __init__(self, parent: OpIterator, store: Any):
    super().__init__([parent])
    self._parent = parent
    self._store = store
    self._mode = _START
    self._count = 0  # elements returned while filling
    self._index = 0  # next cache index while reading
    self._writer: Any = None
    self._reader: Any = None
    self._read_parent_state: Any = None
    self._last_seed = 0

  def _begin(self) -> None:
    if self._store.is_complete():
      self._read_parent_state = self._parent.get_state()
      self._reader = self._store.reader()
      self._mode, self._index = _READ, 0
    else:
      self._writer = self._store.writer()
      self._mode, self._count = _FILL, 0

  def _rebuild(self) -> None:
    """Fills a missing cache from the input's initial state."""
    if not self._store.is_complete():
      writer = self._store.writer()
      parent = self._parent
      for element in parent:
        writer.add(element, parent.last_seed)
      writer.publish()
    self._reader = self._store.reader()
    if self._index > self._reader.num_elements:
      raise PipelineStateError(
        f"cache: the state reads element {self._index} of the "
        f"{self._store.describe()}, which holds "
        f"{self._reader.num_elements} elements."
      )

  def __next__(self) -> Any:
    if self._mode == _READ:
      reader = self._reader
      if reader is None:
        self._rebuild()
        reader = self._reader
      index = self._index
      if index >= reader.num_elements:
        raise StopIteration
      element, self._last_seed = reader.get(index)
      self._index = index + 1
      return element
    if self._mode == _START:
      self._begin()
      return self.__next__()
    try:
      element = next(self._parent)
    except StopIteration:
      if self._writer is not None:
        writer, self._writer = self._writer, None
        try:
          writer.publish()
        except BaseException:
          writer.abort()
          raise
      raise
    except BaseException:
      self._abort_writer()  # A pass with a failure must not be cached.
      raise
    if self._writer is not None:
      try:
        self._writer.add(element, self._parent.last_seed)
      except BaseException:
        self._abort_writer()
        raise
    self._count += 1
    return element

  def skip_elements(self, count: int) -> int:
    """Skips up to `count` elements (at no cost while reading the cache)."""
    if self._mode != _READ or self._reader is None:
      # Filling: every element must reach the cache.
      return parallel.skip_outputs(self, count)
    skipped = max(0, min(count, self._reader.num_elements - self._index))
    self._index += skipped
    if skipped:
      self._last_seed = self._reader.get(self._index - 1)[1]
    return skipped

  @property
  def last_seed(self) -> int:
    if self._mode == _READ:
      return self._last_seed
    return self._parent.last_seed

  def _abort_writer(self) -> None:
    if self._writer is not None:
      writer, self._writer = self._writer, None
      writer.abort()

  # -- state ---------------------------------------------------------------
  def get_state(self) -> dict:
    if self._mode == _READ:
      return {
        "op": self.op_name,
        "own": {"mode": _READ, "index": self._index},
        "parents": [self._read_parent_state],
      }
    return {
      "op": self.op_name,
      "own": {"mode": _FILL, "count": self._count},
      "parents": [self._parent.get_state()],
    }

  def set_state(self, state: dict) -> None:
    check_state(state, self.op_name, 1)
    own = state.get("own")
    position_key = {_FILL: "count", _READ: "index"}.get(
      own.get("mode") if isinstance(own, dict) else None
    )
    position = own.get(position_key) if position_key else None
    if not isinstance(position, int) or isinstance(position, bool) or position < 0:
      raise PipelineStateError(
        f"Cannot restore op 'cache': 'own' must be {{'mode': 'fill', "
        f"'count': n}} or {{'mode': 'read', 'index': i}}, got {own!r}."
      )
    self._abort_writer()
    self._parent.set_state(state["parents"][0])
    self._reader = None
    if own["mode"] == _READ:
      self._mode, self._index = _READ, position
      self._read_parent_state = state["parents"][0]
    elif position == 0:
      self._mode, self._count = _START, 0
    else:
      self._mode, self._count = _FILL, position

  def _close_own(self) -> None:
    self._abort_writer()
    self._reader = None
