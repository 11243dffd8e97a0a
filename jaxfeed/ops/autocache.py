"""`autocache`: marks where a pipeline's output may be kept and reused.

In a local pipeline it passes elements through. On a jaxfeed service worker
started with `--autocache_dir=DIR`, the worker points each autocache op of a
task at `DIR/<fingerprint of the op's input>`, and the op then behaves as
`cache(filename=...)`: the first task whose pass over the input completes
writes the cache, and every later task — of this job or any other job whose
pipeline has the same input subgraph, on any worker sharing DIR — reads it
instead of running the input again.

The input's fingerprint covers its ops, their parameters, the code of its
UDFs, the size and modification time of its source files, and the shard a
static (FILE / DATA) task reads, so different inputs never share a cache (see
`jaxfeed.ops.fingerprint`). An input whose fingerprint is not reproducible (a
UDF holds an object that cannot be hashed by content) passes through: no later
task could find its cache. Tasks of `distributed_epoch` jobs read different splits every time
and pass through. As with `cache`, put `autocache` before random
augmentation and before `repeat` (an endless input never completes a pass),
and do not modify the elements it hands out in place.

A worker's `--autocache_max_bytes` and `--autocache_ttl_s` bound the folder
(least recently used entries go first; an entry being read or written, by
any process sharing the folder, is never removed): see
`jaxfeed.ops.autocache_folder`. `jaxfeed cache ls|rm DIR` lists and removes
entries.
"""

from __future__ import annotations

import os
from typing import Any

from jaxfeed.ops.autocache_entry import AutocacheEntryIterator
from jaxfeed.ops.autocache_folder import AutocacheFolder
from jaxfeed.ops.base import Node, OpIterator, graph_nodes, to_node
from jaxfeed.ops.cache import CacheNode

__all__ = ["AutocacheNode", "AutocacheIterator", "point_at"]

_OP = "autocache"


class AutocacheNode(Node):
  """Its input's elements; cached on disk where a service worker says so."""

  op_name = _OP

  def __init__(self, parent: Any):
    super().__init__([to_node(parent, _OP, "input")])
    # Set on service workers, never part of the spec.
    self.folder: AutocacheFolder | None = None

  @property
  def cache_dir(self) -> str:
    return self.folder.path if self.folder is not None else ""

  def spec_params(self) -> dict:
    return {}

  def cardinality(self) -> int | None:
    return self.parents[0].cardinality()

  def cache_path(self) -> str | None:
    """Where the input's output is kept; None where it is not cached."""
    if not self.cache_dir:
      return None
    fingerprint = self.parents[0].fingerprint()
    if not fingerprint.reproducible:
      return None
    return os.path.join(self.cache_dir, fingerprint)

  def make_iterator(self) -> OpIterator:
    path = self.cache_path()
    if path is not None and self.folder is not None:
      parent = self.parents[0]
      # The on-disk store `cache(filename=path)` reads and writes.
      store = CacheNode(parent, path)._store  # pylint: disable=protected-access
      return AutocacheEntryIterator(parent.make_iterator(), store, self.folder,
                                    os.path.basename(path))
    return AutocacheIterator(self.parents[0].make_iterator())


class AutocacheIterator(OpIterator):
  """Passes its input through (no state of its own)."""

  op_name = _OP

  def __init__(self, parent: OpIterator):
    super().__init__([parent])
    self._parent = parent

  def __next__(self) -> Any:
    return next(self._parent)


def point_at(node: Node, folder: str | AutocacheFolder) -> list[AutocacheNode]:
  """Points every autocache op of a graph at `folder` (a path: one without
  limits); returns them."""
  if not isinstance(folder, AutocacheFolder):
    folder = AutocacheFolder(folder)
  found = [current for current in graph_nodes(node) if isinstance(current, AutocacheNode)]
  for current in found:
    current.folder = folder
  return found
