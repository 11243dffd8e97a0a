"""`ReshardedSampler`: an `IndexSampler`'s shard after a resume on another
number of shards.

The records the old shards had not read yet are dealt out to the new shards;
`jaxfeed.ops.reshard` builds the state that carries it and `from_source`
rebuilds it on restore.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from jaxfeed.sampler import IndexSampler, RecordMetadata, ShardOptions, _is_int
from jaxfeed.seeding import mix_seeds


RESHARD_STATE_VERSION = 2
"""Version 2 added `unread` (positions below a shard's frontier it had not
consumed); version 1 states (without it) are still read."""


class ReshardedSampler:
  """An `IndexSampler`'s shard after a resume on another number of shards.

  A run with `old_shard_count` shards stopped after shard `h` had read its
  first `old_positions[h]` positions, except the positions `old_unread[h]`
  below that (elements an op such as `pack` held but had not emitted yet).
  The records the old shards had not read yet, epoch by epoch, are dealt out
  to the new shards: in each epoch that some old shard had started but not
  finished, the unread global positions in increasing order go round-robin
  to the new shards (new shard `i` of `M` takes the `i`-th, `(i+M)`-th, ...);
  the epochs after those are read as `base` reads them. So over all new
  shards every unread record is read exactly once, and the shards' lengths
  differ by at most one per epoch.

  Looking up a position of the dealt-out epochs costs
  `O(old_shard_count * log(num_records))`.

  Args:
    base: this process's sampler in the new run (its shard options give the
      new shard index and count).
    old_shard_count: the number of shards of the stopped run.
    old_positions: the next position of each old shard `h` (shard `h` of
      `old_shard_count`, with `base`'s records, seed, epochs and
      `drop_remainder`).
    old_unread: None, or per old shard the positions below
      `old_positions[h]` it had not consumed.
  """

  def __init__(
    self, base: IndexSampler, old_shard_count: int, old_positions: Any, old_unread: Any = None
  ):
    if not _is_int(old_shard_count) or old_shard_count < 1:
      raise ValueError(
        f"ReshardedSampler: old_shard_count must be an integer >= 1, got {old_shard_count!r}."
      )
    positions = list(old_positions)
    if len(positions) != old_shard_count or not all(_is_int(p) and p >= 0 for p in positions):
      raise ValueError(
        f"ReshardedSampler: old_positions must be {old_shard_count} "
        f"integers >= 0 (one per old shard), got {old_positions!r}."
      )
    unread = (
      [[] for _ in positions]
      if old_unread is None
      else [list(u) if isinstance(u, (list, tuple)) else None for u in old_unread]
    )
    if len(unread) != old_shard_count or not all(
      u is not None and all(_is_int(j) and 0 <= j < p for j in u) and len(set(u)) == len(u)
      for u, p in zip(unread, positions)
    ):
      raise ValueError(
        f"ReshardedSampler: old_unread must be {old_shard_count} lists of "
        f"distinct positions, each below its shard's old position "
        f"{positions}, got {str(old_unread):.200}."
      )
    self._base = base
    self._old_count = int(old_shard_count)
    self._old_positions = [int(p) for p in positions]
    self._old_unread = [sorted(int(j) for j in u) for u in unread]
    shard = base.shard_options
    n = base.num_records
    per = np.array(
      [
        IndexSampler(
          n, shard_options=ShardOptions(h, self._old_count, shard.drop_remainder)
        ).records_per_epoch
        for h in range(self._old_count)
      ],
      np.int64,
    )
    self._old_per = per
    reading = per > 0
    # Per old shard, the first position it has not consumed.
    frontiers = np.array(
      [min(u[:1] + [p]) for u, p in zip(self._old_unread, self._old_positions)], np.int64
    )
    epochs = frontiers[reading] // per[reading]
    first = int(epochs.min()) if epochs.size else 0
    last = (
      int((np.array(self._old_positions, np.int64)[reading] // per[reading]).max())
      if epochs.size
      else -1
    )
    if base.num_epochs is not None:
      last = min(last, base.num_epochs - 1)
    # The unread positions below the frontiers as global positions, sorted.
    holes = np.array(
      sorted(
        (j // int(per[h]), h + (j % int(per[h])) * self._old_count)
        for h, u in enumerate(self._old_unread)
        for j in u
      ),
      np.int64,
    ).reshape(-1, 2)
    # Per dealt-out epoch: (epoch, unread positions read so far per old
    # shard, that epoch's holes, this shard's share, first position of the
    # share).
    self._epochs: list[tuple[int, np.ndarray, np.ndarray, int, int]] = []
    start = 0
    for epoch in range(first, last + 1):
      done = np.clip(np.array(self._old_positions) - epoch * per, 0, per)
      epoch_holes = holes[holes[:, 0] == epoch, 1]
      unread_count = int((per - done).sum()) + epoch_holes.size
      share = max(0, -(-(unread_count - shard.shard_index) // shard.shard_count))
      self._epochs.append((epoch, done, epoch_holes, share, start))
      start += share
    self._dealt = start
    self._next_epoch = last + 1

  @property
  def num_records(self) -> int:
    return self._base.num_records

  @property
  def num_positions(self) -> int | None:
    """Positions of the dealt-out epochs plus those of the later epochs."""
    base = self._base
    if base.num_epochs is None:
      return None if base.records_per_epoch else self._dealt
    later = max(0, base.num_epochs - self._next_epoch) * base.records_per_epoch
    return self._dealt + later

  def reshard_state(self) -> dict:
    """What `from_source` saves to rebuild this sampler (JSON-able)."""
    return {
      "version": RESHARD_STATE_VERSION,
      "shard_count": self._old_count,
      "positions": list(self._old_positions),
      "unread": [list(u) for u in self._old_unread],
    }

  def base_position(self, position: int) -> int | None:
    """The `base` position equal to `position`; None inside the dealt-out
    epochs."""
    if position < self._dealt:
      return None
    return position - self._dealt + self._next_epoch * self._base.records_per_epoch

  def __getitem__(self, position: int) -> RecordMetadata:
    epochs, records, seeds = self.get_many(np.array([position], np.int64))
    return RecordMetadata(int(position), int(epochs[0]), int(records[0]), int(seeds[0]))

  def get_many(self, positions: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`(epochs, record_indices, rng_seeds)` like `IndexSampler.get_many`."""
    positions = np.asarray(positions, np.int64)
    shape = positions.shape
    positions = positions.reshape(-1)
    num = self.num_positions
    if positions.size and (positions.min() < 0 or (num is not None and positions.max() >= num)):
      bad = int(positions.min() if positions.min() < 0 else positions.max())
      raise IndexError(
        f"Position {bad} is out of range for {self!r}: positions must be "
        f"in [0, {'inf' if num is None else num})."
      )
    epochs = np.zeros(positions.size, np.int64)
    records = np.zeros(positions.size, np.int64)
    seeds = np.zeros(positions.size, np.uint64)
    later = positions >= self._dealt
    if later.any():
      base_positions = (
        positions[later] - self._dealt + self._next_epoch * self._base.records_per_epoch
      )
      epochs[later], records[later], seeds[later] = self._base.get_many(base_positions)
    shard = self._base.shard_options
    for epoch, done, holes, share, start in self._epochs:
      which = (positions >= start) & (positions < start + share)
      if not which.any():
        continue
      ranks = shard.shard_index + (positions[which] - start) * shard.shard_count
      global_positions = self._unread_at(ranks, done, holes)
      epoch_array = np.full(global_positions.size, epoch, np.int64)
      record_indices = self._base._records_many(  # pylint: disable=protected-access
        global_positions, epoch_array
      )
      epochs[which] = epoch
      records[which] = record_indices
      seeds[which] = mix_seeds(self._base.seed, epoch_array, record_indices)
    return epochs.reshape(shape), records.reshape(shape), seeds.reshape(shape)

  def _unread_at(self, ranks: np.ndarray, done: np.ndarray, holes: np.ndarray) -> np.ndarray:
    """The global positions of rank `ranks` among an epoch's unread ones.

    Old shard `h` left positions `h + j * count` for `done[h] <= j < per[h]`
    unread, and the global positions `holes` (sorted) below that; the number
    of unread positions below `g` is monotone in `g`, so a bisection finds
    the smallest `g` with more than `rank` of them below `g + 1`.
    """
    count = self._old_count
    shards = np.arange(count, dtype=np.int64)
    per = self._old_per

    def unread_below(g: np.ndarray) -> np.ndarray:
      below = np.maximum(0, -(-(g[:, None] - shards) // count))
      return (np.clip(below, done, per) - done).sum(axis=1) + np.searchsorted(holes, g)

    low = np.zeros(ranks.size, np.int64)
    high = np.full(ranks.size, self._base.num_records, np.int64)
    while (low < high).any():
      middle = (low + high) // 2
      more = unread_below(middle + 1) > ranks
      high = np.where(more, middle, high)
      low = np.where(more, low, middle + 1)
    return low

  def __repr__(self) -> str:
    return (
      f"ReshardedSampler({self._base!r}, old_shard_count="
      f"{self._old_count}, old_positions={self._old_positions}, "
      f"old_unread={self._old_unread})"
    )
