"""Worker processes for GIL-bound UDFs, returning arrays through shared memory.

`ProcessPool(fn, op_name)` is a callable `work(element, seed)` that the
thread-based `ParallelExecutor` runs (one process per executor thread,
started on first use): each executor thread borrows one worker
process, sends it the element (pickled, inputs are records), and the worker
writes the output's numpy arrays into a shared-memory block owned by the
parent; only a small header (tree skeleton, dtypes, shapes, offsets) travels
back through the pipe. The parent copies the arrays out of the block, so the
block is reused for the worker's next element. Ordering, state and exact
resume are the executor's, unchanged.

Workers are started with the "spawn" method (safe beside JAX and gRPC
threads), so `fn` must be importable: a module-level function or a picklable
callable object. Workers ignore SIGINT (the parent owns shutdown) and exit on
their own when the parent goes away. `close()` — also run on garbage
collection and at interpreter exit — stops the processes and unlinks every
shared-memory block.
"""

from __future__ import annotations

import multiprocessing
import pickle
import queue
import signal
import threading
import traceback
import weakref
from multiprocessing import shared_memory
from typing import Any, Callable

import numpy as np

from jaxfeed.ops import tree

__all__ = ["ProcessPool", "WorkerProcessError"]

_INITIAL_BLOCK_BYTES = 1 << 20


class _ArrayRef:
  """Where one array leaf of an output lies in the worker's block."""

  __slots__ = ("offset", "dtype", "shape")

  def __init__(self, offset: int, dtype: str, shape: tuple):
    self.offset, self.dtype, self.shape = offset, dtype, shape

  def __reduce__(self):
    return _ArrayRef, (self.offset, self.dtype, self.shape)


def _attach(name: str) -> shared_memory.SharedMemory:
  # The parent created (and will unlink) the block; a worker only maps it.
  # Before Python 3.13 attaching registers the name with the parent's
  # resource tracker again, which is harmless: the tracker keeps a set.
  try:
    return shared_memory.SharedMemory(name=name, track=False)
  except TypeError:
    return shared_memory.SharedMemory(name=name)


class WorkerProcessError(RuntimeError):
  """A worker process died or could not run the function."""


class _RemoteTraceback(Exception):
  """Carries a worker's formatted traceback as the cause of its exception."""

  def __init__(self, text: str):
    super().__init__(text)
    self.text = text

  def __str__(self) -> str:
    return self.text


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
      markers.append(_ArrayRef(total, leaf.dtype.str, leaf.shape))
      arrays.append((leaf, total))
      total += leaf.nbytes
    else:
      markers.append(leaf)
  return tree.unflatten(output, markers), arrays, total


def _worker_main(fn_bytes: bytes, conn, block_name: str) -> None:
  signal.signal(signal.SIGINT, signal.SIG_IGN)
  block = _attach(block_name)
  try:
    fn = pickle.loads(fn_bytes)
  except BaseException as exc:  # noqa: BLE001 -- reported to the parent
    conn.send(("error", _picklable(exc), traceback.format_exc()))
    return
  conn.send(("ready",))
  while True:
    try:
      message = conn.recv()
    except (EOFError, OSError):
      return  # The parent went away.
    if message[0] == "stop":
      return
    if message[0] == "block":
      block.close()
      block = _attach(message[1])
      continue
    _, element = message
    try:
      skeleton, arrays, needed = _layout(_call(fn, element))
      if needed > block.size:
        conn.send(("grow", needed))
        reply = conn.recv()
        if reply[0] != "block":
          return
        block.close()
        block = _attach(reply[1])
      for array, offset in arrays:
        np.ndarray(array.shape, array.dtype, buffer=block.buf, offset=offset)[...] = array
      conn.send(("ok", skeleton))
    except BaseException as exc:  # noqa: BLE001 -- re-raised in the parent
      conn.send(("error", _picklable(exc), traceback.format_exc()))


def _picklable(exc: BaseException) -> BaseException:
  try:
    pickle.dumps(exc)
    return exc
  except Exception:  # noqa: BLE001
    return RuntimeError(f"{type(exc).__name__}: {exc}")


class _Worker:
  """One process, its pipe and its shared-memory block (parent side)."""

  def __init__(self, ctx, fn_bytes: bytes, index: int, op_name: str):
    self.op_name = op_name
    self.block = shared_memory.SharedMemory(create=True, size=_INITIAL_BLOCK_BYTES)
    self.conn, child = ctx.Pipe()
    self.process = ctx.Process(
        target=_worker_main, args=(fn_bytes, child, self.block.name),
        name=f"jaxfeed-{op_name}-process-{index}", daemon=True)
    self.process.start()
    child.close()
    reply = self._recv()
    if reply[0] == "error":
      raise WorkerProcessError(
          f"{op_name}: worker process could not load the function: "
          f"{reply[1]!r}") from _RemoteTraceback(reply[2])

  def _recv(self) -> tuple:
    try:
      return self.conn.recv()
    except (EOFError, OSError) as exc:
      self.process.join(timeout=1)
      raise WorkerProcessError(
          f"{self.op_name}: worker process {self.process.name} died "
          f"(exit code {self.process.exitcode}).") from exc

  def run(self, element: Any) -> Any:
    self.conn.send(("run", element))
    reply = self._recv()
    if reply[0] == "grow":
      old = self.block
      self.block = shared_memory.SharedMemory(create=True, size=max(2 * old.size, reply[1]))
      self.conn.send(("block", self.block.name))
      old.close()
      old.unlink()
      reply = self._recv()
    if reply[0] == "error":
      raise reply[1] from _RemoteTraceback(reply[2])
    buf = self.block.buf

    def restore(leaf):
      if type(leaf) is _ArrayRef:
        return np.ndarray(leaf.shape, np.dtype(leaf.dtype), buffer=buf,
                          offset=leaf.offset).copy()
      return leaf

    return tree.map_structure(restore, reply[1])

  def stop(self) -> None:
    try:
      self.conn.send(("stop",))
    except (OSError, ValueError):
      pass
    self.process.join(timeout=5)
    if self.process.is_alive():
      self.process.kill()
      self.process.join()
    self.conn.close()
    self.block.close()
    try:
      self.block.unlink()
    except FileNotFoundError:
      pass


def _stop_all(workers: list, lock: threading.Lock) -> None:
  with lock:
    for worker in workers:
      worker.stop()
    workers.clear()


class ProcessPool:
  """`work(element, seed)` run in worker processes (see module docstring).

  Args:
    fn: the UDF; `fn(element)`, tuples unpacked into arguments (random_map
      sends `(element, seed)` to a `RandomMapCall`).
    op_name: for error messages and process names.
  """

  def __init__(self, fn: Callable, op_name: str):
    try:
      self._fn_bytes = pickle.dumps(fn)
    except Exception as exc:  # noqa: BLE001 -- lambdas, closures, local fns
      raise ValueError(
          f"{op_name}(backend='process'): {fn!r} cannot be sent to worker "
          f"processes ({exc}). Define it at module level (or make it a "
          f"picklable callable object), or use backend='thread'.") from exc
    self._op_name = op_name
    self._ctx = multiprocessing.get_context("spawn")
    self._workers: list[_Worker] = []
    self._idle: queue.SimpleQueue = queue.SimpleQueue()
    self._lock = threading.Lock()
    self._closed = False
    self._finalizer = weakref.finalize(self, _stop_all, self._workers, self._lock)

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
      worker = _Worker(self._ctx, self._fn_bytes, len(self._workers), self._op_name)
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

  def shared_memory_names(self) -> list[str]:
    return [w.block.name for w in self._workers]

  def close(self) -> None:
    """Stops the worker processes and unlinks their shared memory."""
    self._closed = True
    self._finalizer()

