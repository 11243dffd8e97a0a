"""`MixtureSampler`: an index-level weighted mixture of `IndexSampler`s.

Part of the sampler layer (beside `jaxfeed/sampler.py`). Position `q` of the
mixture's global order maps to `(component c, position i of c)` as a pure
function of `(seed, q, weights)`; component `c`'s position `i` is then looked
up in its own `IndexSampler`, so every component keeps its global shuffle and
reads its positions in order: nothing of a component repeats within its
epochs, and a component's records come out exactly in its sampler's order.

The schedule (`jaxfeed.mixture_schedule`) chooses a component per position so
that the weights' proportions hold exactly at every prefix, the same on every
machine.

Weights may change when a pipeline is restored: positions before the switch
point keep their mapping, the new weights apply from it on, and each
component's position counter carries over, so no component position is used
twice. The history is a list of segments `[start, integer weights]`, saved in
the pipeline state (see `from_source`) with the shard's frontier; the switch
point is the furthest frontier of all shards' states, which
`jaxfeed.align_mixture_states` (or resharding) writes into them.

Sharding works on the mixture, never on its components: the global positions
are laid out like the epochs of an unshuffled `IndexSampler` (one epoch of all
positions when the mixture ends, epochs of `BLOCK` positions when it is
endless), and shard `h` of `H` takes the positions that sampler gives it. So a
mixture resumes on another number of shards like any sampler pipeline
(`jaxfeed.resharded_sampler.ReshardedSampler` deals out the unread positions).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

from jaxfeed.mixture_schedule import MAX_WEIGHT_TOTAL, Schedule, integer_weights
from jaxfeed.resharded_sampler import ReshardedSampler
from jaxfeed.sampler import IndexSampler, RecordMetadata, ShardOptions
from jaxfeed.seeding import mix_seeds

__all__ = ["MIXTURE_STATE_VERSION", "MixtureSampler", "merge_mixture_states"]

MIXTURE_STATE_VERSION = 1
# Global positions per epoch of an endless mixture's position layout: the
# most positions a resume on another number of shards deals out at once.
BLOCK = 1 << 20
_OP = "MixtureSampler"


class MixtureSampler:
  """Positions of a weighted mixture of components, each an `IndexSampler`.

  Args:
    components: one unsharded `IndexSampler` per component (its records,
      shuffle, seed and epochs).
    weights: one weight >= 0 per component (any scale), not all 0; None:
      equal weights.
    seed: the seed of the schedule.
    shard_options: which shard of the mixture this process reads
      (`ShardOptions`, a mapping of its fields, or None for all of it).
      `drop_remainder` only matters when the mixture ends.
    segments: the weight history, `[[start, integer weights], ...]` with
      `start` 0 first; restored pipelines pass it (see `restored`). None: the
      weights apply from position 0.

  The mixture ends (when its components do) at the first position whose
  component has no positions left; it is endless when every component with a
  weight > 0 in the last segment is.
  """

  def __init__(
    self,
    components: Sequence[IndexSampler],
    weights: Any = None,
    *,
    seed: int = 0,
    shard_options: ShardOptions | Mapping[str, Any] | None = None,
    segments: Sequence[Sequence[Any]] | None = None,
  ):
    if (
      isinstance(components, (str, bytes, Mapping))
      or not isinstance(components, Sequence)
      or not components
    ):
      raise TypeError(
        f"{_OP}: components must be a non-empty list of IndexSamplers, got {components!r:.200}."
      )
    for i, component in enumerate(components):
      if not isinstance(component, IndexSampler):
        raise TypeError(
          f"{_OP}: components[{i}] must be an IndexSampler, got {type(component).__name__}."
        )
      if component.shard_options.shard_count != 1:
        raise ValueError(
          f"{_OP}: components[{i}] is sharded ({component.shard_options}); "
          "shard the mixture (shard_options=...), not its components, so "
          "every shard reads one global mixture."
        )
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
      raise ValueError(f"{_OP}: seed must be an integer, got {seed!r}.")
    self._components = tuple(components)
    self._weights = integer_weights(weights, len(components))
    self._seed = int(seed)
    if shard_options is None:
      shard_options = ShardOptions(0, 1)
    elif isinstance(shard_options, Mapping):
      shard_options = ShardOptions(**shard_options)
    elif not isinstance(shard_options, ShardOptions):
      raise ValueError(
        f"{_OP}: shard_options must be a ShardOptions, a mapping "
        f"of its fields or None, got {type(shard_options).__name__}."
      )
    self._shard = ShardOptions(
      shard_options.shard_index, shard_options.shard_count, shard_options.drop_remainder
    )
    self._segments = self._check_segments(
      [[0, list(self._weights)]] if segments is None else segments
    )
    self._schedules = [Schedule(tuple(w), self._seed, j) for j, (_, w) in enumerate(self._segments)]
    self._starts = np.array([s for s, _ in self._segments], np.int64)
    # Each component's position count at the start of each segment.
    self._bases = [[0] * len(components)]
    for j in range(1, len(self._segments)):
      span = self._segments[j][0] - self._segments[j - 1][0]
      self._bases.append(
        [b + c for b, c in zip(self._bases[-1], self._schedules[j - 1].counts(span))]
      )
    self._offsets = np.cumsum([0] + [c.num_records for c in components])
    self._total = self._length()
    endless = self._total is None
    self._layout = IndexSampler(
      BLOCK if endless else self._total,
      num_epochs=None if endless else 1,
      shard_options=ShardOptions(
        self._shard.shard_index, self._shard.shard_count, self._shard.drop_remainder and not endless
      ),
    )
    self._positions: Any = self._layout  # A ReshardedSampler after `reshard`.

  def _check_segments(self, segments: Any) -> list[list[Any]]:
    count = len(self._components)
    ok = isinstance(segments, (list, tuple)) and bool(segments)
    checked = []
    previous = -1
    for segment in segments if ok else ():
      if not (
        isinstance(segment, (list, tuple))
        and len(segment) == 2
        and isinstance(segment[0], int)
        and segment[0] > previous
        and isinstance(segment[1], (list, tuple))
        and len(segment[1]) == count
        and all(isinstance(w, int) and w >= 0 for w in segment[1])
        and 0 < sum(segment[1]) <= MAX_WEIGHT_TOTAL
      ):
        ok = False
        break
      previous = segment[0]
      checked.append([segment[0], [int(w) for w in segment[1]]])
    if not ok or checked[0][0] != 0:
      raise ValueError(
        f"{_OP}: segments must be [[start, weights], ...] with starts "
        f"increasing from 0 and {count} integer weights >= 0 (not all 0) "
        f"each, got {str(segments):.200}."
      )
    return checked

  # -- shape ---------------------------------------------------------------
  @property
  def components(self) -> tuple[IndexSampler, ...]:
    return self._components

  @property
  def weights(self) -> tuple[int, ...]:
    """The weights of the last segment, as integers."""
    return tuple(self._segments[-1][1])

  @property
  def segments(self) -> list[list[Any]]:
    """The weight history, `[[start, integer weights], ...]`."""
    return [[s, list(w)] for s, w in self._segments]

  @property
  def seed(self) -> int:
    return self._seed

  @property
  def shard_options(self) -> ShardOptions:
    return self._shard

  @property
  def num_records(self) -> int:
    """The components' records together (record `offset_c + r` is component
    `c`'s record `r`)."""
    return int(self._offsets[-1])

  @property
  def total_positions(self) -> int | None:
    """Global positions of the mixture over all shards; None when endless."""
    return self._total

  @property
  def num_positions(self) -> int | None:
    """This shard's positions; None when endless."""
    return self._positions.num_positions

  def __len__(self) -> int:
    num = self.num_positions
    if num is None:
      raise TypeError(f"{self!r} is endless and has no length.")
    return num

  def _length(self) -> int | None:
    """The first global position whose component has no positions left."""
    sizes = [c.num_positions for c in self._components]

    def exhausted(m: int) -> bool:
      return any(
        size is not None and count > size for size, count in zip(sizes, self.component_counts(m))
      )

    last_start, last_weights = self._segments[-1]
    if exhausted(last_start):  # It ended before the last weights applied.
      low, high = 0, last_start
    elif all(size is None for size, w in zip(sizes, last_weights) if w):
      return None
    else:
      low, high = last_start, last_start + 1
      while not exhausted(high):
        low, high = high, last_start + 2 * (high - last_start)
    # exhausted(m) is monotone: False at low, True at high.
    while high - low > 1:
      middle = (low + high) // 2
      if exhausted(middle):
        high = middle
      else:
        low = middle
    return low

  # -- lookups ---------------------------------------------------------------
  def component_counts(self, m: int) -> list[int]:
    """How many positions of each component the first `m` global positions
    use."""
    j = int(np.searchsorted(self._starts, m, side="right")) - 1
    counts = self._schedules[j].counts(m - self._segments[j][0])
    return [b + c for b, c in zip(self._bases[j], counts)]

  def locate(self, global_positions: Any) -> tuple[np.ndarray, np.ndarray]:
    """`(component, position within the component)` of global positions."""
    q = np.asarray(global_positions, np.int64).reshape(-1)
    components = np.zeros(q.size, np.int64)
    indices = np.zeros(q.size, np.int64)
    segment_of = np.searchsorted(self._starts, q, side="right") - 1
    for j in np.unique(segment_of).tolist():
      which = np.flatnonzero(segment_of == j)
      c, i = self._schedules[j].locate(q[which] - self._segments[j][0])
      components[which] = c
      indices[which] = i + np.asarray(self._bases[j], np.int64)[c]
    return components, indices

  def global_positions(self, positions: Any) -> np.ndarray:
    """The global mixture positions of this shard's positions."""
    epochs, within, _ = self._positions.get_many(positions)
    return epochs * self._layout.num_records + within

  def get_many(self, positions: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`(epochs, record_indices, rng_seeds)` like `IndexSampler.get_many`: the
    component's epoch, the record in the components' joint numbering and the
    component's seed for it (mixed with the component number after the
    first, so a sampler mixed in twice gives distinct seeds)."""
    positions = np.asarray(positions)
    shape = positions.shape
    components, indices = self.locate(self.global_positions(positions.reshape(-1)))
    epochs = np.zeros(components.size, np.int64)
    records = np.zeros(components.size, np.int64)
    seeds = np.zeros(components.size, np.uint64)
    for c in np.unique(components).tolist():
      which = np.flatnonzero(components == c)
      e, r, s = self._components[c].get_many(indices[which])
      epochs[which] = e
      records[which] = r + self._offsets[c]
      seeds[which] = s if c == 0 else mix_seeds(s, c)
    return epochs.reshape(shape), records.reshape(shape), seeds.reshape(shape)

  def __getitem__(self, position: int) -> RecordMetadata:
    epochs, records, seeds = self.get_many(np.array([position], np.int64))
    return RecordMetadata(int(position), int(epochs[0]), int(records[0]), int(seeds[0]))

  # -- resuming --------------------------------------------------------------
  def frontier(self, position: int) -> int:
    """A global position from which on this shard has read nothing, when it
    is about to read its `position`."""
    num = self.num_positions
    if num is not None and position >= num:
      return self._total
    return int(self.global_positions(np.array([position], np.int64))[0])

  def saved_state(self, position: int) -> dict:
    """What a pipeline state keeps of the mixture (JSON-able): the weight
    history and where this shard stands in the global order."""
    return {
      "version": MIXTURE_STATE_VERSION,
      "segments": self.segments,
      "frontier": self.frontier(position),
      # Not even a single shard's frontier is where the new weights may
      # start: a state may hold older snapshots of this one (an op's
      # replay anchor), which must switch at the same position. See
      # `jaxfeed.align_mixture_states`.
      "frontier_is_global": False,
    }

  def restored(self, state: Any) -> "MixtureSampler":
    """This sampler with a saved weight history; when this sampler's weights
    differ from the last saved ones they apply from the saved frontier on."""
    if (
      not isinstance(state, dict)
      or state.get("version") != MIXTURE_STATE_VERSION
      or set(state) != {"version", "segments", "frontier", "frontier_is_global"}
      or isinstance(state["frontier"], bool)
      or not isinstance(state["frontier"], int)
      or state["frontier"] < 0
    ):
      raise ValueError(
        f"{_OP}: a mixture state is a dict with 'version' "
        f"(= {MIXTURE_STATE_VERSION}), 'segments', 'frontier' and "
        f"'frontier_is_global', got {str(state):.200}."
      )
    segments = self._check_segments(state["segments"])
    if integer_weights(segments[-1][1], len(self._components)) != self._weights:
      if not state["frontier_is_global"]:
        raise ValueError(
          f"{_OP}: the weights changed from {segments[-1][1]} to "
          f"{list(self._weights)} on restore, but the state does not say "
          "where the new weights may start. Pass the states of all "
          "processes (a list of one for one process) through "
          "jaxfeed.align_mixture_states first and restore this process's "
          "result (or merge them with jaxfeed.reshard_loader_states)."
        )
      switch = max(state["frontier"], segments[-1][0])
      if switch == segments[-1][0]:
        segments.pop()  # Nothing was read with those weights.
      segments.append([switch, list(self._weights)])
    return MixtureSampler(
      self._components, self._weights, seed=self._seed, shard_options=self._shard, segments=segments
    )

  def reshard(
    self, old_shard_count: int, old_positions: Any, old_unread: Any = None
  ) -> "MixtureSampler":
    """This shard's sampler after a resume on another number of shards (see
    `ReshardedSampler`)."""
    view = MixtureSampler(
      self._components,
      self._weights,
      seed=self._seed,
      shard_options=self._shard,
      segments=self._segments,
    )
    view._positions = ReshardedSampler(self._layout, old_shard_count, old_positions, old_unread)
    return view

  def reshard_state(self) -> dict | None:
    """The resharded part of a saved state; None when not resharded."""
    if self._positions is self._layout:
      return None
    return self._positions.reshard_state()

  def base_position(self, position: int) -> int | None:
    """See `ReshardedSampler.base_position`; the position itself when not
    resharded."""
    if self._positions is self._layout:
      return position
    return self._positions.base_position(position)

  # -- iterations ----------------------------------------------------------
  def for_iteration(self, iteration: int) -> "MixtureSampler":
    """The sampler iteration `iteration` of a pipeline reads (see
    `IndexSampler.for_iteration`): every component's iteration, in this
    mixture's schedule, so each iteration has as many positions."""
    components = [c.for_iteration(iteration) for c in self._components]
    if all(new is old for new, old in zip(components, self._components)):
      return self
    return MixtureSampler(
      components, self._weights, seed=self._seed, shard_options=self._shard, segments=self._segments
    )

  # -- identity ------------------------------------------------------------
  def identity(self) -> dict:
    """What defines the order (JSON-able), checked when a pipeline state is
    restored (see `from_source`). The weights are left out: a restored
    mixture may have new ones (`restored`)."""
    return {
      "type": "MixtureSampler",
      "seed": self._seed,
      "shard_index": self._shard.shard_index,
      "shard_count": self._shard.shard_count,
      "drop_remainder": self._shard.drop_remainder,
      "components": [c.identity() for c in self._components],
    }

  def spec_params(self) -> dict:
    """The constructor keyword arguments (JSON-able but for the component
    samplers, which carry their own) that rebuild this sampler."""
    return {
      "components": list(self._components),
      "weights": list(self._weights),
      "seed": self._seed,
      "shard_options": {
        "shard_index": self._shard.shard_index,
        "shard_count": self._shard.shard_count,
        "drop_remainder": self._shard.drop_remainder,
      },
      "segments": self.segments,
    }

  def __repr__(self) -> str:
    return (
      f"MixtureSampler({list(self._components)!r}, "
      f"weights={list(self._weights)}, seed={self._seed}, "
      f"shard_options={self._shard!r}, segments={self.segments})"
    )


def merge_mixture_states(states: list[dict], frontier: int | None = None) -> dict:
  """One mixture state for all shards, whose frontier is global: every shard
  has read nothing from it on (their largest frontier, or `frontier` when
  larger)."""
  segments = [state.get("segments") if isinstance(state, dict) else None for state in states]
  if any(s != segments[0] for s in segments):
    raise ValueError(
      f"reshard: the processes' mixtures have different weight histories: {str(segments):.300}."
    )
  frontiers = [state.get("frontier") for state in states]
  if not all(isinstance(f, int) and not isinstance(f, bool) for f in frontiers):
    raise ValueError(f"reshard: mixture states need integer frontiers, got {frontiers}.")
  return {**states[0], "frontier": max(frontiers + [frontier or 0]), "frontier_is_global": True}
