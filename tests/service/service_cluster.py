"""Starts dispatcher and worker processes on loopback for the service tests."""

from __future__ import annotations

import os
import pathlib
import queue
import signal
import socket
import subprocess
import sys
import threading

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
TESTS_DIR = pathlib.Path(__file__).resolve().parent
START_TIMEOUT_S = 60
# The modules of the tests' UDFs, allowed on the tests' servers.
TEST_UDF_MODULES = ("service_udfs", "coordinated_reads")


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


class ServiceProcess:
  """A `python -m jaxfeed.service.<role>` child process; kill() or stop() ends it."""

  def __init__(self, role: str, *flags: str, wait_ready: bool = True,
               log_path: str | os.PathLike | None = None):
    """Flags without --udf_modules get TEST_UDF_MODULES; `log_path`: the
    process's stderr (its logging) is appended there."""
    env = dict(os.environ)
    # Workers import the tests' UDFs (service_udfs) by module path.
    env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO_ROOT), str(TESTS_DIR), env.get("PYTHONPATH", "")])
    env["GRPC_VERBOSITY"] = "ERROR"
    env.setdefault("JAX_PLATFORMS", "cpu")
    if not any(f.startswith("--udf_modules") for f in flags):
      flags = (*flags, f"--udf_modules={','.join(TEST_UDF_MODULES)}")
    log = open(log_path, "ab") if log_path else subprocess.DEVNULL  # pylint: disable=consider-using-with
    try:
      self.proc = subprocess.Popen(
          [sys.executable, "-m", f"jaxfeed.service.{role}", *flags],
          stdout=subprocess.PIPE, stderr=log, env=env, text=True)
    finally:
      if log_path:
        log.close()
    self._lines: queue.Queue = queue.Queue()
    self._reader = threading.Thread(target=self._read, daemon=True)
    self._reader.start()
    self.address = ""
    self.data_address = ""
    if wait_ready:
      self.wait_ready()

  def _read(self) -> None:
    for line in self.proc.stdout:
      self._lines.put(line)
    self._lines.put(None)  # exited

  def wait_ready(self) -> "ServiceProcess":
    try:
      line = self._lines.get(timeout=START_TIMEOUT_S)
    except queue.Empty:
      self.kill()
      raise TimeoutError(f"{self.proc.args} did not report its address.") from None
    if line is None:
      code = self.proc.wait(timeout=30)
      raise RuntimeError(f"{self.proc.args} exited with status {code} before "
                         "reporting its address.")
    words = line.split()
    self.address = words[words.index("on") + 1]
    if "data" in words:
      self.data_address = words[words.index("data") + 1]
    return self

  def kill(self) -> None:
    """SIGKILL: no goodbye to anyone."""
    if self.proc.poll() is None:
      self.proc.send_signal(signal.SIGKILL)
    self.proc.wait(timeout=30)
    self._reader.join(timeout=5)

  def pause(self) -> None:
    """SIGSTOP: the process and its sockets stay, nothing runs."""
    self.proc.send_signal(signal.SIGSTOP)

  def resume(self) -> None:
    """SIGCONT after pause()."""
    if self.proc.poll() is None:
      self.proc.send_signal(signal.SIGCONT)

  def stop(self) -> None:
    if self.proc.poll() is None:
      self.proc.send_signal(signal.SIGCONT)  # a paused process cannot end
      self.proc.terminate()
      try:
        self.proc.wait(timeout=10)
      except subprocess.TimeoutExpired:
        self.proc.kill()
    self.kill()
