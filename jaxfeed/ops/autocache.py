"""`autocache`: marks where a pipeline's output may be kept and reused.

Where its input is `from_source` followed by per-record deterministic ops
(`map`, `filter`), the results are kept by record index in a folder that
jobs with other samplers share (see `jaxfeed.ops.shared_preprocessing`):
locally with `autocache(directory=DIR)`, or on jaxfeed service workers
started with `--autocache_dir=DIR`, for every kind of job, splits of
`distributed_epoch` jobs included. Any other input, on a worker with
`--autocache_dir` (or with a local `directory`), is kept whole at
`DIR/<fingerprint of the op's input>`, as `cache(filename=...)` keeps it: the
first task whose pass over the input completes writes the cache, and every
later task — of this job or any other job whose pipeline has the same input
subgraph, on any worker sharing DIR — reads it instead of running the input
again; tasks of `distributed_epoch` jobs never complete a pass and pass such
inputs through. Without a folder, autocache passes elements through.

Whether a point is cached at all is the autocache policy's call
(`jaxfeed.ops.autocache_policy`; the op's `policy`, or a worker's
`--autocache_policy`): with "auto", the default, a pass computes, writes or
reads by what each costs at that point, measured; "always" caches every
point; "never" computes every point.

The input's fingerprint covers its ops, their parameters, the code of its
UDFs, the size and modification time of its source files, and the shard a
static (FILE / DATA) task reads, so different inputs never share a cache (see
`jaxfeed.ops.fingerprint`). An input whose fingerprint is not reproducible (a
UDF holds an object that cannot be hashed by content) passes through: no later
task could find its cache. As with `cache`, put `autocache` before random
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

from jaxfeed.ops import autocache_policy, shared_preprocessing
from jaxfeed.ops.autocache_entry import AutocacheEntryIterator
from jaxfeed.ops.autocache_folder import AutocacheFolder, EntryHold
from jaxfeed.ops.base import Node, OpIterator, graph_nodes, to_node
from jaxfeed.ops.cache import CacheNode

__all__ = ["AutocacheNode", "AutocacheIterator", "point_at"]

_OP = "autocache"


class AutocacheNode(Node):
  """Its input's elements; cached on disk where a service worker says so."""

  op_name = _OP

  def __init__(self, parent: Any, directory: str | None = None, policy: str | None = None):
    super().__init__([to_node(parent, _OP, "input")])
    if directory is not None and (not isinstance(directory, str) or not directory):
      raise ValueError(
        f"{_OP}: directory must be a non-empty folder path or None, got {directory!r}."
      )
    if policy is not None and policy not in autocache_policy.POLICIES:
      raise ValueError(
        f"{_OP}: policy must be one of {', '.join(map(repr, autocache_policy.POLICIES))} "
        f"or None ('auto'), got {policy!r}."
      )
    # Set by service workers (never part of the spec), or given locally.
    self.cache_dir = directory or ""
    self.policy = policy or "auto"
    self.job = ""  # the job's name in metrics (service workers)
    self.records_only = False  # pass through unless kept by record
    self._folder: AutocacheFolder | None = None  # with a worker's limits

  def folder(self) -> AutocacheFolder:
    """The folder's bookkeeping (`jaxfeed.ops.autocache_folder`)."""
    if self._folder is None or self._folder.path != os.path.abspath(self.cache_dir):
      self._folder = AutocacheFolder(self.cache_dir)
    return self._folder

  def spec_params(self) -> dict:
    return {}

  def local_params(self) -> dict:
    params: dict = {"directory": self.cache_dir} if self.cache_dir else {}
    if self.policy != "auto":
      params["policy"] = self.policy
    return params

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

  def _link(self) -> None:
    """Groups this point with the points of its input (one pipeline: only
    the one that saves most caches; see `jaxfeed.ops.autocache_policy`)."""
    below = [n.cache_path() for n in graph_nodes(self.parents[0]) if isinstance(n, AutocacheNode)]
    mine = self.cache_path()
    if mine is None:
      return
    points = [autocache_policy.point(self.cache_dir, os.path.basename(mine))]
    for path in below:
      if path is not None:
        points.append(autocache_policy.point(os.path.dirname(path), os.path.basename(path)))
    autocache_policy.link(points)

  def make_iterator(self) -> OpIterator:
    if self.cache_dir:
      shared = shared_preprocessing.shared_graph(
        self.parents[0], self.cache_dir, self.policy, self.job
      )
      if shared is not None:
        [source] = [
          s
          for s in (getattr(n, "source", None) for n in graph_nodes(shared))
          if isinstance(s, shared_preprocessing.PreprocessedSource)
        ]
        return AutocacheIterator(
          shared.make_iterator(), self.folder(), os.path.basename(source.store.directory)
        )
    path = None if self.records_only else self.cache_path()
    if path is not None:
      parent = self.parents[0]
      # The on-disk store `cache(filename=path)` reads and writes.
      store = CacheNode(parent, path)._store  # pylint: disable=protected-access
      self._link()
      return AutocacheEntryIterator(
        parent.make_iterator(),
        store,
        self.folder(),
        os.path.basename(path),
        self.policy,
        self.job,
      )
    return AutocacheIterator(self.parents[0].make_iterator())


class AutocacheIterator(OpIterator):
  """Passes its input through (no state of its own); given a folder and an
  entry, holds the entry in use from its first element to its end."""

  op_name = _OP

  def __init__(self, parent: OpIterator, folder: AutocacheFolder | None = None, entry: str = ""):
    super().__init__([parent])
    self._parent = parent
    self._folder = folder
    self._entry = entry
    self._hold: EntryHold | None = None

  def __next__(self) -> Any:
    if self._hold is None and self._folder is not None:
      self._hold = self._folder.hold(self._entry)
    try:
      return next(self._parent)
    except BaseException:
      self._release()
      raise

  def _release(self) -> None:
    hold, self._hold = self._hold, None
    if hold is not None:
      hold.release()

  def _close_own(self) -> None:
    self._release()


def point_at(
  node: Node,
  folder: str | AutocacheFolder,
  records_only: bool = False,
  policy: str | None = None,
  job: str = "",
) -> list[AutocacheNode]:
  """Points every autocache op of a graph at `folder` (a path: a folder
  without limits); returns them. `records_only`: only those kept by record
  index (see `jaxfeed.ops.shared_preprocessing`) use it, the others pass
  through (a task that reads splits never completes a pass of its input).
  `policy` (one of `autocache_policy.POLICIES`) replaces the ops' own;
  `job` names the job in the policy's decision counts."""
  if not isinstance(folder, AutocacheFolder):
    folder = AutocacheFolder(folder)
  found = [current for current in graph_nodes(node) if isinstance(current, AutocacheNode)]
  for current in found:
    current.cache_dir = folder.path
    current._folder = folder  # pylint: disable=protected-access
    current.records_only = records_only
    current.job = job
    if policy is not None:
      current.policy = policy
  return found
