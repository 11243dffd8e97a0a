"""The parallel-execution engine shared by map-like ops.

`ParallelExecutor` applies a work function to the elements of a parent
iterator on a pool of threads, with at most `parallelism` elements pulled but
not yet returned. Elements are pulled from the parent in the consumer's thread,
so the parent iterator (and its state) is only ever touched by one thread.

Resume contract. With every element pulled, the executor records the parent's
per-element seed and the parent's state snapshot taken right after the pull.
Its `parent_state()` is the parent state as of the oldest element not yet
returned (that is, nothing in flight), plus the offsets of the elements after
it that were already returned:

* `deterministic=True`: outputs come back in input order, so the list of
  returned-ahead elements is always empty and the state is simply "the parent
  after the last returned element".
* `deterministic=False`: outputs come back in completion order (no
  head-of-line blocking). An element may be returned while an older one is
  still running; those returned-ahead elements are listed in the state, and
  after `restore` they are pulled from the parent again but not recomputed or
  returned. The elements returned after a restore are therefore exactly the
  ones the uninterrupted iterator had left to return (as a multiset; their
  order is, as always with `deterministic=False`, the completion order).

A worker's exception is re-raised, with the worker's traceback, by the
`next()` that would have returned its element; the iterator then continues with
the following elements (like tf.data).
"""

from __future__ import annotations

import collections
import os
import queue
import threading
import time
import weakref
from typing import Any, Callable

import numpy as np

from jaxfeed.ops import autotune
from jaxfeed.ops.base import (AUTOTUNE, OpIterator, PipelineStateError,
                              check_state)

__all__ = [
    "ParallelExecutor",
    "resolve_parallelism",
    "default_autotune_parallelism",
    "check_num_parallel_calls",
    "ParallelMapIterator",
    "call_unpacked",
]

_STOP = None  # Task-queue sentinel: the worker that takes it exits.


def default_autotune_parallelism() -> int:
  """The parallelism AUTOTUNE starts from until the autotuner adjusts it."""
  return max(1, min(os.cpu_count() or 1, 8))


def check_num_parallel_calls(value: Any, op_name: str) -> int | None:
  """Validates `num_parallel_calls`: None, AUTOTUNE (-1) or an int >= 1."""
  if value is None:
    return None
  if (isinstance(value, (int, np.integer)) and not isinstance(value, bool)
      and (value == AUTOTUNE or value >= 1)):
    return int(value)
  raise ValueError(
      f"{op_name}: num_parallel_calls must be None, jaxfeed.AUTOTUNE (-1) or "
      f"an integer >= 1, got {value!r}.")


def resolve_parallelism(num_parallel_calls: int | None) -> int:
  """The number of threads to start for a validated `num_parallel_calls`."""
  if num_parallel_calls is None:
    return 1
  if num_parallel_calls == AUTOTUNE:
    return default_autotune_parallelism()
  return num_parallel_calls


def _worker_loop(tasks: queue.SimpleQueue, results: queue.SimpleQueue,
                 work_fn: Callable[[Any, int], Any], generation: list,
                 busy: list) -> None:
  """A worker thread; `busy[0]` accumulates its seconds spent in work_fn."""
  # Holds no reference to the executor or the op iterator, so an abandoned
  # iterator can be garbage-collected (its finalizer then stops this thread).
  clock = time.perf_counter
  while True:
    task = tasks.get()
    if task is _STOP:
      return
    task_generation, seq, element, seed = task
    task = None
    if task_generation != generation[0]:
      continue  # Discarded by restore() or close(): skip the work.
    start = clock()
    try:
      result = (task_generation, seq, True, work_fn(element, seed))
    except BaseException as exc:  # noqa: BLE001 -- re-raised in the consumer
      result = (task_generation, seq, False, exc)
    element = None
    busy[0] += clock() - start
    results.put(result)
    result = None


def _shutdown(tasks: queue.SimpleQueue, threads: list, generation: list) -> None:
  """Stops and joins the worker threads (close() and garbage collection)."""
  generation[0] += 1  # Queued tasks are skipped instead of computed.
  live = [t for t in threads if t.is_alive()]
  for _ in live:
    tasks.put(_STOP)
  current = threading.current_thread()
  for thread in live:
    if thread is not current:
      thread.join()
  threads.clear()


class _Record:
  """Bookkeeping of one pulled element until it is returned."""

  __slots__ = ("seed", "snapshot")

  def __init__(self, seed: int, snapshot: Any):
    self.seed = seed
    self.snapshot = snapshot


class ParallelExecutor:
  """Pipelined `work_fn(element, seed)` over a parent iterator on threads.

  Attributes:
    parallelism: the maximum number of elements in flight (pulled from the
      parent and not yet returned) and the number of worker threads. The
      autotuner may assign it while iterating.
    deterministic: whether outputs keep the input order.
  """

  def __init__(self, parent: OpIterator, work_fn: Callable[[Any, int], Any],
               parallelism: int, deterministic: bool, op_name: str):
    if parallelism < 1:
      raise ValueError(f"{op_name}: parallelism must be >= 1, got {parallelism}.")
    self._parent = parent
    self._work_fn = work_fn
    self._parallelism = int(parallelism)
    self.deterministic = bool(deterministic)
    self._op_name = op_name
    self._tasks: queue.SimpleQueue = queue.SimpleQueue()
    self._results: queue.SimpleQueue = queue.SimpleQueue()
    self._generation = [0]
    self._threads: list[threading.Thread] = []
    self._num_active_threads = 0
    self._finalizer = weakref.finalize(
        self, _shutdown, self._tasks, self._threads, self._generation)
    self._finalizer.atexit = False  # Daemon threads; never block exit.
    self._closed = False
    self.last_seed = 0
    self.wait_s = 0.0  # Seconds the consumer waited for results.
    self._busy_cells: list[list[float]] = []
    self._reset_bookkeeping(base_snapshot=None, consumed_ahead=())

  # -- configuration -----------------------------------------------------
  @property
  def parallelism(self) -> int:
    return self._parallelism

  @parallelism.setter
  def parallelism(self, value: int) -> None:
    """Changes the parallelism while running (the autotuner's hook)."""
    value = int(value)
    if value < 1:
      raise ValueError(
          f"{self._op_name}: parallelism must be >= 1, got {value}.")
    # The pool itself is resized by the consumer thread, on its next call.
    self._parallelism = value

  def _resize_pool(self) -> None:
    self._threads[:] = [t for t in self._threads if t.is_alive()]
    target = self._parallelism  # Read once: the autotuner may assign it.
    missing = target - self._num_active_threads
    for _ in range(missing):
      busy = [0.0]
      self._busy_cells.append(busy)
      thread = threading.Thread(
          target=_worker_loop,
          args=(self._tasks, self._results, self._work_fn, self._generation,
                busy),
          name=f"jaxfeed-{self._op_name}-worker", daemon=True)
      thread.start()
      self._threads.append(thread)
    for _ in range(-missing):
      # A retiring thread exits after the tasks queued before the sentinel;
      # it stays in _threads so that close() still joins it.
      self._tasks.put(_STOP)
    self._num_active_threads = target

  @property
  def num_threads(self) -> int:
    """Worker threads alive now (retiring ones included)."""
    return sum(t.is_alive() for t in self._threads)

  @property
  def busy_s(self) -> float:
    """Seconds the worker threads spent in the work function, in total."""
    return sum(cell[0] for cell in self._busy_cells)

  # -- bookkeeping ---------------------------------------------------------
  def _reset_bookkeeping(self, base_snapshot: Any, consumed_ahead) -> None:
    self._next_seq = 0          # seq of the next element to pull
    self._base_seq = 0          # oldest element not yet returned
    self._base_snapshot = base_snapshot  # parent state before _base_seq
    self._last_snapshot = base_snapshot  # parent state after the last pull
    self._records: dict[int, _Record] = {}
    self._consumed_ahead: set[int] = set(consumed_ahead)
    self._in_flight = 0         # pulled, submitted and not yet returned
    self._ready: dict[int, tuple] = {}   # finished, not yet returned (ordered)
    self._ready_unordered: collections.deque = collections.deque()
    self._exhausted = False

  def _mark_returned(self, seq: int) -> None:
    """Records that element `seq` was returned; advances the base."""
    if seq != self._base_seq:
      self._consumed_ahead.add(seq)
      return
    records = self._records
    consumed_ahead = self._consumed_ahead
    while True:
      record = records.pop(self._base_seq)
      self._base_snapshot = record.snapshot
      self._base_seq += 1
      nxt = self._base_seq
      if nxt in consumed_ahead and nxt in records:
        consumed_ahead.discard(nxt)
        continue
      return

  # -- iteration -----------------------------------------------------------
  def _fill(self) -> None:
    """Pulls elements and submits work until `parallelism` are in flight."""
    parent = self._parent
    records = self._records
    generation = self._generation[0]
    while self._in_flight < self._parallelism and not self._exhausted:
      if self._base_snapshot is None and self._next_seq == self._base_seq:
        self._base_snapshot = self._last_snapshot = parent.get_state()
      seq = self._next_seq
      try:
        element = next(parent)
      except StopIteration:
        self._exhausted = True
        return
      except Exception as exc:  # noqa: BLE001 -- returned in order below
        pulled_ok = False
        element = exc
        seed = 0
        try:
          snapshot = parent.get_state()
        except Exception:  # noqa: BLE001 -- resume re-pulls the failure
          snapshot = self._last_snapshot
      else:
        pulled_ok = True
        seed = parent.last_seed
        snapshot = parent.get_state()
      self._last_snapshot = snapshot
      records[seq] = _Record(seed, snapshot)
      self._next_seq = seq + 1
      if seq in self._consumed_ahead:
        # Returned before the checkpoint this iterator was restored from.
        self._consumed_ahead.discard(seq)
        self._mark_returned(seq)
        continue
      self._in_flight += 1
      if pulled_ok:
        self._tasks.put((generation, seq, element, seed))
      elif self.deterministic:
        self._ready[seq] = (False, element)
      else:
        self._ready_unordered.append((seq, False, element))
      del element

  def _take_result(self) -> tuple:
    generation = self._generation[0]
    results = self._results
    while True:
      try:
        result_generation, seq, ok, value = results.get_nowait()
      except queue.Empty:
        start = time.perf_counter()
        result_generation, seq, ok, value = results.get()
        self.wait_s += time.perf_counter() - start
      if result_generation == generation:
        return seq, ok, value

  def __next__(self) -> Any:
    """The next output; StopIteration at the end; a worker's exception."""
    if self._closed:
      raise RuntimeError(f"{self._op_name}: the iterator is closed.")
    if self._num_active_threads != self._parallelism:
      self._resize_pool()
    self._fill()
    if self._in_flight == 0:
      raise StopIteration
    if self.deterministic:
      seq = self._base_seq
      ready = self._ready
      while seq not in ready:
        got_seq, ok, value = self._take_result()
        ready[got_seq] = (ok, value)
      ok, value = ready.pop(seq)
    elif self._ready_unordered:
      seq, ok, value = self._ready_unordered.popleft()
    else:
      seq, ok, value = self._take_result()
    self.last_seed = self._records[seq].seed
    self._in_flight -= 1
    self._mark_returned(seq)
    if ok:
      return value
    try:
      raise value
    finally:
      del value

  next = __next__

  # -- state ---------------------------------------------------------------
  def parent_state(self) -> Any:
    """The parent's state as of the oldest element not yet returned."""
    if self._next_seq == self._base_seq and not self._consumed_ahead:
      # Nothing pulled and unreturned: the parent's own state is exact.
      return self._parent.get_state()
    if self._base_snapshot is None:  # pragma: no cover -- set by _fill
      return self._parent.get_state()
    return self._base_snapshot

  def own_state(self) -> dict:
    """The executor's part of the op state (returned-ahead offsets)."""
    base = self._base_seq
    return {"consumed_ahead": sorted(s - base for s in self._consumed_ahead)}

  def restore(self, parent_state: Any, own_state: dict) -> None:
    """Restores the parent and discards everything in flight."""
    consumed_ahead = own_state.get("consumed_ahead", [])
    if (not isinstance(consumed_ahead, list)
        or not all(isinstance(o, int) and o > 0 for o in consumed_ahead)):
      raise PipelineStateError(
          f"{self._op_name}: invalid state: 'consumed_ahead' must be a list "
          f"of positive ints, got {consumed_ahead!r}.")
    self._discard_in_flight()
    self._parent.set_state(parent_state)
    self._reset_bookkeeping(base_snapshot=parent_state,
                            consumed_ahead=consumed_ahead)

  def _discard_in_flight(self) -> None:
    self._generation[0] += 1
    self._ready.clear()
    self._ready_unordered.clear()
    while True:  # Drop what the workers already finished.
      try:
        self._results.get_nowait()
      except queue.Empty:
        break

  # -- lifetime ------------------------------------------------------------
  def close(self) -> None:
    """Stops and joins the worker threads. Idempotent."""
    self._closed = True
    self._finalizer()
    self._ready.clear()
    self._ready_unordered.clear()


class ParallelMapIterator(OpIterator):
  """Iterator of an element-wise op, run in the consumer thread or parallel.

  Subclasses set `op_name` and implement `_apply(element)`, the sequential
  path. `work_fn(element, seed)` is what the worker threads run; it must not
  reference the iterator (so that garbage collection can stop the threads).

  With `num_parallel_calls` None or 1 no thread is started. Otherwise a
  `ParallelExecutor` runs `work_fn`; `parallelism` reads and sets its width.
  The state is `{"consumed_ahead": [...]}` plus the parent's state, identical
  in layout for both paths, so a checkpoint of the sequential path restores
  into the parallel one and vice versa (except a `deterministic=False` state
  with returned-ahead elements, which needs the parallel path).
  """

  def __init__(self, parent: OpIterator, work_fn: Callable[[Any, int], Any],
               num_parallel_calls: int | None, deterministic: bool):
    super().__init__([parent])
    self._parent = parent
    self._autotuned = num_parallel_calls == AUTOTUNE
    if num_parallel_calls is None or num_parallel_calls == 1:
      self.executor: ParallelExecutor | None = None
    else:
      self.executor = ParallelExecutor(
          parent, work_fn, resolve_parallelism(num_parallel_calls),
          deterministic, self.op_name)

  def _apply(self, element: Any) -> Any:
    raise NotImplementedError

  def __next__(self) -> Any:
    executor = self.executor
    if executor is None:
      return self._apply(next(self._parent))
    return executor.next()

  @property
  def last_seed(self) -> int:
    if self.executor is None:
      return self._parent.last_seed
    return self.executor.last_seed

  @property
  def parallelism(self) -> int:
    """Elements processed at once (the autotuner may assign it)."""
    return 1 if self.executor is None else self.executor.parallelism

  @parallelism.setter
  def parallelism(self, value: int) -> None:
    if self.executor is None:
      raise ValueError(
          f"{self.op_name}: parallelism can only be changed on an op built "
          f"with num_parallel_calls > 1 or AUTOTUNE.")
    self.executor.parallelism = value

  def tunables(self) -> list:
    """The parallelism knob, for ops built with AUTOTUNE."""
    if not self._autotuned or self.executor is None:
      return []
    executor = self.executor
    return [autotune.Knob(
        name=f"{self.op_name}/parallelism", kind="threads",
        get=lambda: executor.parallelism,
        set=lambda value: setattr(executor, "parallelism", value),
        minimum=1,
        maximum=max(os.cpu_count() or 1, default_autotune_parallelism()),
        wait_s=lambda: executor.wait_s, busy_s=lambda: executor.busy_s)]

  def get_state(self) -> dict:
    if self.executor is None:
      return {"op": self.op_name, "own": {"consumed_ahead": []},
              "parents": [self._parent.get_state()]}
    return {"op": self.op_name, "own": self.executor.own_state(),
            "parents": [self.executor.parent_state()]}

  def set_state(self, state: dict) -> None:
    check_state(state, self.op_name, 1)
    own = state.get("own")
    if not isinstance(own, dict):
      raise PipelineStateError(
          f"Cannot restore op {self.op_name!r}: 'own' must be a dict, got "
          f"{own!r}.")
    if self.executor is None:
      if own.get("consumed_ahead"):
        raise PipelineStateError(
            f"Cannot restore op {self.op_name!r}: the state lists elements "
            f"returned out of order (deterministic=False), which only a "
            f"parallel {self.op_name} can resume; got {own!r}.")
      self._parent.set_state(state["parents"][0])
      return
    self.executor.restore(state["parents"][0], own)

  def _close_own(self) -> None:
    if self.executor is not None:
      self.executor.close()


def call_unpacked(fn: Callable, element: Any) -> Any:
  """Calls fn like tf.data: a tuple element is unpacked into arguments."""
  if type(element) is tuple:  # Not namedtuples, as in tf.data.
    return fn(*element)
  return fn(element)


BACKENDS = ("auto", "thread", "process")


def check_backend(value: Any, op_name: str) -> str:
  """Validates a parallelism backend name ("auto" runs threads)."""
  if value not in BACKENDS:
    raise ValueError(
        f"{op_name}: backend must be one of {', '.join(map(repr, BACKENDS))}, "
        f"got {value!r}.")
  return value


def check_deterministic(value: Any, op_name: str) -> bool:
  """Validates `deterministic`: a bool, or None for the default (True)."""
  if value is None:
    return True
  if not isinstance(value, (bool, np.bool_)):
    raise TypeError(
        f"{op_name}: deterministic must be a bool or None, got {value!r}.")
  return bool(value)


def check_callable(fn: Any, op_name: str, name: str = "fn") -> Callable:
  """Validates that a user function is callable."""
  if not callable(fn):
    raise TypeError(
        f"{op_name}: {name} must be callable, got {type(fn).__name__}: "
        f"{fn!r}.")
  return fn
