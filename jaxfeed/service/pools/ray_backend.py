"""A worker pool on a Ray cluster: one CPU-reserving actor per worker.

Each worker of the pool is a Ray actor that reserves `num_cpus` on its node
and runs `python -m jaxfeed.service.worker` there as its child process,
bound to the node's IP. Actors are spread over the cluster's nodes (Ray's
SPREAD strategy). The worker watches the actor (`--parent_pid`): when the
actor dies (its node is removed, `ray.kill`), the worker stops too, and the
dispatcher treats it as any lost worker (DYNAMIC exactly-once jobs issue its
unacknowledged splits again).

Ray is an optional dependency (`pip install jaxfeed[ray]`); only this module
imports it, and only `AutoscaleConfig(backend="ray")` imports this module.
The secrets of the workers (worker token, UDF secret) reach the actors as
arguments, that is through the Ray cluster's control store: whoever may use
the Ray cluster may read them (and run any code on its nodes anyway). On its
node an actor hands them to its worker through a flag file only its user can
read, never on a command line.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
from typing import Any, Sequence

import ray

from jaxfeed import _lifetime

_LOG = logging.getLogger(__name__)

# How long a stopping worker may drain (its --drain_timeout_s is 30 s) before
# its actor is killed.
_STOP_TIMEOUT_S = 45.0
# How long `num_workers` waits for the actors to answer whether their worker runs.
_POLL_TIMEOUT_S = 5.0


class _WorkerActor:
  """Runs one worker process on the actor's node (the class Ray makes an actor of)."""

  def __init__(self, args: list[str], secrets: dict[str, str]):
    self._folder = tempfile.TemporaryDirectory(prefix="jaxfeed-ray-worker-")
    args = [*args, f"--parent_pid={os.getpid()}"]
    if not any(a.startswith("--host=") for a in args):
      args.append(f"--host={ray.util.get_node_ip_address()}")
    if secrets:
      path = os.path.join(self._folder.name, "secrets.flags")
      with open(os.open(path, os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
        for name, value in secrets.items():
          f.write(f"--{name}={value}\n")
      args.append(f"--flagfile={path}")
    # It ends with the actor's process, however that ends (jaxfeed._lifetime).
    self._process = _lifetime.popen(
      [sys.executable, "-m", "jaxfeed.service.worker", *args],
      stdout=subprocess.PIPE,
      stdin=subprocess.DEVNULL,
      text=True,
    )
    # "jaxfeed worker listening on ADDRESS [data ADDRESS]"
    words = self._process.stdout.readline().split()
    if "on" not in words:
      code = self._process.wait()
      self._folder.cleanup()
      raise RuntimeError(
        f"The jaxfeed worker on node {ray.util.get_node_ip_address()} "
        f"exited with status {code} before serving (its reason is in "
        "this actor's log)."
      )
    self._address = words[words.index("on") + 1]
    # Anything it prints later must not fill the pipe and block it.
    threading.Thread(target=self._process.stdout.read, daemon=True).start()

  def info(self) -> dict[str, Any]:
    """The worker's address, node and whether it still runs."""
    return {
      "address": self._address,
      "pid": self._process.pid,
      "node_id": ray.get_runtime_context().get_node_id(),
      "running": self._process.poll() is None,
    }

  def stop(self) -> int:
    """SIGTERM: the worker drains, tells the dispatcher it left and exits."""
    self._process.terminate()
    try:
      code = self._process.wait(timeout=_STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
      self._process.kill()
      code = self._process.wait()
    self._folder.cleanup()
    return code


class RayWorkerBackend:
  """Starts and stops the pool's workers as actors on a Ray cluster.

  Args:
    dispatcher_address: host:port the workers register with (reachable from
      every Ray node).
    flags: Extra worker flags.
    secrets: Flag name -> value of flags that must not show on a command line.
    ray_address: The Ray cluster (host:port of its head); None: the one this
      process is connected to already, else Ray's "auto" (RAY_ADDRESS or a
      cluster started on this machine).
    num_cpus: CPUs each worker's actor reserves on its node.
  """

  def __init__(
    self,
    dispatcher_address: str,
    flags: Sequence[str] = (),
    secrets: dict[str, str] | None = None,
    ray_address: str | None = None,
    num_cpus: float = 1.0,
  ):
    self._args = [f"--dispatcher_address={dispatcher_address}", "--port=0", *flags]
    self._secrets = dict(secrets or {})
    self._owns_connection = not ray.is_initialized()
    if self._owns_connection:
      # ray.init() makes SIGTERM end the process with status 15; the process's
      # own handler (the command-line dispatcher's clean stop) stays.
      sigterm = signal.getsignal(signal.SIGTERM)
      # The actors' output stays in their logs: this process's stdout is its own.
      ray.init(address=ray_address or "auto", log_to_driver=False, logging_level=logging.WARNING)
      if threading.current_thread() is threading.main_thread() and sigterm is not None:
        signal.signal(signal.SIGTERM, sigterm)
    self._actor_class = ray.remote(_WorkerActor).options(
      num_cpus=num_cpus, scheduling_strategy="SPREAD", max_restarts=0
    )
    self._lock = threading.Lock()
    self._actors: list[tuple[Any, Any]] = []  # (actor, its first info() call), oldest first
    self._closed = False

  def _prune(self) -> list[tuple[Any, Any]]:
    """Forgets actors that died or whose worker exited; returns the others."""
    with self._lock:
      actors = list(self._actors)
    if not actors:
      return []
    polls = [actor.info.remote() for actor, _ in actors]
    ready, _ = ray.wait(polls, num_returns=len(polls), timeout=_POLL_TIMEOUT_S)
    ready = set(ready)
    gone = []
    for (actor, first), poll in zip(actors, polls):
      if poll not in ready:
        continue  # still being placed or starting: counts as a worker
      try:
        running = ray.get(poll)["running"]
      except ray.exceptions.RayError as e:
        _LOG.warning("Ray worker actor lost: %s", e)
        running = False
      if not running:
        gone.append((actor, first))
    for actor, _ in gone:
      ray.kill(actor)
    with self._lock:
      self._actors = [a for a in self._actors if a not in gone]
      return list(self._actors)

  @property
  def num_workers(self) -> int:
    return len(self._prune())

  def workers(self, timeout_s: float = 120.0) -> list[dict[str, Any]]:
    """The address, pid and Ray node id of each worker that started and
    still runs (waiting up to timeout_s for those still starting)."""
    polls = [actor.info.remote() for actor, _ in self._prune()]
    ready, _ = ray.wait(polls, num_returns=len(polls), timeout=timeout_s)
    found = []
    for poll in ready:
      try:
        info = ray.get(poll)
      except ray.exceptions.RayError:
        continue  # lost meanwhile
      if info["running"]:
        found.append(info)
    return found

  def start_worker(self) -> None:
    actor = self._actor_class.remote(self._args, self._secrets)
    with self._lock:
      self._actors.append((actor, actor.info.remote()))
    _LOG.info("Started a Ray worker actor.")

  def stop_worker(self) -> bool:
    """Stops the newest worker; False if this backend runs none."""
    with self._lock:
      if not self._actors:
        return False
      actor, first = self._actors.pop()
    _stop_actors([(actor, first)])
    _LOG.info("Stopped a Ray worker actor.")
    return True

  def close(self) -> None:
    with self._lock:
      if self._closed:
        return
      self._closed = True
      actors, self._actors = self._actors, []
    _stop_actors(actors)
    if self._owns_connection:
      ray.shutdown()


def _stop_actors(actors: list[tuple[Any, Any]]) -> None:
  """Drains the workers of started actors, then kills every actor."""
  started, _ = ray.wait([first for _, first in actors], num_returns=len(actors), timeout=0)
  started = set(started)
  stops = [actor.stop.remote() for actor, first in actors if first in started]
  if stops:
    ray.wait(stops, num_returns=len(stops), timeout=_STOP_TIMEOUT_S + 5)
  for actor, _ in actors:
    ray.kill(actor)  # an actor still being placed or starting is just dropped
