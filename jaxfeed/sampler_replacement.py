"""Sampling with replacement for `IndexSampler(replacement=True)`.

OneAccess's scheme: every epoch draws its positions uniformly, independently
and with replacement from the records, so a record may be read several times
in an epoch and others not at all (about `1 - 1/e` of the records, 63%, are
read at least once per epoch when the epoch has as many positions as there are
records). The record at global position `g` of epoch `e` is a pure function
of `(seed, e, g)`: random access needs no state, the sampler's state stays
its next position, and hosts that take disjoint global positions read
independent draws of one epoch.
"""

from __future__ import annotations

import numpy as np

from jaxfeed.seeding import mix_seed, mix_seeds

__all__ = ["draw_record", "draw_records"]

# Separates the draws from the permutation's round keys and the per-record
# seeds, which are mixed from the same (seed, epoch) prefix.
_DRAW_DOMAIN = 0x44524157  # "DRAW"


def draw_record(seed: int, epoch: int, global_position: int, num_records: int) -> int:
  """The record drawn at `global_position` of `epoch`.

  Args:
    seed: The sampler's seed.
    epoch: The epoch (0-based).
    global_position: The position in the epoch, across all shards.
    num_records: Number of records to draw from, >= 1.

  Returns:
    A record index in `[0, num_records)`.
  """
  # Multiply-high maps the 64-bit hash onto [0, n) with a bias below n / 2**64.
  return (mix_seed(seed, epoch, _DRAW_DOMAIN, global_position) * num_records) >> 64


def draw_records(
  seed: int, epochs: np.ndarray, global_positions: np.ndarray, num_records: int
) -> np.ndarray:
  """Vectorized `draw_record`: int64 record indices of the broadcast shape of
  `epochs` and `global_positions`, equal element-wise to `draw_record`."""
  hashes = mix_seeds(seed, epochs, _DRAW_DOMAIN, global_positions)
  # The high 64 bits of hash * n, from 32-bit halves (numpy has no uint128).
  # n < 2**63, so n splits into halves below 2**32 as well.
  mask = np.uint64(0xFFFFFFFF)
  shift = np.uint64(32)
  h_hi, h_lo = hashes >> shift, hashes & mask
  n = np.uint64(num_records)
  n_hi, n_lo = n >> shift, n & mask
  with np.errstate(over="ignore"):
    lo_lo = h_lo * n_lo
    hi_lo = h_hi * n_lo
    lo_hi = h_lo * n_hi
    cross = (lo_lo >> shift) + (hi_lo & mask) + (lo_hi & mask)
    high = h_hi * n_hi + (hi_lo >> shift) + (lo_hi >> shift) + (cross >> shift)
  records: np.ndarray = high.astype(np.int64)
  return records
