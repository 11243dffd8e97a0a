"""The worker: registers with the dispatcher, runs tasks, serves their batches.

Run it from the command line:

  python -m jaxfeed.service.worker --dispatcher_address=HOST:PORT

It prints `jaxfeed worker listening on HOST:PORT data HOST:PORT` once it serves.
Workers keep no durable state: a restarted worker registers like a new one.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import weakref
from typing import Any

import grpc

from jaxfeed import _lifetime
from jaxfeed.ops.autocache_folder import FolderLimits
from jaxfeed.service import metrics as metrics_lib
from jaxfeed.service.protocol import import_paths
from jaxfeed.service.protocol import rpc
from jaxfeed.service.protocol import rpc_server
from jaxfeed.service.protocol.protos import service_pb2 as pb
from jaxfeed.service.worker import autocache_keeper
from jaxfeed.service.worker import config as worker_config
from jaxfeed.service.worker import data_server
from jaxfeed.service.worker import local_workers
from jaxfeed.service.worker import round_assembly
from jaxfeed.service.worker.client_calls import ClientCalls
from jaxfeed.service.worker.config import WorkerConfig
from jaxfeed.service.worker.state import WorkerState

SERVICE_NAME = "jaxfeed.service.Worker"
_MAX_REQUEST_BYTES = 64 << 10  # a worker's requests are all small


def _heartbeat_loop(
  worker_ref: weakref.ref, stop: threading.Event, interval: float, give_up_s: float | None
) -> None:
  failures = 0
  heard_at = time.monotonic()
  while not stop.is_set():
    worker = worker_ref()
    if worker is None:
      return
    try:
      worker.heartbeat()
      failures = 0
      heard_at = time.monotonic()
    except grpc.RpcError as e:
      if e.code() in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
        worker.rejected = (
          f"the dispatcher at {worker.config.dispatcher_address} refused worker "
          f"{worker.address}: {e.code().name}: {e.details()} (give the worker the "
          "dispatcher's --worker_token_file, or the certificates it trusts)"
        )
        logging.error("Worker stops: %s", worker.rejected)
        stop.set()
        return
      failures += 1
      silent_s = time.monotonic() - heard_at
      if give_up_s is not None and silent_s > give_up_s:
        worker.gave_up = (
          f"the dispatcher at {worker.config.dispatcher_address} did not answer "
          f"worker {worker.address} for {silent_s:.0f} s (--dispatcher_timeout_s="
          f"{give_up_s:g}); last error: {e.code().name}"
        )
        logging.error("Worker stops: %s", worker.gave_up)
        stop.set()
        return
      if failures in (1, 20) or failures % 200 == 0:
        logging.warning(
          "Worker %s: heartbeat to dispatcher failed (%s); serving the tasks it has and retrying.",
          worker.address,
          e.code().name,
        )
    except Exception:  # pylint: disable=broad-except
      logging.exception("Worker heartbeat failed")
    paced_s = worker.paced_interval_s
    del worker
    stop.wait(max(interval, paced_s))


class WorkerServer:
  """A worker gRPC server plus its heartbeat thread (and raw data socket)."""

  def __init__(self, config: WorkerConfig, start: bool = True):
    self.config = config
    handler_holder: list = []
    self._server, self.port = rpc_server.make_server(
      f"{config.host}:{config.port}",
      _LazyHandler(handler_holder),
      config.max_message_bytes,
      config.tls,
      max_receive_bytes=_MAX_REQUEST_BYTES,
    )
    advertised = _advertised_host(config)
    self._worker = WorkerState(config, f"{advertised}:{self.port}")
    calls = ClientCalls(self._worker)
    # Clients are let in by read tickets, checked per task in GetElements.
    handler_holder.append(
      rpc_server.method_handlers(
        SERVICE_NAME,
        {},
        {
          "GetElements": (calls.GetElements, pb.GetElementsRequest, True, (rpc.CLIENT,)),
          "AckElements": (calls.AckElements, pb.AckElementsRequest, False, (rpc.CLIENT,)),
          "GetTaskStats": (calls.GetTaskStats, pb.GetTaskStatsRequest, False, (rpc.CLIENT,)),
        },
      )
    )
    self._data_server = None
    if config.data_socket:
      self._data_server = data_server.DataServer(
        config.host,
        calls.check_hello,
        calls.serve_socket,
        config.tls.server_ssl_context() if config.tls is not None else None,
        goodbye=calls.take_goodbye,
        port=(
          worker_config.data_transfer_port(config.data_transfer_address)
          if config.data_transfer_address
          else 0
        ),
      )
      self._worker.data_address = (
        config.data_transfer_address.replace("%port%", str(self._data_server.port))
        if config.data_transfer_address
        else f"{advertised}:{self._data_server.port}"
      )
    self._heartbeat = threading.Thread(
      target=_heartbeat_loop,
      name="jaxfeed-worker-heartbeat",
      daemon=True,
      args=(
        weakref.ref(self._worker),
        self._worker.stop,
        config.heartbeat_interval_s,
        config.dispatcher_timeout_s,
      ),
    )
    self._started = False
    # Its tasks find the folder's limits by its path (task_pipeline).
    keeper = (
      autocache_keeper.AutocacheKeeper(
        config.autocache_dir, FolderLimits(config.autocache_max_bytes, config.autocache_ttl_s)
      )
      if config.autocache_dir
      else None
    )
    self._finalizer = weakref.finalize(
      self, _shutdown, self._server, self._worker, self._data_server, keeper
    )
    if start:
      self.start()

  @property
  def target(self) -> str:
    return self._worker.address

  @property
  def data_address(self) -> str:
    return self._worker.data_address

  def drain(self, timeout_s: float = 30.0) -> bool:
    """Finishes the splits this worker holds and waits (up to timeout_s) for
    its consumers to take every batch; stops its other tasks. Call `stop()`
    after it. True if everything was taken in time."""
    return self._worker.drain(timeout_s)

  def start(self) -> "WorkerServer":
    if not self._started:
      self._started = True
      # Listed while it runs: clients of this process may read it through
      # memory (see jaxfeed.service.worker.local_workers).
      local_workers.add(self._worker.address, self._worker)
      self._server.start()
      self._heartbeat.start()
    return self

  def join(self, timeout: float | None = None) -> None:
    """Blocks until the server stops, the dispatcher refused this worker, or
    it did not answer for dispatcher_timeout_s."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while not self._worker.stop.is_set():
      wait = 0.2 if deadline is None else min(0.2, deadline - time.monotonic())
      if wait <= 0 or not self._server.wait_for_termination(wait):
        return

  @property
  def rejected(self) -> str | None:
    """Why the dispatcher refused this worker (it then stops serving), or None."""
    return self._worker.rejected

  @property
  def gave_up(self) -> str | None:
    """Why this worker stopped serving on its own (its dispatcher did not
    answer for `WorkerConfig.dispatcher_timeout_s`), or None."""
    return self._worker.gave_up

  def stop(self) -> None:
    """Stops serving, its tasks and its threads. Idempotent."""
    self._finalizer()
    if self._heartbeat.is_alive():
      self._heartbeat.join(timeout=10)

  close = stop

  def __enter__(self) -> "WorkerServer":
    return self.start()

  def __exit__(self, *exc) -> None:
    self.stop()


def _advertised_host(config: WorkerConfig) -> str:
  if config.advertise_host:
    return config.advertise_host
  if rpc.is_wildcard_host(config.host):
    return socket.gethostname()  # a wildcard cannot be connected to from elsewhere
  return config.host


class _LazyHandler(grpc.GenericRpcHandler):
  """Forwards to a handler made after the port (and so the address) is known."""

  def __init__(self, holder: list):
    self._holder = holder

  def service(self, handler_call_details):
    return self._holder[0].service(handler_call_details) if self._holder else None


def _shutdown(
  server: rpc_server.ServerHandle,
  worker: WorkerState,
  data_server: Any,
  keeper: autocache_keeper.AutocacheKeeper | None,
) -> None:
  worker.stop.set()
  local_workers.remove(worker.address, worker)
  worker.leave()
  if data_server is not None:
    data_server.close()
  server.stop()
  worker.shutdown()
  if keeper is not None:
    keeper.close()


def main(argv: Any) -> None:
  """Runs a worker from flags; a bad flag value ends it with the reason."""
  del argv
  from absl import flags  # pylint: disable=g-import-not-at-top

  f = flags.FLAGS
  # Started by a pool (or anything using jaxfeed._lifetime.popen): it ends
  # with its parent, however the parent ends.
  _lifetime.die_with_parent_from_env()
  try:
    udf_secret = rpc.read_secret(
      f.pickled_udf_secret, f.pickled_udf_secret_file, "pickled_udf_secret"
    )
    config = WorkerConfig(
      dispatcher_address=f.dispatcher_address,
      port=f.port,
      host=f.host,
      advertise_host=f.advertise_host or None,
      heartbeat_interval_s=f.heartbeat_interval_s,
      buffer_size=f.buffer_size,
      worker_token=rpc.read_secret(f.worker_token, f.worker_token_file, "worker_token"),
      udf_modules=import_paths.parse_udf_modules(f.udf_modules),
      insecure=f.insecure,
      data_socket=f.data_socket,
      max_window_batches=f.max_window_batches,
      sharing_window_bytes=f.sharing_window_bytes,
      autocache_dir=f.autocache_dir or None,
      autocache_max_bytes=f.autocache_max_bytes or None,
      autocache_ttl_s=f.autocache_ttl_s or None,
      autocache_policy=f.autocache_policy,
      worker_tags=tuple(t for t in f.worker_tags.split(",") if t),
      data_transfer_address=f.data_transfer_address or None,
      dispatcher_timeout_s=f.dispatcher_timeout_s or None,
      pickled_udf_secret=udf_secret.encode() if udf_secret else None,
      tls=rpc.TLSConfig.from_files(f.tls_key, f.tls_cert, f.tls_root_certs, f.tls_client_ca),
    )
  except ValueError as e:  # a flag's value: say which, without a traceback
    rpc.exit_for_bad_flags("jaxfeed worker", e)
  # SIGTERM stops the worker cleanly from here on, before it registers and
  # says it listens: a pool (or a test) may stop it as soon as it is up.
  rpc.stop_on_sigterm()
  try:
    server = WorkerServer(config)
  except OSError as e:  # its port: say which, without a traceback
    rpc.exit_for_bad_flags("jaxfeed worker", f"cannot start: {e}")
  metrics = None
  try:
    data = f" data {server.data_address}" if server.data_address else ""
    print(f"jaxfeed worker listening on {server.target}{data}", flush=True)
    metrics = metrics_lib.serve_worker(server, f.host, f.metrics_port)
    if metrics is not None:
      print(f"jaxfeed worker metrics on {metrics.url}", flush=True)
    if f.parent_pid:  # a pool's worker: goes when the process that started it does
      threading.Thread(
        target=_stop_with_parent,
        args=(f.parent_pid, server),
        name="jaxfeed-worker-parent-watch",
        daemon=True,
      ).start()
    server.join()
  except SystemExit:  # SIGTERM: hand over what it holds, then stop
    if f.drain_timeout_s > 0 and not server.drain(f.drain_timeout_s):
      logging.warning("Stopping with batches not taken after %.0fs.", f.drain_timeout_s)
    raise
  finally:
    server.stop()
    if metrics is not None:
      metrics.close()
  if server.rejected or server.gave_up:
    raise SystemExit(f"jaxfeed worker: {server.rejected or server.gave_up}")


def _stop_with_parent(parent_pid: int, server: WorkerServer) -> None:
  while os.getppid() == parent_pid:
    time.sleep(1.0)
  logging.warning("The process that started this worker (%d) is gone: stopping.", parent_pid)
  server.stop()


def define_flags() -> None:
  from absl import flags  # pylint: disable=g-import-not-at-top

  flags.DEFINE_string("dispatcher_address", None, "host:port of the dispatcher.")
  flags.DEFINE_integer("port", 0, "Port to serve on; 0 picks a free one.")
  flags.DEFINE_string("host", "127.0.0.1", "Interface to bind; 0.0.0.0 for all.")
  flags.DEFINE_string(
    "advertise_host",
    "",
    "Host name or IP clients reach this worker "
    "at (default: --host, or the host name when --host is 0.0.0.0).",
  )
  flags.DEFINE_float("heartbeat_interval_s", 0.5, "Seconds between heartbeats.")
  flags.DEFINE_float(
    "dispatcher_timeout_s",
    0.0,
    "Seconds the worker goes on serving "
    "the tasks it has while its dispatcher does not answer (it "
    "registers again when the dispatcher is back); past them it "
    "stops. 0: for as long as it takes.",
  )
  flags.DEFINE_integer("buffer_size", 8, "Ready batches buffered per task.")
  rpc.define_auth_flags(flags)
  flags.DEFINE_bool("data_socket", True, "Serve batches on a raw TCP port too.")
  flags.DEFINE_string(
    "data_transfer_address",
    "",
    "host:port clients fetch batches "
    "from (the data socket's address), when it differs from the "
    "gRPC address; '%port%' stands for the socket's own port.",
  )
  flags.DEFINE_string(
    "worker_tags",
    "",
    "Comma-separated tags for the dispatcher; "
    "COLOCATED: a worker on a trainer's host, which other trainers' "
    "target_workers='auto' reads skip.",
  )
  flags.DEFINE_float(
    "drain_timeout_s",
    30.0,
    "On SIGTERM, seconds to finish the splits "
    "held and let consumers take the batches before stopping.",
  )
  flags.DEFINE_integer(
    "parent_pid",
    0,
    "Stop when this parent process is gone (set by the dispatcher for the workers of its pool).",
  )
  flags.DEFINE_string(
    "autocache_dir",
    "",
    "Folder where autocache ops keep and reuse "
    "their input's output across jobs (may be shared by workers).",
  )
  flags.DEFINE_integer(
    "autocache_max_bytes",
    0,
    "Most bytes the --autocache_dir folder "
    "holds: least recently used entries go first, never one being read "
    "or written; a write that finds no room goes on without caching. "
    "0: no limit.",
  )
  flags.DEFINE_float(
    "autocache_ttl_s",
    0.0,
    "Remove --autocache_dir entries nobody read for this many seconds. 0: keep them.",
  )
  flags.DEFINE_string(
    "autocache_policy",
    "auto",
    "Whether each autocache point computes, writes or reads its cache: auto "
    "(from what each costs, measured per point), always (cache every point), "
    "never (compute every point).",
  )
  flags.DEFINE_integer(
    "sharing_window_bytes",
    256 << 20,
    "Ephemeral sharing: bytes a shared pipeline keeps for slower jobs.",
  )
  flags.DEFINE_integer(
    "max_window_batches",
    round_assembly.DEFAULT_MAX_WINDOW_BATCHES,
    "Round-robin jobs: batches held in partial bucket windows.",
  )
  flags.DEFINE_string(
    "tls_key", "", "PEM private key file: serve TLS on gRPC and the data socket (with --tls_cert)."
  )
  flags.DEFINE_string("tls_cert", "", "PEM certificate chain file of --tls_key.")
  flags.DEFINE_string("tls_root_certs", "", "PEM root certificates that verify a TLS dispatcher.")
  flags.DEFINE_integer(
    "metrics_port",
    metrics_lib.OFF,
    "Serve Prometheus metrics on this port (0: a free one, printed; -1: off).",
  )
  flags.mark_flag_as_required("dispatcher_address")
