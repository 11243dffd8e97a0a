"""Worker processes for GIL-bound UDFs, returning arrays through shared memory.

`ProcessPool(fn, op_name)` is a callable `work(element, seed)` that the
thread-based `ParallelExecutor` runs (one process per executor thread,
started on first use): each executor thread borrows one worker process,
sends it the element (pickled, inputs are records), and the worker writes the
output's numpy arrays into a block of shared memory owned by the parent (a
memfd, `jaxfeed.ops.memfd`); only a small header (tree skeleton, dtypes,
shapes, offsets) travels back through the pipe. The parent copies the arrays
out of the block, so the block is reused for the worker's next element.
Ordering, state and exact resume are the executor's, unchanged. (Maps between
an indexed input and a `batch` are fused instead, see
`jaxfeed.ops.process_batch`.)

Workers are `jaxfeed.ops.worker_processes`: `fn` travels by value
(lambdas, closures, functions of `__main__`), the user's main module never
runs in them, and they die with their parent. `close()` — also run on
garbage collection and at interpreter exit — stops them; their shared memory
goes with them.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import traceback
import weakref
from multiprocessing import reduction
from typing import Any, Callable

import numpy as np

from jaxfeed.ops import memfd, shipping, tree
from jaxfeed.ops.memfd import ArrayRef
from jaxfeed.ops.worker_processes import (
  RemoteTraceback,
  WorkerProcess,
  WorkerProcessError,
  picklable_error,
)

__all__ = ["ProcessPool", "WorkerProcessError", "pool_or_threads"]

_INITIAL_BLOCK_BYTES = 1 << 20
_LOG = logging.getLogger("jaxfeed")


def _call(fn: Callable, element: Any) -> Any:
  if type(element) is tuple:
    return fn(*element)
  return fn(element)


def _layout(output: Any) -> tuple[Any, list[np.ndarray], int]:
  """Replaces array leaves by markers; returns skeleton, arrays, bytes needed."""
  arrays, total = [], 0
  markers = []
  for leaf in tree.flatten(output):
    if isinstance(leaf, np.ndarray) and leaf.dtype != object:
      total = (total + 63) // 64 * 64  # keep every array 64-byte aligned
      markers.append(ArrayRef(total, leaf.dtype.str, leaf.shape))
      arrays.append((leaf, total))
      total += leaf.nbytes
    else:
      markers.append(leaf)
  return tree.unflatten(output, markers), arrays, total


class _Block:
  """A memfd the outputs of one worker are written to, and a mapping of it."""

  def __init__(self, size: int, fd: int | None = None):
    self.size = size
    self.fd = memfd.anonymous_file("process_pool", size) if fd is None else fd
    self.map = memfd.map_file(self.fd, size)

  def close(self) -> None:
    self.map.close()
    if self.fd >= 0:
      os.close(self.fd)
      self.fd = -1


def _worker_main(conn, fn: Callable) -> None:
  """A worker process: maps its block, then runs `fn` on what it is sent."""
  block = None
  try:
    while True:
      try:
        message = conn.recv()
      except (EOFError, OSError):
        return  # the parent went away
      if message[0] == "stop":
        return
      if message[0] == "block":
        if block is not None:
          block.close()
        block = _Block(message[1], reduction.recv_handle(conn))
        if message[2]:
          conn.send(("ready",))
        continue
      try:
        skeleton, arrays, needed = _layout(_call(fn, message[1]))
        if needed > block.size:
          conn.send(("grow", needed))
          reply = conn.recv()
          if reply[0] != "block":
            return
          block.close()
          block = _Block(reply[1], reduction.recv_handle(conn))
        for array, offset in arrays:
          np.ndarray(array.shape, array.dtype, buffer=block.map, offset=offset)[...] = array
        conn.send(("ok", skeleton))
      except BaseException as exc:  # noqa: BLE001 -- re-raised in the parent
        conn.send(("error", picklable_error(exc), traceback.format_exc()))
  finally:
    if block is not None:
      block.close()


class _Worker:
  """One process, its pipe and its block (parent side)."""

  def __init__(self, shipment: shipping.Shipment, index: int, op_name: str):
    self.op_name = op_name
    self.process = WorkerProcess(shipment, f"{op_name}-process-{index}")
    self.block = _Block(_INITIAL_BLOCK_BYTES)
    self._send_block(first=True)
    reply = self._recv()
    if reply[0] == "error":
      self.stop()
      raise WorkerProcessError(
        f"{op_name}: worker process could not load the function: {reply[1]!r}"
      ) from RemoteTraceback(reply[2])

  def _send_block(self, first: bool = False) -> None:
    self.process.check_started()  # its target goes first
    self.process.conn.send(("block", self.block.size, first))
    reduction.send_handle(self.process.conn, self.block.fd, 0)

  def _recv(self) -> tuple:
    try:
      return self.process.conn.recv()
    except (EOFError, OSError) as exc:
      self.process.stop(timeout_s=1)
      raise WorkerProcessError(
        f"{self.op_name}: worker process {self.process.name} died "
        f"(exit code {self.process.exitcode})."
      ) from exc

  def run(self, element: Any) -> Any:
    conn = self.process.conn
    conn.send(("run", element))
    reply = self._recv()
    if reply[0] == "grow":
      self.block.close()
      self.block = _Block(max(2 * self.block.size, reply[1]))
      self._send_block()
      reply = self._recv()
    if reply[0] == "error":
      raise reply[1] from RemoteTraceback(reply[2])
    buf = self.block.map

    def restore(leaf):
      if type(leaf) is ArrayRef:
        return np.ndarray(leaf.shape, np.dtype(leaf.dtype), buffer=buf, offset=leaf.offset).copy()
      return leaf

    return tree.map_structure(restore, reply[1])

  def stop(self) -> None:
    try:
      self.process.conn.send(("stop",))
    except (OSError, ValueError):
      pass
    self.process.stop()
    self.block.close()


def _stop_all(workers: list, lock: threading.Lock, shipment: shipping.Shipment) -> None:
  with lock:
    for worker in workers:
      worker.stop()
    workers.clear()
  shipment.close()


class ProcessPool:
  """`work(element, seed)` run in worker processes (see module docstring).

  Args:
    fn: the UDF; `fn(element)`, tuples unpacked into arguments (random_map
      sends `(element, seed)` to a `RandomMapCall`).
    op_name: for error messages and process names.

  Raises:
    ValueError: `fn` cannot be sent to worker processes (see `pool_or_threads`).
  """

  def __init__(self, fn: Callable, op_name: str):
    try:
      self._shipment = shipping.dumps((_worker_main, (fn,)))
    except Exception as exc:  # noqa: BLE001 -- a lock, a generator, ...
      raise ValueError(
        f"{op_name}(backend='process'): {fn!r} cannot be sent to worker "
        f"processes ({type(exc).__name__}: {exc})."
      ) from exc
    self._op_name = op_name
    self._workers: list[_Worker] = []
    self._idle: queue.SimpleQueue = queue.SimpleQueue()
    self._lock = threading.Lock()
    self._closed = False
    self._finalizer = weakref.finalize(self, _stop_all, self._workers, self._lock, self._shipment)

  @property
  def num_processes(self) -> int:
    return len(self._workers)

  def _borrow(self) -> _Worker:
    try:
      return self._idle.get_nowait()
    except queue.Empty:
      pass
    with self._lock:
      if self._closed:
        raise WorkerProcessError(f"{self._op_name}: the process pool is closed.")
      worker = _Worker(self._shipment, len(self._workers), self._op_name)
      self._workers.append(worker)
      return worker

  def __call__(self, element: Any, seed: int) -> Any:
    del seed  # the executor's signature; random_map puts the seed in the element
    worker = self._borrow()
    try:
      result = worker.run(element)
    except WorkerProcessError:
      with self._lock:  # A dead worker is replaced on the next call.
        if worker in self._workers:
          self._workers.remove(worker)
      worker.stop()
      raise
    self._idle.put(worker)
    return result

  def pids(self) -> list[int]:
    return [w.process.pid for w in self._workers]

  def close(self) -> None:
    """Stops the worker processes; their shared memory goes with them."""
    self._closed = True
    self._finalizer()


def pool_or_threads(fn: Callable, op_name: str) -> ProcessPool | None:
  """A `ProcessPool` for `fn`, or None (and one log line saying why) when
  `fn` cannot be sent to worker processes: the op then runs it on threads."""
  why = shipping.why_not_shippable(fn)
  if why is None:
    try:
      return ProcessPool(fn, op_name)
    except ValueError as exc:
      why = str(exc)
  _LOG.warning(
    "%s(backend='process'): running %r on threads: it cannot be sent to worker processes (%s).",
    op_name,
    fn,
    why,
  )
  return None
