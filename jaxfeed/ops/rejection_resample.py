"""`rejection_resample`: resamples elements towards a target class
distribution (tf.data's `Dataset.rejection_resample`).

Output elements are `(class, element)` pairs, `class = class_func(element)`
(a tuple element is unpacked into the arguments). As in tf.data, the output
mixes two reads of the input, which repeat or drop elements as needed:

- with probability `m`, the next element of the input as it comes;
- otherwise the next element of a second read of the input that a
  rejection sampler accepts: class `i` with probability `a_i`.

With `p` the input's class distribution and `t` the target, `r_i = t_i / p_i`,
`m = min_i r_i` and `a_i = (r_i - m) / (max_i r_i - m)` (tf.data's
`_calculate_acceptance_probs_with_mixing`): the mixture's class distribution
is exactly `t`, with as few rejections as possible. The output ends when the
read it draws from ends. `p` is `initial_dist` when given; otherwise it is
estimated as the input is read: per-class counts, each starting at 10
(tf.data's smoothing), over the elements both reads have taken. tf.data
updates its estimate once per 32 elements from a third read of the input;
here it is updated at every element, from the reads that take them anyway.

Randomness: draw `k` of the mixture and acceptance test `j` of the sampler
are pure functions of `(seed, k)` and `(seed, j)`, so the output is
deterministic from the seed, and the state (the two reads' states, the
counters and the class counts) resumes it exactly. `seed=None` draws a seed,
saved in the state (see `jaxfeed.ops.op_seed`). tf.data's random numbers come
from its own generators: for the same seed the two libraries pick different
elements, with the same distribution.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import numpy as np

from jaxfeed.ops import parallel
from jaxfeed.ops.base import Node, OpIterator, PipelineStateError, state_int, to_node
from jaxfeed.ops.op_seed import OpSeed
from jaxfeed.seeding import mix_seed

__all__ = ["RejectionResampleNode", "RejectionResampleIterator", "acceptance_and_mixing"]

_OP = "rejection_resample"
_SMOOTHING = 10  # tf.data's initial count per class.
_TINY = float(np.finfo(np.float32).tiny)  # tf.data's guard against p_i = 0.
_TWO_64 = float(2**64)
_MIXTURE, _ACCEPTANCE = 0, 1  # The two random streams of a seed.


def _distribution(value: Any, name: str, count: int | None = None) -> list[float]:
  try:
    probs = np.asarray(value, dtype=np.float64)
  except (TypeError, ValueError):
    raise TypeError(f"{_OP}: {name} must be a list of probabilities, got {value!r:.120}.") from None
  if (
    probs.ndim != 1
    or not probs.size
    or not np.all(np.isfinite(probs))
    or np.any(probs < 0)
    or not math.isclose(probs.sum(), 1.0, abs_tol=1e-4)
  ):
    raise ValueError(
      f"{_OP}: {name} must be a 1-d list of probabilities "
      f">= 0 that sum to 1 (one per class), got {value!r:.120}."
    )
  if count is not None and probs.size != count:
    raise ValueError(
      f"{_OP}: {name} has {probs.size} classes but target_dist "
      f"has {count}; give one probability per class."
    )
  return probs.tolist()


def acceptance_and_mixing(initial: np.ndarray, target: np.ndarray) -> tuple[np.ndarray, float]:
  """The per-class acceptance probabilities `a` and the probability `m` of
  taking the input as it comes (see the module docstring).

  Args:
    initial: the input's class distribution, `[num_classes]`.
    target: the target distribution, `[num_classes]`.
  """
  ratio = target / (initial + _TINY)
  low, high = float(ratio.min()), float(ratio.max())
  if high - low <= 0:  # The input has the target distribution already.
    return np.ones_like(ratio), 1.0
  return (ratio - low) / (high - low), min(low, 1.0)


class RejectionResampleNode(Node):
  """`(class, element)` pairs resampled towards `target_dist`."""

  op_name = _OP

  def __init__(
    self,
    parent: Any,
    class_func: Callable,
    target_dist: Sequence[float],
    initial_dist: Sequence[float] | None = None,
    seed: int | None = None,
    seed_given: bool | None = None,
  ):
    super().__init__([to_node(parent, _OP, "input")])
    self.class_func = parallel.check_callable(class_func, _OP, "class_func")
    self.target_dist = _distribution(target_dist, "target_dist")
    self.initial_dist = (
      None
      if initial_dist is None
      else _distribution(initial_dist, "initial_dist", len(self.target_dist))
    )
    self.op_seed = OpSeed(seed, _OP, seed_given)

  def spec_params(self) -> dict:
    return {
      "class_func": self.class_func,
      "target_dist": self.target_dist,
      "initial_dist": self.initial_dist,
      **self.op_seed.params(),
    }

  def make_iterator(self) -> "RejectionResampleIterator":
    # Two reads of the input, as tf.data's two inputs of its mixture.
    parent = self.parents[0]
    return RejectionResampleIterator(parent.make_iterator(), parent.make_iterator(), self)


class RejectionResampleIterator(OpIterator):
  """Parents: the read taken as it comes, and the read that is filtered.

  Own state: the seed, the mixture's draws, the sampler's tests and (when
  the input's distribution is estimated) the class counts.
  """

  op_name = _OP

  def __init__(self, as_is: OpIterator, filtered: OpIterator, node: RejectionResampleNode):
    super().__init__([as_is, filtered])
    self._node = node
    self._class_func = node.class_func
    self._target = np.array(node.target_dist)
    self._seed = node.op_seed.seed
    self._draws = 0
    self._tests = 0
    self._counts: list[int] | None = None
    if node.initial_dist is None:
      self._counts = [_SMOOTHING] * len(node.target_dist)
      self._estimate()
    else:
      self._accept, self._mixing = acceptance_and_mixing(np.array(node.initial_dist), self._target)
    self._last_seed = 0

  @property
  def last_seed(self) -> int:
    return self._last_seed

  def _uniform(self, stream: int, index: int) -> float:
    return mix_seed(self._seed, stream, index) / _TWO_64

  def __next__(self) -> Any:
    draw = self._uniform(_MIXTURE, self._draws)
    self._draws += 1
    if draw < self._mixing:
      as_is = self.parents[0]
      element = next(as_is)
      self._last_seed = as_is.last_seed
      label = self._class_of(element)
      self._count(label)
      return label, element
    filtered = self.parents[1]
    while True:
      element = next(filtered)
      label = self._class_of(element)
      test = self._uniform(_ACCEPTANCE, self._tests)
      self._tests += 1
      self._count(label)
      if test < self._accept[int(label)]:
        self._last_seed = filtered.last_seed
        return label, element

  def _count(self, label: Any) -> None:
    if self._counts is not None:
      self._counts[int(label)] += 1
      self._estimate()

  def _estimate(self) -> None:
    """The acceptance and mixing of the class distribution counted so far."""
    counts = np.array(self._counts, np.float64)
    self._accept, self._mixing = acceptance_and_mixing(counts / counts.sum(), self._target)

  def _class_of(self, element: Any) -> Any:
    label = parallel.call_unpacked(self._class_func, element)
    value = np.asarray(label)
    if value.shape != () or value.dtype.kind not in "iu" or not 0 <= int(value) < len(self._target):
      raise ValueError(
        f"{_OP}: class_func must return an integer scalar in "
        f"[0, {len(self._target)}) (one class per target_dist entry), got "
        f"{label!r:.80}."
      )
    return value[()]

  def _get_own_state(self) -> dict:
    return {"seed": self._seed, "draws": self._draws, "tests": self._tests, "counts": self._counts}

  def _set_own_state(self, state: dict) -> None:
    self._seed = self._node.op_seed.restored(state, _OP)
    self._draws = state_int(state, "draws", _OP)
    self._tests = state_int(state, "tests", _OP)
    counts = state.get("counts")
    if (counts is None) != (self._counts is None) or (
      counts is not None
      and (
        not isinstance(counts, list)
        or len(counts) != len(self._target)
        or not all(isinstance(c, int) and c >= _SMOOTHING for c in counts)
      )
    ):
      raise PipelineStateError(
        f"Cannot restore op {_OP!r}: the saved class counts {counts!r:.120} "
        f"do not fit this pipeline's {len(self._target)} classes "
        + ("estimated as it reads." if self._counts is not None else "with a given initial_dist.")
      )
    if counts is not None:
      self._counts = list(counts)
      self._estimate()
