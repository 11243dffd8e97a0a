"""`shard`: every `num_shards`-th element from `index` (tf.data's `shard`).

`shard(SHARD_HINT, SHARD_HINT)` is a placeholder (tf.data's
`SHARD_HINT`): a service job with processing mode HINT makes it `shard(n, i)`
on worker i of n (`jaxfeed.service.SHARD_HINT` is this value). Anywhere
else the pipeline fails when it is iterated, saying so.
"""

from __future__ import annotations

from typing import Any

from jaxfeed.ops.base import Node, OpIterator, check_positive_int, graph_nodes, state_int, to_node

__all__ = ["SHARD_HINT", "ShardNode", "ShardIterator", "has_shard_hint"]

_OP = "shard"

SHARD_HINT = -1
"""tf.data's value: `shard(SHARD_HINT, SHARD_HINT)` is filled in by HINT sharding."""


def has_shard_hint(root: Node) -> bool:
  """Whether a pipeline holds a `shard(SHARD_HINT, SHARD_HINT)`."""
  return any(
    isinstance(node, ShardNode) and node.num_shards == SHARD_HINT for node in graph_nodes(root)
  )


class ShardNode(Node):
  """Elements `index, index + num_shards, index + 2 * num_shards, ...`."""

  op_name = _OP

  def __init__(self, parent: Any, num_shards: int, index: int):
    super().__init__([to_node(parent, _OP, "input")])
    if SHARD_HINT in (num_shards, index):
      if num_shards != SHARD_HINT or index != SHARD_HINT:
        raise ValueError(
          f"{_OP}: SHARD_HINT ({SHARD_HINT}) is a placeholder for both "
          f"num_shards and index, as shard(SHARD_HINT, SHARD_HINT); got "
          f"num_shards={num_shards!r}, index={index!r}."
        )
      self.num_shards = self.index = SHARD_HINT
      return
    self.num_shards = check_positive_int(num_shards, _OP, "num_shards")
    index = check_positive_int(index, _OP, "index", allow_zero=True)
    if index >= self.num_shards:
      raise ValueError(f"{_OP}: index must be in [0, num_shards={self.num_shards}), got {index}.")
    self.index = index

  def spec_params(self) -> dict:
    return {"num_shards": self.num_shards, "index": self.index}

  def cardinality(self) -> int | None:
    if self.num_shards == SHARD_HINT:
      return None  # known once the service fills it in
    parent = self.parents[0].cardinality()
    if parent is None or parent < 0:
      return parent
    return max(0, -(-(parent - self.index) // self.num_shards))

  def make_iterator(self) -> "ShardIterator":
    if self.num_shards == SHARD_HINT:
      raise ValueError(
        f"{_OP}(SHARD_HINT, SHARD_HINT) is a placeholder that only a "
        "jaxfeed service job with processing_mode=ShardingPolicy.HINT fills "
        "in (as shard(num_workers, worker_index)); this pipeline runs "
        "elsewhere. Give shard() numbers, or distribute the pipeline with "
        "processing_mode='HINT'."
      )
    return ShardIterator(self.parents[0].make_iterator(), self.num_shards, self.index)


class ShardIterator(OpIterator):
  """Reads and drops the elements of the other shards; state: elements read."""

  op_name = _OP

  def __init__(self, parent: OpIterator, num_shards: int, index: int):
    super().__init__([parent])
    self._num_shards = num_shards
    self._index = index
    self._read = 0

  def __next__(self) -> Any:
    parent = self.parents[0]
    while True:
      element = next(parent)
      position = self._read
      self._read += 1
      if position % self._num_shards == self._index:
        return element

  def _get_own_state(self) -> dict:
    return {"read": self._read}

  def _set_own_state(self, state: dict) -> None:
    self._read = state_int(state, "read", _OP)
