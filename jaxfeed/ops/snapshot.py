"""`snapshot`: persists a pipeline's output once and reads it back after.

Like tf.data's `snapshot(path)`: the first complete pass writes the input's
elements under `path`; later iterations (in this process or any other) read
them from there instead of running the input. The snapshot lives in
`path/<fingerprint of the input>`, so a changed pipeline writes a new one
instead of reading a stale one.

It is the on-disk `cache` under that directory: written under a temporary name
and renamed into place only when the pass is complete, so a process killed
mid-write leaves no partial snapshot behind (the next pass writes it anew),
and reads resume exactly from the state (`{"mode": "read", "index": i}`).
"""

from __future__ import annotations

import os
from typing import Any

from etils import epath

from jaxfeed.ops import cache
from jaxfeed.ops.base import to_node

__all__ = ["SnapshotNode"]


class SnapshotNode(cache.CacheNode):
  """The input's elements, persisted under `path` on the first full pass."""

  op_name = "snapshot"

  def __init__(self, parent: Any, path: str | os.PathLike):
    if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
      raise TypeError(f"snapshot: path must be a non-empty str or path, got {path!r}.")
    node = to_node(parent, "snapshot", "input")
    self.path = os.fspath(path)
    super().__init__(node, os.fspath(epath.Path(self.path) / node.fingerprint()))

  def spec_params(self) -> dict:
    return {"path": self.path}

  def make_iterator(self) -> Any:
    iterator = super().make_iterator()
    iterator.op_name = self.op_name
    return iterator
