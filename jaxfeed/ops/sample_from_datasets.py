"""`sample_from_datasets`: a random mixture of datasets by weight.

tf.data's `Dataset.sample_from_datasets(datasets, weights=None, seed=None,
stop_on_empty_dataset=False)`: each output element is the next element of an
input drawn at random with probability proportional to its weight (uniform
when `weights` is None).

- `stop_on_empty_dataset=False`: an exhausted input drops out and the draw is
  among the others, by their weights; the output ends when every input with a
  positive weight is exhausted, so nothing is lost.
- `stop_on_empty_dataset=True`: the output ends at the first draw of an
  exhausted input.

Draw `k` is a pure function of `(seed, k)` and of which inputs are still
live: the mixture is deterministic from the seed, and its state is the number
of draws (plus the inputs' states), so it resumes exactly. The weights are not
part of the state: a restored iterator may run with new weights.

`seed=None` draws a seed when the node is built; it is saved in the state and
adopted on restore, so an unseeded mixture resumes exactly too. (tf.data's
draws come from its own generator, so the two libraries choose differently for
the same seed; `choose_from_datasets` matches tf.data exactly.)
"""

from __future__ import annotations

import math
import os
from typing import Any, Sequence

import numpy as np

from jaxfeed.ops import base
from jaxfeed.ops import mixing

__all__ = ["SampleFromDatasetsNode", "SampleIterator"]

_OP = "sample_from_datasets"
_TWO_64 = float(2**64)


def _check_weights(weights: Any, count: int) -> tuple[float, ...]:
  if weights is None:
    return (1.0 / count,) * count
  if hasattr(weights, "node") or isinstance(weights, base.Node):
    raise TypeError(
      f"{_OP}: weights must be a list of numbers; weights that "
      "change per element (a dataset of weights) are not supported."
    )
  try:
    values = [float(w) for w in np.asarray(weights, dtype=np.float64).reshape(-1)]
  except (TypeError, ValueError):
    raise TypeError(f"{_OP}: weights must be a list of numbers, got {weights!r:.200}.") from None
  if len(values) != count:
    raise ValueError(
      f"{_OP}: got {len(values)} weights for {count} datasets; give one weight per dataset."
    )
  if any(not math.isfinite(w) or w < 0 for w in values) or sum(values) <= 0:
    raise ValueError(f"{_OP}: weights must be finite, >= 0 and not all 0, got {values}.")
  total = sum(values)
  return tuple(w / total for w in values)


def _check_seed(seed: Any) -> int:
  if not isinstance(seed, (int, np.integer)) or isinstance(seed, bool) or not 0 <= seed < 2**64:
    raise ValueError(f"{_OP}: seed must be None or an integer in [0, 2**64), got {seed!r}.")
  return int(seed)


class SampleFromDatasetsNode(base.Node):
  """Elements of `datasets` drawn at random by `weights`."""

  op_name = _OP

  def __init__(
    self,
    *parents: base.Node,
    weights: Sequence[float] | None = None,
    seed: int | None = None,
    stop_on_empty_dataset: bool = False,
    seed_given: bool | None = None,
  ):
    """Mixes `parents`, each element from one drawn by weight.

    Args:
      *parents: the datasets mixed.
      weights: one non-negative weight per dataset; None for uniform.
      seed: the seed of the draws; None draws one now.
      stop_on_empty_dataset: end at the first draw of an exhausted input.
      seed_given: internal (rebuilt specs): whether the user gave `seed`.
    """
    nodes = mixing.check_datasets(list(parents), _OP)
    super().__init__(nodes)
    self.weights = _check_weights(weights, len(nodes))
    self.seed_given = seed is not None if seed_given is None else bool(seed_given)
    self.seed = _check_seed(seed) if seed is not None else int.from_bytes(os.urandom(8), "little")
    self.stop_on_empty_dataset = mixing.check_stop(stop_on_empty_dataset, _OP)

  def spec_params(self) -> dict:
    return {
      "weights": list(self.weights),
      "seed": self.seed,
      "stop_on_empty_dataset": self.stop_on_empty_dataset,
      "seed_given": self.seed_given,
    }

  def cardinality(self) -> int | None:
    counts = [p.cardinality() for p in self.parents]
    live = [c for c, w in zip(counts, self.weights) if w > 0]
    if self.stop_on_empty_dataset:
      return -1 if all(c == -1 for c in live) else None
    if any(c is None for c in live):
      return None
    return -1 if any(c == -1 for c in live) else sum(live)

  def make_iterator(self) -> "SampleIterator":
    return SampleIterator([p.make_iterator() for p in self.parents], self)


class SampleIterator(mixing.MixIterator):
  """Draws the input of draw `k` from `mix_seed(seed, k)`."""

  op_name = _OP

  def __init__(self, inputs: list[base.OpIterator], node: SampleFromDatasetsNode):
    super().__init__(inputs, None, node.stop_on_empty_dataset, _OP)
    self._weights = node.weights
    self._seed = node.seed
    self._seed_given = node.seed_given
    self._draws = 0

  def _choose(self) -> int:
    live = [
      i
      for i, w in enumerate(self._weights)
      if w > 0 and not (self._exhausted[i] and not self._stop_on_empty)
    ]
    if not live:
      raise StopIteration
    total = sum(self._weights[i] for i in live)
    u = base.mix_seed(self._seed, self._draws) / _TWO_64 * total
    self._draws += 1
    for i in live:
      u -= self._weights[i]
      if u < 0:
        return i
    return live[-1]  # rounding at the top end

  def _get_own_state(self) -> dict:
    state = super()._get_own_state()
    state.update(draws=self._draws, seed=self._seed)
    return state

  def _set_own_state(self, state: dict) -> None:
    super()._set_own_state(state)
    self._draws = base.state_int(state, "draws", _OP)
    seed = base.state_int(state, "seed", _OP, high=2**64 - 1)
    if self._seed_given and seed != self._seed:
      raise base.PipelineStateError(
        f"Cannot restore op {_OP!r}: the state was saved with seed {seed}, "
        f"this pipeline has seed {self._seed}."
      )
    self._seed = seed
