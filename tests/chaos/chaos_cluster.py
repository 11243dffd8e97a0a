"""A dispatcher and workers as processes, with handles to break them from outside.

The dispatcher listens on a fixed port with a work_dir, so it can be killed
and restarted in place; workers and clients reach it through a `TcpProxy`.
Workers listen on fixed ports, so they too restart in place. With
`proxied_workers`, each worker advertises its own loopback address
127.0.0.<2+slot> on which a proxy forwards to the worker's real port on
127.0.0.1 (clients then read over gRPC: the worker's raw data port changes
at every start, so it is not served); otherwise clients read the raw data
socket straight from the worker, and connections are cut with `ss -K`.
"""

from __future__ import annotations

import os
import pathlib
import random
import subprocess
import time

import grpc
from grpc_health.v1 import health_pb2
from grpc_health.v1 import health_pb2_grpc

import work_dir_damage
from service_cluster import ServiceProcess, free_port, release_port
from small_disk import SmallDisk
from tcp_proxy import TcpProxy

HEARTBEAT_INTERVAL_S = 0.2
# Stalls and stops in the schedules stay well below this: a worker silent
# this long is dead to the dispatcher.
HEARTBEAT_TIMEOUT_S = 5.0
# Torn journal tail: the start of a record, cut mid-write.
TORN_RECORD = b'{"kind":"splits_acked","job_id":'
# The dispatcher compacts its journal this often, so that its snapshots
# meet the faults too.
SNAPSHOT_EVERY_RECORDS = 100
SERVING_AGAIN_S = 15.0  # after a full disk is freed


def cut_tcp(port: int) -> None:
  """Resets every established TCP connection to or from `port` (`ss -K`)."""
  subprocess.run(
    ["ss", "-K", "-n", "state", "established", f"( dport = :{port} or sport = :{port} )"],
    stdout=subprocess.DEVNULL,
    stderr=subprocess.DEVNULL,
    check=False,
    timeout=30,
  )


class ChaosWorker:
  """One worker slot: a process restarted in place, and its proxy if any."""

  def __init__(
    self,
    slot: int,
    dispatcher_address: str,
    proxied: bool,
    flags: tuple[str, ...],
    log_path: pathlib.Path,
    env: dict[str, str] | None = None,
  ):
    self.slot = slot
    self.port = free_port()
    self.proxied = proxied
    self._dispatcher_address = dispatcher_address
    self._flags = flags
    self._log_path = log_path
    self._env = env
    self.host = f"127.0.0.{2 + slot}" if proxied else "127.0.0.1"
    self.proxy = TcpProxy(f"127.0.0.1:{self.port}", self.host, self.port) if proxied else None
    self.process: ServiceProcess | None = None
    self.incarnations = 0
    self.paused = False

  @property
  def address(self) -> str:
    return f"{self.host}:{self.port}"

  @property
  def alive(self) -> bool:
    return self.process is not None and self.process.proc.poll() is None

  def start(self, wait_ready: bool = True) -> None:
    flags = [
      f"--dispatcher_address={self._dispatcher_address}",
      f"--port={self.port}",
      f"--heartbeat_interval_s={HEARTBEAT_INTERVAL_S}",
      *self._flags,
    ]
    if self.proxied:
      flags += [f"--advertise_host={self.host}", "--data_socket=false"]
    self.process = ServiceProcess(
      "worker", *flags, wait_ready=wait_ready, log_path=self._log_path, env=self._env
    )
    self.incarnations += 1

  def kill(self) -> None:
    if self.process is not None:
      self.process.kill()
    self.paused = False

  def pause(self) -> None:
    self.process.pause()
    self.paused = True

  def resume(self) -> None:
    self.process.resume()
    self.paused = False

  def cut(self) -> None:
    """Breaks every connection of this worker (clients' and its dispatcher's)."""
    if self.proxy is not None:
      self.proxy.cut()
      return
    cut_tcp(self.port)
    data = self.process.data_address if self.process is not None else ""
    if data:
      cut_tcp(int(data.rsplit(":", 1)[1]))

  def close(self) -> None:
    if self.process is not None:
      self.process.kill()
    if self.proxy is not None:
      self.proxy.close()
    release_port(self.port)


class ChaosCluster:
  """A dispatcher with a work_dir plus worker slots; `close()` ends all of it."""

  def __init__(
    self,
    work_dir: str | os.PathLike,
    num_workers: int,
    *,
    proxied_workers: bool = False,
    split_size: int = 16,
    worker_buffer_size: int = 8,
    start: bool = True,
    worker_env: dict[str, str] | None = None,
    small_disk: bool = False,
  ):
    """`worker_env`: variables added to the workers' environment;
    `small_disk`: the dispatcher's work_dir is a small tmpfs that `fill_disk`
    fills (when the machine cannot mount one, `disk` is None)."""
    self.work_dir = pathlib.Path(work_dir)
    self.work_dir.mkdir(parents=True, exist_ok=True)
    self.disk = None
    if small_disk:
      try:
        self.disk = SmallDisk(self.work_dir / "disk")
      except OSError:
        pass
    # The dispatcher's files (its log stays out of a small disk).
    self.state_dir = self.work_dir / "disk" if self.disk is not None else self.work_dir
    self.journal_path = self.state_dir / "journal.jsonl"
    self.log_path = self.work_dir / "dispatcher.log"
    self.dispatcher_port = free_port()
    self._dispatcher_flags = (
      f"--port={self.dispatcher_port}",
      f"--work_dir={self.state_dir}",
      f"--heartbeat_timeout_s={HEARTBEAT_TIMEOUT_S}",
      f"--split_size={split_size}",
      f"--snapshot_every_records={SNAPSHOT_EVERY_RECORDS}",
    )
    self.dispatcher_proxy = TcpProxy(f"127.0.0.1:{self.dispatcher_port}")
    self.dispatcher: ServiceProcess | None = None
    self.dispatcher_starts = 0
    self.proxied_workers = proxied_workers
    self._worker_flags = (f"--buffer_size={worker_buffer_size}",)
    self._worker_env = worker_env
    self.workers = [
      ChaosWorker(
        slot, self.address, proxied_workers, self._worker_flags, self._worker_log(slot), worker_env
      )
      for slot in range(num_workers)
    ]
    if start:
      try:
        self.start_dispatcher()
        for worker in self.workers:
          worker.start()
      except BaseException:
        self.close()
        raise

  @property
  def address(self) -> str:
    """What clients and workers dial: the dispatcher's proxy."""
    return self.dispatcher_proxy.address

  def start_dispatcher(self) -> None:
    self.dispatcher = ServiceProcess("dispatcher", *self._dispatcher_flags, log_path=self.log_path)
    self.dispatcher_starts += 1

  def kill_dispatcher(self) -> None:
    if self.dispatcher is not None:
      self.dispatcher.kill()

  def tear_journal(self) -> None:
    """Appends the start of a record without its end, as a crash mid-write leaves."""
    with open(self.journal_path, "ab") as f:
      f.write(TORN_RECORD)

  def wipe_state(self) -> None:
    """Deletes what the dispatcher keeps in its work_dir (not the logs): the
    next one starts as a new dispatcher, as one without a work_dir does."""
    for path in self.state_dir.iterdir():
      if path.is_file() and path.suffix != ".log":
        path.unlink()

  def restart_dispatcher(self, torn_journal: bool = False) -> None:
    """SIGKILL, optionally a torn journal tail, then a new process on the same
    port and work_dir."""
    self.kill_dispatcher()
    if torn_journal:
      self.tear_journal()
    self.start_dispatcher()

  def flip_bit_and_restart(self, rng: random.Random) -> str:
    """SIGKILL, one bit flipped in a journal or snapshot file, a new process.

    Returns "served" if it started on the damaged files; "refused" if it
    refused to start, naming the file and the offset of the damaged line:
    then the bit is flipped back (an operator restoring a backup) and a
    process started again. Raises AssertionError if it refused otherwise.
    """
    self.kill_dispatcher()
    lines = work_dir_damage.record_lines(self.state_dir)
    name, start, end, kinds = rng.choice(lines)
    flip = work_dir_damage.Flip(name, rng.randrange(start, end), rng.randrange(8), start, kinds)
    flip.apply(self.state_dir)
    try:
      self.start_dispatcher()
      return "served"
    except RuntimeError:  # exited before serving
      said = self.log_path.read_text(errors="replace").strip().splitlines()[-1:]
      assert said and str(self.state_dir / name) in said[0] and f"byte {start} " in said[0], (
        f"{flip}: the dispatcher refused to start without naming the file and the "
        f"offset of the damaged line: {said}"
      )
    flip.apply(self.state_dir)  # restored
    self.start_dispatcher()
    return "refused"

  def fill_disk(self, duration_s: float) -> None:
    """Fills the dispatcher's disk for `duration_s`, then frees it.

    Raises AssertionError if the dispatcher does not say SERVING again within
    SERVING_AGAIN_S after, or exited meanwhile.
    """
    self.disk.fill()
    time.sleep(duration_s)
    self.disk.free()
    deadline = time.monotonic() + SERVING_AGAIN_S
    while True:
      assert self.dispatcher.proc.poll() is None, (
        f"the dispatcher exited (status {self.dispatcher.proc.poll()}) on a full disk"
      )
      try:
        if self.health() == health_pb2.HealthCheckResponse.SERVING:
          return
      except grpc.RpcError:
        pass
      assert time.monotonic() < deadline, (
        f"the dispatcher did not serve again within {SERVING_AGAIN_S} s of a full disk being freed"
      )
      time.sleep(0.1)

  def health(self) -> int:
    """The dispatcher's overall status (grpc.health.v1), straight, not proxied."""
    with grpc.insecure_channel(f"127.0.0.1:{self.dispatcher_port}") as channel:
      return (
        health_pb2_grpc.HealthStub(channel)
        .Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
        .status
      )

  def cut_dispatcher(self, with_ss: bool = False) -> None:
    """Breaks every connection to the dispatcher."""
    if with_ss:
      cut_tcp(self.dispatcher_port)
    else:
      self.dispatcher_proxy.cut()

  def add_worker(self) -> ChaosWorker:
    slot = len(self.workers)
    worker = ChaosWorker(
      slot,
      self.address,
      self.proxied_workers,
      self._worker_flags,
      self._worker_log(slot),
      self._worker_env,
    )
    self.workers.append(worker)
    worker.start()
    return worker

  def _worker_log(self, slot: int) -> pathlib.Path:
    return self.work_dir / f"worker{slot}.log"

  def log_tail(self, lines: int = 12) -> str:
    """Each server's last log lines, for a failure message."""
    parts = []
    for path in [self.log_path] + [self._worker_log(w.slot) for w in self.workers]:
      if path.exists():
        tail = path.read_text(errors="replace").splitlines()[-lines:]
        parts.append(f"-- {path.name}:\n" + "\n".join(tail))
    return "\n".join(parts)

  def close(self) -> None:
    for worker in self.workers:
      worker.close()
    if self.dispatcher is not None:
      self.dispatcher.kill()
    self.dispatcher_proxy.close()
    release_port(self.dispatcher_port)
    if self.disk is not None:
      self.disk.close()

  def __enter__(self) -> "ChaosCluster":
    return self

  def __exit__(self, *exc) -> None:
    self.close()
