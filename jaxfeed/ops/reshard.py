"""Folding the pipeline states of N processes into one that M processes
resume (`reshard_states`): the records the old processes had not read, and
those a `pack` held, are dealt out to the new ones (see
`jaxfeed.resharded_sampler.ReshardedSampler`)."""

from __future__ import annotations

from typing import Any

from jaxfeed.mixture import merge_mixture_states
from jaxfeed.ops import pack as pack_lib
from jaxfeed.ops.base import state_int
from jaxfeed.resharded_sampler import RESHARD_STATE_VERSION

__all__ = ["reshard_states"]

_SOURCE = "from_source"

# Ops whose state at a batch boundary holds nothing but their parent's: a
# pipeline of these over from_source can be resumed on another number of
# processes. Map-like ops must have nothing in flight.
_RESHARDABLE = {_SOURCE, *pack_lib.ELASTIC_INPUT_OPS, "batch", "padded_batch"}
_AT_REST = ({}, {"skip": 0, "consumed_ahead": []})
# `pack` (with its `pack_split` under it) may appear once: it names the
# elements it holds, which go back into the global order.
_PACK_OPS = ("pack", pack_lib.SPLIT_OP)
_ELASTIC = sorted(_RESHARDABLE | {"pack"})


def _source_positions(state: Any) -> list:
  """The `from_source` own states anywhere inside `state` (replay anchors)."""
  found = []
  if isinstance(state, dict):
    if state.get("op") == _SOURCE and isinstance(state.get("own"), dict):
      found.append(state["own"])
    for value in state.values():
      found.extend(_source_positions(value))
  elif isinstance(state, list):
    for value in state:
      found.extend(_source_positions(value))
  return found


def _check_identities(identities: list) -> None:
  """Raises ValueError unless state `h` was saved by shard `h` of
  `len(identities)` of one pipeline (states saved before states recorded
  their pipeline are not checked)."""
  count = len(identities)
  for h, identity in enumerate(identities):
    if identity is None:
      continue
    sampler = identity.get("sampler", {}) if isinstance(identity, dict) else {}
    shard = (sampler.get("shard_index"), sampler.get("shard_count"))
    if shard != (h, count):
      raise ValueError(
        f"reshard: state {h} of {count} was saved by shard {shard[0]} of "
        f"{shard[1]}; pass every process's state, in process order."
      )
    same = {**identity, "sampler": {**sampler, "shard_index": 0}}
    first = identities[0]
    if first is not None and same != {**first, "sampler": {**first["sampler"], "shard_index": 0}}:
      raise ValueError(
        f"reshard: the states of processes 0 and {h} were saved by "
        f"different pipelines: {first} and {identity}."
      )


def reshard_states(states: list[dict]) -> dict:
  """One pipeline state that resumes, on any number of processes, the run
  whose process `h` of `len(states)` saved `states[h]`.

  The pipeline must be a chain of `from_source` (with an `IndexSampler`
  sharded by process, e.g. `ShardByJaxProcess()`, or a `Dataset.mix`),
  `map`, `random_map`, `filter`, at most one `pack` and `batch` /
  `padded_batch`. Restored into such a pipeline on process `i` of `M`, it
  reads the records the old processes had not read, each once over all new
  processes (see `jaxfeed.resharded_sampler.ReshardedSampler`); the records a `pack`
  held but had not emitted count as unread, and of a record it had partly
  emitted (`overflow="split"`) only the missing pieces are packed.

  Raises:
    ValueError: naming the op when a state cannot be resharded (an op that
      holds elements of its own shard, e.g. a `shuffle` buffer, or a state
      already resharded whose dealt-out epochs are not finished).
  """
  positions = []
  iterations = []
  identities = []
  mixtures = []
  chains = []
  pending = []
  keep: list[list] = []
  for process, state in enumerate(states):
    chain = []
    node = state
    held: dict | None = None
    while True:
      if not isinstance(node, dict) or "op" not in node:
        raise ValueError(
          f"reshard: process {process}'s pipeline state is not an op state: {str(node):.200}."
        )
      op = node["op"]
      own = node.get("own")
      parents = node.get("parents", [])
      if (op not in _RESHARDABLE and op not in _PACK_OPS) or len(parents) > 1:
        raise ValueError(
          f"reshard: op {op!r} cannot be resumed on another number of "
          f"processes (it may hold elements read from its own process's "
          f"shard); only chains of {_ELASTIC} (with at most one pack) "
          f"can. Resume with {len(states)} processes, or shuffle globally "
          "with IndexSampler(shuffle=True) instead of a shuffle buffer."
        )
      chain.append(op)
      if op == _SOURCE:
        if any("resharded" in s for s in [own] + (held or {}).get("anchors", [])):
          raise ValueError(
            f"reshard: process {process}'s state was itself resumed on "
            "another number of processes and has not finished the epochs "
            "dealt out then; resume it with the same number of processes."
          )
        positions.append(state_int(own, "position", _SOURCE, 0))
        iterations.append(own.get("iteration", 0))
        identities.append(own.get("identity"))
        mixtures.append(own.get("mixture"))
        if held is not None:
          seeds, partial = pack_lib.unemitted_elements(held["own"])
          keep.extend(partial)
          start = min(
            [positions[-1]] + [state_int(s, "position", _SOURCE, 0) for s in held["anchors"]]
          )
          pending.append({"from": start, "seeds": seeds})
        break
      if op in _PACK_OPS:
        if op == "pack" and held is not None:
          raise ValueError(
            f"reshard: process {process}'s pipeline packs twice; only one "
            "pack can be resumed on another number of processes."
          )
        if op == "pack":
          held = {"own": own, "anchors": []}
        held["anchors"].extend(_source_positions(own))
      elif own not in _AT_REST or not parents:
        raise ValueError(
          f"reshard: op {op!r} of process {process} has elements in flight "
          f"(state {own!r}); only a state taken between batches with "
          "nothing in flight can be resumed on another number of processes."
        )
      node = parents[0]
    chains.append(chain)
  if any(chain != chains[0] for chain in chains):
    raise ValueError(f"reshard: the processes' pipelines differ: {chains}.")
  if any(i != iterations[0] for i in iterations):
    raise ValueError(
      f"reshard: the processes' states are in different iterations (epochs "
      f"of the Loader) {iterations}; they must be taken at the same step."
    )
  _check_identities(identities)
  resharded = {"version": RESHARD_STATE_VERSION, "shard_count": len(states), "positions": positions}
  if pending:
    resharded["pending"] = pending
  else:
    resharded["unread"] = [[] for _ in positions]
  own: dict[str, Any] = {"position": 0, "resharded": resharded}
  if iterations[0]:
    own["iteration"] = iterations[0]
  if identities[0] is not None:
    own["identity"] = identities[0]  # Any shard restores it (resharded).
  if any(m is not None for m in mixtures):
    own["mixture"] = merge_mixture_states(mixtures)
  fresh = {
    "pack": pack_lib.resumed_pack_state(),
    pack_lib.SPLIT_OP: pack_lib.resumed_split_state(keep),
  }

  def rebuild(node: dict) -> dict:
    if node["op"] == _SOURCE:
      return {**node, "own": own}
    return {
      **node,
      "own": fresh.get(node["op"], node["own"]),
      "parents": [rebuild(node["parents"][0])],
    }

  return rebuild(states[0])
