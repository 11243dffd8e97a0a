"""Builds a task's pipeline on a worker: the spec plus the task's sharding.

Static sharding (FILE / DATA) gives the pipeline's sampler ShardOptions(i, n).
DYNAMIC sharding wraps the sampler in a `SplitSampler` that maps the
pipeline's positions onto position ranges fetched from the dispatcher; the
per-record seeds stay those of the global sampler, so a record is augmented
the same way whichever worker reads it.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

import numpy as np

from jaxfeed.ops import base
from jaxfeed.service import spec as spec_lib
from jaxfeed.service.protos import service_pb2 as pb
from jaxfeed.service.sharding import ShardingPolicy

SOURCE_OP = "from_source"


class SplitsExhausted(Exception):
  """The dispatcher has no more splits for this job."""


def _is_sampler(value: Any) -> bool:
  return hasattr(value, "get_many") and hasattr(value, "num_positions")


def find_samplers(node: base.Node) -> list[Any]:
  """The samplers of every from_source node in a graph."""
  found = []
  if node.op_name == SOURCE_OP:
    found += [v for v in node.spec_params().values() if _is_sampler(v)]
  for parent in node.parents:
    found += find_samplers(parent)
  for value in node.spec_params().values():
    inner = getattr(value, "node", value)
    if isinstance(inner, base.Node) and inner is not node:
      found += find_samplers(inner)
  return found


def num_positions(node: base.Node) -> int:
  """Positions DYNAMIC sharding splits: those of the single sampler, -1 if unbounded."""
  samplers = find_samplers(node)
  if len(samplers) != 1:
    return -1
  count = samplers[0].num_positions
  return -1 if count is None else int(count)


class SplitSampler:
  """A sampler whose positions come from dispatcher-issued ranges.

  Local position k is the k-th position of the concatenated ranges; looking
  past the last range fetches more, and past the job's end raises IndexError
  like an exhausted sampler.
  """

  def __init__(self, inner: Any, fetch_ranges: Callable[[], tuple[list, bool]]):
    self.inner = inner
    self._fetch = fetch_ranges
    self._lock = threading.Lock()
    self._starts: list[int] = []   # local start of each range
    self._globals: list[int] = []  # global start of each range
    self._local_end = 0
    self._exhausted = False

  num_positions = None  # unknown in advance: ends when splits run out

  @property
  def num_records(self) -> int:
    return self.inner.num_records

  def _ensure(self, local_stop: int) -> None:
    with self._lock:
      while self._local_end < local_stop and not self._exhausted:
        ranges, end = self._fetch()
        for start, stop in ranges:
          self._starts.append(self._local_end)
          self._globals.append(start)
          self._local_end += stop - start
        if end or not ranges:
          self._exhausted = end

  def _to_global(self, positions: np.ndarray) -> np.ndarray:
    idx = np.searchsorted(np.asarray(self._starts), positions, side="right") - 1
    return np.asarray(self._globals)[idx] + (positions - np.asarray(self._starts)[idx])

  def get_many(self, positions: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    positions = np.asarray(positions, dtype=np.int64).reshape(-1)
    if positions.size == 0:
      return self.inner.get_many(positions)
    high = int(positions.max())
    self._ensure(high + 1)
    if high >= self._local_end:
      raise IndexError(f"Position {high} is past the end of this worker's "
                       f"splits ({self._local_end} positions).")
    return self.inner.get_many(self._to_global(positions))

  def __getitem__(self, position: int) -> Any:
    self._ensure(int(position) + 1)
    if position >= self._local_end or position < 0:
      raise IndexError(f"Position {position} is past the end of this worker's "
                       f"splits ({self._local_end} positions).")
    return self.inner[int(self._to_global(np.asarray([position]))[0])]

  def spec_params(self) -> dict:
    return self.inner.spec_params()


def build_task_node(dataset_def: pb.DatasetDef, task: pb.TaskInfo,
                    udf_secret: bytes | None,
                    fetch_ranges: Callable[[], tuple[list, bool]] | None) -> base.Node:
  """Rebuilds a task's pipeline with the task's sharding applied."""
  policy = ShardingPolicy(task.sharding_policy)
  touched = []

  def rewrite(cls: type, params: dict) -> dict:
    if getattr(cls, "op_name", None) != SOURCE_OP or policy == ShardingPolicy.OFF:
      return params
    params = dict(params)
    for name, value in params.items():
      if not _is_sampler(value):
        continue
      touched.append(name)
      if policy.is_static:
        sampler_params = dict(value.spec_params())
        current = sampler_params.get("shard_options") or {}
        if dict(current).get("shard_count", 1) != 1:
          raise spec_lib.SpecError(
              f"{policy.name} sharding shards the pipeline's sampler itself, "
              f"but it is already sharded ({current}); use an unsharded sampler.")
        sampler_params["shard_options"] = {"shard_index": task.worker_index,
                                           "shard_count": task.num_workers,
                                           "drop_remainder": False}
        params[name] = type(value)(**sampler_params)
      else:
        params[name] = SplitSampler(value, fetch_ranges)
    return params

  node = spec_lib.from_dataset_def(dataset_def, udf_secret, rewrite)
  if policy != ShardingPolicy.OFF and len(touched) != 1:
    raise spec_lib.SpecError(
        f"{policy.name} sharding needs a pipeline with exactly one "
        f"from_source(source, sampler) op to shard; dataset "
        f"{task.dataset_id!r} has {len(touched)}. Use processing_mode "
        "'parallel_epochs' (OFF) or read records through Dataset.from_source "
        "with an IndexSampler.")
  return node
