"""The iterator of a fused chain (`process_batch`).

It hands chunks of input positions to whoever computes them now (see
`jaxfeed.ops.chunk_workers`: the consumer's thread, worker threads or worker
processes), up to `AHEAD_CHUNKS` per worker sent and not yet consumed, each
to the worker with the fewest left to compute, and returns the batches in
order, as views of the slots they were written to (`batch_slots`).

With AUTOTUNE it follows the node's `backend_choice.BackendChooser`: it
measures the rate of the backend running, window by window (`Window`,
once the chunks that fill its pipeline are in; a window an epoch ends goes
on in the next), reports it, and moves to the
backend the chooser names at a batch boundary: without a filter it stops
sending chunks and returns those in flight first (nothing is computed twice);
with one it drops them (their batches do not end at chunk boundaries).
Worker processes start in the background while another backend runs.

What the iterator borrows from its node (the node's worker processes and
slots, warm from the last epoch) it gives back at its end, on `close()` or
when it is garbage-collected (`_Lease`).
"""

from __future__ import annotations

import collections
import time
import weakref
from typing import Any

from jaxfeed.ops import base, op_stats, stacking
from jaxfeed.ops.backend_choice import Window
from jaxfeed.ops.chunk_plan import MIN_CHUNK_ELEMENTS, Chunk, chunk_stop, tuned_size
from jaxfeed.ops.chunk_workers import InlineWorker, ThreadWorkers
from jaxfeed.ops.worker_processes import RemoteTraceback, WorkerProcessError

__all__ = ["ProcessBatchIterator"]

_OP = "process_batch"

CHUNKS_PER_WORKER = 2
"""Chunks queued at each worker thread or process (one computing, one
waiting)."""

SETTLE_CHUNKS = 1
"""Chunks after a change of backend (or the start of an iterator) that are
not measured, besides the `ahead` per worker that fill its pipeline (and
its slots: a new slot costs its pages)."""

CLOSE_WAIT_S = 5.0
"""How long `close()` waits for worker processes to finish the chunks in
flight before it stops them (their next iterator starts new ones)."""


class ProcessBatchIterator(base.OpIterator):
  """Iterator of `process_batch.ProcessBatchNode` (see the module docstring).

  Args:
    node: the fused node.
    runtime: what the node keeps across iterators (`process_batch._Runtime`).
  """

  op_name = _OP

  def __init__(self, node: Any, runtime: Any):
    super().__init__()
    self._node, self._chain, self._runtime = node, node.chain, runtime
    # The chain's state at its input's current iteration, and that
    # iteration's input positions (see `index_ranges.iteration_span`).
    self._template = self._chain.first_state()
    span = self._chain.span(self._template)
    # The input position after the last batch returned; the end of the
    # iteration's positions (None: endless).
    self._position, self._end = span or (0, None)
    self._next_start = self._position  # the first position not sent to a worker
    self._last_seed = 0
    self._error: BaseException | None = None
    self._fallback: base.OpIterator | None = None
    self._lease: Any = None
    self._finalizer: weakref.finalize | None = None
    self._inflight: collections.deque = collections.deque()
    self._pending: list[collections.deque] = []
    self._items: collections.deque = collections.deque()
    self._workers: Any = None
    self._backend: str | None = None
    self._ran: str | None = None  # the backend that ran last, once ended
    self._switch_to: str | None = None
    self._window: Window | None = None
    self._chunk_size = self._chain.batch_size
    self._batches = 0  # returned
    self._ended = False  # StopIteration raised (until a state is restored)
    self._busy_s = 0.0  # worker threads' and processes' time in chunks
    self._per_position: float | None = None  # smoothed busy time per position
    self._sent = 0
    self._slot_bytes = 1 << 20
    if span is None:
      self._run_element_wise(None)
    else:
      self._start()

  # -- backends ------------------------------------------------------------
  @property
  def _kit(self) -> Any:
    return self._lease.kit

  def _start(self) -> None:
    """Borrows the node's kit and starts the backend it says."""
    self._lease = self._runtime.lease()
    self._lease.inflight = self._inflight
    self._finalizer = weakref.finalize(self, self._lease.close)
    chooser = self._runtime.chooser
    if chooser is not None and chooser.measuring and "process" in chooser.candidates:
      self._processes_started()  # in the background, ready for their turn
    self._follow(self._runtime.backend(), first=True)

  def _give_back(self) -> None:
    if self._lease is not None:
      if self._window is not None:
        self._window.pause(time.perf_counter(), self._position)
      self._ran = self._backend
      self._workers = self._backend = self._switch_to = None
      self._finalizer()
      self._lease = None

  def _follow(self, backend: str, first: bool = False) -> None:
    """Moves to `backend` now if nothing is in flight, else once what is
    has been returned; worker processes are started first, in the
    background (another backend runs meanwhile)."""
    if backend == "process":
      if not self._processes_started():
        backend = self._runtime.interim_backend()
      elif first and self._runtime.chooser is not None and self._kit.processes_starting():
        self._switch(self._runtime.interim_backend())
        self._switch_to = "process"
        return
    if backend == self._backend:
      self._switch_to = None
    elif first:
      self._switch(backend)
    else:
      self._switch_to = backend

  def _processes_started(self) -> bool:
    """Starts the node's worker processes if needed; False (and processes
    are ruled out) if they cannot start."""
    try:
      self._kit.start_processes()
    except Exception as exc:  # noqa: BLE001 -- a reason to run elsewhere
      self._runtime.no_processes(f"they could not start: {exc}")
      return False
    return True

  def _switch(self, backend: str) -> None:
    """Starts `backend` at `self._position` (nothing is in flight)."""
    old = self._workers
    if old is not None and old.name != "process":
      old.close()
    if backend == "process":
      workers = self._kit.processes
    elif backend == "thread":
      workers = ThreadWorkers(self._chain.payload(), self._runtime.num_threads, _OP)
    else:
      workers = InlineWorker(self._chain.payload(), self._grow_slot)
    self._workers, self._backend, self._switch_to = workers, backend, None
    self._per_position = None
    self._sent = 0  # chunks sent to this backend
    self._lease.transport = workers
    self._pending = [collections.deque() for _ in range(len(workers))]
    self._next_start = self._position
    self._set_chunk(self._node.chunk or self._runtime.learned.get(backend) or self._chunk_size)
    window = self._runtime.window
    if window is None or window.backend != backend:
      window = self._runtime.window = Window(backend)
    window.resume(SETTLE_CHUNKS + workers.ahead * len(workers))
    self._window = window

  def _set_chunk(self, size: int) -> None:
    """Chunks of `size` positions from now on, in slots that fit them (by
    the bytes per position the node's chunks needed so far)."""
    self._chunk_size = size
    per_position = self._runtime.learned.get("slot_bytes_per_position", 0)
    self._slot_bytes = max(1 << 20, int(1.05 * per_position * size))

  def _switch_ready(self) -> bool:
    """Whether the backend to move to can start (processes: loaded)."""
    if self._switch_to != "process":
      return True
    try:
      return self._kit.processes.ready()
    except WorkerProcessError as exc:
      self._runtime.no_processes(str(exc))
      self._kit.stop_processes()
      self._switch_to = None
      return False

  # -- iteration -----------------------------------------------------------
  def __next__(self) -> Any:
    if self._closed:
      raise RuntimeError(f"{_OP}: the iterator is closed.")
    if self._error is not None:
      raise self._error
    if self._fallback is not None:
      batch = next(self._fallback)
      self._last_seed = self._fallback.last_seed
      return batch
    if self._ended:
      raise StopIteration
    if self._lease is None:  # after the end, restored to an earlier state
      self._start()
    try:
      batch = self._next_batch()
    except StopIteration:
      self._ended = True
      self._give_back()  # the node's workers serve its next iterator now
      raise
    except WorkerProcessError as exc:
      self._error = exc
      self._inflight.clear()
      self._kit.stop_processes()
      self._give_back()
      raise
    self._batches += 1
    if self._runtime.chooser is not None:
      self._observe()
    return batch

  next = __next__

  def _next_batch(self) -> Any:
    while True:
      if self._switch_to is not None and self._switch_ready():
        if self._chain.filters:
          self._discard()  # batches cross chunks: drop what is in flight
          self._switch(self._switch_to)
        elif not self._inflight and not self._items:
          self._switch(self._switch_to)
      batch = self._take_batch()
      if batch is not None:
        return batch
      if self._switch_to is None or not self._switch_ready():
        raise StopIteration

  def _draining(self) -> bool:
    return self._switch_to is not None and not self._chain.filters and self._switch_ready()

  def _take_batch(self) -> Any:
    """The next batch of the running backend; None when it has no more (the
    end of the input, or it is draining before a switch)."""
    chain = self._chain
    elements, seeds = [], []
    last = self._position
    items = self._items
    while True:
      if not items:
        if not self._receive_chunk(need=bool(elements)):
          break
        continue
      item = items.popleft()
      kind = item[0]
      if kind == "release":
        self._kit.slots.release(item[1])
        continue
      if kind == "batch":
        _, batch, seed, self._position = item
        self._last_seed = seed
        return batch
      if kind == "element":
        _, element, seed, last = item
        elements.append(element)
        seeds.append(seed)
        if len(elements) == chain.batch_size:
          break
        continue
      # An error: the elements read into this batch are lost, the next
      # batch starts after the failing element.
      _, exc, text, position = item
      self._restart(position)
      raise exc from RemoteTraceback(text)
    if not elements:
      return None
    if len(elements) < chain.batch_size and chain.drop_remainder:
      raise StopIteration
    self._position = last
    self._last_seed = seeds[0]
    return stacking.stack(elements, "batch")

  def _submit(self, force: bool = False) -> None:
    """Sends chunks to the workers with the fewest to compute (at most
    `CHUNKS_PER_WORKER` each), up to `ahead` per worker not yet consumed;
    none while draining before a switch unless `force`."""
    if not force and self._draining():
      return
    workers, pending = self._workers, self._pending
    depth = workers.ahead * len(workers)
    per_worker = min(CHUNKS_PER_WORKER, workers.ahead)
    while len(self._inflight) < depth and (self._end is None or self._next_start < self._end):
      index = min(range(len(workers)), key=lambda i: len(pending[i]))
      if len(pending[index]) >= per_worker:
        return
      start = self._next_start
      stop = self._chunk_stop(start)
      # The consumer's own thread stacks into new arrays, unless the
      # function writes into its batch rows (then they are in a slot).
      slot = (
        None
        if self._chain.filters or (self._backend == "inline" and not self._chain.writes_rows)
        else self._kit.slots.take(self._slot_bytes, index)
      )
      workers.send_chunk(index, start, stop, slot)
      chunk = Chunk(index, start, stop, slot)
      self._inflight.append(chunk)
      pending[index].append(chunk)
      self._next_start = stop
      self._sent += 1

  def _chunk_stop(self, start: int) -> int:
    """Where the chunk from `start` ends (`chunk_plan.chunk_stop`); a
    `chunk` of the node is kept."""
    if self._node.chunk is not None:
      stop = start + self._chunk_size
      return stop if self._end is None else min(stop, self._end)
    unit = MIN_CHUNK_ELEMENTS if self._chain.filters else self._chain.batch_size
    return chunk_stop(
      start, self._chunk_size, end=self._end, workers=len(self._workers), sent=self._sent, unit=unit
    )

  def _receive_chunk(self, need: bool = False) -> bool:
    """Moves the oldest chunk's outputs to `_items`; False when there is
    none (`need`: a batch is half made, so send chunks even if draining)."""
    self._submit(force=need)
    if not self._inflight:
      return False
    chunk = self._inflight.popleft()
    headers, busy_s = self._result(chunk)
    self._tune_chunk(chunk, busy_s)
    if self._backend != "inline":  # inline, op_stats samples it as self time
      self._busy_s += busy_s
    self._window.chunk_received()
    if chunk.slot is None:
      self._items.extend(headers)
      return True
    self._items.extend(chunk.slot.unpack(headers, self._node.copy))
    self._items.append(("release", chunk.slot))
    return True

  def _result(
    self, chunk: Chunk, refill: bool = True, deadline: float | None = None
  ) -> tuple[list, float]:
    """The chunk's (headers, busy seconds). Meanwhile answers every worker
    (a slot to grow) and, with `refill`, gives a worker that finished its
    chunks new ones. With a `deadline` (time.monotonic), raises TimeoutError
    past it."""
    workers, pending = self._workers, self._pending
    while chunk.reply is None:
      if deadline is not None and time.monotonic() > deadline:
        raise TimeoutError
      busy = {i: queue[0].doing() for i, queue in enumerate(pending) if queue}
      for index, reply in workers.wait(busy):
        if reply[0] == "done":
          oldest = pending[index].popleft()  # a worker computes in order
          oldest.reply = reply[1], reply[2]
          if refill:
            self._submit()
          continue
        workers.send_slot(index, self._grow_slot(index, reply[1]))
    return chunk.reply

  def _grow_slot(self, index: int, needed: int) -> Any:
    """A bigger slot for the chunk worker `index` computes (its batches
    need `needed` bytes); the size is kept for the node's next chunks."""
    chunk = self._pending[index][0]
    learned = self._runtime.learned
    learned["slot_bytes_per_position"] = max(
      learned.get("slot_bytes_per_position", 0), -(-needed // max(1, chunk.stop - chunk.start))
    )
    self._slot_bytes = max(2 * chunk.slot.size, needed)
    chunk.slot.taken = False
    self._kit.slots.retire(chunk.slot)
    chunk.slot = self._kit.slots.take(self._slot_bytes, index)
    return chunk.slot

  def _tune_chunk(self, chunk: Chunk, busy_s: float) -> None:
    """Sizes chunks to about `CHUNK_WORK_S` of a worker's time: once, from
    the backend's first chunks, then only when that time changes fourfold
    (a noisy machine would otherwise change it all the time, and each
    chunk size wants slots of its own size)."""
    if self._node.chunk is not None or chunk.stop <= chunk.start:
      return
    per_position = busy_s / (chunk.stop - chunk.start)
    self._per_position = (
      per_position
      if self._per_position is None
      else self._per_position + 0.25 * (per_position - self._per_position)
    )
    if self._sent <= len(self._workers):
      return  # the first chunks: cold, and small (`_chunk_stop`)
    size = tuned_size(self._per_position, self._chain.batch_size, bool(self._chain.filters))
    learned = self._runtime.learned.get(self._backend)
    if learned is None or not learned / 4 <= size <= 4 * learned:
      self._runtime.learned[self._backend] = size
      self._set_chunk(size)

  def _discard(self, deadline: float | None = None) -> None:
    """Waits for the chunks in flight and drops their outputs."""
    while self._inflight:
      chunk = self._inflight[0]
      self._result(chunk, refill=False, deadline=deadline)
      self._inflight.popleft()
      if chunk.slot is not None:
        self._kit.slots.release(chunk.slot)
    while self._items:
      item = self._items.popleft()
      if item[0] == "release":
        self._kit.slots.release(item[1])

  def _restart(self, position: int) -> None:
    self._discard()
    self._next_start = self._position = position

  # -- AUTOTUNE ------------------------------------------------------------
  def _observe(self) -> None:
    """Measures the running backend; follows the chooser after a window."""
    rate = self._window.after_batch(self._position, len(self._workers))
    if rate is None:
      return
    chooser = self._runtime.chooser
    chooser.record(self._backend, rate, self._window.seconds)
    self._runtime.window = self._window = Window(self._backend)
    self._follow(chooser.backend())
    if (
      not chooser.measuring
      and self._kit.processes is not None
      and "process" not in (self._backend, self._switch_to)
    ):
      self._runtime.idle_processes(self._kit)

  # -- state ---------------------------------------------------------------
  @property
  def last_seed(self) -> int:
    """The seed of the first element of the batch returned last."""
    return self._last_seed

  def get_state(self) -> dict:
    if self._fallback is not None:
      return self._fallback.get_state()
    return self._chain.state_at(self._template, self._position)

  def set_state(self, state: dict) -> None:
    base.check_state(state, "batch", 1)
    state = self._chain.restored(state)
    span = self._chain.span(state)
    self._last_seed = 0
    self._error = None
    self._ended = False
    if self._lease is not None:
      self._discard()
    if span is None:
      self._give_back()
      self._run_element_wise(state)
      return
    if self._fallback is not None:
      self._fallback.close()
      self._fallback = None
      self.parents = []
    self._template = state
    self._position, self._end = span
    self._next_start = self._position

  def _run_element_wise(self, state: dict | None) -> None:
    """Runs the chain element by element on threads from `state` (None: its
    start). Workers read positions of the input they rebuilt: an input whose
    state is more than a position (a mixture's, a resharded resume) runs so."""
    if self._fallback is None:
      self._fallback = self._chain.batch_node.make_iterator()
      self.parents = [self._fallback]
    if state is not None:
      self._fallback.set_state(state)
    self._runtime.note("the input's state is more than a position: element by element on threads")

  # -- reporting and lifetime ----------------------------------------------
  def _stats_fields(self) -> dict:
    """What runs the chain (`backend`: now; `picked`, `reason`, `rates`,
    `measuring`: AUTOTUNE's choice, why, and the rates it measured; workers,
    chunk), in its `stats()` row."""
    fields = {"backend": self.backend}
    fields.update(self._runtime.summary())
    fields["chunk"] = self._chunk_size
    fields["copy"] = self._node.copy
    fields["elements"] = self._batches
    fields["busy_seconds"] = self._busy_s
    if self._workers is not None:
      fields["parallelism"] = len(self._workers)
    else:  # ended: the workers it ran on went back to the node
      fields["parallelism"] = (
        self._runtime.num_workers or 1 if self.backend in ("thread", "process") else 1
      )
    return fields

  @property
  def backend(self) -> str | None:
    """What computes the chain now: "inline", "thread" or "process"."""
    if self._fallback is not None:
      return "thread (element by element)"
    return self._backend or self._ran

  def pids(self) -> list[int]:
    """The ids of the worker processes this iterator uses, or once it ended
    those its node keeps for the next one (none before they are started)."""
    kit = self._kit if self._lease is not None else self._runtime.kit()
    if kit is None or kit.processes is None:
      return []
    return kit.processes.pids()

  def __repr__(self) -> str:
    fields = self._stats_fields()
    details = ", ".join(f"{k}={v}" for k, v in fields.items() if v is not None)
    return f"ProcessBatchIterator({details})"

  def close(self) -> None:
    if self._closed:
      return
    self._closed = True
    if self._lease is not None:
      try:
        self._discard(deadline=time.monotonic() + CLOSE_WAIT_S)
      except (TimeoutError, WorkerProcessError):
        self._inflight.clear()
        self._kit.stop_processes()
      self._give_back()
    if self._fallback is not None:
      self._fallback.close()
    op_stats.release(self)
