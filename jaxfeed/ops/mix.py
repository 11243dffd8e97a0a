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

from typing import Any, Callable, Mapping, Sequence

from jaxfeed.mixture import MixtureSampler, merge_mixture_states
from jaxfeed.ops import mixing
from jaxfeed.ops.from_source import SourceNode
from jaxfeed.sampler import IndexSampler, ShardOptions
from jaxfeed.sources.concat_source import ConcatSource

__all__ = ["align_mixture_states", "mix_node"]

_OP = "mix"


def mix_node(
  datasets: Sequence[Any],
  weights: Any = None,
  *,
  seed: int = 0,
  shard_options: ShardOptions | Mapping[str, Any] | None = None,
) -> SourceNode:
  """The `from_source` node of the mixture (see `Dataset.mix`)."""
  nodes = mixing.check_datasets(datasets, _OP)
  samplers = []
  for i, node in enumerate(nodes):
    sampler = getattr(node, "sampler", None)
    if not isinstance(node, SourceNode) or not isinstance(sampler, IndexSampler):
      what = (
        f"a from_source with a {type(sampler).__name__}"
        if isinstance(node, SourceNode)
        else f"op {node.op_name!r}"
      )
      raise TypeError(
        f"{_OP}: datasets[{i}] is {what}; mix chooses records by position, "
        "so each component must be Dataset.from_source(source, sampler) with "
        "an IndexSampler and no op after it (apply map, filter, ... to the "
        "mixture)."
      )
    samplers.append(sampler)
  try:
    sampler = MixtureSampler(samplers, weights, seed=seed, shard_options=shard_options)
  except (TypeError, ValueError) as e:
    raise type(e)(f"{_OP}: {e}") from None
  return SourceNode(ConcatSource([node.source for node in nodes]), sampler)


def align_mixture_states(states: Sequence[Any]) -> list:
  """The states of all processes, ready to restore with new mixture weights.

  Restored into a `mix` with other weights, a state needs to say from which
  global position on the new weights apply: one that no process had read
  yet. Given the states that processes `0 .. H-1` saved at one checkpoint
  (`Loader.get_state()` or pipeline states; a list of one for one process),
  this returns them in the same order with every mixture state in them set
  to switch at the furthest position any of them reached, so that process
  `h` can restore element `h`. Nothing else changes: unlike
  `reshard_loader_states`, it works for every pipeline (open `pack` rows,
  replay anchors, buffers, ...), on the same number of processes.

  Raises:
    ValueError: the states hold different numbers of mixtures or their weight
      histories differ.
  """
  found: list[list] = []
  for state in states:
    found.append([])
    _map_mixtures(state, lambda m, f=found[-1]: f.append(m) or m)
  if any(len(f) != len(found[0]) for f in found):
    raise ValueError(
      f"align_mixture_states: the processes' states hold different numbers "
      f"of mixtures: {[len(f) for f in found]}."
    )
  # One switch position for every snapshot of every mixture: an op's replay
  # anchor holds an older snapshot of the same mixture, which must switch
  # where the newest one does.
  furthest = max((merge_mixture_states(f)["frontier"] for f in found if f), default=0)
  merged = [merge_mixture_states([f[i] for f in found], furthest) for i in range(len(found[0]))]
  aligned = []
  for state in states:
    replacements = iter(merged)
    aligned.append(_map_mixtures(state, lambda m, replacements=replacements: next(replacements)))
  return aligned


def _map_mixtures(state: Any, fn: Callable[[dict], dict]) -> Any:
  """`state` (a Loader or pipeline state) with `fn` applied to each mixture
  state in it, depth first, own state before parents."""
  if isinstance(state, dict):
    out = {}
    for key, value in state.items():
      if (
        key == "own"
        and state.get("op") == SourceNode.op_name
        and isinstance(value, dict)
        and "mixture" in value
      ):
        out[key] = {**value, "mixture": fn(value["mixture"])}
      else:
        out[key] = _map_mixtures(value, fn)
    return out
  if isinstance(state, list):
    return [_map_mixtures(item, fn) for item in state]
  return state
