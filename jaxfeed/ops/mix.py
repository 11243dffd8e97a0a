"""`mix`: an index-level weighted mixture of `from_source` datasets.

Unlike `sample_from_datasets`, which draws from its inputs' iterators, `mix`
works on record positions: its components are `from_source` datasets, whose
samplers it combines into one `jaxfeed.mixture.MixtureSampler` over their
sources read as one (`ConcatSource`). The result is a `from_source` dataset,
so it is sharded, addressed by position (service splits), checkpointed and
resumed on another number of processes like any sampler pipeline; ops that
transform records (`map`, `filter`, ...) go after the mixture.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from jaxfeed.mixture import MixtureSampler
from jaxfeed.ops import mixing
from jaxfeed.ops.from_source import SourceNode
from jaxfeed.sampler import IndexSampler, ShardOptions
from jaxfeed.sources.concat_source import ConcatSource

__all__ = ["mix_node"]

_OP = "mix"


def mix_node(datasets: Sequence[Any], weights: Any = None, *, seed: int = 0,
             shard_options: ShardOptions | Mapping[str, Any] | None = None
             ) -> SourceNode:
  """The `from_source` node of the mixture (see `Dataset.mix`)."""
  nodes = mixing.check_datasets(datasets, _OP)
  samplers = []
  for i, node in enumerate(nodes):
    sampler = getattr(node, "sampler", None)
    if not isinstance(node, SourceNode) or not isinstance(sampler, IndexSampler):
      what = (f"a from_source with a {type(sampler).__name__}"
              if isinstance(node, SourceNode) else f"op {node.op_name!r}")
      raise TypeError(
          f"{_OP}: datasets[{i}] is {what}; mix chooses records by position, "
          "so each component must be Dataset.from_source(source, sampler) with "
          "an IndexSampler and no op after it (apply map, filter, ... to the "
          "mixture).")
    samplers.append(sampler)
  try:
    sampler = MixtureSampler(samplers, weights, seed=seed,
                             shard_options=shard_options)
  except (TypeError, ValueError) as e:
    raise type(e)(f"{_OP}: {e}") from None
  return SourceNode(ConcatSource([node.source for node in nodes]), sampler)

