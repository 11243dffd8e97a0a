"""Worker processes that never run the user's main module and die with their
parent, whatever kills it.

`WorkerProcess(shipment, name)` runs `target(conn, *args)` from a
`shipping.dumps((target, args))` in a new process; `conn` is a
`multiprocessing.connection.Connection` to the parent's `WorkerProcess.conn`.

* A fresh interpreter (`python -c`): not forked from a process that runs
  threads (JAX, gRPC, the pipeline's own), and not started by
  multiprocessing's spawn or fork server, which import the parent's
  `__main__` again in the worker. That runs the body of a script without an
  `if __name__ == "__main__":` guard a second time (it then fails starting
  processes of its own), and fails for `python - <<EOF` (no file to import).
  The target travels by value instead (`jaxfeed.ops.shipping`), with the
  parent's `sys.path` for the modules it imports.
* A worker dies with its parent (`jaxfeed._lifetime.die_with_parent`):
  `PR_SET_PDEATHSIG` (SIGKILL) on Linux, and a thread that ends the worker
  when its parent process changes (a fallback, and the only means
  elsewhere). The death signal fires when the *thread* that started a
  child ends, so every child is started by one thread of this
  module (`LAUNCHER_THREAD`) that lives as long as any child does (and
  `LINGER_S` more). That thread also does the slow part of a start (the
  interpreter and the shipment), so starting workers does not block.
* No helper process (multiprocessing's fork server or resource tracker) is
  involved: a process jaxfeed starts is one of these workers.
"""

from __future__ import annotations

import collections
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
import weakref
from multiprocessing import connection, reduction
from typing import Callable

from jaxfeed import _lifetime
from jaxfeed.ops import shipping

__all__ = [
  "WorkerProcess",
  "WorkerProcessError",
  "RemoteTraceback",
  "LAUNCHER_THREAD",
  "LINGER_S",
  "every_tick",
  "launcher_running",
  "picklable_error",
]

LAUNCHER_THREAD = "jaxfeed-process-launcher"
"""The thread that starts (and outlives) every worker process."""

LINGER_S = 1.0
"""Seconds the launcher thread waits for new work once no worker lives."""

TICK_S = 1.0
"""Seconds between two calls of the `every_tick` callbacks."""

PARENT_POLL_S = 0.5
"""Seconds between two looks of a worker at its parent process."""

_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# sys.argv: [-c, socket fd, parent pid, the directory jaxfeed is in].
_BOOT = (
  "import sys; sys.path.insert(0, sys.argv[3]); "
  "from jaxfeed.ops.worker_processes import _child_main; "
  "_child_main(int(sys.argv[1]), int(sys.argv[2]))"
)


class WorkerProcessError(RuntimeError):
  """A worker process died, could not be started or could not load its
  target."""


class RemoteTraceback(Exception):
  """Carries a worker's formatted traceback as the cause of its exception."""

  def __init__(self, text: str):
    super().__init__(text)
    self.text = text

  def __str__(self) -> str:
    return self.text


# -- the launcher thread ---------------------------------------------------------
class _Launcher:
  """The process's one thread that starts workers (see the module docstring).

  It runs the jobs it is given in order, calls the `every_tick` callbacks
  every `TICK_S`, and ends once no child it started has been alive for
  `LINGER_S` (a new job starts a new thread).
  """

  def __init__(self):
    self._lock = threading.Lock()
    self._wake = threading.Condition(self._lock)
    self._jobs: collections.deque = collections.deque()
    self._children: list[subprocess.Popen] = []
    self._ticks: list[weakref.WeakMethod] = []
    self._thread: threading.Thread | None = None

  def after_fork_in_child(self) -> None:
    self.__init__()

  def submit(self, job: Callable[[], None]) -> None:
    with self._lock:
      self._jobs.append(job)
      if self._thread is None:
        self._thread = threading.Thread(target=self._run, name=LAUNCHER_THREAD, daemon=True)
        self._thread.start()
      self._wake.notify()

  def adopt(self, child: subprocess.Popen) -> None:
    """Called on the launcher thread with each child it started."""
    with self._lock:
      self._children.append(child)

  def every_tick(self, callback: Callable[[], None]) -> None:
    """Calls the bound method `callback` every `TICK_S` while the thread
    runs, until its object is collected."""
    with self._lock:
      self._ticks.append(weakref.WeakMethod(callback))

  def running(self) -> bool:
    with self._lock:
      return self._thread is not None

  def _run(self) -> None:
    idle_since = None
    next_tick = time.monotonic() + TICK_S
    while True:
      with self._lock:
        while not self._jobs:
          now = time.monotonic()
          if now >= next_tick:
            break
          self._children = [c for c in self._children if c.poll() is None]
          if self._children:
            idle_since = None
          elif idle_since is None:
            idle_since = now
          elif now - idle_since >= LINGER_S:
            self._thread = None
            return
          self._wake.wait(min(next_tick - now, LINGER_S))
        job = self._jobs.popleft() if self._jobs else None
        ticks = [] if job is not None else list(self._ticks)
      if job is not None:
        job()
        job = None  # nothing it holds lingers with the thread
        continue
      next_tick = time.monotonic() + TICK_S
      for ref in ticks:
        callback = ref()
        if callback is None:
          with self._lock:
            self._ticks = [r for r in self._ticks if r() is not None]
          continue
        try:
          callback()
        except Exception:  # noqa: BLE001 -- a tick must not end the launcher
          traceback.print_exc()


_LAUNCHER = _Launcher()
os.register_at_fork(after_in_child=_LAUNCHER.after_fork_in_child)


def every_tick(callback: Callable[[], None]) -> None:
  """Calls the bound method `callback` about every `TICK_S` seconds while any
  worker process lives (e.g. to stop idle workers), until its object is
  garbage-collected."""
  _LAUNCHER.every_tick(callback)


def launcher_running() -> bool:
  """Whether the launcher thread runs (or lingers) now."""
  return _LAUNCHER.running()


# -- the parent's side ---------------------------------------------------------
class WorkerProcess:
  """A worker process running a shipped `target(conn, *args)`.

  Starting is asynchronous (the launcher thread starts the interpreter and
  sends the shipment): `conn` can be read at once, and messages sent to it
  before the worker reads them wait in the socket. `shipment` stays the
  caller's (it may start several workers).

  Args:
    shipment: `shipping.dumps((target, args))`, or a function that makes it
      (called on the launcher thread: a large shipment takes a while). The
      worker keeps it (its descriptors close with its last holder).
    name: for errors (e.g. "process_batch-0").
  """

  def __init__(self, shipment: shipping.Shipment | Callable[[], shipping.Shipment], name: str):
    self.name = name
    parent, child = socket.socketpair()
    self.conn = connection.Connection(parent.detach())
    self.shipment: shipping.Shipment | None = None
    self._popen: subprocess.Popen | None = None
    self._start_error: BaseException | None = None
    self._started = threading.Event()
    _LAUNCHER.submit(lambda: self._launch(child, shipment))

  def _launch(
    self, child: socket.socket, shipment: shipping.Shipment | Callable[[], shipping.Shipment]
  ) -> None:
    """On the launcher thread: starts the interpreter, sends the target."""
    try:
      if callable(shipment):
        shipment = shipment()
      self.shipment = shipment
      data, fds = shipment.data, shipment.fds
      with child:
        self._popen = subprocess.Popen(
          [sys.executable, "-c", _BOOT, str(child.fileno()), str(os.getpid()), _PACKAGE_ROOT],
          pass_fds=(child.fileno(),),
          stdin=subprocess.DEVNULL,
        )
      _LAUNCHER.adopt(self._popen)
      self.conn.send((list(sys.path), data, len(fds)))
      for fd in fds:
        reduction.send_handle(self.conn, fd, self._popen.pid)
    except BaseException as exc:  # noqa: BLE001 -- raised by the caller's next wait
      self._start_error = exc
      child.close()
    finally:
      self._started.set()

  def _wait_started(self) -> subprocess.Popen | None:
    self._started.wait()
    return self._popen

  @property
  def pid(self) -> int | None:
    popen = self._wait_started()
    return None if popen is None else popen.pid

  def ended(self) -> bool:
    """Whether the process was started and has ended, or could not be
    started (without waiting for the start)."""
    if not self._started.is_set():
      return False
    return self._popen is None or self._popen.poll() is not None

  def is_alive(self) -> bool:
    popen = self._wait_started()
    return popen is not None and popen.poll() is None

  @property
  def exitcode(self) -> int | None:
    popen = self._wait_started()
    return None if popen is None else popen.poll()

  def check_started(self) -> None:
    """Waits until the process is started and has been sent its target (so
    that the caller may send it messages); raises WorkerProcessError if the
    interpreter could not be started."""
    self._wait_started()
    if self._start_error is not None:
      raise WorkerProcessError(
        f"{self.name}: could not start a worker process: {self._start_error!r}"
      ) from self._start_error

  def stop(self, timeout_s: float = 5.0) -> None:
    """Waits up to `timeout_s` for the process to end (after the caller asked
    it to), then kills it; closes the pipe. Idempotent."""
    popen = self._wait_started()
    if popen is not None:
      try:
        popen.wait(timeout_s)
      except subprocess.TimeoutExpired:
        popen.kill()
        popen.wait()
    self.conn.close()

  def kill(self) -> None:
    """Ends the process now (SIGKILL) and closes the pipe. Idempotent."""
    popen = self._wait_started()
    if popen is not None and popen.poll() is None:
      popen.kill()
    self.stop()


def picklable_error(exc: BaseException) -> BaseException:
  """`exc`, or a RuntimeError with its text when it cannot be pickled."""
  try:
    pickle.dumps(exc)
    return exc
  except Exception:  # noqa: BLE001
    return RuntimeError(f"{type(exc).__name__}: {exc}")


# -- the worker's side ---------------------------------------------------------
def _child_main(fd: int, parent_pid: int) -> None:
  """The worker: loads the shipped target and runs it."""
  # PR_SET_PDEATHSIG and a parent watch (see the module docstring).
  _lifetime.die_with_parent(parent_pid, poll_s=PARENT_POLL_S)
  signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent owns shutdown
  conn = connection.Connection(fd)
  try:
    sys_path, data, count = conn.recv()
    sys.path[:] = sys_path
    fds = [reduction.recv_handle(conn) for _ in range(count)]
    target, args = shipping.loads(data, fds)
  except (EOFError, OSError):
    return  # the parent went away
  except BaseException as exc:  # noqa: BLE001 -- reported to the parent
    conn.send(("error", picklable_error(exc), traceback.format_exc()))
    return
  target(conn, *args)
