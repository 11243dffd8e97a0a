"""Builds a task's pipeline on a worker: the spec plus the task's sharding.

Static sharding (FILE / DATA) gives the pipeline's sampler ShardOptions(i, n).
DYNAMIC sharding replaces the `from_source` op by a `SplitSourceNode` that
reads the sampler positions of dispatcher-issued ranges. The per-record seeds
stay those of the global sampler, so a record is augmented the same way
whichever worker reads it.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Iterator, NamedTuple, Sequence

import numpy as np

from jaxfeed.ops import base
from jaxfeed.ops import from_source
from jaxfeed.service import spec as spec_lib
from jaxfeed.service.protos import service_pb2 as pb
from jaxfeed.service.sharding import ShardingPolicy

SOURCE_OP = "from_source"
_MAX_CHUNK = 256

FetchRanges = Callable[[], "tuple[list[tuple[int, int]], bool]"]


class SplitEnd(NamedTuple):
  """Exactly-once tasks: every element of the split starting here came before."""
  start: int


class _Waiting:
  def __repr__(self) -> str:
    return "WAITING"


# Exactly-once tasks: no split to read yet, but the job has not ended either.
WAITING = _Waiting()


def _is_sampler(value: Any) -> bool:
  return hasattr(value, "get_many") and hasattr(value, "num_positions")


def find_samplers(node: base.Node) -> list[Any]:
  """The samplers of every from_source op in a graph."""
  found = []
  params = node.spec_params()
  if node.op_name == SOURCE_OP:
    found += [v for v in params.values() if _is_sampler(v)]
  for parent in node.parents:
    found += find_samplers(parent)
  for value in params.values():
    inner = getattr(value, "node", value)
    if isinstance(inner, base.Node):
      found += find_samplers(inner)
  return found


def num_positions(node: base.Node) -> int:
  """Positions DYNAMIC sharding splits: the single sampler's, -1 if unbounded."""
  samplers = find_samplers(node)
  if len(samplers) != 1:
    return -1
  count = samplers[0].num_positions
  return -1 if count is None else int(count)


class SplitSourceNode(base.Node):
  """The records of a source at the sampler positions of fetched ranges."""

  op_name = SOURCE_OP

  def __init__(self, source: Any, sampler: Any, fetch_ranges: FetchRanges):
    super().__init__()
    self.source = source
    self.sampler = sampler
    self.fetch_ranges = fetch_ranges

  def spec_params(self) -> dict:
    return {"source": self.source, "sampler": self.sampler,
            "fetch_ranges": self.fetch_ranges}

  def make_iterator(self) -> "SplitSourceIterator":
    return SplitSourceIterator(self)


class SplitSourceIterator(base.OpIterator):
  """Reads range after range; ends when the dispatcher has no more splits."""

  op_name = SOURCE_OP

  def __init__(self, node: SplitSourceNode):
    super().__init__()
    self._node = node
    self._read_many = from_source.records_reader(node.source)
    self._ranges: list[tuple[int, int]] = []
    self._exhausted = False
    self._records: list = []
    self._seeds = np.zeros(0, np.uint64)
    self._offset = 0
    self._last_seed = 0
    self._records_read = 0

  def __next__(self) -> Any:
    if self._offset >= len(self._records):
      self._read_chunk()
    record = self._records[self._offset]
    self._last_seed = int(self._seeds[self._offset])
    self._offset += 1
    self._records_read += 1
    return record

  def _read_chunk(self) -> None:
    while not self._ranges:
      if self._exhausted:
        raise StopIteration
      ranges, end = self._node.fetch_ranges()
      self._ranges = [(int(a), int(b)) for a, b in ranges if b > a]
      self._exhausted = end or not ranges
    start, stop = self._ranges[0]
    count = min(stop - start, _MAX_CHUNK)
    if start + count < stop:
      self._ranges[0] = (start + count, stop)
    else:
      self._ranges.pop(0)
    _, record_indices, seeds = self._node.sampler.get_many(
        np.arange(start, start + count, dtype=np.int64))
    self._records = self._read_many(record_indices)
    self._seeds = seeds
    self._offset = 0

  @property
  def last_seed(self) -> int:
    return self._last_seed

  def _get_own_state(self) -> dict:
    return {"records_read": self._records_read}

  def _set_own_state(self, state: dict) -> None:
    if state.get("records_read") != self._records_read:
      raise base.PipelineStateError(
          "A DYNAMIC service task cannot be restored to another position: its "
          f"splits come from the dispatcher (state {state}).")


def build_task_node(dataset_def: pb.DatasetDef, task: pb.TaskInfo,
                    udf_secret: bytes | None,
                    fetch_ranges: FetchRanges | None,
                    udf_modules: Sequence[str] = ()) -> base.Node:
  """Rebuilds a task's pipeline with the task's sharding applied (and the
  deployment's allowed UDF modules, see `spec.from_dataset_def`)."""
  policy = ShardingPolicy(task.sharding_policy)
  touched = []

  def rewrite(cls: type, params: dict) -> tuple[type, dict]:
    if getattr(cls, "op_name", None) != SOURCE_OP or policy == ShardingPolicy.OFF:
      return cls, params
    sampler = params.get("sampler")
    source = params.get("source")
    if sampler is None and source is not None:
      from jaxfeed.sampler import IndexSampler  # pylint: disable=g-import-not-at-top
      sampler = IndexSampler(len(source))
    if not _is_sampler(sampler):
      return cls, params
    touched.append(sampler)
    if policy == ShardingPolicy.DYNAMIC:
      return SplitSourceNode, {"source": source, "sampler": sampler,
                               "fetch_ranges": fetch_ranges}
    sampler_params = dict(sampler.spec_params())
    current = dict(sampler_params.get("shard_options") or {})
    if current.get("shard_count", 1) != 1:
      raise spec_lib.SpecError(
          f"{policy.name} sharding shards the pipeline's sampler itself, but it "
          f"is already sharded ({current}); give the pipeline an unsharded sampler.")
    sampler_params["shard_options"] = {"shard_index": task.worker_index,
                                       "shard_count": task.num_workers,
                                       "drop_remainder": False}
    return cls, {**params, "sampler": type(sampler)(**sampler_params)}

  node = spec_lib.from_dataset_def(dataset_def, udf_secret, rewrite, udf_modules)
  if policy != ShardingPolicy.OFF and len(touched) != 1:
    raise spec_lib.SpecError(
        f"{policy.name} sharding needs a pipeline with exactly one "
        f"from_source(source, sampler) op to shard; dataset "
        f"{task.dataset_id!r} has {len(touched)}. Use processing_mode "
        "'parallel_epochs' (OFF) or read records through Dataset.from_source.")
  return node


def close_quietly(iterator: Any, what: str) -> None:
  """Closes a pipeline's iterator (if any), logging instead of raising."""
  if iterator is None or not hasattr(iterator, "close"):
    return
  try:
    iterator.close()
  except Exception:  # pylint: disable=broad-except
    logging.exception("Closing %s failed", what)


def split_by_split(dataset_def: pb.DatasetDef, task: pb.TaskInfo, udf_secret: bytes | None,
                   fetch_ranges: FetchRanges, poll_s: float = 0.05,
                   udf_modules: Sequence[str] = ()) -> Iterator[Any]:
  """An exactly-once task's elements: the pipeline runs on one split at a
  time, so each element belongs to one split (a batch never spans two), and
  `SplitEnd(start)` follows each split's elements. Yields `WAITING` while the
  dispatcher holds the end back: other workers' splits are not yet
  acknowledged and may come back to this task if their worker is lost.
  """
  current: list[tuple[int, int]] = []

  def this_split() -> tuple[list[tuple[int, int]], bool]:
    ranges = list(current)
    current.clear()
    return ranges, True

  node = build_task_node(dataset_def, task, udf_secret, this_split, udf_modules)
  while True:
    ranges, end = fetch_ranges()
    for start, stop in ranges:
      current[:] = [(start, stop)]
      iterator = node.make_iterator()
      try:
        yield from iterator
      finally:
        close = getattr(iterator, "close", None)
        if close is not None:
          close()
      yield SplitEnd(start)
    if end:
      return
    if not ranges:
      yield WAITING
      time.sleep(poll_s)
