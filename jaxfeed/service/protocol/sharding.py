"""Processing modes (tf.data's `ShardingPolicy`) and their option checks."""

from __future__ import annotations

import enum
from typing import Any


class ShardingPolicy(enum.Enum):
  """How a job's data is split among its workers.

  OFF: every worker runs the whole pipeline ("parallel_epochs").
  DYNAMIC: the dispatcher hands out ranges of the positions of the
    pipeline's one index-addressable input (`range`, `from_tensor_slices`,
    `from_source`'s sampler positions, `from_tfrecord`'s files, or a
    `concatenate` / `zip` of those; see `jaxfeed.ops.index_ranges`); each
    position is read by one worker, so with nothing lost every element of
    the epoch is delivered once in total ("distributed_epoch"). Where the
    positions are files (`from_tfrecord([files])`,
    `from_tensor_slices(files).interleave(read)`) a split is one file. The
    ops after that input run on each worker's share; a `repeat` after it is
    refused (repeat the distributed dataset instead).
  FILE: static sharding by files: worker i of n reads files i, i + n, ...
    of the pipeline's file input (`from_tfrecord`, or the input of an
    `interleave` / `flat_map`); a pipeline without one is refused (use DATA
    or FILE_OR_DATA).
  DATA: static sharding by records: worker i of n applies ShardOptions(i, n)
    to the pipeline's `from_source` sampler; a pipeline without one keeps
    elements i, i + n, ... of its output.
  FILE_OR_DATA: FILE when the pipeline reads files, else DATA.
  HINT: every `shard(SHARD_HINT, SHARD_HINT)` of the pipeline becomes
    `shard(n, i)` on worker i of n (`jaxfeed.service.SHARD_HINT`).

  The static policies fix a job's workers when it starts (the dispatcher's
  `num_workers`, or its `worker_addresses` in their order).
  """

  OFF = "OFF"
  DYNAMIC = "DYNAMIC"
  FILE = "FILE"
  DATA = "DATA"
  FILE_OR_DATA = "FILE_OR_DATA"
  HINT = "HINT"

  @property
  def is_static(self) -> bool:
    return self in _STATIC


_STATIC = frozenset(
  {ShardingPolicy.FILE, ShardingPolicy.DATA, ShardingPolicy.FILE_OR_DATA, ShardingPolicy.HINT}
)

_ALIASES = {"parallel_epochs": ShardingPolicy.OFF, "distributed_epoch": ShardingPolicy.DYNAMIC}


def to_sharding_policy(value: Any) -> ShardingPolicy:
  """Accepts a ShardingPolicy, its name, or tf.data's mode strings."""
  if isinstance(value, ShardingPolicy):
    return value
  if isinstance(value, str):
    if value in _ALIASES:
      return _ALIASES[value]
    if value.upper() in ShardingPolicy.__members__:
      return ShardingPolicy[value.upper()]
  raise ValueError(
    f"Unknown processing_mode {value!r}; allowed: 'parallel_epochs', "
    "'distributed_epoch' or a jaxfeed.service.ShardingPolicy "
    "(OFF, DYNAMIC, FILE, DATA, FILE_OR_DATA, HINT)."
  )
