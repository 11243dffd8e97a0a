"""Who computes a fused chain's chunks: the consumer's thread, worker
threads, or worker processes.

The three share one protocol, driven by `process_batch`'s iterator from its
consumer thread: `send_chunk(worker, start, stop, slot)` hands worker
`worker` the input positions [start, stop) to compute into `slot` (None with
a filter); `wait(doing)` returns the messages of the workers in `doing`:
("done", items, busy seconds) when a chunk is computed (see
`chunk_runner.ChunkRunner.run`; its batches are in the slot) and ("grow",
bytes) when a chunk's batches need a bigger slot, answered by
`send_slot(worker, slot)`. Each worker computes its chunks in the order it
got them. Every worker runs a `chunk_runner.ChunkRunner`, so the outputs are
the same whoever computes them.

* `InlineWorker`: the consumer's thread computes each chunk when it is
  waited for (no hand-off at all), into new arrays (no slot).
* `ThreadWorkers`: threads, each computing whole chunks into the slot (one
  hand-off per chunk, not per element; the threads read their input
  positions themselves).
* `ProcessWorkers`: worker processes (`jaxfeed.ops.worker_processes`), which
  map the slots (memfds) they are sent; started in the background, so the
  consumer can go on meanwhile (`ready`).
"""

from __future__ import annotations

import collections
import multiprocessing.connection
import os
import queue
import threading
import time
import traceback
from multiprocessing import reduction
from typing import Any, Callable

from jaxfeed.ops import batch_slots, memfd, shipping
from jaxfeed.ops.chunk_runner import ChunkRunner
from jaxfeed.ops.worker_processes import (
  RemoteTraceback,
  WorkerProcess,
  WorkerProcessError,
  picklable_error,
)

__all__ = ["InlineWorker", "ThreadWorkers", "ProcessWorkers", "ship", "AHEAD_CHUNKS"]

AHEAD_CHUNKS = 3
"""Chunks per worker thread or process sent and not yet consumed (each
holds a slot): a worker that is ahead goes on while the consumer waits for a
slower one's chunk."""

_RECV_POLL_S = 0.2


class _LocalSlot:
  """A slot written in this process (by a worker thread or the consumer);
  `grow` gets a bigger one from `bigger(needed)` and moves what was written."""

  def __init__(self, slot: batch_slots.Slot, bigger: Callable[[int], Any]):
    self.slot, self._bigger = slot, bigger
    self.buf = memoryview(slot.mapping())

  def grow(self, needed: int, written: int) -> memoryview:
    old = self.buf
    self.slot = self._bigger(needed)
    self.buf = memoryview(self.slot.mapping())
    self.buf[:written] = old[:written]
    return self.buf


def _compute(runner: ChunkRunner, start: int, stop: int, slot: Any) -> tuple:
  """Runs a chunk in this thread: ("done", items, seconds it took)."""
  begin = time.perf_counter()
  items = runner.run(start, stop, slot)
  return ("done", items, time.perf_counter() - begin)


class InlineWorker:
  """The consumer's thread as the one worker (see the module docstring).

  Args:
    payload: the chain (see `ChunkRunner`).
    grow: `grow(worker, needed) -> Slot`, the iterator's answer to a
      chunk that needs a bigger slot (called from `wait`).
  """

  name = "inline"
  ahead = 1

  def __init__(self, payload: tuple, grow: Callable[[int, int], batch_slots.Slot]):
    self._runner = ChunkRunner(payload, contiguous=True)
    self._grow = grow
    self._queued: collections.deque = collections.deque()

  def __len__(self) -> int:
    return 1

  def ready(self) -> bool:
    return True

  def send_chunk(self, index: int, start: int, stop: int, slot: batch_slots.Slot | None) -> None:
    self._queued.append((start, stop, slot))

  def send_slot(self, index: int, slot: batch_slots.Slot) -> None:
    raise AssertionError("an inline worker grows its slots itself")

  def wait(self, doing: dict[int, str]) -> list[tuple[int, tuple]]:
    del doing
    start, stop, slot = self._queued.popleft()
    local = None if slot is None else _LocalSlot(slot, lambda n: self._grow(0, n))
    return [(0, _compute(self._runner, start, stop, local))]

  def pids(self) -> list[int]:
    return []

  def close(self) -> None:
    self._queued.clear()
    self._runner.close()


class ThreadWorkers:
  """Threads computing whole chunks (see the module docstring)."""

  name = "thread"
  ahead = AHEAD_CHUNKS

  def __init__(self, payload: tuple, num_threads: int, op_name: str):
    self._results: queue.SimpleQueue = queue.SimpleQueue()
    self._tasks = [queue.SimpleQueue() for _ in range(num_threads)]
    self._replies = [queue.SimpleQueue() for _ in range(num_threads)]
    self._threads = [
      threading.Thread(
        target=_thread_main,
        args=(payload, index, self._tasks[index], self._replies[index], self._results),
        name=f"jaxfeed-{op_name}-thread-{index}",
        daemon=True,
      )
      for index in range(num_threads)
    ]
    for thread in self._threads:
      thread.start()

  def __len__(self) -> int:
    return len(self._threads)

  def ready(self) -> bool:
    return True

  def send_chunk(self, index: int, start: int, stop: int, slot: batch_slots.Slot | None) -> None:
    self._tasks[index].put((start, stop, slot))

  def send_slot(self, index: int, slot: batch_slots.Slot) -> None:
    self._replies[index].put(slot)

  def wait(self, doing: dict[int, str]) -> list[tuple[int, tuple]]:
    del doing
    try:
      messages = [self._results.get(timeout=_RECV_POLL_S)]
    except queue.Empty:
      return []
    while True:
      try:
        messages.append(self._results.get_nowait())
      except queue.Empty:
        break
    for _, message in messages:
      if message[0] == "failed":  # a fault of jaxfeed's own, not the UDF's
        raise message[1]
    return messages

  def pids(self) -> list[int]:
    return []

  def close(self) -> None:
    for tasks in self._tasks:
      tasks.put(None)
    for replies in self._replies:
      replies.put(None)
    current = threading.current_thread()
    for thread in self._threads:
      if thread is not current:
        thread.join()


def _thread_main(
  payload: tuple,
  index: int,
  tasks: queue.SimpleQueue,
  replies: queue.SimpleQueue,
  results: queue.SimpleQueue,
) -> None:
  runner = ChunkRunner(payload)

  def bigger(needed: int) -> batch_slots.Slot:
    results.put((index, ("grow", needed)))
    slot = replies.get()
    if slot is None:
      raise _Stopped
    return slot

  while True:
    task = tasks.get()
    if task is None:
      return
    start, stop, slot = task
    try:
      local = None if slot is None else _LocalSlot(slot, bigger)
      message = _compute(runner, start, stop, local)
    except _Stopped:
      return
    except BaseException as exc:  # noqa: BLE001 -- raised in the consumer
      message = ("failed", exc)
    local = slot = None
    results.put((index, message))
    message = None


class _Stopped(BaseException):
  """The iterator closed while a thread waited for a bigger slot."""


# -- worker processes ------------------------------------------------------------
class ProcessWorkers:
  """Worker processes computing chunks (see the module docstring).

  Args:
    shipment: `ship(payload)` (which may start other workers too), or a
      function that makes it, called in the background.
    num_workers: processes to start.
    op_name: for process names and errors.
  """

  name = "process"
  ahead = AHEAD_CHUNKS

  def __init__(
    self,
    shipment: shipping.Shipment | Callable[[], shipping.Shipment],
    num_workers: int,
    op_name: str,
  ):
    self._op_name = op_name
    self.workers = [WorkerProcess(shipment, f"{op_name}-{i}") for i in range(num_workers)]
    self._ready = [False] * num_workers
    self.retired: list[list[int]] = [[] for _ in range(num_workers)]

  def __len__(self) -> int:
    return len(self.workers)

  def ready(self) -> bool:
    """Whether every worker has loaded the chain (without waiting); raises
    WorkerProcessError if one could not."""
    for index, worker in enumerate(self.workers):
      if not self._ready[index]:
        try:
          if not worker.conn.poll(0):
            if worker.ended():
              raise self._died(index, "starting")
            return False
        except OSError as exc:
          raise self._died(index, "starting") from exc
        self._check_ready(index, self.recv(index, "starting"))
    return True

  def wait_ready(self) -> None:
    """Waits until every worker has loaded the chain (see `ready`)."""
    for index in range(len(self.workers)):
      if not self._ready[index]:
        self._check_ready(index, self.recv(index, "starting"))

  def _check_ready(self, index: int, reply: tuple) -> None:
    if reply[0] == "error":
      raise WorkerProcessError(
        f"{self._op_name}: a worker process could not load the pipeline: {reply[1]!r}"
      ) from RemoteTraceback(reply[2])
    self._ready[index] = True

  def pids(self) -> list[int]:
    return [worker.pid for worker in self.workers]

  def on_retire(self, slot_id: int) -> None:
    """A slot was retired: each worker unmaps it with its next chunk."""
    for ids in self.retired:
      ids.append(slot_id)

  def send_chunk(self, index: int, start: int, stop: int, slot: batch_slots.Slot | None) -> None:
    """Sends a chunk, and the slot's descriptor if the worker lacks it."""
    ids, self.retired[index] = self.retired[index], []
    spec = None if slot is None else slot.spec(index)
    self._send(index, ("chunk", start, stop, ids, spec))
    self._send_fd(index, slot)

  def send_slot(self, index: int, slot: batch_slots.Slot) -> None:
    """Answers a worker's "grow" with `slot`."""
    self._send(index, ("slot", slot.spec(index)))
    self._send_fd(index, slot)

  def _send_fd(self, index: int, slot: batch_slots.Slot | None) -> None:
    if slot is None or index in slot.mapped_by:
      return
    worker = self.workers[index]
    try:
      reduction.send_handle(worker.conn, slot.fd, worker.pid)
    except OSError as exc:
      raise self._died(index, "receiving work") from exc
    slot.mapped_by.add(index)

  def _send(self, index: int, message: tuple) -> None:
    worker = self.workers[index]
    worker.check_started()  # its target goes first, from the launcher thread
    try:
      worker.conn.send(message)
    except (OSError, ValueError) as exc:
      raise self._died(index, "receiving work") from exc

  def wait(self, doing: dict[int, str]) -> list[tuple[int, tuple]]:
    """(index, message) of the workers in `doing` (index -> what it does)
    that sent one, within `_RECV_POLL_S`; WorkerProcessError if one died."""
    conns = {self.workers[i].conn: i for i in doing}
    ready = multiprocessing.connection.wait(list(conns), _RECV_POLL_S)
    if not ready:
      for index in doing:
        if not self.workers[index].is_alive():
          raise self._died(index, doing[index])
    messages = []
    for conn in ready:
      index = conns[conn]
      try:
        message = conn.recv()
      except (EOFError, OSError) as exc:
        raise self._died(index, doing[index]) from exc
      if not self._ready[index]:  # sent chunks before it had loaded
        self._check_ready(index, message)
        continue
      messages.append((index, message))
    return messages

  def recv(self, index: int, doing: str) -> tuple:
    """The worker's next message; WorkerProcessError if it died."""
    worker = self.workers[index]
    try:
      while not worker.conn.poll(_RECV_POLL_S):
        if not worker.is_alive():
          raise self._died(index, doing)
      return worker.conn.recv()
    except (EOFError, OSError) as exc:
      raise self._died(index, doing) from exc

  def _died(self, index: int, doing: str) -> WorkerProcessError:
    worker = self.workers[index]
    worker.check_started()
    worker.stop(timeout_s=1)
    return WorkerProcessError(
      f"{self._op_name}: worker process {worker.name} (pid {worker.pid}) "
      f"died (exit code {worker.exitcode}) while {doing}; the iterator "
      f"cannot go on. Restore its last state into a new iterator to resume."
    )

  def close(self) -> None:
    """Stops the processes (killing those that do not stop in time)."""
    for worker in self.workers:
      try:
        worker.conn.send(("stop",))
      except (OSError, ValueError):
        pass
    for worker in self.workers:
      worker.stop()
    self.workers = []


# -- a worker process's side --------------------------------------------------------
class _ParentGone(BaseException):
  """The parent closed the pipe mid-chunk (not a function's error)."""


class _Mapped:
  """A slot mapped by a worker (from the descriptor the parent sent)."""

  def __init__(self, fd: int, size: int):
    try:
      self.map = memfd.map_file(fd, size)
    finally:
      os.close(fd)
    self.size = size
    self.buf = memoryview(self.map)

  def close(self) -> None:
    try:
      self.buf.release()
      self.map.close()
    except BufferError:
      pass  # a view of it lives on (kept by fn): unmapped when the worker exits


class _WorkerSlot:
  """The slot a worker process writes a chunk's batches into; `grow` asks
  the parent for a bigger one and moves what was written there."""

  def __init__(self, conn, slots: dict, queued: collections.deque, slot_id: int):
    # `slots`: the worker's mapped slots by id (mapped once each).
    self.conn, self.slots, self.queued = conn, slots, queued
    self.block = slots[slot_id]

  @property
  def buf(self) -> memoryview:
    return self.block.buf

  def grow(self, needed: int, written: int) -> memoryview:
    """A slot of `needed` bytes or more holding bytes [0, written) of this
    one (the batches already written)."""
    self.conn.send(("grow", needed))
    try:
      reply = _receive(self.conn, self.slots)
      while reply[0] == "chunk":
        self.queued.append(reply)
        reply = _receive(self.conn, self.slots)
    except (EOFError, OSError) as exc:
      raise _ParentGone from exc
    if reply[0] != "slot":
      raise _ParentGone
    old = self.block
    self.block = self.slots[reply[1][0]]
    self.block.buf[:written] = old.buf[:written]
    return self.block.buf


def _receive(conn, slots: dict) -> tuple:
  """The parent's next message; maps the slot it names when its descriptor
  follows (the first time this worker gets that slot)."""
  message = conn.recv()
  if message[0] in ("chunk", "slot") and message[-1] is not None:
    slot_id, size, new = message[-1]
    if new:
      slots[slot_id] = _Mapped(reduction.recv_handle(conn), size)
  return message


def ship(payload: tuple) -> shipping.Shipment:
  """What `ProcessWorkers` starts its processes with: the chain's payload
  (see `ChunkRunner`), shipped by value.

  Raises:
    Exception: a function of the chain cannot be shipped.
  """
  return shipping.dumps((_process_main, (payload,)))


def _process_main(conn, payload: tuple) -> None:
  """A worker process: builds the chain, then computes the chunks it is sent."""
  try:
    runner = ChunkRunner(payload)
  except BaseException as exc:  # noqa: BLE001 -- reported to the parent
    conn.send(("error", picklable_error(exc), traceback.format_exc()))
    return
  conn.send(("ready",))
  slots: dict[int, _Mapped] = {}
  queued: collections.deque = collections.deque()  # chunks sent meanwhile
  try:
    while True:
      try:
        message = queued.popleft() if queued else _receive(conn, slots)
      except (EOFError, OSError):
        return  # the parent went away
      if message[0] == "stop":
        return
      _, start, stop, retired, slot_spec = message
      for slot_id in retired:
        block = slots.pop(slot_id, None)
        if block is not None:
          block.close()
      slot = None if slot_spec is None else _WorkerSlot(conn, slots, queued, slot_spec[0])
      reply = _compute(runner, start, stop, slot)
      del slot
      items = reply[1]
      if items and items[-1][0] == "error":
        error = items[-1]
        items[-1] = (error[0], picklable_error(error[1])) + error[2:]
      conn.send(reply)
      del reply, items
  except _ParentGone:
    return
