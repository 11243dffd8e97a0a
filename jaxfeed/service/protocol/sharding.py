"""Processing modes (tf.data's `ShardingPolicy`) and their option checks."""

from __future__ import annotations

import enum
from typing import Any


class ShardingPolicy(enum.Enum):
  """How a job's data is split among its workers.

  OFF: every worker runs the whole pipeline ("parallel_epochs").
  DYNAMIC: the dispatcher hands out ranges of the positions of the
    pipeline's one index-addressable input (`range`, `from_tensor_slices`,
    `from_source`'s sampler positions, or a `concatenate` / `zip` of those;
    see `jaxfeed.ops.index_ranges`); each position is read by one worker, so
    with nothing lost every element of the epoch is delivered once in total
    ("distributed_epoch"). The ops after that input run on each worker's
    share: a `repeat` there ends with the distributed epoch, where tf.data
    service would start another (use the sampler's `num_epochs`).
  FILE / DATA: static sharding, worker i of n applies ShardOptions(i, n) to
    the pipeline's sampler (for record sources the two coincide).
  """

  OFF = "OFF"
  DYNAMIC = "DYNAMIC"
  FILE = "FILE"
  DATA = "DATA"

  @property
  def is_static(self) -> bool:
    return self in (ShardingPolicy.FILE, ShardingPolicy.DATA)


_ALIASES = {"parallel_epochs": ShardingPolicy.OFF,
            "distributed_epoch": ShardingPolicy.DYNAMIC}


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
      "(OFF, DYNAMIC, FILE, DATA).")
