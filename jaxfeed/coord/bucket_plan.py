"""`BucketPlan`: a global, communication-free plan of sequence-length buckets.

Every host of a multi-host job builds the same `BucketPlan` (same length index,
boundaries, batch sizes and seed) and so computes the same global schedule:
for every step, which bucket is trained on and which records form the global
batch. Host `h` of `H` reads its contiguous `1/H` slice of that batch. Because
the schedule is a pure function of the seed and the step, no host ever waits
for another to agree, and the plan's whole state is the step number.

Buckets follow tf.data's `bucket_by_sequence_length`: with boundaries
`[b0, b1, ..., bk]` the buckets are `[0, b0), [b0, b1), ..., [bk, inf)`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import threading
from typing import Any, Sequence

import numpy as np

from jaxfeed.sampler import NoSharding, ShardOptions
from jaxfeed.seeding import mix_seed, mix_seeds

__all__ = ["BucketPlan"]

# Distinct salts keep the record shuffle and the batch-order shuffle of one
# epoch independent of each other.
_RECORD_ORDER_SALT = 0x5245434F5244  # "RECORD"
_BATCH_ORDER_SALT = 0x4241544348  # "BATCH"
_CACHED_EPOCHS = 2  # the current epoch and the next (a prefetcher runs ahead)


@dataclasses.dataclass(frozen=True)
class _EpochTable:
  """One epoch of the global plan (all arrays read-only)."""

  grouped_records: np.ndarray  # record indices, grouped by bucket
  step_bucket: np.ndarray  # bucket id of each step of the epoch
  step_start: np.ndarray  # offset of each step's global batch in grouped_records
  step_max_length: np.ndarray  # longest record of each step's global batch


def _read_only(array: np.ndarray) -> np.ndarray:
  array.flags.writeable = False
  return array


def _is_int(value: Any) -> bool:
  return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


class BucketPlan:
  """The global step -> (bucket, records) schedule, identical on every host.

  Per epoch, the record indices are shuffled (seeded by `(seed, epoch)`),
  grouped into their length buckets and cut into global batches of the
  bucket's size; each bucket's remainder that does not fill a global batch is
  dropped for that epoch (see `dropped_per_epoch`). The epoch's global batches
  are then ordered by a seeded shuffle, so buckets interleave across steps.
  With `shuffle=False`, records keep their index order and batches come in the
  order tf.data's `bucket_by_sequence_length` would emit them from the records
  read in index order (a batch is due when its bucket fills).

  With `carry_remainders=True` a bucket's remainder instead joins the next
  longer bucket (padded to its length, as its shorter records are), so only
  the last bucket's remainder is dropped. With fine-grained buckets this keeps
  most of the records a plain plan drops: each bucket's remainder can be up
  to a whole global batch.

  Every record appears at most once per epoch, and the number of steps is the
  same for every epoch.

  Args:
    lengths: One non-negative integer length per record of the source (a 1-D
      integer array; see `jaxfeed.coord.compute_lengths`).
    bucket_boundaries: Strictly increasing positive upper bounds of the buckets.
    bucket_batch_sizes: The GLOBAL batch size of each bucket, one more than
      there are boundaries; each must be divisible by the number of hosts.
    seed: Seeds the record shuffle and the batch order.
    shuffle: Whether to shuffle records and batches per epoch.
    num_epochs: Epochs to plan, or None for an endless plan.
    shard_options: This host's `jaxfeed.ShardOptions` (`shard_index` of
      `shard_count` hosts; `drop_remainder` does not apply: bucket remainders
      are dropped or carried). `NoSharding()`: one host reads whole batches.
    carry_remainders: Move each bucket's remainder into the next longer
      bucket instead of dropping it.
  """

  def __init__(
    self,
    lengths: Any,
    bucket_boundaries: Sequence[int],
    bucket_batch_sizes: Sequence[int],
    *,
    seed: int = 0,
    shuffle: bool = True,
    num_epochs: int | None = 1,
    shard_options: ShardOptions = NoSharding(),
    carry_remainders: bool = False,
  ):
    self._lengths = _read_only(_check_lengths(lengths))
    self._boundaries = _check_boundaries(bucket_boundaries)
    self._shard_index, self._shard_count = _shard_of(shard_options)
    self._batch_sizes = _check_batch_sizes(
      bucket_batch_sizes, len(self._boundaries), self._shard_count
    )
    if not _is_int(seed):
      raise ValueError(f"BucketPlan: seed must be an integer, got {seed!r}.")
    if num_epochs is not None and (not _is_int(num_epochs) or num_epochs < 1):
      raise ValueError(
        f"BucketPlan: num_epochs must be an integer >= 1 or None (endless), got {num_epochs!r}."
      )
    self._seed = int(seed)
    self._shuffle = bool(shuffle)
    self._num_epochs = None if num_epochs is None else int(num_epochs)
    self._carry = bool(carry_remainders)

    num_buckets = len(self._batch_sizes)
    # Small bucket ids make the per-epoch stable sort a radix sort.
    bucket_dtype = np.uint16 if num_buckets <= 1 << 16 else np.int64
    self._record_bucket = _read_only(
      np.searchsorted(self._boundaries, self._lengths, side="right").astype(bucket_dtype)
    )
    self._bucket_counts = np.bincount(self._record_bucket, minlength=num_buckets).astype(np.int64)
    self._bucket_offsets = np.concatenate([[0], np.cumsum(self._bucket_counts)[:-1]]).astype(
      np.int64
    )
    # The records each bucket's batches are cut from: its own, after the
    # remainder carried from the bucket before (which sits right before them
    # once records are grouped by bucket).
    self._group_offsets = self._bucket_offsets.copy()
    self._group_counts = self._bucket_counts.copy()
    if self._carry:
      for b in range(1, num_buckets):
        carried = self._group_counts[b - 1] % self._batch_sizes[b - 1]
        self._group_offsets[b] -= carried
        self._group_counts[b] += carried
    self._batches_per_bucket = self._group_counts // self._batch_sizes
    self._steps_per_epoch = int(self._batches_per_bucket.sum())
    if self._steps_per_epoch == 0:
      raise ValueError(
        f"BucketPlan: no bucket holds a full global batch: records per "
        f"bucket {self._bucket_counts.tolist()}, global batch sizes "
        f"{self._batch_sizes.tolist()}. Use smaller batch sizes or fewer "
        f"buckets."
      )
    # The epoch-independent layout of the global batches inside the grouped
    # record array: batch j covers grouped[batch_start[j]:+batch_size].
    self._batch_bucket = np.repeat(np.arange(num_buckets), self._batches_per_bucket)
    first_batch = np.cumsum(self._batches_per_bucket) - self._batches_per_bucket
    within_bucket = np.arange(self._steps_per_epoch) - np.repeat(
      first_batch, self._batches_per_bucket
    )
    self._batch_start = (
      self._group_offsets[self._batch_bucket]
      + within_bucket * self._batch_sizes[self._batch_bucket]
    )
    used_end = self._group_offsets + self._batches_per_bucket * self._batch_sizes
    group_end = self._group_offsets + self._group_counts
    if self._carry:  # only the last bucket's remainder is left over
      used_end, group_end = used_end[-1:], group_end[-1:]
    self._dropped_ranges = [(int(a), int(b)) for a, b in zip(used_end, group_end) if b > a]
    self._num_dropped = sum(b - a for a, b in self._dropped_ranges)

    self._lock = threading.Lock()
    self._tables: dict[int, _EpochTable] = {}
    self._digest = self._content_digest()

  # -- shape of the plan ----------------------------------------------------
  @property
  def num_records(self) -> int:
    """Records in the length index (must equal the source's length)."""
    return int(self._lengths.shape[0])

  @property
  def lengths(self) -> np.ndarray:
    """The per-record length index (read-only)."""
    return self._lengths

  @property
  def bucket_boundaries(self) -> tuple[int, ...]:
    return tuple(int(b) for b in self._boundaries)

  @property
  def bucket_batch_sizes(self) -> tuple[int, ...]:
    """Global batch size of each bucket."""
    return tuple(int(b) for b in self._batch_sizes)

  @property
  def num_buckets(self) -> int:
    return len(self._batch_sizes)

  @property
  def seed(self) -> int:
    return self._seed

  @property
  def shuffle(self) -> bool:
    return self._shuffle

  @property
  def num_epochs(self) -> int | None:
    return self._num_epochs

  @property
  def shard_index(self) -> int:
    return self._shard_index

  @property
  def shard_count(self) -> int:
    return self._shard_count

  @property
  def steps_per_epoch(self) -> int:
    return self._steps_per_epoch

  @property
  def carry_remainders(self) -> bool:
    return self._carry

  @property
  def num_dropped_per_epoch(self) -> int:
    """Records left out of every epoch (bucket remainders; same each epoch)."""
    return self._num_dropped

  @property
  def bucket_counts(self) -> np.ndarray:
    """Records per bucket."""
    return self._bucket_counts.copy()

  def __len__(self) -> int:
    if self._num_epochs is None:
      raise TypeError(
        "BucketPlan with num_epochs=None is endless and has no len(); use steps_per_epoch."
      )
    return self._steps_per_epoch * self._num_epochs

  def num_steps(self) -> int | None:
    """Total steps, or None for an endless plan."""
    if self._num_epochs is None:
      return None
    return self._steps_per_epoch * self._num_epochs

  def local_batch_size(self, bucket_id: int) -> int:
    """Rows this host reads for a step of bucket `bucket_id`."""
    return int(self._batch_sizes[bucket_id]) // self._shard_count

  def bucket_bound(self, bucket_id: int) -> int | None:
    """The exclusive upper length bound of a bucket (None for the last)."""
    if bucket_id >= len(self._boundaries):
      return None
    return int(self._boundaries[bucket_id])

  # -- lookups --------------------------------------------------------------
  def __getitem__(self, step: int) -> tuple[int, np.ndarray]:
    """(bucket id, record indices of THIS shard's slice) at global `step`."""
    table, local_step = self._locate(step)
    bucket_id = int(table.step_bucket[local_step])
    rows = self.local_batch_size(bucket_id)
    start = int(table.step_start[local_step]) + self._shard_index * rows
    return bucket_id, table.grouped_records[start : start + rows]

  def global_step(self, step: int) -> tuple[int, np.ndarray]:
    """(bucket id, record indices of the whole global batch) at `step`."""
    table, local_step = self._locate(step)
    bucket_id = int(table.step_bucket[local_step])
    start = int(table.step_start[local_step])
    return bucket_id, table.grouped_records[start : start + int(self._batch_sizes[bucket_id])]

  def max_length(self, step: int) -> int:
    """The longest record of the GLOBAL batch at `step` (same on all hosts)."""
    table, local_step = self._locate(step)
    return int(table.step_max_length[local_step])

  def padded_length(self, step: int, pad_to_bucket_boundary: bool = False) -> int:
    """The sequence length every host pads to at `step`.

    The global batch's longest record, or with `pad_to_bucket_boundary` its
    bucket's boundary minus one (as tf.data does); the last bucket has no
    boundary, so it raises ValueError if asked to pad to it.
    """
    table, local_step = self._locate(step)
    if not pad_to_bucket_boundary:
      return int(table.step_max_length[local_step])
    bucket_id = int(table.step_bucket[local_step])
    bound = self.bucket_bound(bucket_id)
    if bound is None:
      raise ValueError(
        f"BucketPlan: with pad_to_bucket_boundary=True every record must be "
        f"shorter than the last boundary {int(self._boundaries[-1])}, but "
        f"step {step} is from the unbounded last bucket."
      )
    return bound - 1

  def epoch_buckets(self, epoch: int) -> np.ndarray:
    """Bucket id of every step of `epoch` (read-only)."""
    return self._table(self._check_epoch(epoch)).step_bucket

  def epoch_max_lengths(self, epoch: int) -> np.ndarray:
    """Longest record of every global batch of `epoch` (read-only)."""
    return self._table(self._check_epoch(epoch)).step_max_length

  def dropped_per_epoch(self, epoch: int) -> np.ndarray:
    """Sorted indices of the records `epoch` leaves out (bucket remainders)."""
    table = self._table(self._check_epoch(epoch))
    pieces = [table.grouped_records[a:b] for a, b in self._dropped_ranges]
    if not pieces:
      return np.zeros((0,), np.int64)
    return np.sort(np.concatenate(pieces))

  def fingerprint(self) -> str:
    """A stable hash of everything that determines this host's plan."""
    return self._digest

  def __repr__(self) -> str:
    epochs = "endless" if self._num_epochs is None else self._num_epochs
    return (
      f"BucketPlan(num_records={self.num_records}, "
      f"bucket_boundaries={list(self.bucket_boundaries)}, "
      f"bucket_batch_sizes={list(self.bucket_batch_sizes)}, "
      f"seed={self._seed}, shuffle={self._shuffle}, "
      f"num_epochs={epochs}, shard={self._shard_index}/"
      f"{self._shard_count}, carry_remainders={self._carry}, "
      f"fingerprint={self._digest})"
    )

  # -- internals ------------------------------------------------------------
  def _check_epoch(self, epoch: int) -> int:
    if (
      not _is_int(epoch)
      or epoch < 0
      or (self._num_epochs is not None and epoch >= self._num_epochs)
    ):
      allowed = "any integer >= 0" if self._num_epochs is None else f"0..{self._num_epochs - 1}"
      raise IndexError(f"BucketPlan: epoch {epoch!r} out of range; allowed: {allowed}.")
    return int(epoch)

  def _locate(self, step: int) -> tuple[_EpochTable, int]:
    total = self.num_steps()
    if not _is_int(step) or step < 0 or (total is not None and step >= total):
      allowed = "any integer >= 0" if total is None else f"0..{total - 1}"
      raise IndexError(f"BucketPlan: step {step!r} out of range; allowed: {allowed}.")
    epoch, local_step = divmod(int(step), self._steps_per_epoch)
    return self._table(epoch), local_step

  def _table(self, epoch: int) -> _EpochTable:
    with self._lock:
      table = self._tables.get(epoch)
      if table is None:
        table = self._build_table(epoch)
        if len(self._tables) >= _CACHED_EPOCHS:
          farthest = max(self._tables, key=lambda e: (abs(e - epoch), e))
          del self._tables[farthest]
        self._tables[epoch] = table
      return table

  def _build_table(self, epoch: int) -> _EpochTable:
    n = self.num_records
    if self._shuffle:
      # The keys are distinct (the mixer is a bijection of the index for a
      # fixed prefix), so any sort algorithm gives the same order.
      record_keys = mix_seeds(
        mix_seed(self._seed, epoch, _RECORD_ORDER_SALT), np.arange(n, dtype=np.uint64)
      )
      record_order = np.argsort(record_keys)
    else:
      record_order = np.arange(n, dtype=np.int64)
    # Stable grouping keeps the shuffled order inside each bucket.
    stream_position = np.argsort(self._record_bucket[record_order], kind="stable")
    grouped = record_order[stream_position]

    batch_sizes = self._batch_sizes[self._batch_bucket]
    if self._shuffle:
      batch_keys = mix_seeds(
        mix_seed(self._seed, epoch, _BATCH_ORDER_SALT),
        np.arange(self._steps_per_epoch, dtype=np.uint64),
      )
      batch_order = np.argsort(batch_keys)
    else:
      # A batch is due when its last record has been read (tf.data's order).
      last_read = stream_position[self._batch_start + batch_sizes - 1]
      batch_order = np.argsort(last_read, kind="stable")

    # Max length of each batch: reduce over [start, end) pairs; a trailing
    # sentinel keeps every index inside the array.
    grouped_lengths = np.append(self._lengths[grouped], 0)
    bounds = np.empty(2 * self._steps_per_epoch, np.int64)
    bounds[0::2] = self._batch_start
    bounds[1::2] = self._batch_start + batch_sizes
    batch_max = np.maximum.reduceat(grouped_lengths, bounds)[0::2]

    return _EpochTable(
      grouped_records=_read_only(grouped),
      step_bucket=_read_only(self._batch_bucket[batch_order]),
      step_start=_read_only(self._batch_start[batch_order]),
      step_max_length=_read_only(batch_max[batch_order]),
    )

  def _content_digest(self) -> str:
    h = hashlib.sha256()
    h.update(np.ascontiguousarray(self._lengths, np.int64).tobytes())
    h.update(
      repr(
        (
          self.bucket_boundaries,
          self.bucket_batch_sizes,
          self._seed,
          self._shuffle,
          self._num_epochs,
          self._shard_index,
          self._shard_count,
        )
      ).encode()
    )
    if self._carry:  # plans made before the option keep their fingerprints
      h.update(b"carry_remainders")
    return h.hexdigest()[:16]


def _check_lengths(lengths: Any) -> np.ndarray:
  array = np.asarray(lengths)
  if array.ndim != 1:
    raise ValueError(
      f"BucketPlan: lengths must be a 1-D array with one length per record, "
      f"got shape {array.shape}."
    )
  if array.size and not np.issubdtype(array.dtype, np.integer):
    raise ValueError(f"BucketPlan: lengths must be integers, got dtype {array.dtype}.")
  array = array.astype(np.int64)
  if array.size and array.min() < 0:
    bad = int(np.argmax(array < 0))
    raise ValueError(
      f"BucketPlan: lengths must be >= 0, but record {bad} has length "
      f"{int(array[bad])} ({int((array < 0).sum())} negative in all)."
    )
  return array


def _check_boundaries(boundaries: Sequence[int]) -> np.ndarray:
  values = list(boundaries)
  if not all(_is_int(b) for b in values):
    raise ValueError(f"BucketPlan: bucket_boundaries must be integers, got {values!r}.")
  if values and values[0] < 1:
    raise ValueError(f"BucketPlan: bucket_boundaries must be >= 1, got {values!r}.")
  for low, high in zip(values, values[1:]):
    if high <= low:
      raise ValueError(
        f"BucketPlan: bucket_boundaries must be strictly increasing, got "
        f"{values!r} ({high} follows {low})."
      )
  return np.asarray(values, dtype=np.int64)


def _check_batch_sizes(sizes: Sequence[int], num_boundaries: int, shard_count: int) -> np.ndarray:
  values = list(sizes)
  if len(values) != num_boundaries + 1:
    raise ValueError(
      f"BucketPlan: bucket_batch_sizes must have len(bucket_boundaries) + 1 "
      f"= {num_boundaries + 1} entries (one per bucket), got {len(values)}: "
      f"{values!r}."
    )
  for size in values:
    if not _is_int(size) or size < 1:
      raise ValueError(
        f"BucketPlan: bucket_batch_sizes must be integers >= 1, got {size!r} in {values!r}."
      )
    if size % shard_count:
      raise ValueError(
        f"BucketPlan: global batch size {size} is not divisible by the "
        f"{shard_count} hosts (shard_count) it is split across; every "
        f"bucket_batch_sizes entry must be a multiple of {shard_count}."
      )
  return np.asarray(values, dtype=np.int64)


def _shard_of(shard_options: Any) -> tuple[int, int]:
  """(shard_index, shard_count) of a ShardOptions-like object."""
  try:
    index = shard_options.shard_index
    count = shard_options.shard_count
  except AttributeError:
    raise TypeError(
      f"BucketPlan: shard_options must be a jaxfeed.ShardOptions "
      f"(shard_index, shard_count), got {shard_options!r}."
    ) from None
  if not _is_int(count) or count < 1 or not _is_int(index) or not (0 <= index < count):
    raise ValueError(
      f"BucketPlan: shard_options needs 0 <= shard_index < shard_count, got "
      f"shard_index={index!r}, shard_count={count!r}."
    )
  return int(index), int(count)
