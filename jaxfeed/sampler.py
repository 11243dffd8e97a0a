"""`IndexSampler`: which record each position of a pipeline reads.

The sampler is a pure function from a shard-local position `k = 0, 1, 2, ...`
to `RecordMetadata(position, epoch, record_index, rng_seed)`, so its whole
state is the next position. Every epoch lays the records out at global
positions `0 .. N-1`; shard `h` of `H` takes the global positions
`h, h+H, h+2H, ...` of each epoch. With `shuffle=True` the record at global
position `g` of epoch `e` is `perm_e(g)`, where `perm_e` is a keyed permutation
of the WHOLE dataset (a Feistel network with cycle walking, O(1) memory),
reseeded every epoch. Shards therefore see disjoint, uniformly spread slices of
one global shuffle rather than shuffles of their own contiguous blocks.

Iterations: a pipeline iterated again (the next `for batch in dataset`, the
next epoch of a `Loader`, the next repetition under `repeat`) reads the
sampler's iteration 1, 2, ...: `for_iteration(i)`, the same sampler with a
seed derived from `(seed, i)`, so every iteration has its own order and its
own per-record seeds, the same on every host. `reshuffle_each_iteration=False`
and endless samplers read the same positions in every iteration. A state is
then the position plus, from the second iteration on, the iteration number:
the position alone cannot tell the end of iteration i from the start of
iteration i + 1, and the iteration picks the seed.

With `replacement=True` each global position of each epoch draws its record
uniformly with replacement instead (`jaxfeed.sampler_replacement`), a pure
function of the seed, the epoch and the position, sharded as above.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any, Mapping, NamedTuple

import numpy as np

from jaxfeed.sampler_replacement import draw_record, draw_records
from jaxfeed.seeding import mix_seed, mix_seeds

__all__ = [
  "IndexSampler",
  "NoSharding",
  "RecordMetadata",
  "ShardByJaxProcess",
  "ShardOptions",
]

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_M1 = 0xBF58476D1CE4E5B9
_M2 = 0x94D049BB133111EB
# Separates the permutation's round keys from the per-record seeds, which are
# mixed from the same (seed, epoch) prefix.
_PERMUTATION_DOMAIN = 0x5045524D  # "PERM"
# Derives the seed of iteration i >= 1 from the seed, apart from other seeds.
_ITERATION_DOMAIN = 0x49544552  # "ITER"
_FEISTEL_ROUNDS = 6


def _is_int(value: Any) -> bool:
  return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True)
class ShardOptions:
  """Which slice of every epoch this process reads.

  Attributes:
    shard_index: This shard, in `[0, shard_count)`.
    shard_count: Number of shards, >= 1.
    drop_remainder: If True, every shard reads `floor(N / shard_count)` records
      per epoch (so all shards have equal length and the last `N % shard_count`
      global positions of each epoch are dropped); if False, shard `h` reads
      `ceil((N - h) / shard_count)` records per epoch.
  """

  shard_index: int
  shard_count: int
  drop_remainder: bool = False

  def __post_init__(self) -> None:
    if not _is_int(self.shard_count) or self.shard_count < 1:
      raise ValueError(
        f"ShardOptions: shard_count must be an integer >= 1, got {self.shard_count!r}."
      )
    if not _is_int(self.shard_index) or not 0 <= self.shard_index < self.shard_count:
      raise ValueError(
        f"ShardOptions: shard_index must be an integer in "
        f"[0, {int(self.shard_count)}) (shard_count={int(self.shard_count)}), "
        f"got {self.shard_index!r}."
      )
    if not isinstance(self.drop_remainder, (bool, np.bool_)):
      raise ValueError(
        f"ShardOptions: drop_remainder must be True or False, got {self.drop_remainder!r}."
      )
    # Numpy ints are accepted but stored as Python values so the options
    # compare, hash and serialize like plain ints.
    object.__setattr__(self, "shard_index", int(self.shard_index))
    object.__setattr__(self, "shard_count", int(self.shard_count))
    object.__setattr__(self, "drop_remainder", bool(self.drop_remainder))


@dataclasses.dataclass(frozen=True)
class NoSharding(ShardOptions):
  """A single shard holding every record (shard 0 of 1)."""

  def __init__(self) -> None:
    super().__init__(shard_index=0, shard_count=1, drop_remainder=False)


@dataclasses.dataclass(frozen=True)
class ShardByJaxProcess(ShardOptions):
  """One shard per JAX process: `jax.process_index()` of `jax.process_count()`."""

  def __init__(self, drop_remainder: bool = False):
    import jax  # pylint: disable=g-import-not-at-top  # only where used

    super().__init__(
      shard_index=jax.process_index(),
      shard_count=jax.process_count(),
      drop_remainder=drop_remainder,
    )


class RecordMetadata(NamedTuple):
  """What the sampler says about one shard-local position.

  Attributes:
    position: The shard-local position asked for.
    epoch: The epoch the position falls in (0-based).
    record_index: The index of the record to read from the source.
    rng_seed: A 64-bit seed for this record's randomness,
      `mix_seed(seed, epoch, record_index)`.
  """

  position: int
  epoch: int
  record_index: int
  rng_seed: int


class IndexSampler:
  """Maps shard-local positions to records: sharded, optionally shuffled.

  Args:
    num_records: Number of records in the source, >= 0.
    shuffle: Whether each epoch visits the records in a (global) random order.
    seed: Integer seed of the shuffle and of the per-record rng seeds.
    num_epochs: Number of passes over the data (>= 1), or None for endless.
    shard_options: A `ShardOptions` (or a mapping of its fields); default
      `NoSharding()`.
    reshuffle_each_iteration: Whether each iteration of a pipeline over this
      sampler (see `for_iteration`) has its own order and per-record seeds,
      like tf.data's `shuffle(..., reshuffle_each_iteration=True)`; False
      repeats the first iteration's. Endless samplers are never iterated
      again, so it does not apply to them.
    replacement: Whether each epoch draws its positions uniformly with
      replacement from the records (OneAccess's sampling) instead of visiting
      every record once; needs `shuffle=False` (the draws are random already).
  """

  def __init__(
    self,
    num_records: int,
    *,
    shuffle: bool = False,
    seed: int = 0,
    num_epochs: int | None = 1,
    shard_options: ShardOptions | Mapping[str, Any] | None = None,
    reshuffle_each_iteration: bool = True,
    replacement: bool = False,
  ):
    if not _is_int(num_records) or num_records < 0:
      raise ValueError(f"IndexSampler: num_records must be an integer >= 0, got {num_records!r}.")
    if not isinstance(shuffle, (bool, np.bool_)):
      raise ValueError(f"IndexSampler: shuffle must be True or False, got {shuffle!r}.")
    if not isinstance(reshuffle_each_iteration, (bool, np.bool_)):
      raise ValueError(
        f"IndexSampler: reshuffle_each_iteration must be True or False, got "
        f"{reshuffle_each_iteration!r}."
      )
    if not isinstance(replacement, (bool, np.bool_)):
      raise ValueError(f"IndexSampler: replacement must be True or False, got {replacement!r}.")
    if replacement and shuffle:
      raise ValueError(
        "IndexSampler: replacement=True draws every position at random "
        "already; it needs shuffle=False, got shuffle=True."
      )
    if not _is_int(seed):
      raise ValueError(
        f"IndexSampler: seed must be an integer, got {seed!r} ({type(seed).__name__})."
      )
    if num_epochs is not None and (not _is_int(num_epochs) or num_epochs < 1):
      raise ValueError(
        f"IndexSampler: num_epochs must be an integer >= 1 or None for endless, got {num_epochs!r}."
      )
    if shard_options is None:
      shard_options = NoSharding()
    elif isinstance(shard_options, Mapping):
      shard_options = ShardOptions(**shard_options)
    elif not isinstance(shard_options, ShardOptions):
      raise ValueError(
        f"IndexSampler: shard_options must be a ShardOptions, a mapping of "
        f"its fields or None, got {type(shard_options).__name__}."
      )

    self._num_records = int(num_records)
    self._shuffle = bool(shuffle)
    self._seed = int(seed)
    self._num_epochs = None if num_epochs is None else int(num_epochs)
    self._shard = ShardOptions(
      shard_options.shard_index, shard_options.shard_count, shard_options.drop_remainder
    )
    self._reshuffle = bool(reshuffle_each_iteration)
    self._replacement = bool(replacement)

    n, h, count = self._num_records, self._shard.shard_index, self._shard.shard_count
    if self._shard.drop_remainder:
      self._per_epoch = n // count
    else:
      self._per_epoch = max(0, (n - h + count - 1) // count)
    # Feistel domain: the smallest power of two covering [0, N), split into
    # two halves whose widths alternate between rounds, so cycle walking
    # needs fewer than two passes on average.
    num_bits = max(1, (n - 1).bit_length()) if n > 1 else 0
    self._hi_bits = (num_bits + 1) // 2
    self._lo_bits = num_bits // 2
    self._cached_keys: tuple[int, list[int]] | None = None

  # -- shape ---------------------------------------------------------------
  @property
  def num_records(self) -> int:
    """Number of records in the source the sampler indexes."""
    return self._num_records

  @property
  def shuffle(self) -> bool:
    return self._shuffle

  @property
  def seed(self) -> int:
    return self._seed

  @property
  def num_epochs(self) -> int | None:
    return self._num_epochs

  @property
  def shard_options(self) -> ShardOptions:
    return self._shard

  @property
  def reshuffle_each_iteration(self) -> bool:
    return self._reshuffle

  @property
  def replacement(self) -> bool:
    return self._replacement

  @property
  def records_per_epoch(self) -> int:
    """Number of positions this shard reads in every epoch."""
    return self._per_epoch

  @property
  def num_positions(self) -> int | None:
    """Number of shard-local positions; None when endless.

    An endless sampler whose shard reads nothing per epoch has 0 positions.
    """
    if self._per_epoch == 0:
      return 0
    if self._num_epochs is None:
      return None
    return self._per_epoch * self._num_epochs

  def __len__(self) -> int:
    num = self.num_positions
    if num is None:
      raise TypeError(
        f"{self!r} is endless (num_epochs=None) and has no length; use "
        f"num_positions, which is None for endless samplers."
      )
    return num

  # -- lookups ---------------------------------------------------------------
  def __getitem__(self, position: int) -> RecordMetadata:
    """The metadata of shard-local `position`; IndexError past the end."""
    try:
      position = operator.index(position)
    except TypeError:
      raise TypeError(
        f"IndexSampler positions must be integers, got {type(position).__name__}: {position!r}."
      ) from None
    num = self.num_positions
    if position < 0 or (num is not None and position >= num):
      raise IndexError(self._out_of_range_message(position))
    epoch, local = divmod(position, self._per_epoch)
    global_position = self._shard.shard_index + local * self._shard.shard_count
    if self._replacement:
      record_index = draw_record(self._seed, epoch, global_position, self._num_records)
    elif self._shuffle:
      record_index = self._permute_one(global_position, epoch)
    else:
      record_index = global_position
    return RecordMetadata(position, epoch, record_index, mix_seed(self._seed, epoch, record_index))

  def get_many(self, positions: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Vectorized `__getitem__` over an integer array of positions.

    Args:
      positions: Integer array-like of shard-local positions (any shape).

    Returns:
      `(epochs, record_indices, rng_seeds)`: int64, int64 and uint64 arrays of
      the shape of `positions`, equal element-wise to `self[k]`.
    """
    positions = np.asarray(positions)
    if positions.size and positions.dtype.kind not in "iu":
      raise TypeError(
        f"IndexSampler.get_many: positions must be integers, got dtype {positions.dtype}."
      )
    shape = positions.shape
    positions = positions.astype(np.int64, copy=False).reshape(-1)
    if positions.size:
      low, high = int(positions.min()), int(positions.max())
      num = self.num_positions
      if low < 0:
        raise IndexError(self._out_of_range_message(low))
      if num is not None and high >= num:
        raise IndexError(self._out_of_range_message(high))
    per_epoch = max(self._per_epoch, 1)  # Only 0 when `positions` is empty.
    epochs, local = np.divmod(positions, per_epoch)
    global_positions = self._shard.shard_index + local * self._shard.shard_count
    record_indices = self._records_many(global_positions, epochs)
    seeds = mix_seeds(self._seed, epochs, record_indices)
    return (epochs.reshape(shape), record_indices.reshape(shape), seeds.reshape(shape))

  def _out_of_range_message(self, position: int) -> str:
    num = self.num_positions
    allowed = "[0, inf)" if num is None else f"[0, {num})"
    return f"Position {position} is out of range for {self!r}: positions must be in {allowed}."

  # -- permutation ---------------------------------------------------------
  def _records_many(self, global_positions: np.ndarray, epochs: np.ndarray) -> np.ndarray:
    """The records at `global_positions` of `epochs` (int64 arrays)."""
    if self._replacement:
      return draw_records(self._seed, epochs, global_positions, self._num_records)
    if self._shuffle:
      return self._permute_many(global_positions, epochs)
    return global_positions

  def _round_keys(self, epoch: int) -> list[int]:
    cached = self._cached_keys
    if cached is None or cached[0] != epoch:
      keys = [mix_seed(self._seed, epoch, _PERMUTATION_DOMAIN, r) for r in range(_FEISTEL_ROUNDS)]
      cached = self._cached_keys = (epoch, keys)
    return cached[1]

  def _permute_one(self, global_position: int, epoch: int) -> int:
    keys = self._round_keys(epoch)
    x = _feistel(global_position, keys, self._hi_bits, self._lo_bits)
    while x >= self._num_records:  # Cycle walking back into [0, N).
      x = _feistel(x, keys, self._hi_bits, self._lo_bits)
    return int(x)

  def _permute_many(self, global_positions: np.ndarray, epochs: np.ndarray) -> np.ndarray:
    if global_positions.size == 0:
      return global_positions.astype(np.int64)
    first, last = int(epochs.min()), int(epochs.max())
    if first == last:
      keys = [np.uint64(k) for k in self._round_keys(first)]
    else:
      unique_epochs, inverse = np.unique(epochs, return_inverse=True)
      keys = [
        mix_seeds(self._seed, unique_epochs, _PERMUTATION_DOMAIN, r)[inverse]
        for r in range(_FEISTEL_ROUNDS)
      ]
    x = _feistel(global_positions.astype(np.uint64), keys, self._hi_bits, self._lo_bits)
    limit = np.uint64(self._num_records)
    walking = np.flatnonzero(x >= limit)
    while walking.size:
      sub_keys = [k[walking] if k.ndim else k for k in keys]
      x[walking] = _feistel(x[walking], sub_keys, self._hi_bits, self._lo_bits)
      walking = walking[x[walking] >= limit]
    permuted: np.ndarray = x.astype(np.int64)
    return permuted

  # -- iterations ----------------------------------------------------------
  def for_iteration(self, iteration: int) -> "IndexSampler":
    """The sampler that iteration `iteration` (0, 1, ...) of a pipeline reads.

    Iteration 0 is this sampler. With `reshuffle_each_iteration` and a finite
    number of positions, iteration `i >= 1` is this sampler with the seed
    `mix_seed(seed, "ITER", i)`: its own global shuffle and per-record seeds,
    the same number of positions, the same on every host. Otherwise every
    iteration is this sampler.
    """
    if not _is_int(iteration) or iteration < 0:
      raise ValueError(
        f"IndexSampler.for_iteration: iteration must be an integer >= 0, got {iteration!r}."
      )
    if not iteration or not self._reshuffle or self.num_positions is None:
      return self
    return IndexSampler(
      self._num_records,
      shuffle=self._shuffle,
      seed=mix_seed(self._seed, _ITERATION_DOMAIN, iteration),
      num_epochs=self._num_epochs,
      shard_options=self._shard,
      replacement=self._replacement,
    )

  # -- identity ------------------------------------------------------------
  def spec_params(self) -> dict[str, Any]:
    """The constructor keyword arguments (JSON-able) that rebuild this sampler."""
    params = {
      "num_records": self._num_records,
      "shuffle": self._shuffle,
      "seed": self._seed,
      "num_epochs": self._num_epochs,
      "shard_options": dataclasses.asdict(self._shard),
    }
    if not self._reshuffle:  # Only when set: fingerprints stay as they were.
      params["reshuffle_each_iteration"] = False
    if self._replacement:
      params["replacement"] = True
    return params

  def identity(self) -> dict[str, Any]:
    """What defines the order this sampler gives (JSON-able), which a
    pipeline state records and checks on restore (see `from_source`)."""
    return {
      "type": "IndexSampler",
      "num_records": self._num_records,
      "shuffle": self._shuffle,
      "seed": self._seed,
      "num_epochs": self._num_epochs,
      "shard_index": self._shard.shard_index,
      "shard_count": self._shard.shard_count,
      "drop_remainder": self._shard.drop_remainder,
      "reshuffle_each_iteration": self._reshuffle,
      **({"replacement": True} if self._replacement else {}),
    }

  def _key(self) -> tuple[Any, ...]:
    return (
      self._num_records,
      self._shuffle,
      self._seed,
      self._num_epochs,
      self._shard.shard_index,
      self._shard.shard_count,
      self._shard.drop_remainder,
      self._reshuffle,
      self._replacement,
    )

  def __eq__(self, other: Any) -> bool:
    if not isinstance(other, IndexSampler):
      return NotImplemented
    return self._key() == other._key()

  def __hash__(self) -> int:
    return hash(self._key())

  def __repr__(self) -> str:
    reshuffle = "" if self._reshuffle else ", reshuffle_each_iteration=False"
    reshuffle += ", replacement=True" if self._replacement else ""
    return (
      f"IndexSampler(num_records={self._num_records}, "
      f"shuffle={self._shuffle}, seed={self._seed}, "
      f"num_epochs={self._num_epochs}, shard_options={self._shard!r}"
      f"{reshuffle})"
    )


def _feistel(x: Any, keys: list[Any], hi_bits: int, lo_bits: int) -> Any:
  """One pass of the keyed permutation of `[0, 2**(hi_bits + lo_bits))`.

  Works on a Python int (with explicit 64-bit wrapping) or element-wise on a
  uint64 array (which wraps natively), so the scalar and vectorized lookups
  share one definition.

  Args:
    x: A Python int or a uint64 array of values in the domain.
    keys: One key per round: Python ints, uint64 scalars or uint64 arrays
      broadcastable against `x`.
    hi_bits: Width of the high half in the first round.
    lo_bits: Width of the low half in the first round.

  Returns:
    The permuted value(s), of the same kind as `x`.
  """
  scalar = isinstance(x, int)
  for key in keys:
    hi = x >> lo_bits
    lo = x & ((1 << lo_bits) - 1)
    # Round function: a splitmix64 finalizer of the low half and the key.
    # Augmented operators work in place on arrays and rebind Python ints.
    z = lo * _GOLDEN
    z += key
    if scalar:
      z &= _MASK64
    z ^= z >> 30
    z *= _M1
    if scalar:
      z &= _MASK64
    z ^= z >> 27
    z *= _M2
    if scalar:
      z &= _MASK64
    z ^= z >> 31
    # The halves swap, so their widths alternate from round to round.
    z &= (1 << hi_bits) - 1
    z ^= hi
    lo <<= hi_bits
    lo |= z
    x = lo
    hi_bits, lo_bits = lo_bits, hi_bits
  return x
