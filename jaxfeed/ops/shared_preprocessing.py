"""Shared preprocessing: an `autocache` that follows per-record deterministic
ops over `from_source` keeps their results by record index.

For `from_source(source, sampler)` followed by `map` (per element) and
`filter` ops, then `autocache()`, the ops' result for record i depends on
record i alone, not on the sampler. So the results are kept in a
`RecordStore` keyed by the fingerprint of the source and those ops (their
functions by code), not of the sampler: jobs with other seeds, shuffles,
shards, epochs or sampling schemes read the same store, each record is
preprocessed about once across all of them, and each still sees exactly the
elements, in exactly the order, its own pipeline defines. A record a filter
drops is kept as dropped.

The pipeline then runs as `from_source(PreprocessedSource, sampler)` (and a
filter of the dropped records): the sampler, its state and its resume are
those of the pipeline as written. What is computed on a miss is computed in
the reading thread, a block of records at a time (`record_store.BLOCK`),
whatever `num_parallel_calls` the ops asked for.
"""

from __future__ import annotations

import os
from typing import Any

from jaxfeed.ops import fingerprint as fingerprint_lib
from jaxfeed.ops.base import Node
from jaxfeed.ops.filter import FilterNode, predicate_result
from jaxfeed.ops.from_source import SourceNode
from jaxfeed.ops.index_ranges import RangesNode
from jaxfeed.ops.map import MapNode
from jaxfeed.ops.map_and_filter import MapAndFilterNode
from jaxfeed.ops.record_store import RecordStore
from jaxfeed.ops.udf_args import call_unpacked
from jaxfeed.sources.base import source_identity

__all__ = [
  "Dropped",
  "PreprocessedSource",
  "per_record_chain",
  "store_key",
  "shared_graph",
  "STORE_PREFIX",
]

STORE_PREFIX = "records-"
"""A store's folder in an autocache folder: this, then its key."""

_KEY_PARAMS = {"map": ("fn",), "filter": ("predicate",), "map_and_filter": ("fn", "predicate")}
"""What of each op decides its output (not how parallel it runs)."""


class Dropped:
  """A record a filter dropped, as the store keeps it."""

  def __reduce__(self) -> str:
    return "DROPPED"


DROPPED = Dropped()


def _kept(*element: Any) -> bool:
  """Whether a record was kept (a tuple element comes unpacked, as filter
  hands it to predicates)."""
  return not (len(element) == 1 and element[0] is DROPPED)


def per_record_chain(node: Node) -> tuple[Node, list[Node]] | None:
  """(the `from_source` node, or the ranges a service task reads of it; the
  ops above it, in order) when `node` is such a chain of per-record
  deterministic ops, else None."""
  ops: list[Node] = []
  while True:
    if type(node) is SourceNode or (
      type(node) is RangesNode and type(node.parents[0]) is SourceNode
    ):
      return node, ops[::-1]
    if type(node) is MapNode:
      if node.batched or node.writes_out:
        return None
    elif type(node) not in (FilterNode, MapAndFilterNode):
      return None
    ops.append(node)
    node = node.parents[0]


def store_key(source: Any, ops: list[Node]) -> fingerprint_lib.Fingerprint:
  """The fingerprint of `source` and what `ops` compute of each record."""
  key = fingerprint_lib.node_fingerprint("records", {"source": source}, [])
  for op in ops:
    params = {name: getattr(op, name) for name in _KEY_PARAMS[op.op_name]}
    key = fingerprint_lib.node_fingerprint(op.op_name, params, [key])
  return key


def preprocess(ops: list[Node], element: Any) -> Any:
  """`ops` applied to one record: the element, or DROPPED."""
  for op in ops:
    if type(op) is not FilterNode:
      element = call_unpacked(op.fn, element)  # type: ignore[attr-defined]
    if type(op) is not MapNode:
      predicate = op.predicate  # type: ignore[attr-defined]
      if not predicate_result(predicate, call_unpacked(predicate, element), "filter"):
        return DROPPED
  return element


class PreprocessedSource:
  """`source` with `ops` applied to each record, kept in a `RecordStore`."""

  def __init__(
    self,
    source: Any,
    ops: list[Node],
    directory: str,
    key: str,
    policy: str = "auto",
    job: str = "",
  ):
    self.source, self.ops, self.key = source, ops, key
    self.store = RecordStore(directory, len(source), self._compute, policy, job)

  def _compute(self, start: int, stop: int) -> list:
    get_many = getattr(self.source, "get_many", None)
    indices = list(range(start, stop))
    records = get_many(indices) if get_many is not None else [self.source[i] for i in indices]
    return [preprocess(self.ops, record) for record in records]

  def __len__(self) -> int:
    return len(self.source)

  def __getitem__(self, index: int) -> Any:
    return self.store.get(int(index))

  def get_many(self, indices: Any) -> list:
    get = self.store.get
    return [get(int(i)) for i in indices]

  def identity(self) -> dict:
    return {"preprocessed": self.key, "source": source_identity(self.source)}


def shared_graph(node: Node, directory: str, policy: str = "auto", job: str = "") -> Node | None:
  """`node` (an autocache's input) reading through a store in `directory`,
  or None when its ops are not a per-record chain over `from_source` (or a
  function in them cannot be fingerprinted by content)."""
  chain = per_record_chain(node)
  if chain is None:
    return None
  bottom, ops = chain
  ranges = bottom if type(bottom) is RangesNode else None
  source_node = bottom.parents[0] if ranges is not None else bottom
  assert isinstance(source_node, SourceNode)
  key = store_key(source_node.source, ops)
  if not key.reproducible:
    return None
  source = PreprocessedSource(
    source_node.source, ops, os.path.join(directory, f"{STORE_PREFIX}{key}"), key, policy, job
  )
  new: Node = SourceNode(source, source_node.sampler)
  new.iterations = source_node.iterations  # type: ignore[attr-defined]
  if ranges is not None:
    new = RangesNode(new, ranges.fetch_ranges)  # type: ignore[attr-defined]
  if any(type(op) is not MapNode for op in ops):
    new = FilterNode(new, _kept)
  return new
