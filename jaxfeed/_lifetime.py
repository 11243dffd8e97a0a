"""Child processes that end with the process that started them.

A trainer killed by the OOM killer (SIGKILL) runs no cleanup: every process
jaxfeed started for it must notice on its own and end. Two mechanisms, both
used by `die_with_parent`:

* Linux: `prctl(PR_SET_PDEATHSIG, sig)` in the child; the kernel sends `sig`
  the moment its parent ends, however it ended, even while the child is
  stuck in C code that holds the GIL.
* Everywhere: a daemon thread that polls `os.getppid()` and ends the process
  once it is no longer the parent's pid (the child was re-parented).

The kernel counts as the parent the *thread* that started the child: the
signal comes as soon as that thread ends, though the process lives on. So
a child that calls `die_with_parent` must have been started from a thread
that lives as long as the process: `popen` starts children from the main
thread or from one thread kept for that (`jaxfeed-spawner`), and marks them
(PARENT_PID_ENV) for `die_with_parent_from_env`. A child started some other
way gets the parent watch only (`die_with_parent(pid, deathsig=False)`).

Usage, in the parent:

  process = _lifetime.popen([sys.executable, "-m", "my.child"], ...)

(or `_lifetime.run`, for `subprocess.run`)
and first thing in the child (`python -m my.child`):

  _lifetime.die_with_parent_from_env()

or, for `multiprocessing` processes and `concurrent.futures` pools (their
processes are started by the thread that starts or submits work):

  initializer=_lifetime.die_with_parent,
  initargs=(os.getpid(), _lifetime.on_lasting_thread())
"""

from __future__ import annotations

import ctypes
import logging
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from typing import Any, Callable, Mapping, Sequence

# The environment variable `popen` sets in a child: the parent's pid.
PARENT_PID_ENV = "JAXFEED_PARENT_PID"
# The thread `popen` starts children from, when not on the main thread.
SPAWNER_THREAD_NAME = "jaxfeed-spawner"
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_POLL_S = 0.2


def set_parent_death_signal(sig: int = signal.SIGKILL) -> bool:
  """Linux: asks the kernel to send `sig` to this process when the thread
  that started it ends. Returns False where that is not available."""
  if not sys.platform.startswith("linux"):
    return False
  try:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
      raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
  except (OSError, AttributeError) as e:
    logging.warning(
      "prctl(PR_SET_PDEATHSIG) failed (%s): only a parent watch "
      "thread ends this process with its parent.",
      e,
    )
    return False
  return True


def on_lasting_thread() -> bool:
  """Whether the current thread lives as long as this process (the main
  thread, or the spawner), so that children it starts may set
  PR_SET_PDEATHSIG (`die_with_parent`'s `deathsig`)."""
  current = threading.current_thread()
  return current is threading.main_thread() or current.name == SPAWNER_THREAD_NAME


def die_with_parent(
  parent_pid: int | None = None,
  deathsig: bool = True,
  *,
  sig: int = signal.SIGKILL,
  poll_s: float = _POLL_S,
) -> None:
  """Ends this process with `sig` once `parent_pid` is no longer its parent.

  Call it first thing in a child process. If the parent is gone already (it
  died before the child got here), the process ends at once.

  Args:
    parent_pid: the pid of the process that started this one (default: the
      current parent). Pass the pid the parent had when it started the
      child, so that a child started by a parent that died meanwhile ends.
    deathsig: also set PR_SET_PDEATHSIG (Linux), for which the child must
      have been started from a thread that lives as long as its process
      (`on_lasting_thread()` in the parent; see the module docstring);
      False: the watch thread only.
    sig: how the process ends: SIGKILL (default) ends it whatever it is
      doing; a catchable signal lets it clean up, if it can.
    poll_s: how often the watch thread looks at the parent.
  """
  if parent_pid is None:
    parent_pid = os.getppid()
  if deathsig:
    set_parent_death_signal(sig)
  if os.getppid() != parent_pid:  # it died before the signal was set
    _end(parent_pid, sig)
  threading.Thread(
    target=_watch, args=(parent_pid, sig, poll_s), name="jaxfeed-parent-watch", daemon=True
  ).start()


def die_with_parent_from_env(sig: int = signal.SIGKILL) -> bool:
  """In a child started by `popen`: `die_with_parent` with the pid it names.

  Removes the variable from this process's environment, so that its own
  children do not take this process's parent for theirs. Returns whether
  the variable was set.
  """
  value = os.environ.pop(PARENT_PID_ENV, "")
  if not value:
    return False
  try:
    parent_pid = int(value)
  except ValueError:
    logging.warning("Ignoring %s=%r: not a process id.", PARENT_PID_ENV, value)
    return False
  die_with_parent(parent_pid, sig=sig)
  return True


def child_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
  """`env` (default: this process's environment) naming this process as the
  parent that a child's `die_with_parent_from_env` watches."""
  return {**(os.environ if env is None else env), PARENT_PID_ENV: str(os.getpid())}


def popen(args: Sequence[str], **kwargs: Any) -> subprocess.Popen:
  """`subprocess.Popen(args, **kwargs)` for a child that calls
  `die_with_parent_from_env`: its environment (`env`, default this
  process's) names this process, and it is started from the main thread or
  the spawner thread, which live as long as this process."""
  kwargs["env"] = child_env(kwargs.get("env"))
  if threading.current_thread() is threading.main_thread():
    return subprocess.Popen(args, **kwargs)  # pylint: disable=consider-using-with
  return _spawner().run(lambda: subprocess.Popen(args, **kwargs))


def run(
  args: Sequence[str], *, timeout: float | None = None, **kwargs: Any
) -> subprocess.CompletedProcess:
  """`subprocess.run(args, timeout=timeout, **kwargs)` through `popen`."""
  with popen(args, **kwargs) as process:
    try:
      stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
      process.kill()
      process.communicate()
      raise
  return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


def _watch(parent_pid: int, sig: int, poll_s: float) -> None:
  while os.getppid() == parent_pid:
    time.sleep(poll_s)
  _end(parent_pid, sig)


def _end(parent_pid: int, sig: int) -> None:
  try:
    sys.stderr.write(
      f"jaxfeed: process {os.getpid()}: its parent {parent_pid} is gone; "
      f"ending with {signal.Signals(sig).name}.\n"
    )
    sys.stderr.flush()
  except (OSError, ValueError):
    pass  # no stderr left
  os.kill(os.getpid(), sig)
  time.sleep(1.0)  # a catchable signal's handler runs on the main thread
  os._exit(1)  # pylint: disable=protected-access


class _Spawner:
  """One daemon thread that runs the calls handed to it, for as long as the
  process lives (it is never stopped: children it started would get their
  parent-death signal)."""

  def __init__(self):
    self._calls: queue.Queue = queue.Queue()
    self._thread = threading.Thread(target=self._serve, name=SPAWNER_THREAD_NAME, daemon=True)
    self._thread.start()

  def _serve(self) -> None:
    while True:
      call, done, result = self._calls.get()
      try:
        result.append((True, call()))
      except BaseException as e:  # pylint: disable=broad-except
        result.append((False, e))
      done.set()

  def run(self, call: Callable[[], Any]) -> Any:
    done = threading.Event()
    result: list[Any] = []
    self._calls.put((call, done, result))
    done.wait()
    ok, value = result[0]
    if not ok:
      raise value
    return value


_SPAWNER: _Spawner | None = None
_SPAWNER_LOCK = threading.Lock()


def _spawner() -> _Spawner:
  global _SPAWNER
  with _SPAWNER_LOCK:
    if _SPAWNER is None or not _SPAWNER._thread.is_alive():  # pylint: disable=protected-access
      _SPAWNER = _Spawner()
    return _SPAWNER
