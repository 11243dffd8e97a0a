"""`random`: endless pseudorandom integers (tf.data's `Dataset.random`).

Like tf.data's, the elements are int64 scalars uniform in [0, 2**32); the
same seed gives the same sequence, and each iteration (epoch) repeats it
unless `rerandomize_each_iteration=True`, which gives every iteration its own
sequence. Element `i` of iteration `e` is the top 32 bits of
`mix_seed(seed, e, i)`: a pure function of its position, so the state is the
position and resuming is exact. (tf.data's values come from its own
generator: the two libraries give different numbers for the same seed.)
`seed=None` draws a seed, saved in the state (see `jaxfeed.ops.op_seed`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from jaxfeed.ops.base import IterationCounter, Node, OpIterator, PipelineStateError, state_int
from jaxfeed.ops.op_seed import OpSeed
from jaxfeed.seeding import mix_seed, mix_seeds

__all__ = ["RandomNode", "RandomIterator"]

_OP = "random"
_CHUNK = 256  # Values computed at once.


class RandomNode(Node):
  """Endless int64 values uniform in [0, 2**32), from `seed`."""

  op_name = _OP

  def __init__(
    self,
    seed: int | None = None,
    rerandomize_each_iteration: bool | None = None,
    seed_given: bool | None = None,
  ):
    super().__init__()
    self.op_seed = OpSeed(seed, _OP, seed_given)
    if rerandomize_each_iteration is not None and not isinstance(
      rerandomize_each_iteration, (bool, np.bool_)
    ):
      raise TypeError(
        f"{_OP}: rerandomize_each_iteration must be a bool or "
        f"None, got {rerandomize_each_iteration!r}."
      )
    self.rerandomize_each_iteration = bool(rerandomize_each_iteration)
    self.iterations = IterationCounter()

  def spec_params(self) -> dict:
    return {**self.op_seed.params(), "rerandomize_each_iteration": self.rerandomize_each_iteration}

  def cardinality(self) -> int:
    return -1

  def begin_iteration(self) -> None:
    if self.rerandomize_each_iteration:
      self.iterations.begin()

  def make_iterator(self) -> "RandomIterator":
    return RandomIterator(self, self.iterations.current)


class RandomIterator(OpIterator):
  """State: the seed, the iteration and the index of the next value."""

  op_name = _OP

  def __init__(self, node: RandomNode, iteration: int):
    super().__init__()
    self._node = node
    self._seed = node.op_seed.seed
    self._iteration = iteration
    self._index = 0
    self._chunk: list = []
    self._chunk_start = 0

  def __next__(self) -> Any:
    offset = self._index - self._chunk_start
    if offset >= len(self._chunk):
      self._chunk_start, offset = self._index, 0
      positions = np.arange(self._index, self._index + _CHUNK, dtype=np.int64)
      values = mix_seeds(self._seed, self._iteration, positions) >> np.uint64(32)
      self._chunk = list(values.astype(np.int64))
    self._index += 1
    return self._chunk[offset]

  @property
  def last_seed(self) -> int:
    return mix_seed(self._seed, self._iteration, self._index - 1)

  def _stats_fields(self) -> dict:
    return {"elements": self._index}

  def _get_own_state(self) -> dict:
    return {"seed": self._seed, "iteration": self._iteration, "index": self._index}

  def _set_own_state(self, state: dict) -> None:
    self._seed = self._node.op_seed.restored(state, _OP)
    self._iteration = state_int(state, "iteration", _OP)
    if self._iteration and not self._node.rerandomize_each_iteration:
      raise PipelineStateError(
        f"Cannot restore op {_OP!r}: the state is in iteration "
        f"{self._iteration} of a random dataset with "
        "rerandomize_each_iteration=True, but this pipeline's repeats the "
        "same sequence every iteration."
      )
    self._index = state_int(state, "index", _OP)
    self._chunk, self._chunk_start = [], self._index
    if self._node.rerandomize_each_iteration:
      self._node.iterations.restored(self._iteration)
