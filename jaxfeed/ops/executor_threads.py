"""The worker threads of `jaxfeed.ops.parallel_executor.ParallelExecutor`:
their loop, the task format, and their shutdown.

A task is a run of consecutive elements (`CHUNK` of them while a batch is
read), worked on in order and answered with one message: one hand-off each
way per run, not per element.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any, Callable

from jaxfeed.ops import batch_placement

__all__ = ["CHUNK", "BATCH_DEPTH", "STOP", "worker_loop", "call_work", "shutdown"]

CHUNK = 8
"""Reading batches (`next_batch`), each task is a run of this many
consecutive elements (at most a batch's share per thread): handing an
element to a thread and back costs two queue operations and a thread
wake-up, each a turn of the GIL that the work function's own threads wait
for, so elements travel in runs."""

BATCH_DEPTH = 3
"""Reading batches, the executor keeps this many runs per thread in flight
(at most a batch), not one: a worker that finishes finds its next run
queued instead of waiting for the consumer thread to wake up and pull one,
which on a busy machine can take a scheduler time slice."""

STOP = None  # Task-queue sentinel: the worker that takes it exits.


def worker_loop(
  tasks: queue.SimpleQueue,
  results: queue.SimpleQueue,
  work_fn: Callable[[Any, int], Any],
  generation: list,
  busy: list,
) -> None:
  """A worker thread; `busy[0]` accumulates its seconds spent in work_fn.

  A task is a run of consecutive elements (see `CHUNK`), worked on in
  order and answered with one message: one hand-off each way per run, not
  per element.
  """
  # Holds no reference to the executor or the op iterator, so an abandoned
  # iterator can be garbage-collected (its finalizer then stops this thread).
  clock = time.perf_counter
  place = batch_placement.place
  while True:
    task = tasks.get()
    if task is STOP:
      return
    task_generation, items = task
    task = None
    if task_generation != generation[0]:
      continue  # Discarded by restore() or close(): skip the work.
    start = clock()
    done = []
    for seq, element, seed, slot in items:
      try:
        value = call_work(work_fn, element, seed, slot)
        if slot is not None:
          value = place(value, slot)
        done.append((seq, True, value))
      except BaseException as exc:  # noqa: BLE001 -- re-raised in the consumer
        done.append((seq, False, exc))
      element = value = slot = None
    del items  # the elements: their memory goes now
    busy[0] += clock() - start
    results.put((task_generation, done))
    del done


def call_work(work_fn: Callable, element: Any, seed: int, slot: tuple | None) -> Any:
  """work_fn(element, seed), and the row to write into as a third argument
  when the slot hands one out (see `batch_placement.Placement.slot`)."""
  out = None if slot is None else slot[4]
  if out is None:
    return work_fn(element, seed)
  return work_fn(element, seed, out)


def shutdown(tasks: queue.SimpleQueue, threads: list, generation: list) -> None:
  """Stops and joins the worker threads (close() and garbage collection)."""
  generation[0] += 1  # Queued tasks are skipped instead of computed.
  live = [t for t in threads if t.is_alive()]
  for _ in live:
    tasks.put(STOP)
  current = threading.current_thread()
  for thread in live:
    if thread is not current:
      thread.join()
  threads.clear()
