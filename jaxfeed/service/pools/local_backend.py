"""A worker pool on this machine: the autoscaler starts and stops worker
processes (`python -m jaxfeed.service.worker`), children of the dispatcher.

The workers end with the dispatcher's process, however it ends (a SIGKILL
included: see `jaxfeed._lifetime`), and the pool remembers how each of its
workers ended, which the dispatcher names when a split kills them (see
`jaxfeed.service.protocol.split_failures`).
"""

from __future__ import annotations

import collections
import logging
import os
import subprocess
import sys
import tempfile
import threading
from typing import Sequence

from jaxfeed import _lifetime

_LOG = logging.getLogger(__name__)


class LocalWorkerBackend:
  """Starts and stops worker processes on this machine.

  Args:
    dispatcher_address: host:port the workers register with.
    flags: Extra worker flags.
    secrets: Flag name -> value of flags that must not show on a command
      line (auth token, UDF secret); they reach the workers through a
      flag file only this user can read.
  """

  def __init__(
    self, dispatcher_address: str, flags: Sequence[str] = (), secrets: dict[str, str] | None = None
  ):
    self._address = dispatcher_address
    self._flags = list(flags)
    self._lock = threading.Lock()
    self._processes: list[subprocess.Popen] = []
    # pid -> return code of the workers that ended, the latest _EXITS_KEPT.
    self._exits: collections.OrderedDict[int, int] = collections.OrderedDict()
    self._folder = tempfile.TemporaryDirectory(prefix="jaxfeed-workers-")
    self._flagfile = None
    if secrets:
      path = os.path.join(self._folder.name, "secrets.flags")
      with open(os.open(path, os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
        for name, value in secrets.items():
          f.write(f"--{name}={value}\n")
      self._flagfile = path

  @property
  def num_workers(self) -> int:
    with self._lock:
      return len(self._live_locked())

  def pids(self) -> list[int]:
    with self._lock:
      return [p.pid for p in self._live_locked()]

  def exit_status(self, pid: int) -> int | None:
    """The return code of worker process `pid` (negative: the signal that
    ended it), None while it runs. Raises KeyError for a process this pool
    did not start (or ended too long ago)."""
    with self._lock:
      self._live_locked()
      if pid in self._exits:
        return self._exits[pid]
      if any(p.pid == pid for p in self._processes):
        return None
    raise KeyError(pid)

  def _live_locked(self) -> list[subprocess.Popen]:
    """The processes still running; notes how the others ended (lock held)."""
    live = []
    for process in self._processes:
      code = process.poll()
      if code is None:
        live.append(process)
        continue
      self._note_exit(process.pid, code)
    self._processes = live
    return live

  def _note_exit(self, pid: int, code: int) -> None:
    self._exits[pid] = code
    while len(self._exits) > _EXITS_KEPT:
      self._exits.popitem(last=False)

  def start_worker(self) -> None:
    args = [
      sys.executable,
      "-m",
      "jaxfeed.service.worker",
      f"--dispatcher_address={self._address}",
      "--port=0",
      f"--parent_pid={os.getpid()}",
      *self._flags,
    ]
    if self._flagfile:
      args.append(f"--flagfile={self._flagfile}")
    # It calls _lifetime.die_with_parent_from_env(): it ends with this process.
    process = _lifetime.popen(args, stdout=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
    with self._lock:
      self._processes.append(process)
    _LOG.info("Started worker process %d.", process.pid)

  def stop_worker(self) -> bool:
    """Stops the newest worker; False if this backend runs none."""
    with self._lock:
      live = [p for p in self._processes if p.poll() is None]
      if not live:
        return False
      process = live[-1]
      self._processes.remove(process)
    _stop_process(process)
    with self._lock:
      self._note_exit(process.pid, process.returncode)
    _LOG.info("Stopped worker process %d.", process.pid)
    return True

  def close(self) -> None:
    with self._lock:
      processes, self._processes = self._processes, []
    for process in processes:
      process.terminate()
    for process in processes:
      _stop_process(process)
    self._folder.cleanup()


_EXITS_KEPT = 1024


def _stop_process(process: subprocess.Popen) -> None:
  process.terminate()  # the worker drains first (--drain_timeout_s, 30 s)
  try:
    process.wait(timeout=45)
  except subprocess.TimeoutExpired:
    process.kill()
    process.wait()
