"""The dispatcher: datasets, jobs, workers, clients and splits. No data.

`DispatchServer` serves `DispatcherState` (jaxfeed.service.dispatcher.state)
over gRPC; its options are `DispatcherConfig`.

Run it from the command line:

  python -m jaxfeed.service.dispatcher --port=5050 --work_dir=/tmp/jf

It prints `jaxfeed dispatcher listening on HOST:PORT` once it serves (with
`--port=0` the OS picks the port).
"""

from __future__ import annotations

import gc
import logging
import sys
import threading
import time
import weakref
from typing import Any

import grpc

from jaxfeed import _lifetime
from jaxfeed.service import metrics as metrics_lib
from jaxfeed.service.dispatcher import autoscale as autoscale_lib
from jaxfeed.service.dispatcher import job_autoscaler
from jaxfeed.service.dispatcher import health as health_lib
from jaxfeed.service.dispatcher import heartbeat_pacing
from jaxfeed.service.dispatcher import saves as saves_lib
from jaxfeed.service.dispatcher.config import DispatcherConfig
from jaxfeed.service.dispatcher.state import DispatcherState
from jaxfeed.service.protocol import element_chunks
from jaxfeed.service.protocol import import_paths
from jaxfeed.service.protocol import rpc
from jaxfeed.service.protocol import rpc_server
from jaxfeed.service.protocol import split_failures
from jaxfeed.service.protocol.protos import service_pb2 as pb
from jaxfeed.service.storage import journal as journal_lib
from jaxfeed.service.storage import journal_replay

SERVICE_NAME = "jaxfeed.service.Dispatcher"


class _DispatcherServicer:
  """Maps RPCs onto DispatcherState."""

  def __init__(self, state: DispatcherState, saves: saves_lib.SaveRegistry):
    self.state = state
    self.saves = saves

  def RegisterDataset(self, request, context):
    del context
    return pb.RegisterDatasetResponse(
      dataset_id=self.state.register_dataset(
        request.dataset, request.dataset_id, request.compression
      )
    )

  def GetDatasetDef(self, request, context):
    del context
    return pb.GetDatasetDefResponse(dataset=self.state.dataset_def(request.dataset_id))

  def GetOrCreateJob(self, request, context):
    job_id, client_id = self.state.get_or_create_job(request, _peer_host(context.peer()))
    joined = pb.GetOrCreateJobResponse(job_id=job_id, client_id=client_id).SerializeToString()
    if not request.first_heartbeat:
      return joined
    # The client's first heartbeat, answered with the join: a pod's hosts
    # join at once, and each would heartbeat right after. Serialized messages
    # concatenate into their merge: the task list, serialized once per change,
    # goes in as it is.
    heartbeat = self.state.client_heartbeat_wire(job_id, client_id)
    return joined + _HEARTBEAT_TAG + element_chunks.varint(len(heartbeat)) + heartbeat

  def ClientHeartbeat(self, request, context):
    del context
    return self.state.client_heartbeat_wire(
      request.job_id, request.client_id, request.acked_splits, request
    )

  def ReleaseJobClient(self, request, context):
    del context
    self.state.release_client(request.job_id, request.client_id, request)
    return pb.ReleaseJobClientResponse()

  def WorkerHeartbeat(self, request, context):
    del context
    response = self.state.worker_heartbeat(request)
    if not request.leaving:
      response.active_saves.extend(self.saves.active_paths())
    return response

  def GetSplits(self, request, context):
    del context
    return self.state.get_splits(request)

  def StartSave(self, request, context):
    del context
    return self.saves.start(request)

  def SaveChunks(self, request, context):
    del context
    with self.state.lock:
      self.state.lock.answer_without_fsync()  # reads the workers, writes nothing
      live = {a: w.incarnation for a, w in self.state.workers.items()}
    return self.saves.chunks(request, live)

  def handler(self, config: DispatcherConfig) -> grpc.GenericRpcHandler:
    client, worker = (rpc.CLIENT,), (rpc.WORKER,)
    methods = {
      "RegisterDataset": (pb.RegisterDatasetRequest, client),
      "GetDatasetDef": (pb.GetDatasetDefRequest, worker),
      "GetOrCreateJob": (pb.GetOrCreateJobRequest, client),
      "ClientHeartbeat": (pb.ClientHeartbeatRequest, client),
      "ReleaseJobClient": (pb.ReleaseJobClientRequest, client),
      "WorkerHeartbeat": (pb.WorkerHeartbeatRequest, worker),
      "GetSplits": (pb.GetSplitsRequest, worker),
      "StartSave": (pb.StartSaveRequest, client),
      "SaveChunks": (pb.SaveChunksRequest, worker),
    }
    return rpc_server.method_handlers(
      SERVICE_NAME,
      {rpc.CLIENT: config.auth_token, rpc.WORKER: config.worker_token},
      {name: (getattr(self, name), cls, False, roles) for name, (cls, roles) in methods.items()},
    )


# GetOrCreateJobResponse.heartbeat: field 3, length-delimited.
_HEARTBEAT_TAG = bytes([3 << 3 | 2])


def _peer_host(peer: str) -> str:
  """The host of a gRPC peer ("ipv4:1.2.3.4:5678", "ipv6:[::1]:5678")."""
  kind, _, rest = peer.partition(":")
  if kind in ("ipv4", "ipv6"):
    return rest.rsplit(":", 1)[0].strip("[]")
  return peer


def _liveness_loop(
  state_ref: weakref.ref, stop: threading.Event, period: float, excused_from_s: float
) -> None:
  woke = time.monotonic()
  while not stop.wait(period):
    # Woken this much later than asked: the process was stopped (SIGSTOP, a
    # paused container) or starved, and heartbeats could not reach it. Short
    # delays are left to the heartbeat timeout's margin: a busy machine wakes
    # this thread late now and then, and a dead worker would be found later.
    now = time.monotonic()
    late, woke = now - woke - period, now
    state = state_ref()
    if state is None:
      return
    try:
      state.check_liveness(away_s=late if late > excused_from_s else 0.0)
    except Exception:  # pylint: disable=broad-except
      logging.exception("Dispatcher liveness check failed")
    del state


class DispatchServer:
  """A dispatcher gRPC server; `start()` (or `with`) serves, `stop()` ends it."""

  def __init__(self, config: DispatcherConfig | None = None, start: bool = True):
    self.config = config or DispatcherConfig()
    self.state = DispatcherState(self.config)
    self.saves = saves_lib.SaveRegistry(self.config)
    servicer = _DispatcherServicer(self.state, self.saves)
    self._server, self.port = rpc_server.make_server(
      f"{self.config.host}:{self.config.port}",
      servicer.handler(self.config),
      self.config.max_message_bytes,
      self.config.tls,
    )
    self.health = health_lib.DispatcherHealth(self._server.server, SERVICE_NAME, self.state.journal)
    self._stop = threading.Event()
    self._liveness = threading.Thread(
      target=_liveness_loop,
      name="jaxfeed-dispatcher-liveness",
      daemon=True,
      args=(
        weakref.ref(self.state),
        self._stop,
        min(0.5, self.config.heartbeat_timeout_s / 4),
        self.config.heartbeat_timeout_s / 4,
      ),
    )
    self._started = False
    self._stopped = False
    self.autoscaler: autoscale_lib.Autoscaler | None = None
    if self.config.autoscale is not None:
      secrets = {}
      if self.config.worker_token:
        secrets["worker_token"] = self.config.worker_token
      if self.config.pickled_udf_secret:
        secrets["pickled_udf_secret"] = self.config.pickled_udf_secret.decode()
      host = self.config.host
      local = "127.0.0.1" if rpc.is_wildcard_host(host) else host
      flags = list(self.config.autoscale.worker_flags)
      if self.config.udf_modules:
        flags.append(f"--udf_modules={','.join(self.config.udf_modules)}")
      backend = autoscale_lib.make_backend(
        self.config.autoscale, f"{local}:{self.port}", flags, secrets
      )
      if self.config.autoscale.policy == autoscale_lib.PER_JOB:
        self.autoscaler = job_autoscaler.JobAutoscaler(self.config.autoscale, backend, self.state)
      else:
        self.autoscaler = autoscale_lib.Autoscaler(
          self.config.autoscale, backend, self.state.sample_clients, self.state.num_workers
        )
      # How its workers ended, for the splits they die on (local processes only).
      self.state.worker_exit_status = getattr(backend, "exit_status", None)
    self._finalizer = weakref.finalize(
      self, _shutdown, self._server, self._stop, self.state, self.autoscaler, self.health
    )
    if start:
      self.start()

  @property
  def target(self) -> str:
    """The address clients and workers connect to."""
    return f"{self.config.host}:{self.port}"

  def start(self) -> "DispatchServer":
    if not self._started:
      self._started = True
      self._server.start()
      self._liveness.start()
      if self.autoscaler is not None:
        self.autoscaler.start()
    return self

  def join(self, timeout: float | None = None) -> None:
    """Blocks until the server stops."""
    self._server.wait_for_termination(timeout)

  def stop(self) -> None:
    """Stops serving and releases the port. Idempotent."""
    if self._stopped:
      return
    self._stopped = True
    self._finalizer()
    if self._liveness.is_alive():
      self._liveness.join(timeout=5)

  close = stop

  def __enter__(self) -> "DispatchServer":
    return self.start()

  def __exit__(self, *exc) -> None:
    self.stop()


def _shutdown(
  server: rpc_server.ServerHandle,
  stop: threading.Event,
  state: DispatcherState,
  autoscaler: autoscale_lib.Autoscaler | None = None,
  health: health_lib.DispatcherHealth | None = None,
) -> None:
  if health is not None:
    health.stopping()
  if autoscaler is not None:  # its workers go first, while they can still say goodbye
    autoscaler.close()
  stop.set()
  server.stop()
  state.close()


def _no_autoscaling(policy: str) -> autoscale_lib.AutoscaleConfig | None:
  """None (--autoscale_max_workers=0: workers are started by hand), or the
  error of a policy set for no pool."""
  if policy != autoscale_lib.POOL:
    raise ValueError(
      f"--autoscale_policy={policy} needs an elastic pool: set "
      "--autoscale_max_workers to the most workers it may run (> 0)."
    )
  return None


def main(argv: Any) -> None:
  """Runs a dispatcher from flags; a bad flag value ends it with the reason."""
  del argv
  from absl import flags  # pylint: disable=g-import-not-at-top

  f = flags.FLAGS
  # Started with jaxfeed._lifetime.popen: it ends with its parent.
  _lifetime.die_with_parent_from_env()
  try:
    udf_secret = rpc.read_secret(
      f.pickled_udf_secret, f.pickled_udf_secret_file, "pickled_udf_secret"
    )
    config = DispatcherConfig(
      port=f.port,
      host=f.host,
      work_dir=f.work_dir or None,
      heartbeat_timeout_s=f.heartbeat_timeout_s,
      client_timeout_s=f.client_timeout_s,
      auth_token=rpc.read_secret(f.auth_token, f.auth_token_file, "auth_token"),
      worker_token=rpc.read_secret(f.worker_token, f.worker_token_file, "worker_token"),
      split_size=f.split_size,
      num_workers=f.num_workers or None,
      worker_addresses=tuple(f.worker_addresses or ()),
      pickled_udf_secret=udf_secret.encode() if udf_secret else None,
      udf_modules=import_paths.parse_udf_modules(f.udf_modules),
      insecure=f.insecure,
      max_jobs_per_host=f.max_jobs_per_host,
      tls=rpc.TLSConfig.from_files(f.tls_key, f.tls_cert, client_ca=f.tls_client_ca),
      journal_fsync=f.journal_fsync,
      journal_damage=f.journal_damage,
      snapshot_every_records=f.snapshot_every_records,
      snapshot_every_bytes=f.snapshot_every_bytes,
      job_gc_timeout_s=f.job_gc_timeout_s,
      dataset_gc_timeout_s=f.dataset_gc_timeout_s,
      autoscale=autoscale_lib.AutoscaleConfig(
        min_workers=f.autoscale_min_workers,
        max_workers=f.autoscale_max_workers,
        interval_s=f.autoscale_interval_s,
        worker_flags=tuple(f.worker_flag or ()),
        backend=f.worker_backend,
        ray_address=f.ray_address or None,
        kubernetes_deployment=f.kubernetes_deployment or None,
        policy=f.autoscale_policy,
        min_gain=f.autoscale_min_gain,
        scale_up_wait_fraction=f.autoscale_wait_fraction,
        queue_growth=f.autoscale_queue_growth,
        scale_down_intervals=f.autoscale_scale_down_intervals,
        scale_down_fill=f.autoscale_scale_down_fill,
      )
      if f.autoscale_max_workers
      else _no_autoscaling(f.autoscale_policy),
      heartbeat_pacing=heartbeat_pacing.HeartbeatPacing(
        goodbye_via_worker_clients=f.goodbye_via_worker_clients
      ),
      max_split_attempts=f.max_split_attempts,
    )
  except ValueError as e:  # a flag's value: say which, without a traceback
    rpc.exit_for_bad_flags("jaxfeed dispatcher", e)
  # SIGTERM stops the dispatcher cleanly from here on: the pool it starts
  # while it is being built goes with it, even when the signal comes first.
  rpc.stop_on_sigterm()
  try:
    server = DispatchServer(config)
  except journal_lib.JournalDamageError as e:  # the file and offset, without a traceback
    raise SystemExit(f"jaxfeed dispatcher: {e}") from e
  except OSError as e:  # its port or work_dir: say which, without a traceback
    rpc.exit_for_bad_flags("jaxfeed dispatcher", f"cannot start: {e}")
  metrics = None
  try:
    # The modules and the replayed state live as long as the process: out of
    # the collector's full passes, which otherwise stalled every call for
    # 35-210 ms (benchmarks/dispatcher_scale.py, 256-1,024 workers). Only here:
    # a DispatchServer in a user's process leaves its collector alone.
    gc.freeze()
    print(f"jaxfeed dispatcher listening on {server.target}", flush=True)
    metrics = metrics_lib.serve_dispatcher(server, f.host, f.metrics_port)
    if metrics is not None:
      print(f"jaxfeed dispatcher metrics on {metrics.url}", flush=True)
    if f.port_file:
      _write_port_file(f.port_file, server.port)
    server.health.failed.wait()  # until SIGTERM (SystemExit) or its journal fails
    print(
      f"jaxfeed dispatcher: its journal in {config.work_dir} failed (see the log); "
      f"exiting with status {journal_lib.FATAL_EXIT_STATUS} to be restarted: a "
      "restart replays every acknowledged change.",
      file=sys.stderr,
      flush=True,
    )
    raise SystemExit(journal_lib.FATAL_EXIT_STATUS)
  finally:
    server.stop()
    if metrics is not None:
      metrics.close()


def _write_port_file(path: str, port: int) -> None:
  import os  # pylint: disable=g-import-not-at-top

  tmp = f"{path}.tmp"
  with open(tmp, "w") as f:
    f.write(str(port))
  os.replace(tmp, path)


def define_flags() -> None:
  from absl import flags  # pylint: disable=g-import-not-at-top

  flags.DEFINE_integer("port", 0, "Port to serve on; 0 picks a free one.")
  flags.DEFINE_string(
    "host",
    "127.0.0.1",
    "Interface to bind; 0.0.0.0 for all (workers and clients on other machines).",
  )
  flags.DEFINE_string("work_dir", "", "Folder of the write-ahead journal.")
  flags.DEFINE_bool(
    "journal_fsync",
    True,
    "fsync the journal before answering a change "
    "that must be durable (a heartbeat's are fsynced within ~20 ms, and "
    "acknowledged splits are sent again until they are); "
    "--nojournal_fsync: changes survive a process crash, not a power loss.",
  )
  flags.DEFINE_enum(
    "journal_damage",
    journal_replay.REFUSE,
    list(journal_replay.DAMAGE_POLICIES),
    "What a restart does with a damaged journal (a checksum that does "
    "not match, before valid records): refuse to start, naming the file "
    "and offset; or truncate: cut the journal there, losing every change "
    "after it (logged). A torn last line is always cut; a damaged "
    "snapshot always refuses.",
  )
  flags.DEFINE_integer(
    "snapshot_every_records",
    50_000,
    "Compact the journal into a snapshot after this many records (0: never by count).",
  )
  flags.DEFINE_integer(
    "snapshot_every_bytes",
    32 << 20,
    "Compact the journal into a snapshot after this many bytes (0: never by size).",
  )
  flags.DEFINE_float(
    "job_gc_timeout_s", 300.0, "A named job without clients is deleted after this long."
  )
  flags.DEFINE_float(
    "dataset_gc_timeout_s", 24 * 3600.0, "A dataset no job reads is deleted after this long."
  )
  flags.DEFINE_float("heartbeat_timeout_s", 10.0, "Worker heartbeat timeout.")
  flags.DEFINE_float(
    "client_timeout_s",
    60.0,
    "A client silent this long is released "
    "from its job (exactly-once: its unacknowledged splits are "
    "issued again).",
  )
  rpc.define_auth_flags(flags)
  flags.DEFINE_string(
    "auth_token",
    "",
    "Token of the clients (tests; prefer --auth_token_file: command lines are visible in ps).",
  )
  flags.DEFINE_string("auth_token_file", "", "File holding the clients' token.")
  flags.DEFINE_integer("max_jobs_per_host", 256, "Most jobs one client host may read at once.")
  flags.DEFINE_integer(
    "split_size", 256, "Positions per DYNAMIC split (one file where the positions are files)."
  )
  flags.DEFINE_integer(
    "max_split_attempts",
    split_failures.DEFAULT_MAX_SPLIT_ATTEMPTS,
    "Exactly-once reads: a split whose worker was lost while it "
    "made the split this many times is handed out no more and the "
    "read fails, naming the split's positions and how the workers "
    "ended (a record that kills the worker reading it).",
  )
  flags.DEFINE_integer(
    "goodbye_via_worker_clients",
    heartbeat_pacing.HeartbeatPacing.goodbye_via_worker_clients,
    "From this many live clients on, clients say goodbye through a "
    "worker, which forwards it in its heartbeat, instead of a "
    "ReleaseJobClient call each (0: never).",
  )
  flags.DEFINE_integer("num_workers", 0, "Workers static sharding waits for.")
  flags.DEFINE_list(
    "worker_addresses",
    [],
    "Static sharding (FILE, DATA, FILE_OR_DATA, HINT) with fixed worker "
    "indices: comma-separated addresses (host:port, host, or "
    "host:%port%) of the workers, the one at entry i reading shard i.",
  )
  flags.DEFINE_string("port_file", "", "Write the bound port to this file.")
  flags.DEFINE_string("tls_key", "", "PEM private key file: serve TLS (with --tls_cert).")
  flags.DEFINE_string("tls_cert", "", "PEM certificate chain file of --tls_key.")
  flags.DEFINE_integer(
    "autoscale_max_workers",
    0,
    "Run an elastic pool of up to this many workers (0: workers are started by hand).",
  )
  flags.DEFINE_integer("autoscale_min_workers", 1, "Workers the elastic pool keeps.")
  flags.DEFINE_float("autoscale_interval_s", 5.0, "Seconds between pool resizes.")
  flags.DEFINE_string(
    "autoscale_policy",
    autoscale_lib.POOL,
    "How the elastic pool is sized: 'pool' (one pool for every job) or "
    "'per_job' (each job its own workers, sized on its batch time; a "
    "worker serves one job at a time).",
  )
  flags.DEFINE_float(
    "autoscale_min_gain",
    None,
    "A worker added must cut the batch time "
    "(per_job; pool: raise the throughput) by more than this fraction, or "
    "the job (pool) stops growing (default: 0.03 per_job, 0.1 pool).",
  )
  flags.DEFINE_float(
    "autoscale_wait_fraction",
    0.05,
    "Consumers waiting more than this "
    "share of the time are input-bound: their job (pool) may grow.",
  )
  flags.DEFINE_float(
    "autoscale_queue_growth",
    0.4,
    "per_job: a job whose consumers stopped "
    "waiting gives a worker back once its clients' buffers stay this "
    "much (relative) fuller than when it converged.",
  )
  flags.DEFINE_float(
    "autoscale_scale_down_fill",
    0.9,
    "pool: buffers at least this full (and consumers hardly waiting) count as well fed.",
  )
  flags.DEFINE_integer(
    "autoscale_scale_down_intervals",
    3,
    "Intervals in a row a job (pool) must look over-provisioned before a worker goes.",
  )
  flags.DEFINE_multi_string(
    "worker_flag",
    None,
    "A flag of the pool's workers, e.g. --worker_flag=--buffer_size=16 (repeat for more).",
  )
  flags.DEFINE_integer(
    "metrics_port",
    metrics_lib.OFF,
    "Serve Prometheus metrics on this port (0: a free one, printed; -1: off).",
  )
  flags.DEFINE_enum(
    "worker_backend",
    "local",
    list(autoscale_lib.BACKENDS),
    "Where the elastic pool's workers run: local processes, actors "
    "on a Ray cluster (--ray_address) or the pods of a Kubernetes "
    "Deployment (--kubernetes_deployment).",
  )
  flags.DEFINE_string(
    "ray_address",
    "",
    "host:port of the Ray cluster's head (--worker_backend=ray; default: Ray's auto-detection).",
  )
  flags.DEFINE_string(
    "kubernetes_deployment",
    "",
    "NAMESPACE/NAME of the worker Deployment the pool scales (--worker_backend=kubernetes).",
  )
