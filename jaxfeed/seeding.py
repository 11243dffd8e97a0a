"""Seed mixing shared by the sampler and the ops (a splitmix64 chain).

`mix_seed(a, b, ...)` on Python ints and `mix_seeds(a, b, ...)` on numpy
uint64 arrays compute the same function, so a per-record seed computed in bulk
by the sampler equals the one an op computes for a single element.
"""

from __future__ import annotations

import numpy as np

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_M1 = 0xBF58476D1CE4E5B9
_M2 = 0x94D049BB133111EB


def mix_seed(*values: int) -> int:
  """Mixes integers into one well-spread seed in [0, 2**64).

  Args:
    *values: Python or numpy ints; negative values are taken modulo 2**64.

  Returns:
    A Python int in [0, 2**64).
  """
  return continue_mix(_GOLDEN, *values)


def continue_mix(prefix: int, *values: int) -> int:
  """Goes on mixing from `prefix = mix_seed(a, ...)`.

  `continue_mix(mix_seed(a), b) == mix_seed(a, b)`, so a prefix that stays
  fixed (an op's seed) is mixed once instead of for every element.
  """
  z = prefix
  for v in values:
    z = (z + (int(v) & _MASK64) + _GOLDEN) & _MASK64
    z = ((z ^ (z >> 30)) * _M1) & _MASK64
    z = ((z ^ (z >> 27)) * _M2) & _MASK64
    z ^= z >> 31
  return z


def mix_seeds(*values: np.ndarray | int) -> np.ndarray:
  """Vectorized `mix_seed`: broadcasts its arguments, returns uint64."""
  # Leading Python ints are mixed once as a scalar prefix.
  count = 0
  while count < len(values) and isinstance(values[count], int):
    count += 1
  prefix = continue_mix(_GOLDEN, *values[:count])
  arrays = [
    np.asarray(v).astype(np.uint64) if not isinstance(v, int) else np.uint64(v & _MASK64)
    for v in values[count:]
  ]
  shape = np.broadcast_shapes(*(np.shape(a) for a in arrays))
  z = np.full(shape, prefix, dtype=np.uint64)
  with np.errstate(over="ignore"):
    for a in arrays:
      z = z + a + np.uint64(_GOLDEN)
      z = (z ^ (z >> np.uint64(30))) * np.uint64(_M1)
      z = (z ^ (z >> np.uint64(27))) * np.uint64(_M2)
      z = z ^ (z >> np.uint64(31))
  return z
