"""Starts dispatcher and worker processes on loopback for the service tests."""

from __future__ import annotations

import fcntl
import os
import pathlib
import queue
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading

from jaxfeed import _lifetime

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
TESTS_DIR = pathlib.Path(__file__).resolve().parent
START_TIMEOUT_S = 60
# The modules of the tests' UDFs, allowed on the tests' servers.
TEST_UDF_MODULES = ("service_udfs", "coordinated_reads")


# Lock files of the ports `free_port` handed out, one per port, so that test
# processes running side by side never pick the same one.
_PORT_LOCKS = pathlib.Path(tempfile.gettempdir()) / "jaxfeed-test-ports"
_held_ports: dict[int, int] = {}  # port -> file descriptor holding its lock


def _ephemeral_low() -> int:
  try:
    return int(pathlib.Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
  except (OSError, ValueError, IndexError):
    return 32768


def free_port() -> int:
  """A loopback port that stays this process's until `release_port`.

  Servers that are killed and restarted on the same port need a port nobody
  else takes while they are down. A port the OS picks (bind to 0) comes from
  the ephemeral range, where any outgoing connection or other test may get it
  next; so this one comes from below that range, and a lock file held until
  `release_port` (or the process's end) keeps other test processes off it.
  """
  high = _ephemeral_low()
  low = max(1024, min(20000, high - 4096))
  _PORT_LOCKS.mkdir(exist_ok=True)
  rng = random.SystemRandom()
  for _ in range(2000):
    port = rng.randrange(low, high)
    if port in _held_ports:
      continue
    fd = os.open(_PORT_LOCKS / f"{port}.lock", os.O_CREAT | os.O_RDWR, 0o666)
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
      with socket.socket() as s:
        s.bind(("127.0.0.1", port))
    except OSError:
      os.close(fd)
      continue
    _held_ports[port] = fd
    return port
  raise RuntimeError(f"no free loopback port in [{low}, {high})")


def release_port(port: int) -> None:
  """Gives back a port from `free_port` (its server is gone for good)."""
  fd = _held_ports.pop(port, None)
  if fd is not None:
    os.close(fd)


class ServiceProcess:
  """A `python -m jaxfeed.service.<role>` child process; kill() or stop() ends it."""

  def __init__(
    self,
    role: str,
    *flags: str,
    wait_ready: bool = True,
    log_path: str | os.PathLike | None = None,
    env: dict[str, str] | None = None,
  ):
    """Flags without --udf_modules get TEST_UDF_MODULES; `log_path`: the
    process's stderr (its logging) is appended there; `env`: variables
    added to this process's environment."""
    env = {**os.environ, **(env or {})}
    # Workers import the tests' UDFs (service_udfs) by module path.
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), str(TESTS_DIR), env.get("PYTHONPATH", "")])
    env["GRPC_VERBOSITY"] = "ERROR"
    env.setdefault("JAX_PLATFORMS", "cpu")
    if not any(f.startswith("--udf_modules") for f in flags):
      flags = (*flags, f"--udf_modules={','.join(TEST_UDF_MODULES)}")
    log = open(log_path, "ab") if log_path else subprocess.DEVNULL  # pylint: disable=consider-using-with
    try:
      # It ends with this process, however that ends (jaxfeed._lifetime).
      self.proc = _lifetime.popen(
        [sys.executable, "-m", f"jaxfeed.service.{role}", *flags],
        stdout=subprocess.PIPE,
        stderr=log,
        env=env,
        text=True,
      )
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
      raise RuntimeError(
        f"{self.proc.args} exited with status {code} before reporting its address."
      )
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
