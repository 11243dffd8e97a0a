"""`interleave`: tf.data's cycle over nested datasets, sequential or parallel.

`fn(element)` maps each input element to a dataset (tuple elements are
unpacked into arguments, as in tf.data). Up to `cycle_length` nested datasets
are open at once, in cycle positions 0 .. cycle_length-1. The output takes up to
`block_length` consecutive elements from the dataset at the current position,
then moves to the next position. An empty position takes the next input
element; a nested dataset that ends frees its position, which is refilled when
the cycle comes back to it. This is tf.data's exact order, and
`num_parallel_calls` with `deterministic=True` keeps it.

Parallel reading: with `num_parallel_calls`, every cycle position is opened as
soon as it is empty (in the order the sequential cycle would open it, so with
the same input element), and its nested dataset is created (fn runs) and read
ahead on a pool of `num_parallel_calls` threads, in reads of
max(block_length, 8) elements with one read queued ahead per position; the
consumer takes the elements in cycle order. (When `fn` raises, the element
is skipped in both modes, but the order after the error may differ between
them, as it does in tf.data.) With `deterministic=False` the consumer skips a position whose
block is not ready yet when another one is, so a slow nested dataset does not
hold the others back (each nested dataset's own order is kept).

State: the input's position (through `InputReplay`) plus, per cycle position,
the read index of the input element that opened it and the nested iterator's
state (in parallel mode: its state before the current block and the number of
elements consumed from that block). Restoring reads those input elements again,
calls `fn` again and restores the nested iterators, so `fn` must be
deterministic. The state layout is the same in both modes: a checkpoint of the
sequential op restores into the parallel one and vice versa.

Nested datasets are run as built (the static optimizer applies to the outer
pipeline only).
"""

from __future__ import annotations

import concurrent.futures
import os
import sys
import weakref
from typing import Any, Callable

import numpy as np

from jaxfeed.ops import base
from jaxfeed.ops import parallel

__all__ = ["InterleaveNode", "InterleaveIterator", "default_cycle_length"]

# Elements per read-ahead task at least: amortizes the task overhead when
# block_length is small.
_MIN_READ_AHEAD = 8


def default_cycle_length() -> int:
  """The cycle length used for None / AUTOTUNE: the number of CPU cores."""
  return os.cpu_count() or 1


def _check_cycle_length(value: Any, op_name: str) -> int | None:
  if value is None or (
    isinstance(value, (int, np.integer)) and not isinstance(value, bool) and value == base.AUTOTUNE
  ):
    return None
  return base.check_positive_int(value, op_name, "cycle_length")


class InterleaveNode(base.Node):
  """Interleaves the datasets `fn` returns for the input elements.

  Args:
    parent: the input node.
    fn: element -> Dataset (a jaxfeed `Dataset` or op node).
    cycle_length: nested datasets open at once; None or `jaxfeed.AUTOTUNE`
      means the number of CPU cores (`os.cpu_count()`), as tf.data's default.
    block_length: consecutive elements taken from one nested dataset per turn.
    num_parallel_calls: None reads in the consumer's thread; an int or
      `jaxfeed.AUTOTUNE` reads nested datasets ahead on that many threads.
    deterministic: with parallel reading, whether to keep the sequential order.
  """

  op_name = "interleave"

  def __init__(
    self,
    parent: base.Node,
    fn: Callable,
    cycle_length: int | None = None,
    block_length: int = 1,
    num_parallel_calls: int | None = None,
    deterministic: bool = True,
  ):
    super().__init__([base.to_node(parent, self.op_name, "input")])
    self.fn = parallel.check_callable(fn, self.op_name)
    self.cycle_length = _check_cycle_length(cycle_length, self.op_name)
    self.block_length = base.check_positive_int(block_length, self.op_name, "block_length")
    self.num_parallel_calls = parallel.check_num_parallel_calls(num_parallel_calls, self.op_name)
    self.deterministic = parallel.check_deterministic(deterministic, self.op_name)

  def spec_params(self) -> dict:
    return {
      "fn": self.fn,
      "cycle_length": self.cycle_length,
      "block_length": self.block_length,
      "num_parallel_calls": self.num_parallel_calls,
      "deterministic": self.deterministic,
    }

  def cardinality(self) -> int | None:
    return 0 if self.parents[0].cardinality() == 0 else None

  def make_iterator(self) -> "InterleaveIterator":
    cycle_length = self.cycle_length or default_cycle_length()
    threads = (
      None
      if self.num_parallel_calls is None
      else parallel.resolve_parallelism(self.num_parallel_calls)
    )
    return InterleaveIterator(
      self.parents[0].make_iterator(),
      self.fn,
      cycle_length,
      self.block_length,
      threads,
      self.deterministic,
      self.op_name,
    )


def _open_nested(
  fn: Callable, element: Any, op_name: str, state: Any, skip: int
) -> base.OpIterator:
  """The nested iterator of an input element, restored to `state` + `skip`."""
  result = parallel.call_unpacked(fn, element)
  node = base.to_node(result, op_name, "the value returned by fn")
  iterator = node.make_iterator()
  if state is not None:
    iterator.set_state(state)
  for _ in range(skip):
    try:
      next(iterator)
    except StopIteration:
      break  # Already at its end: the position frees at its next read.
  return iterator


class _Slot:
  """One open cycle position read in the consumer's thread."""

  __slots__ = ("input_index", "input_seed", "iterator")
  failed = False

  def __init__(self, input_index: int, input_seed: int, iterator: base.OpIterator):
    self.input_index = input_index
    self.input_seed = input_seed
    self.iterator = iterator

  def next(self) -> Any:
    return next(self.iterator)

  def ready(self) -> bool:
    return True

  def future(self) -> None:
    return None

  def seed(self) -> int:
    return base.mix_seed(self.input_seed, self.iterator.last_seed)

  def get_state(self) -> dict:
    return {"input_index": self.input_index, "child": self.iterator.get_state(), "skip": 0}

  def close(self) -> None:
    self.iterator.close()


class _Block:
  """Elements read ahead from one nested iterator, with its state before them.

  Reads need not line up with the cycle's blocks: a position's elements are
  one stream, and a state is the read's starting state plus the count taken.
  """

  __slots__ = ("state", "elements", "seeds", "exhausted", "error")

  def __init__(
    self, state: Any, elements: list, seeds: list, exhausted: bool, error: BaseException | None
  ):
    self.state = state
    self.elements = elements
    self.seeds = seeds
    self.exhausted = exhausted
    self.error = error


class _PrefetchSlot:
  """One open cycle position whose nested dataset is read ahead on a pool.

  At most one read task per slot is queued or running, so the nested iterator
  is only ever used by one thread; the consumer only reads finished blocks.
  The tasks reference this slot, never the op iterator (garbage collection of
  an abandoned iterator then shuts the pool down).
  """

  def __init__(
    self,
    pool: concurrent.futures.ThreadPoolExecutor,
    input_index: int,
    input_seed: int,
    open_nested: Callable,
    read_length: int,
    child_state: Any = None,
    skip: int = 0,
  ):
    self.input_index = input_index
    self.input_seed = input_seed
    self.failed = False
    self._pool = pool
    self._read_length = read_length
    self._iterator: base.OpIterator | None = None
    self._initial = (child_state, skip)
    self._block: _Block | None = None
    self._pos = 0
    self._future: concurrent.futures.Future | None = pool.submit(
      self._open_and_read, open_nested, child_state, skip
    )

  # -- worker side -----------------------------------------------------------
  def _open_and_read(self, open_nested: Callable, state: Any, skip: int) -> _Block:
    self._iterator = open_nested(state, skip)
    return self._read_block()

  def _read_block(self) -> _Block:
    iterator = self._iterator
    state = iterator.get_state()
    elements, seeds = [], []
    exhausted, error = False, None
    for _ in range(self._read_length):
      try:
        element = next(iterator)
      except StopIteration:
        exhausted = True
        break
      except Exception as exc:  # noqa: BLE001 -- raised in the consumer
        error = exc
        break
      elements.append(element)
      seeds.append(iterator.last_seed)
    return _Block(state, elements, seeds, exhausted, error)

  # -- consumer side -----------------------------------------------------------
  def ready(self) -> bool:
    block = self._block
    if block is not None and (
      self._pos < len(block.elements) or block.error is not None or block.exhausted
    ):
      return True
    return self._future is None or self._future.done()

  def future(self) -> concurrent.futures.Future | None:
    return self._future

  def next(self) -> Any:
    while True:
      block = self._block
      if block is not None:
        if self._pos < len(block.elements):
          element = block.elements[self._pos]
          block.elements[self._pos] = None  # Returned: do not keep it alive.
          self._pos += 1
          return element
        if block.error is not None:
          error, block.error = block.error, None
          self._future = self._pool.submit(self._read_block)
          raise error
        if block.exhausted:
          raise StopIteration
      try:
        block = self._future.result()
      except BaseException:
        self.failed = True  # Opening the nested dataset failed.
        self._future = None
        raise
      self._block, self._pos = block, 0
      if block.exhausted or block.error is not None:
        self._future = None
      else:
        self._future = self._pool.submit(self._read_block)

  def seed(self) -> int:
    return base.mix_seed(self.input_seed, self._block.seeds[self._pos - 1])

  def get_state(self) -> dict:
    if self._block is None:
      state, skip = self._initial
    else:
      state, skip = self._block.state, self._pos
    return {"input_index": self.input_index, "child": state, "skip": skip}

  def wait(self) -> None:
    """Waits for the queued read so the nested iterator is idle."""
    future = self._future
    if future is not None:
      future.cancel()
      concurrent.futures.wait([future])

  def close(self) -> None:
    self.wait()
    if self._iterator is not None:
      self._iterator.close()


class InterleaveIterator(base.OpIterator):
  """The cycle of nested iterators (see the module docstring)."""

  op_name = "interleave"

  def __init__(
    self,
    parent: base.OpIterator,
    fn: Callable,
    cycle_length: int,
    block_length: int,
    num_threads: int | None,
    deterministic: bool,
    op_name: str = "interleave",
  ):
    super().__init__([parent])
    self.op_name = op_name
    self._fn = fn
    self._cycle_length = cycle_length
    self._block_length = block_length
    self._deterministic = deterministic
    self._slots: list = [None] * cycle_length
    self._num_open = 0
    self._cycle_index = 0
    self._block_index = 0
    self._end_of_input = False
    self._last_slot = None
    self._input = base.InputReplay(parent, op_name, interval=16, oldest_needed=self._oldest_input)
    self._pool = None
    if num_threads is not None:
      self._pool = concurrent.futures.ThreadPoolExecutor(
        max_workers=num_threads, thread_name_prefix=f"jaxfeed-{op_name}"
      )
      self._finalizer = weakref.finalize(self, self._pool.shutdown, wait=False, cancel_futures=True)

  @property
  def last_seed(self) -> int:
    return 0 if self._last_slot is None else self._last_slot.seed()

  def _oldest_input(self) -> int:
    indices = [s.input_index for s in self._slots if s is not None]
    return min(indices) if indices else self._input.num_read

  def _advance_cycle(self) -> None:
    self._block_index = 0
    self._cycle_index = (self._cycle_index + 1) % self._cycle_length

  def _open(
    self, input_index: int, element: Any, input_seed: int, child_state: Any = None, skip: int = 0
  ):
    if self._pool is None:
      return _Slot(
        input_index, input_seed, _open_nested(self._fn, element, self.op_name, child_state, skip)
      )
    fn, op_name = self._fn, self.op_name

    def open_nested(state: Any, skip: int) -> base.OpIterator:
      return _open_nested(fn, element, op_name, state, skip)

    return _PrefetchSlot(
      self._pool,
      input_index,
      input_seed,
      open_nested,
      max(self._block_length, _MIN_READ_AHEAD),
      child_state,
      skip,
    )

  def _can_skip(self, index: int) -> bool:
    """deterministic=False: whether to pass over the unready position `index`.

    True as soon as another position can produce; waits for the first read
    to finish while none can, and is False once `index` itself is ready.
    """
    current = self._slots[index]
    while not current.ready():
      for i, slot in enumerate(self._slots):
        if i != index and (slot.ready() if slot is not None else not self._end_of_input):
          return True
      futures = [s.future() for s in self._slots if s is not None]
      concurrent.futures.wait(
        [f for f in futures if f is not None], return_when=concurrent.futures.FIRST_COMPLETED
      )
    return False

  def _fill_empty_positions(self) -> None:
    """Parallel mode: opens every empty position now, in cycle order.

    Positions are refilled in the order they became empty, which is the order
    in which the sequential cycle refills them, so every position gets the
    input element it would get there; opening them early lets their first
    reads overlap.
    """
    slots = self._slots
    for k in range(self._cycle_length):
      index = (self._cycle_index + k) % self._cycle_length
      if slots[index] is None:
        try:
          element = self._input.read()
        except StopIteration:
          self._end_of_input = True
          return
        slots[index] = self._open(self._input.num_read - 1, element, self.parents[0].last_seed)
        self._num_open += 1

  def __next__(self) -> Any:
    slots = self._slots
    eager = self._pool is not None
    while not self._end_of_input or self._num_open:
      if eager and not self._end_of_input and (self._num_open < self._cycle_length):
        self._fill_empty_positions()
        continue
      index = self._cycle_index
      slot = slots[index]
      if slot is None:
        if self._end_of_input:
          self._advance_cycle()
          continue
        try:
          element = self._input.read()
        except StopIteration:
          self._end_of_input = True
          continue
        # If fn fails the element is consumed and the position stays empty,
        # as in tf.data.
        slots[index] = self._open(self._input.num_read - 1, element, self.parents[0].last_seed)
        self._num_open += 1
        continue
      if not self._deterministic and not slot.ready() and self._can_skip(index):
        self._advance_cycle()
        continue
      try:
        element = slot.next()
      except StopIteration:
        slot.close()
        slots[index] = None
        self._num_open -= 1
        self._advance_cycle()
        continue
      except BaseException:
        if slot.failed:
          slot.close()
          slots[index] = None
          self._num_open -= 1
        raise
      self._last_slot = slot
      self._block_index += 1
      if self._block_index == self._block_length:
        self._advance_cycle()
      return element
    raise StopIteration

  # -- state -----------------------------------------------------------------
  def _get_own_state(self) -> dict:
    return {
      "cycle_index": self._cycle_index,
      "block_index": self._block_index,
      "end_of_input": self._end_of_input,
      "input": self._input.get_state(self._oldest_input()),
      "slots": [None if s is None else s.get_state() for s in self._slots],
    }

  def _set_own_state(self, state: dict) -> None:
    op = self.op_name
    self._close_slots()
    slot_states = state.get("slots") if isinstance(state, dict) else None
    if (
      not isinstance(slot_states, list)
      or len(slot_states) != self._cycle_length
      or not all(s is None or isinstance(s, dict) for s in slot_states)
    ):
      raise base.PipelineStateError(
        f"Cannot restore op {op!r}: 'slots' must be a list of "
        f"{self._cycle_length} (the cycle_length) entries, got "
        f"{slot_states!r:.200}."
      )
    cycle_index = base.state_int(state, "cycle_index", op, high=self._cycle_length - 1)
    block_index = base.state_int(state, "block_index", op, high=self._block_length - 1)
    needed = {}
    for s in slot_states:
      if s is not None:
        needed[base.state_int(s, "input_index", op)] = None
        base.state_int(s, "skip", op)
    found = {}

    def consume(index: int, element: Any, seed: int) -> None:
      if index in needed:
        found[index] = (element, seed)

    self._input.set_state(state.get("input"), min(needed) if needed else sys.maxsize, consume)
    if len(found) != len(needed):
      raise base.PipelineStateError(
        f"Cannot restore op {op!r}: input elements {sorted(set(needed) - set(found))} "
        f"named by the state were not re-read."
      )
    for i, s in enumerate(slot_states):
      if s is not None:
        element, seed = found[s["input_index"]]
        self._slots[i] = self._open(s["input_index"], element, seed, s.get("child"), s["skip"])
        self._num_open += 1
    self._cycle_index = cycle_index
    self._block_index = block_index
    self._end_of_input = bool(state.get("end_of_input"))

  # -- lifetime --------------------------------------------------------------
  def _close_slots(self) -> None:
    # Stop all queued reads first: a running read must not race a close.
    for slot in self._slots:
      if isinstance(slot, _PrefetchSlot):
        slot.wait()
    for i, slot in enumerate(self._slots):
      if slot is not None:
        slot.close()
        self._slots[i] = None
    self._num_open = 0
    self._last_slot = None

  def _close_own(self) -> None:
    self._close_slots()
    if self._pool is not None:
      self._pool.shutdown(wait=True, cancel_futures=True)
      self._finalizer.detach()
