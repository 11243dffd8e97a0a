"""`shuffle`: a windowed shuffle with exact, small state.

The input is cut into consecutive windows of `buffer_size` elements (the last
one may be shorter). Each window is read whole and emitted in a random
permutation keyed by `mix_seed(seed, iteration, window_index)`.

How it differs from tf.data's `shuffle`: tf.data keeps a sliding reservoir (it
emits a random buffered element and refills that slot), so an element can be
delayed without bound but never moves more than `buffer_size - 1` positions
earlier, and restoring its state means saving the whole buffer. Here an
element at input position `p` leaves at a position inside its own window
`[w * buffer_size, (w + 1) * buffer_size)`, `w = p // buffer_size`, so it moves
at most `buffer_size - 1` positions in either direction; within a window every
order is equally likely. With `buffer_size >= ` the number of elements this is
a uniform random permutation of the whole input, as in tf.data. Each pass
yields the same multiset of elements as tf.data's; the order is not tf.data's
(its random stream cannot be reproduced). For a global shuffle of a source,
shuffle in the sampler (`IndexSampler(shuffle=True)`) and use this op to mix
what comes out of per-element ops.

State: the parent's state at the start of the current window, the window's
index, how many of its elements were emitted, the iteration and the seed. To
restore, the parent is restored to the window start, the window is read again
and the emitted elements are skipped: the saved state stays small no matter
how large the buffer, at the cost of re-reading at most `buffer_size`
elements on restore.

Seeds: `seed=None` draws a seed from `os.urandom` when the node is built; it
is saved in the state, and restoring adopts it, so even an unseeded pipeline
resumes exactly (in a new process too). An explicit seed that differs from the
saved one is a `PipelineStateError`.

Iterations: with `reshuffle_each_iteration=True` every iterator made from the
node (each pass over the dataset, or each epoch under `repeat`) gets the next
iteration number and so its own order, as in tf.data; `False` repeats the
order of iteration 0. A restored iterator takes its iteration from the state
and the next iterator made from the node gets the iteration after it, so the
passes after a restore (e.g. later epochs under `repeat`) get the orders the
uninterrupted run gave them.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import numpy as np

from jaxfeed.ops import base


def window_permutation(seed: int, iteration: int, window_index: int, size: int) -> np.ndarray:
  """The emission order of one window: a permutation of `range(size)`."""
  key = base.mix_seed(seed, iteration, window_index)
  return np.random.Generator(np.random.PCG64(key)).permutation(size)


class _ShuffleRun:
  """Mutable run-time facts of one user-built ShuffleNode.

  The seed in use (a drawn seed is replaced by a restored one) and the
  iteration the next iterator gets. Graph rewrites rebuild nodes from
  `spec_params()`; the seed travels there as a `_CarriedSeed`, so rebuilt
  copies of a node share its `_ShuffleRun` and keep counting iterations.
  """

  def __init__(self, seed: int, seed_given: bool):
    self.seed = seed
    self.seed_given = seed_given
    self.next_iteration = 0
    self.lock = threading.Lock()

  def __getstate__(self) -> dict:
    return {"seed": self.seed, "seed_given": self.seed_given, "next_iteration": self.next_iteration}

  def __setstate__(self, state: dict) -> None:
    self.__dict__.update(state)
    self.lock = threading.Lock()

  def take_iteration(self) -> int:
    with self.lock:
      iteration = self.next_iteration
      self.next_iteration += 1
      return iteration

  def restored(self, seed: int, iteration: int) -> None:
    """A restored iterator is at `iteration`: the next one follows it."""
    with self.lock:
      if not self.seed_given:
        self.seed = seed
      self.next_iteration = iteration + 1


class _CarriedSeed(int):
  """An int seed (it fingerprints and serializes as the plain int) that
  carries its node's `_ShuffleRun` through rebuilds from `spec_params`."""

  run: _ShuffleRun

  def __reduce__(self):
    # Pickled and copied specs hold the plain seed, as other processes see it.
    return int, (int(self),)


class ShuffleNode(base.Node):
  """Elements of `parent` shuffled within windows of `buffer_size`."""

  op_name = "shuffle"

  def __init__(
    self,
    parent: base.Node,
    buffer_size: int,
    seed: int | None = None,
    reshuffle_each_iteration: bool = True,
  ):
    super().__init__([base.to_node(parent, self.op_name, "input")])
    self.buffer_size = base.check_positive_int(buffer_size, self.op_name, "buffer_size")
    if isinstance(seed, _CarriedSeed):
      self._run = seed.run
    elif seed is None:
      self._run = _ShuffleRun(int.from_bytes(os.urandom(8), "little"), False)
    elif not isinstance(seed, (int, np.integer)) or isinstance(seed, bool) or not 0 <= seed < 2**64:
      raise ValueError(f"shuffle: seed must be None or an integer in [0, 2**64), got {seed!r}.")
    else:
      self._run = _ShuffleRun(int(seed), True)
    self.seed = int(seed) if seed is not None else self._run.seed
    self.reshuffle_each_iteration = bool(reshuffle_each_iteration)

  def spec_params(self) -> dict:
    seed = _CarriedSeed(self.seed)
    seed.run = self._run
    return {
      "buffer_size": self.buffer_size,
      "seed": seed,
      "reshuffle_each_iteration": self.reshuffle_each_iteration,
    }

  def cardinality(self) -> int | None:
    return self.parents[0].cardinality()

  def make_iterator(self) -> "ShuffleIterator":
    iteration = self._run.take_iteration() if self.reshuffle_each_iteration else 0
    return ShuffleIterator(self.parents[0].make_iterator(), self, iteration)


class ShuffleIterator(base.OpIterator):
  """Reads a window, emits it permuted, then reads the next window."""

  op_name = "shuffle"

  def __init__(self, parent: base.OpIterator, node: ShuffleNode, iteration: int):
    super().__init__([parent])
    self._buffer_size = node.buffer_size
    self._run = node._run  # pylint: disable=protected-access
    self._seed = self._run.seed
    self._iteration = iteration
    self._window_index = -1  # no window read yet
    self._window_start: dict | None = None
    self._elements: list = []
    self._seeds: list[int] = []
    self._order: list[int] = []
    self._offset = 0
    self._before = 0  # elements of the windows before this one, for stats()
    self._last_seed = 0

  @property
  def last_seed(self) -> int:
    return self._last_seed

  def __next__(self) -> Any:
    if self._offset >= len(self._order):
      self._read_window(self._window_index + 1)
      if not self._order:
        raise StopIteration
    slot = self._order[self._offset]
    self._offset += 1
    element = self._elements[slot]
    self._elements[slot] = None  # the window keeps no emitted element alive
    self._last_seed = self._seeds[slot]
    return element

  def _read_window(self, window_index: int) -> None:
    parent = self.parents[0]
    self._window_start = parent.get_state()
    self._window_index = window_index
    elements, seeds = [], []
    try:
      for _ in range(self._buffer_size):
        elements.append(next(parent))
        seeds.append(parent.last_seed)
    except StopIteration:
      pass
    self._before += len(self._order)  # every element of the last window left
    self._elements, self._seeds = elements, seeds
    self._offset = 0
    self._order = window_permutation(
      self._seed, self._iteration, window_index, len(elements)
    ).tolist()

  def _stats_fields(self) -> dict:
    """Elements returned: those of the windows before plus this one's."""
    return {"elements": self._before + self._offset}

  # -- state ---------------------------------------------------------------
  def get_state(self) -> dict:
    """The parent's state at the window start plus the position in it."""
    if self._offset >= len(self._order):
      # Between windows: the next window starts where the parent is now.
      parent_state: dict | None = self.parents[0].get_state()
      window_index, offset = self._window_index + 1, 0
    else:
      parent_state = self._window_start
      window_index, offset = self._window_index, self._offset
    return {
      "op": self.op_name,
      "own": {
        "seed": self._seed,
        "buffer_size": self._buffer_size,
        "iteration": self._iteration,
        "window_index": window_index,
        "offset": offset,
      },
      "parents": [parent_state],
    }

  def _set_own_state(self, state: dict) -> None:
    # The base class has restored the parent to the window start.
    seed = base.state_int(state, "seed", self.op_name, 0, 2**64 - 1)
    buffer_size = base.state_int(state, "buffer_size", self.op_name, 1)
    iteration = base.state_int(state, "iteration", self.op_name)
    window_index = base.state_int(state, "window_index", self.op_name)
    offset = base.state_int(state, "offset", self.op_name, 0, buffer_size)
    if self._run.seed_given and seed != self._run.seed:
      raise base.PipelineStateError(
        f"shuffle: the state was saved with seed {seed}, but this "
        f"pipeline's shuffle has seed {self._run.seed}; restore into a "
        f"pipeline built with the same seed (or seed=None to adopt the "
        f"saved one)."
      )
    if buffer_size != self._buffer_size:
      raise base.PipelineStateError(
        f"shuffle: the state was saved with buffer_size {buffer_size}, but "
        f"this pipeline's shuffle has buffer_size {self._buffer_size}."
      )
    self._seed, self._iteration = seed, iteration
    self._run.restored(seed, iteration)
    self._elements, self._seeds, self._order = [], [], []
    self._offset = 0
    # Every window before a window that was read is full.
    self._before = window_index * buffer_size
    self._window_index = window_index - 1
    self._last_seed = 0
    if offset:
      self._read_window(window_index)
      if offset > len(self._order):
        raise base.PipelineStateError(
          f"shuffle: the state is {offset} elements into window "
          f"{window_index}, but the input holds only {len(self._order)} "
          f"elements there; the state belongs to other input."
        )
      for slot in self._order[:offset]:
        self._elements[slot] = None
      self._last_seed = self._seeds[self._order[offset - 1]]
      self._offset = offset

  def set_state(self, state: dict) -> None:
    base.check_state(state, self.op_name, 1)
    own = state.get("own")
    keys = ("seed", "buffer_size", "iteration", "window_index", "offset")
    if not isinstance(own, dict) or any(k not in own for k in keys):
      raise base.PipelineStateError(
        f"shuffle: expected own state with keys {list(keys)}, got {own!r}."
      )
    super().set_state(state)
