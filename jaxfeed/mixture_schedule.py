"""The schedule of a `MixtureSampler` (`jaxfeed.mixture`): which component
each position of the mixture's order reads, and the weights as integers.

The schedule: components are the leaves of a balanced binary tree; at an
inner node whose subtrees weigh `a` and `b`, the first `m` positions that
reach the node send `floor((m * a + phase) / (a + b))` to the left subtree
and the rest to the right, with `phase` in `[0, a + b)` drawn from the seed.
Both counts grow by 0 or 1 per position, so after `m` positions component
`c` has been chosen `m * w_c` times to within one per tree level: the
proportions hold exactly at every prefix, not only on average. Weights are
kept as integers (decimal weights such as 0.7 exactly, others to 2**-20 of
the total), so the schedule is the same on every machine.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import numpy as np

from jaxfeed.seeding import mix_seed

_QUANTUM = 1 << 20  # Weights that are not short decimals: to 2**-20 of the total.
MAX_WEIGHT_TOTAL = 1 << 30  # Keeps `remainder * weight` inside int64.
_SCHEDULE_DOMAIN = 0x4D495853  # "MIXS": tree phases, apart from other seeds.
_OP = "MixtureSampler"


def integer_weights(weights: Any, count: int) -> tuple[int, ...]:
  """The weights as integers of the same proportions (reduced by their gcd).

  Args:
    weights: one finite weight >= 0 per component, not all 0; None: equal.
    count: the number of components.

  Returns:
    Integer weights: exact for integers and for decimals of up to six
    places, else rounded to 2**-20 of the total.
  """
  if weights is None:
    return (1,) * count
  if isinstance(weights, (str, bytes, Mapping)):
    raise TypeError(f"{_OP}: weights must be a list of numbers, got {type(weights).__name__}.")
  try:
    values = np.asarray(weights, dtype=np.float64).reshape(-1)
  except (TypeError, ValueError):
    raise TypeError(f"{_OP}: weights must be a list of numbers, got {weights!r:.200}.") from None
  if values.size != count:
    raise ValueError(
      f"{_OP}: got {values.size} weights for {count} components; give one weight per component."
    )
  if not np.isfinite(values).all() or (values < 0).any() or values.sum() <= 0:
    raise ValueError(f"{_OP}: weights must be finite, >= 0 and not all 0, got {values.tolist()}.")
  for scale in (1, 10, 100, 1000, 10_000, 100_000, 1_000_000):
    scaled = values * scale
    rounded = np.round(scaled)
    if (
      (np.abs(scaled - rounded) <= 1e-9 * scaled).all()
      and ((rounded > 0) == (values > 0)).all()
      and rounded.sum() <= MAX_WEIGHT_TOTAL
    ):
      ints = [int(v) for v in rounded]
      break
  else:
    ints = [int(v) for v in np.round(values / values.sum() * _QUANTUM)]
    tiny = [i for i, (v, w) in enumerate(zip(values, ints)) if v > 0 and w == 0]
    if tiny:
      raise ValueError(
        f"{_OP}: weights {[values[i] for i in tiny]} (components {tiny}) are "
        f"below 2**-20 of the total {values.sum()}; give them weight 0 or "
        "more weight."
      )
  divisor = math.gcd(*ints)
  return tuple(w // divisor for w in ints)


class Schedule:
  """One segment's split of positions `m = 0, 1, ...` among the components."""

  def __init__(self, weights: tuple[int, ...], seed: int, segment: int):
    self.weights = weights
    # (lo, hi) -> (mid, weight of [lo, mid), weight of [lo, hi), phase)
    self._nodes: dict[tuple[int, int], tuple[int, int, int, int]] = {}
    stack = [(0, len(weights))]
    while stack:
      lo, hi = stack.pop()
      if hi - lo < 2:
        continue
      mid = (lo + hi) // 2
      left, total = sum(weights[lo:mid]), sum(weights[lo:hi])
      phase = mix_seed(seed, _SCHEDULE_DOMAIN, segment, lo, hi) % total if total else 0
      self._nodes[(lo, hi)] = (mid, left, total, phase)
      stack += [(lo, mid), (mid, hi)]

  @staticmethod
  def _to_left(m: Any, left: int, total: int, phase: int) -> Any:
    """`floor((m * left + phase) / total)`, without overflow on int64 `m`."""
    whole, rest = divmod(m, total)
    return whole * left + (rest * left + phase) // total

  def counts(self, m: int) -> list[int]:
    """How often each component is chosen among the first `m` positions."""
    counts = [0] * len(self.weights)
    stack = [(0, len(self.weights), m)]
    while stack:
      lo, hi, n = stack.pop()
      if hi - lo == 1:
        counts[lo] = n
        continue
      mid, left, total, phase = self._nodes[(lo, hi)]
      to_left = self._to_left(n, left, total, phase) if total else 0
      stack += [(lo, mid, to_left), (mid, hi, n - to_left)]
    return counts

  def locate(self, m: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The component chosen at each position `m` and how often it was chosen
    before it."""
    components = np.zeros(m.size, np.int64)
    indices = np.zeros(m.size, np.int64)
    stack = [(0, len(self.weights), np.arange(m.size), m)]
    while stack:
      lo, hi, which, n = stack.pop()
      if not which.size:
        continue
      if hi - lo == 1:
        components[which], indices[which] = lo, n
        continue
      mid, left, total, phase = self._nodes[(lo, hi)]
      before = self._to_left(n, left, total, phase)
      goes_left = self._to_left(n + 1, left, total, phase) > before
      stack += [
        (lo, mid, which[goes_left], before[goes_left]),
        (mid, hi, which[~goes_left], (n - before)[~goes_left]),
      ]
    return components, indices
