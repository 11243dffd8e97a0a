"""`ParallelExecutor`: a work function over a parent iterator's elements on
a pool of threads (the engine of map-like ops with `num_parallel_calls`).

Elements are pulled from the parent in the consumer's thread, so the parent
iterator (and its state) is only ever touched by one thread. The resume
contract is in the class docstring (see also `jaxfeed.ops.replay`).
"""

from __future__ import annotations

import collections
import queue
import threading
import time
import weakref
from typing import Any, Callable

from jaxfeed.ops import batch_placement, executor_threads, op_stats
from jaxfeed.ops.executor_batches import BatchReads
from jaxfeed.ops.executor_threads import BATCH_DEPTH, CHUNK
from jaxfeed.ops.base import OpIterator
from jaxfeed.ops.replay import anchor_interval, check_replay_state, drop_replayed, skip_outputs

__all__ = [
  "ParallelExecutor",
  "INLINE_BELOW_S",
  "PROBE_INTERVAL",
  "PROBE_LENGTH",
  "CHUNK",
  "BATCH_DEPTH",
]

INLINE_BELOW_S = 100e-6
"""Work cheaper than this per element runs in the consumer (ordered mode).

0 turns the timing off: work then always runs on the threads.
"""

INLINE_TIMING_EVERY = 8
"""Running in the consumer, one call in this many is timed."""

PROBE_INTERVAL = 256
"""Outputs between two timings of the work in the consumer (ordered mode)."""

PROBE_LENGTH = 4
"""Elements timed in the consumer per probe (the fastest one counts)."""


class ParallelExecutor(BatchReads):
  """Pipelined `work_fn(element, seed)` over a parent iterator on threads.

  Elements are pulled in the consumer's thread, so the parent is only ever
  touched by one thread; the work runs on `parallelism` threads, overlapping
  with the consumer's own work even when `parallelism` is 1.

  Cheap work. Handing an element to a thread and back costs tens of
  microseconds of thread switching (and the GIL), more than cheap Python or
  numpy work takes. So with `deterministic=True` the executor times the work
  of `PROBE_LENGTH` elements in the consumer every `PROBE_INTERVAL` outputs
  (after the elements in flight are out, so the order is kept), and while a
  call takes less than `INLINE_BELOW_S` it runs every element in the
  consumer, timing each, until the work gets dearer. Outputs and states do
  not change.

  Resume. Every `interval` pulls the executor saves the parent's state (an
  anchor). Its state is the newest anchor at or before the oldest element not
  yet returned, plus `skip` (how many elements after the anchor were all
  returned) and `consumed_ahead` (offsets from the anchor of later elements
  already returned, which only `deterministic=False` produces). `restore`
  sets the parent to the anchor, pulls and drops the `skip` elements, and
  drops the `consumed_ahead` ones when it pulls them again, without running
  work on any of them. So the outputs after a restore are exactly those the
  uninterrupted executor had left to return (for `deterministic=False`, as a
  multiset: their order is the completion order), provided the parent repeats
  its elements when restored. When a parent does not (it has an unordered
  op upstream, see `replays_identically`) the interval is 1 and `skip` is 0,
  so no returned element is pulled again except `consumed_ahead` ones.

  Batches. `next_batch` (what a following `batch` reads) tells each task the
  batch row its output goes to, and the worker writes it there (see
  `jaxfeed.ops.batch_placement`); tasks are then runs of `CHUNK` elements,
  `BATCH_DEPTH` of them per thread in flight. With `writes_out` the work
  function is also handed the row itself, to write the output there without
  a copy.

  Attributes:
    parallelism: the maximum number of elements in flight (pulled from the
      parent and not yet returned; more for `next_batch`) and the number of
      worker threads. The
      autotuner may assign it, from any thread, while iterating.
    deterministic: whether outputs keep the input order.
    last_seed: the parent's seed of the element returned last.
    wait_s: seconds the consumer waited for outputs.
    placement: where workers write outputs for `next_batch` (None until a
      batch showed that its elements can be placed).
  """

  def __init__(
    self,
    parent: OpIterator,
    work_fn: Callable[[Any, int], Any],
    parallelism: int,
    deterministic: bool,
    op_name: str,
    writes_out: bool = False,
  ):
    """Args:
    parent: the input iterator.
    work_fn: work_fn(element, seed) -> output; must not reference the
      op iterator (so that garbage collection can stop the threads).
    parallelism: initial `parallelism`.
    deterministic: whether outputs keep the input order.
    op_name: for thread names and errors.
    writes_out: work_fn(element, seed, out) also takes the batch row its
      output goes to, and may write the output there itself.
    """
    if parallelism < 1:
      raise ValueError(f"{op_name}: parallelism must be >= 1, got {parallelism}.")
    self._parent = parent
    self._work_fn = work_fn
    self._parallelism = int(parallelism)
    self.deterministic = bool(deterministic)
    self._op_name = op_name
    self.writes_out = writes_out
    self._interval = anchor_interval(parent)
    self._tasks: queue.SimpleQueue = queue.SimpleQueue()
    self._results: queue.SimpleQueue = queue.SimpleQueue()
    self._generation = [0]
    self._threads: list[threading.Thread] = []
    self._num_active_threads = 0
    self._busy_cells: list[list[float]] = []
    self._finalizer = weakref.finalize(
      self, executor_threads.shutdown, self._tasks, self._threads, self._generation
    )
    self._finalizer.atexit = False  # Daemon threads; never block exit.
    self._closed = False
    self.last_seed = 0
    self.wait_s = 0.0
    # Ordered mode runs cheap work in the consumer (see the class docstring):
    # a running estimate of one work call, and outputs since the last probe.
    self._inline = False
    self._work_s_estimate = 0.0
    self._probe_times: list[float] = []
    self._since_probe = PROBE_INTERVAL  # Probe the first elements.
    self.placement: batch_placement.Placement | None = None
    self.placement_declined = False  # outputs that stacking handles best
    self._batch_depth = 0  # in flight for next_batch (see BATCH_DEPTH)
    self._chunk = 1  # elements per task (see CHUNK)
    self._reset_bookkeeping(consumed_ahead=())

  # -- configuration -----------------------------------------------------
  @property
  def parallelism(self) -> int:
    return self._parallelism

  @parallelism.setter
  def parallelism(self, value: int) -> None:
    """Changes the parallelism while running (the autotuner's hook)."""
    value = int(value)
    if value < 1:
      raise ValueError(f"{self._op_name}: parallelism must be >= 1, got {value}.")
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
        target=executor_threads.worker_loop,
        args=(self._tasks, self._results, self._work_fn, self._generation, busy),
        name=f"jaxfeed-{self._op_name}-worker",
        daemon=True,
      )
      thread.start()
      self._threads.append(thread)
    for _ in range(-missing):
      # A retiring thread exits after the tasks queued before the sentinel;
      # it stays in _threads so that close() still joins it.
      self._tasks.put(executor_threads.STOP)
    self._num_active_threads = target

  @property
  def num_threads(self) -> int:
    """Worker threads alive now (retiring ones included)."""
    return sum(t.is_alive() for t in self._threads)

  @property
  def num_returned(self) -> int:
    """Inputs pulled and done with, except those returned out of order."""
    return self._base_seq

  @property
  def num_ready(self) -> int:
    """Outputs computed and not yet returned."""
    return len(self._ready)

  @property
  def busy_s(self) -> float:
    """Seconds the worker threads spent in the work function, in total."""
    return sum(cell[0] for cell in self._busy_cells)

  # -- bookkeeping ---------------------------------------------------------
  def _reset_bookkeeping(self, consumed_ahead) -> None:
    self._next_seq = 0  # seq of the next element to pull
    self._base_seq = 0  # oldest element not yet returned
    self._anchors: collections.deque = collections.deque()  # (seq, state)
    self._pending: dict[int, int] = {}  # seq -> seed: pulled, not returned
    self._consumed_ahead: set[int] = set(consumed_ahead)
    self._ready: dict[int, tuple] = {}  # finished, not yet returned
    self._exhausted = False

  def _mark_returned(self, seq: int) -> None:
    """Records that element `seq` was returned; advances the base."""
    if seq != self._base_seq:
      self._consumed_ahead.add(seq)
      return
    base = seq + 1
    consumed_ahead = self._consumed_ahead
    # A returned-ahead element not pulled again yet keeps its place, so that
    # it is recognized (and dropped) when it is pulled.
    while base in consumed_ahead and base < self._next_seq:
      consumed_ahead.discard(base)
      base += 1
    self._base_seq = base

  # -- iteration -----------------------------------------------------------
  def _pull(self) -> tuple | None:
    """Pulls the next element to work on: (seq, ok, element or error, seed).

    Elements returned before the checkpoint this executor was restored from
    are dropped. None at the end of the input.
    """
    parent = self._parent
    anchors = self._anchors
    while not self._exhausted:
      seq = self._next_seq
      if not anchors or seq - anchors[-1][0] >= self._interval:
        while len(anchors) > 1 and anchors[1][0] <= self._base_seq:
          anchors.popleft()
        anchors.append((seq, parent.get_state()))
      try:
        element = next(parent)
      except StopIteration:
        self._exhausted = True
        return None
      except Exception as exc:  # noqa: BLE001 -- returned in order
        ok, element, seed = False, exc, 0
      else:
        ok, seed = True, parent.last_seed
      self._next_seq = seq + 1
      if seq in self._consumed_ahead:
        self._consumed_ahead.discard(seq)
        self._mark_returned(seq)
        continue
      return seq, ok, element, seed
    return None

  def _fill(self) -> None:
    """Pulls elements and submits work until `parallelism` are in flight
    (more, in runs of `CHUNK`, while reading batches: `BATCH_DEPTH`)."""
    pending = self._pending
    generation = self._generation[0]
    chunk = self._chunk
    limit = max(self._parallelism, self._batch_depth)
    if pending and limit - len(pending) < chunk:
      return  # room for a whole run only
    tasks, items = self._tasks, []
    while len(pending) < limit:
      pulled = self._pull()
      if pulled is None:
        break
      seq, ok, element, seed = pulled
      pending[seq] = seed
      placement = self.placement
      if ok:
        slot = None if placement is None else placement.slot(seq)
        items.append((seq, element, seed, slot))
        if len(items) >= chunk:
          tasks.put((generation, items))
          items = []
      else:
        self._ready[seq] = (False, element)
        if placement is not None:
          placement.realign(seq + 1)  # the error ends its batch
      del pulled, element
    if items:
      tasks.put((generation, items))

  def _next_inline(self) -> Any:
    """Pulls the next element and runs its work in the consumer, timed."""
    if self._consumed_ahead or self._exhausted:
      pulled = self._pull()
      if pulled is None:
        raise StopIteration
      seq, ok, value, seed = pulled
      del pulled
      self.last_seed = seed
      self._mark_returned(seq)
      if not ok:
        raise value
    else:
      # Nothing in flight: the parent's own state is the executor's (see
      # `parent_state`), so the element needs no anchor.
      seq = self._next_seq
      try:
        value = next(self._parent)
      except StopIteration:
        self._exhausted = True
        raise
      except Exception:
        self._next_seq = self._base_seq = seq + 1  # an element: an error
        self.last_seed = 0
        raise
      self._next_seq = self._base_seq = seq + 1
      seed = self.last_seed = self._parent.last_seed
    # A probe between parallel stretches writes into the batch like the
    # workers do; work cheap enough to stay here is stacked as it was.
    placement = None if self._inline else self.placement
    slot = None if placement is None else placement.slot(seq)
    call_work = executor_threads.call_work
    if self._inline and seq % INLINE_TIMING_EVERY:
      value = call_work(self._work_fn, value, seed, slot)  # timed now and then
    else:
      start = time.perf_counter()
      try:
        value = call_work(self._work_fn, value, seed, slot)
      finally:
        self._judge_work_time(time.perf_counter() - start)
    if slot is not None:
      value = batch_placement.place(value, slot)
    return value

  def _judge_work_time(self, elapsed: float) -> None:
    """Decides from one timed call whether work runs in the consumer."""
    if self._inline:
      # A slow running mean of clipped samples: a rare pause (the machine
      # is busy, a garbage collection) does not send work to the threads.
      sample = min(elapsed, 4 * INLINE_BELOW_S)
      self._work_s_estimate = 0.9 * self._work_s_estimate + 0.1 * sample
      self._inline = self._work_s_estimate < 2 * INLINE_BELOW_S
      return
    # A probe: the fastest of PROBE_LENGTH calls (a call right after the
    # threads ran, or the very first one, is slower than the work itself).
    self._probe_times.append(elapsed)
    if len(self._probe_times) < PROBE_LENGTH:
      return
    self._work_s_estimate = min(self._probe_times)
    self._probe_times = []
    self._since_probe = 0
    self._inline = self._work_s_estimate < INLINE_BELOW_S

  @op_stats.waits_for_input
  def _receive(self, block: bool, until: int | None = None) -> bool:
    """Moves finished results into `_ready`.

    Returns when a result arrived (or, with `until`, that element's result);
    without `block`, returns False as soon as none is waiting.
    """
    generation = self._generation[0]
    results = self._results
    ready = self._ready
    while True:
      try:
        result_generation, done = results.get(block)
      except queue.Empty:
        return False
      if result_generation == generation:
        arrived = until is None
        for seq, ok, value in done:
          ready[seq] = (ok, value)
          arrived = arrived or seq == until
        if arrived:
          return True

  def __next__(self) -> Any:
    """The next output; StopIteration at the end; a worker's exception."""
    if self._closed:
      raise RuntimeError(f"{self._op_name}: the iterator is closed.")
    if self._num_active_threads != self._parallelism:
      self._resize_pool()
    if self.deterministic and (
      self._inline or (self._since_probe >= PROBE_INTERVAL and INLINE_BELOW_S > 0)
    ):
      # Measure the work in the consumer once everything in flight is out.
      if not self._pending:
        return self._next_inline()
    else:
      self._fill()
      if not self._pending:
        raise StopIteration
    self._since_probe += 1
    ready = self._ready
    if self.deterministic:
      seq = self._base_seq
      if seq not in ready and not self._receive(block=False, until=seq):
        start = time.perf_counter()
        self._receive(block=True, until=seq)
        self.wait_s += time.perf_counter() - start
    else:
      if not ready and not self._receive(block=False):
        start = time.perf_counter()
        self._receive(block=True)
        self.wait_s += time.perf_counter() - start
      seq = next(iter(ready))
    ok, value = ready.pop(seq)
    self.last_seed = self._pending.pop(seq)
    self._mark_returned(seq)
    if ok:
      return value
    try:
      raise value
    finally:
      del value

  next = __next__

  def skip(self, count: int) -> int:
    """Skips up to `count` outputs, without work when the parent can skip."""
    skip_parent = getattr(self._parent, "skip_elements", None)
    if skip_parent is None or self._pending or self._consumed_ahead or self._exhausted:
      return skip_outputs(self, count)
    skipped = skip_parent(count)
    self._next_seq += skipped
    self._base_seq += skipped
    return skipped

  # -- state ---------------------------------------------------------------
  def parent_state(self) -> Any:
    """The parent state to restore (see the class docstring)."""
    if self._next_seq == self._base_seq and not self._consumed_ahead:
      # Nothing pulled and unreturned: the parent's own state is exact.
      return self._parent.get_state()
    return self._anchor()[1]

  def own_state(self) -> dict:
    """The executor's part of the op state: `skip` and `consumed_ahead`."""
    if self._next_seq == self._base_seq and not self._consumed_ahead:
      return {"skip": 0, "consumed_ahead": []}
    anchor_seq = self._anchor()[0]
    return {
      "skip": self._base_seq - anchor_seq,
      "consumed_ahead": sorted(s - anchor_seq for s in self._consumed_ahead),
    }

  def _anchor(self) -> tuple[int, Any]:
    """The newest anchor at or before the oldest unreturned element."""
    anchors = self._anchors
    while len(anchors) > 1 and anchors[1][0] <= self._base_seq:
      anchors.popleft()
    return anchors[0]

  def restore(self, parent_state: Any, own_state: dict) -> None:
    """Restores the parent and discards everything in flight."""
    skip, consumed_ahead = check_replay_state(own_state, self._op_name)
    self._discard_in_flight()
    self._parent.set_state(parent_state)
    drop_replayed(self._parent, skip, self._op_name)
    self._reset_bookkeeping(consumed_ahead=[o - skip for o in consumed_ahead])
    if self.placement is not None:
      self.placement.realign(0)
    if consumed_ahead:
      # The parent's state now is the state before the oldest unreturned.
      self._anchors.append((0, self._parent.get_state()))

  def _discard_in_flight(self) -> None:
    self._generation[0] += 1
    self._ready.clear()
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
    self._pending.clear()
