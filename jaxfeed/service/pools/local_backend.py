"""A worker pool on this machine: the autoscaler starts and stops worker
processes (`python -m jaxfeed.service.worker`), children of the dispatcher."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import tempfile
import threading
from typing import Sequence

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

  def __init__(self, dispatcher_address: str, flags: Sequence[str] = (),
               secrets: dict[str, str] | None = None):
    self._address = dispatcher_address
    self._flags = list(flags)
    self._lock = threading.Lock()
    self._processes: list[subprocess.Popen] = []
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
      self._processes = [p for p in self._processes if p.poll() is None]
      return len(self._processes)

  def pids(self) -> list[int]:
    with self._lock:
      return [p.pid for p in self._processes if p.poll() is None]

  def start_worker(self) -> None:
    args = [sys.executable, "-m", "jaxfeed.service.worker",
            f"--dispatcher_address={self._address}", "--port=0",
            f"--parent_pid={os.getpid()}", *self._flags]
    if self._flagfile:
      args.append(f"--flagfile={self._flagfile}")
    process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
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


def _stop_process(process: subprocess.Popen) -> None:
  process.terminate()  # the worker drains first (--drain_timeout_s, 30 s)
  try:
    process.wait(timeout=45)
  except subprocess.TimeoutExpired:
    process.kill()
    process.wait()
