"""The dispatcher: datasets, jobs, workers, clients and splits. No data.

Run it from the command line:

  python -m jaxfeed.service.dispatcher --port=5050 --work_dir=/tmp/jf

It prints `jaxfeed dispatcher listening on HOST:PORT` once it serves (with
`--port=0` the OS picks the port).
"""

from __future__ import annotations

import base64
import dataclasses
import itertools
import logging
import os
import threading
import time
import weakref
from typing import Any, Sequence

import grpc

from jaxfeed.service import autoscale as autoscale_lib
from jaxfeed.service import heartbeat_pacing
from jaxfeed.service import journal as journal_lib
from jaxfeed.service import metrics as metrics_lib
from jaxfeed.service import read_state
from jaxfeed.service import journal_records
from jaxfeed.service import round_assembly
from jaxfeed.service import rpc
from jaxfeed.service import spec as spec_lib
from jaxfeed.service import state_snapshot
from jaxfeed.service import task_lists
from jaxfeed.service.protos import service_pb2 as pb
from jaxfeed.service.sharding import ShardingPolicy, to_sharding_policy

SERVICE_NAME = "jaxfeed.service.Dispatcher"


@dataclasses.dataclass(frozen=True)
class DispatcherConfig:
  """Options of a dispatcher.

  Attributes:
    port: TCP port; 0 lets the OS pick one (read it from `DispatchServer.port`).
    host: Interface to bind; loopback unless set.
    work_dir: Folder of the write-ahead journal; None keeps state in memory.
    heartbeat_timeout_s: A worker silent this long is declared dead.
    client_timeout_s: A client silent this long is released from its job;
      exactly-once jobs issue the splits it had not acknowledged again.
    job_gc_timeout_s: A named job left without clients is kept this long,
      so a consumer that joins late still shares it (it gets what is left,
      or the end of the job) instead of starting the job over.
    auth_token: The clients' token: registering datasets and reading jobs
      need it (gRPC metadata). Set together with worker_token.
    worker_token: The workers' token: registering, heartbeats and splits
      need it. Different from auth_token, so that a client cannot pose as a
      worker nor a worker as a client; clients read from workers with
      per-task tickets the dispatcher hands them instead.
    split_size: Sampler positions per DYNAMIC split.
    max_message_bytes: Largest gRPC message accepted or sent.
    pickled_udf_secret: Shared secret that signs pickled UDFs; None refuses them.
    udf_modules: Modules (or package prefixes ending in ".") whose UDFs and
      classes pipelines may use beyond `spec.DEFAULT_UDF_MODULES`; a dataset
      naming any other import path is refused when registered.
    insecure: Allow binding beyond loopback without authentication.
    max_jobs_per_host: Most jobs one client host may read at once.
    num_workers: Static sharding and round-robin jobs wait for this many
      workers; None takes the workers registered when the job starts.
    tls: Server key and certificate for TLS; None serves plaintext. With a
      client CA, callers must present certificates it signed.
    journal_fsync: fsync the journal before a change is acknowledged (durable
      across power loss; one fsync per state change, shared by changes that
      commit together). Without it a change survives a crash of the
      dispatcher process but not of the machine.
    snapshot_every_records: Compact the journal into a snapshot of the live
      state once it holds this many records (0: never by count). A restart
      reads the snapshot plus at most about this many records.
    snapshot_every_bytes: The same by journal size in bytes (0: never by size).
    dataset_gc_timeout_s: A dataset no job reads is deleted after this long;
      a later read of its id gets NOT_FOUND (registering the pipeline again
      works and may give a new id).
    autoscale: Start and resize a pool of workers (local processes, Ray
      actors or a Kubernetes Deployment: `AutoscaleConfig.backend`) from the
      clients' reports (see `jaxfeed.service.autoscale`); None: workers are
      started by hand.
    heartbeat_pacing: How often workers and clients are asked to heartbeat,
      and how DYNAMIC splits grow, as their numbers grow.
  """

  port: int = 0
  host: str = "127.0.0.1"
  work_dir: str | None = None
  heartbeat_timeout_s: float = 10.0
  client_timeout_s: float = 60.0
  job_gc_timeout_s: float = 300.0
  auth_token: str | None = None
  worker_token: str | None = None
  split_size: int = 256
  max_message_bytes: int = rpc.DEFAULT_MAX_MESSAGE_BYTES
  pickled_udf_secret: bytes | None = None
  udf_modules: tuple[str, ...] = ()
  insecure: bool = False
  max_jobs_per_host: int = 256
  num_workers: int | None = None
  tls: rpc.TLSConfig | None = None
  journal_fsync: bool = True
  snapshot_every_records: int = 50_000
  snapshot_every_bytes: int = 32 << 20
  dataset_gc_timeout_s: float = 24 * 3600.0
  autoscale: autoscale_lib.AutoscaleConfig | None = None
  heartbeat_pacing: heartbeat_pacing.HeartbeatPacing = heartbeat_pacing.HeartbeatPacing()

  def __post_init__(self):
    if not isinstance(self.heartbeat_pacing, heartbeat_pacing.HeartbeatPacing):
      raise ValueError("DispatcherConfig: heartbeat_pacing must be a HeartbeatPacing, "
                       f"got {self.heartbeat_pacing!r}.")
    if not isinstance(self.port, int) or not 0 <= self.port < 65536:
      raise ValueError(f"DispatcherConfig: port must be in [0, 65535], got {self.port!r}.")
    for name in ("heartbeat_timeout_s", "client_timeout_s", "job_gc_timeout_s",
                 "dataset_gc_timeout_s"):
      value = getattr(self, name)
      if not isinstance(value, (int, float)) or value <= 0:
        raise ValueError(f"DispatcherConfig: {name} must be > 0 seconds, got {value!r}.")
    for name in ("snapshot_every_records", "snapshot_every_bytes"):
      value = getattr(self, name)
      if not isinstance(value, int) or value < 0:
        raise ValueError(
            f"DispatcherConfig: {name} must be an integer >= 0 (0: off), got {value!r}.")
    if not isinstance(self.split_size, int) or self.split_size < 1:
      raise ValueError(f"DispatcherConfig: split_size must be an integer >= 1, got {self.split_size!r}.")
    if not isinstance(self.max_message_bytes, int) or self.max_message_bytes < 1024:
      raise ValueError("DispatcherConfig: max_message_bytes must be an integer "
                       f">= 1024, got {self.max_message_bytes!r}.")
    if self.num_workers is not None and (
        not isinstance(self.num_workers, int) or self.num_workers < 1):
      raise ValueError(f"DispatcherConfig: num_workers must be None or >= 1, got {self.num_workers!r}.")
    for name in ("auth_token", "worker_token"):
      value = getattr(self, name)
      if value is not None and (not isinstance(value, str) or not value):
        raise ValueError(f"DispatcherConfig: {name} must be a non-empty string or None.")
    if (self.auth_token is None) != (self.worker_token is None):
      raise ValueError(
          "DispatcherConfig: set both auth_token (for clients) and worker_token "
          "(for workers), or neither: with one token only, anyone could take "
          "the other role.")
    if self.auth_token is not None and self.auth_token == self.worker_token:
      raise ValueError("DispatcherConfig: auth_token and worker_token must differ, "
                       "so that clients cannot pose as workers.")
    if not isinstance(self.max_jobs_per_host, int) or self.max_jobs_per_host < 1:
      raise ValueError("DispatcherConfig: max_jobs_per_host must be an integer >= 1, "
                       f"got {self.max_jobs_per_host!r}.")
    object.__setattr__(self, "udf_modules", spec_lib.check_udf_modules(self.udf_modules))
    rpc.check_bind_is_safe(
        "Dispatcher", self.host, self.authenticates, self.insecure,
        "register pipelines that run their code on every worker, or pose as a worker")

  @property
  def authenticates(self) -> bool:
    """Whether every caller must prove who it is (tokens, or client certificates)."""
    return bool(self.auth_token) or bool(self.tls is not None and self.tls.verifies_clients)


@dataclasses.dataclass
class _Task:
  task_id: int
  job_id: int
  worker_address: str
  worker_index: int
  num_workers: int
  finished: bool = False


@dataclasses.dataclass
class _Job:
  job_id: int
  dataset_id: str
  policy: ShardingPolicy
  job_name: str
  num_consumers: int
  num_positions: int
  round_timeout_s: float = 0.0
  tasks: dict[int, _Task] = dataclasses.field(default_factory=dict)
  clients: dict[int, float] = dataclasses.field(default_factory=dict)
  # Round-robin jobs: client id -> its consumer_index.
  consumers: dict[int, int] = dataclasses.field(default_factory=dict)
  # Static and round-robin jobs fix their workers (address -> index) once.
  fixed_workers: dict[str, int] | None = None
  next_position: int = 0
  # When the last client left a named job (kept for job_gc_timeout_s).
  idle_since: float | None = None
  # Exactly-once DYNAMIC jobs: issued splits not yet acknowledged by a client
  # (start -> (stop, task id)), and splits of lost tasks to issue again.
  exactly_once: bool = False
  ephemeral_sharing: bool = False
  unacked: dict[int, tuple[int, int]] = dataclasses.field(default_factory=dict)
  reissue: dict[int, int] = dataclasses.field(default_factory=dict)
  # Exactly-once: the client a worker is sending each unacknowledged split
  # to (start -> client id); a released client's splits are issued again.
  holders: dict[int, int] = dataclasses.field(default_factory=dict)
  # Task id -> (request_seq, ranges) of its last GetSplits that handed out
  # ranges: a request repeated after a lost reply gets the same ones.
  last_splits: dict[int, tuple[int, list]] = dataclasses.field(default_factory=dict)
  # A resumed exactly-once read's job: positions no split is carved from (sorted
  # disjoint [start, stop) ranges; see jaxfeed.service.read_state).
  skip: list = dataclasses.field(default_factory=list)

  def return_split(self, start: int) -> None:
    """An unacknowledged split goes back to the pool, to be issued again."""
    stop, _ = self.unacked.pop(start)
    self.holders.pop(start, None)
    self.reissue[start] = stop

  @property
  def splits_exhausted(self) -> bool:
    return 0 <= self.num_positions <= self.next_position

  @property
  def all_splits_delivered(self) -> bool:
    """No split is left to issue, or (exactly-once) to be acknowledged."""
    return self.splits_exhausted and not self.unacked and not self.reissue

  @property
  def fixes_workers(self) -> bool:
    return self.policy.is_static or self.num_consumers > 0


@dataclasses.dataclass
class _Worker:
  address: str
  data_address: str
  last_heartbeat: float
  tasks: set[int] = dataclasses.field(default_factory=set)
  incarnation: str = ""  # of the worker's process ("": it sends none)


class _WorkerTable(dict):
  """Address -> _Worker; a worker that comes or goes changes the clients'
  task lists (they list the tasks of live workers only)."""

  def __init__(self, task_lists_cache: task_lists.TaskListCache):
    super().__init__()
    self._task_lists = task_lists_cache

  def __setitem__(self, key, value):
    super().__setitem__(key, value)
    self._task_lists.changed()

  def __delitem__(self, key):
    super().__delitem__(key)
    self._task_lists.changed()

  def pop(self, *args):
    self._task_lists.changed()
    return super().pop(*args)


# Journal records that change a job's task list as clients see it.
_TASK_LIST_RECORDS = frozenset({"task", "task_finished", "task_lost", "fix_workers"})


class DispatcherState:
  """The dispatcher's bookkeeping; every change is journaled before it is acknowledged."""

  def __init__(self, config: DispatcherConfig):
    self.config = config
    self.datasets: dict[str, pb.DatasetDef] = {}
    self.dataset_by_fingerprint: dict[str, str] = {}
    self.jobs: dict[int, _Job] = {}
    self.job_by_name: dict[str, int] = {}
    # Clients' task lists, built once per change (see jaxfeed.service.task_lists).
    self._task_lists = task_lists.TaskListCache()
    self.workers: dict[str, _Worker] = _WorkerTable(self._task_lists)
    # Task id -> its job's id (entries of lost tasks and deleted jobs stay
    # until their worker's next heartbeat finds them gone).
    self._task_jobs: dict[int, int] = {}
    # (when counted, live clients): the count paces client heartbeats.
    self._client_count = (float("-inf"), 0)
    self._ids = itertools.count(1)
    self._journal = None
    # Workers of replayed tasks: address -> when they count as lost if they
    # have not registered again by then.
    self._awaited: dict[str, float] = {}
    # Autoscaling: each client's latest cumulative report, and the reports
    # as of the last sample (not journaled: they are only rates).
    self._reports: dict[int, tuple[int, float, float, float]] = {}
    self._sampled: dict[int, tuple[int, float, float, float]] = {}
    self._sampled_at = time.monotonic()
    # The live clients' hosts, for max_jobs_per_host (clients replayed from
    # the journal count for no host).
    self._client_hosts: dict[int, str] = {}
    # Workers derive their read-ticket keys from it; journaled (and kept in
    # snapshots), so that the tickets clients hold stay valid across a restart.
    self._ticket_master: bytes | None = None
    # Datasets no job reads: id -> since when (not journaled: a restart
    # only extends their life).
    self._unread_since: dict[str, float] = {}
    self.replay_stats = journal_lib.ReplayStats()
    if config.work_dir:
      self._journal = journal_lib.Journal(
          config.work_dir, config.journal_fsync, config.snapshot_every_records,
          config.snapshot_every_bytes)
      replay_started = time.monotonic()
      self.replay_stats = self._journal.replay(self._apply)
      self.replay_seconds = time.monotonic() - replay_started  # for --metrics_port
      deadline = time.monotonic() + config.heartbeat_timeout_s
      self._awaited = {t.worker_address: deadline for job in self.jobs.values()
                       for t in job.tasks.values() if not t.finished}
    self.lock = journal_lib.JournalLock(self._journal, self._live_records)
    if config.auth_token and self._ticket_master is None:
      with self.lock:
        self._record({"kind": "ticket_master", "key": os.urandom(32).hex()})

  def close(self) -> None:
    if self._journal is not None:
      self._journal.close()

  # -- journaled changes --------------------------------------------------
  def _record(self, record: dict) -> None:
    """Applies a change; it is journaled when the lock is released."""
    self._apply(record)
    self.lock.add(record)
    if record["kind"] in _TASK_LIST_RECORDS:
      self._task_lists.changed()
    elif record["kind"] == "job_deleted":
      self._task_lists.forget(record["job_id"])

  def _live_records(self) -> list[dict]:
    next_id = next(self._ids)
    self._ids = itertools.count(next_id)
    records = state_snapshot.state_records(self.datasets, self.jobs, next_id)
    if self._ticket_master is not None:  # the tickets clients hold stay valid
      records.append({"kind": "ticket_master", "key": self._ticket_master.hex()})
    return records

  def _next_id(self) -> int:
    return next(self._ids)

  def _apply(self, r: dict) -> None:
    journal_records.check_record(r, self.jobs)
    kind = r["kind"]
    if "id" in r:  # keep ids unique across restarts
      n = int(r["id"])
      current = next(self._ids)
      self._ids = itertools.count(max(current, n + 1))
    if kind == "ids":
      pass  # a snapshot's highest id: handled above
    elif kind == "dataset":
      dataset_def = pb.DatasetDef.FromString(base64.b64decode(r["def"]))
      self.datasets[r["dataset_id"]] = dataset_def
      self.dataset_by_fingerprint[dataset_def.fingerprint] = r["dataset_id"]
    elif kind == "dataset_deleted":
      dataset_def = self.datasets.pop(r["dataset_id"], None)
      if dataset_def is not None and self.dataset_by_fingerprint.get(
          dataset_def.fingerprint) == r["dataset_id"]:
        del self.dataset_by_fingerprint[dataset_def.fingerprint]
      self._unread_since.pop(r["dataset_id"], None)
    elif kind == "job":
      job = _Job(int(r["id"]), r["dataset_id"], ShardingPolicy(r["policy"]),
                 r["job_name"], r["num_consumers"], r["num_positions"],
                 r.get("round_timeout_s", 0.0), exactly_once=r.get("exactly_once", False),
                 ephemeral_sharing=r.get("ephemeral_sharing", False),
                 skip=read_state.merge_ranges(r.get("skip", [])))
      job.next_position = read_state.skip_to(job.skip, 0)
      self.jobs[job.job_id] = job
      if job.job_name:
        self.job_by_name[job.job_name] = job.job_id
    elif kind == "fix_workers":
      self.jobs[r["job_id"]].fixed_workers = dict(r["workers"])
    elif kind == "task":
      job = self.jobs[r["job_id"]]
      job.tasks[int(r["id"])] = _Task(int(r["id"]), job.job_id, r["worker_address"],
                                      r["worker_index"], r["num_workers"])
      self._task_jobs[int(r["id"])] = job.job_id
      worker = self.workers.get(r["worker_address"])
      if worker is not None:
        worker.tasks.add(int(r["id"]))
    elif kind == "task_finished":
      task = self.jobs[r["job_id"]].tasks.get(r["task_id"])
      if task is not None:
        task.finished = True
    elif kind == "task_lost":
      job = self.jobs[r["job_id"]]
      job.tasks.pop(r["task_id"], None)
      job.last_splits.pop(r["task_id"], None)
      for start, (_, task_id) in list(job.unacked.items()):
        if task_id == r["task_id"]:  # its elements may never have arrived
          job.return_split(start)
    elif kind == "splits_held":
      job = self.jobs[r["job_id"]]
      for start in r["starts"]:
        if start not in job.unacked:
          continue
        if r["client_id"] in job.clients:
          job.holders[start] = r["client_id"]
        else:  # its client left before the worker told
          job.return_split(start)
    elif kind == "client":
      job = self.jobs[r["job_id"]]
      job.clients[int(r["id"])] = time.monotonic()
      if job.num_consumers:
        job.consumers[int(r["id"])] = r.get("consumer_index", 0)
    elif kind == "client_released":
      job = self.jobs[r["job_id"]]
      job.clients.pop(r["client_id"], None)
      job.consumers.pop(r["client_id"], None)
      for start, client_id in list(job.holders.items()):
        if client_id == r["client_id"]:  # it may never have had all of them
          job.return_split(start)
    elif kind == "job_deleted":
      job = self.jobs.pop(r["job_id"], None)
      if job is not None and self.job_by_name.get(job.job_name) == job.job_id:
        del self.job_by_name[job.job_name]
    elif kind == "splits":
      job = self.jobs[r["job_id"]]
      job.next_position = r["next_position"]
      if "request_seq" in r:
        job.last_splits[r["task_id"]] = (r["request_seq"], r["ranges"])
    elif kind == "splits_reply":  # from a compacted journal
      self.jobs[r["job_id"]].last_splits[r["task_id"]] = (r["request_seq"], r["ranges"])
    elif kind == "splits_issued":
      job = self.jobs[r["job_id"]]
      if "request_seq" in r:
        job.last_splits[r["task_id"]] = (r["request_seq"], r["ranges"])
      for start, stop in r["ranges"]:
        job.reissue.pop(start, None)
        job.holders.pop(start, None)
        job.unacked[start] = (stop, r["task_id"])
    elif kind == "ticket_master":
      self._ticket_master = bytes.fromhex(r["key"])
    elif kind == "splits_acked":
      job = self.jobs[r["job_id"]]
      for start in r["starts"]:
        job.unacked.pop(start, None)
        job.holders.pop(start, None)
        job.reissue.pop(start, None)  # acknowledged just after its worker was lost
    elif kind == "splits_lost":
      self.jobs[r["job_id"]].reissue.update((start, stop) for start, stop in r["ranges"])
    else:
      raise ValueError(f"Unknown journal record kind {kind!r}.")

  # -- datasets -------------------------------------------------------------
  def register_dataset(self, dataset_def: pb.DatasetDef) -> str:
    spec_lib.check_signature(dataset_def, self.config.pickled_udf_secret)
    spec_lib.check_spec_paths(dataset_def, self.config.udf_modules)
    if not dataset_def.graph_json:
      raise ValueError("RegisterDataset: the dataset definition has no graph.")
    # Computed here from the spec's content, never taken from the client: a
    # forged fingerprint would let one pipeline be served another's data.
    trusted = pb.DatasetDef()
    trusted.CopyFrom(dataset_def)
    trusted.fingerprint = spec_lib.fingerprint(dataset_def)
    with self.lock:
      existing = self.dataset_by_fingerprint.get(trusted.fingerprint)
      if existing is not None:
        self._unread_since.pop(existing, None)  # registered again: in use
        return existing
      dataset_id = str(self._next_id())
      self._record({"kind": "dataset", "id": dataset_id, "dataset_id": dataset_id,
                    "def": base64.b64encode(trusted.SerializeToString()).decode()})
      return dataset_id

  def dataset_def(self, dataset_id: str) -> pb.DatasetDef:
    with self.lock:
      found = self.datasets.get(dataset_id)
    if found is None:
      raise rpc.NotFoundError(f"Unknown dataset id {dataset_id!r}: register the dataset first.")
    return found

  # -- jobs -------------------------------------------------------------------
  def get_or_create_job(self, request: pb.GetOrCreateJobRequest,
                        host: str = "") -> tuple[int, int]:
    """Returns (job id, client id); `host` is the client's, for max_jobs_per_host."""
    policy = to_sharding_policy(request.sharding_policy)
    _check_job_request(request, policy)
    with self.lock:
      open_jobs = sum(1 for h in self._client_hosts.values() if h == host)
      if host and open_jobs >= self.config.max_jobs_per_host:
        raise rpc.StatusError(
            "RESOURCE_EXHAUSTED",
            f"Client host {host} already reads {open_jobs} jobs, the most "
            f"max_jobs_per_host={self.config.max_jobs_per_host} allows "
            "(--max_jobs_per_host): finish or release some first.")
      dataset_def = self.datasets.get(request.dataset_id)
      if dataset_def is None:
        raise rpc.NotFoundError(
            f"Unknown dataset id {request.dataset_id!r}: register the dataset first.")
      job = None
      if request.job_name:
        job_id = self.job_by_name.get(request.job_name)
        job = self.jobs.get(job_id) if job_id is not None else None
        if job is not None and (job.dataset_id != request.dataset_id or job.policy != policy
                                or job.num_consumers != request.num_consumers
                                or job.exactly_once != request.exactly_once
                                or job.ephemeral_sharing != request.ephemeral_sharing):
          raise ValueError(
              f"Job {request.job_name!r} exists for dataset {job.dataset_id} with "
              f"processing mode {job.policy.name}, num_consumers "
              f"{job.num_consumers}, {_visitation(job.exactly_once)} visitation and "
              f"ephemeral_sharing={job.ephemeral_sharing}; it cannot be read as "
              f"dataset {request.dataset_id} with {policy.name} / num_consumers "
              f"{request.num_consumers} / {_visitation(request.exactly_once)} / "
              f"ephemeral_sharing={request.ephemeral_sharing}: every consumer of a "
              "job must pass the same dataset, processing mode, num_consumers, "
              "visitation and ephemeral_sharing.")
        if job is not None and request.round_timeout_s and (
            request.round_timeout_s != job.round_timeout_s):
          raise ValueError(
              f"Job {request.job_name!r} has round_timeout_s "
              f"{job.round_timeout_s}; a consumer asked for "
              f"{request.round_timeout_s}: pass the same value (or none).")
      if job is None:
        if policy == ShardingPolicy.DYNAMIC and dataset_def.num_positions == 0:
          pass  # an empty pipeline: the job finishes at once
        done = [[r.start, r.stop] for r in request.resume_done]
        partial = [[r.start, r.stop] for r in request.resume_partial]
        read_state.check_resume_ranges(done, partial, int(dataset_def.num_positions))
        job_id = self._next_id()
        self._record({"kind": "job", "id": job_id, "dataset_id": request.dataset_id,
                      **({"skip": read_state.merge_ranges(done + partial)}
                         if done or partial else {}),
                      "policy": policy.value, "job_name": request.job_name,
                      "num_consumers": request.num_consumers,
                      "num_positions": int(dataset_def.num_positions),
                      "round_timeout_s": (request.round_timeout_s
                                          or round_assembly.DEFAULT_ROUND_TIMEOUT_S),
                      "exactly_once": request.exactly_once,
                      "ephemeral_sharing": request.ephemeral_sharing})
        if partial:  # issued again first, whole
          self._record({"kind": "splits_lost", "job_id": job_id, "ranges": partial})
        job = self.jobs[job_id]
        self._assign_tasks(job)
      holder = next((c for c, i in job.consumers.items()
                     if i == request.consumer_index), None) if job.num_consumers else None
      if holder is not None:
        raise ValueError(
            f"consumer_index {request.consumer_index} of job {job.job_name!r} is "
            f"already being read by client {holder}: each consumer of a "
            f"round-robin job needs its own index in [0, {job.num_consumers}). A "
            "consumer that died is released after "
            f"client_timeout_s={self.config.client_timeout_s:g} s without heartbeats.")
      client_id = self._next_id()
      self._record({"kind": "client", "id": client_id, "job_id": job.job_id,
                    "consumer_index": request.consumer_index})
      if host:
        self._client_hosts[client_id] = host
      job.idle_since = None
      return job.job_id, client_id

  def _assign_tasks(self, job: _Job) -> None:
    """Creates tasks for live workers that lack one (lock held)."""
    if job.fixes_workers and job.fixed_workers is None:
      wanted = self.config.num_workers or 1
      if len(self.workers) < wanted:
        return
      addresses = sorted(self.workers)[:self.config.num_workers or len(self.workers)]
      self._record({"kind": "fix_workers", "job_id": job.job_id,
                    "workers": [[a, i] for i, a in enumerate(addresses)]})
    have = {t.worker_address for t in job.tasks.values()}
    for address in sorted(self.workers):
      if address in have:
        continue
      if job.fixed_workers is not None:
        if address not in job.fixed_workers:
          continue
        index, count = job.fixed_workers[address], len(job.fixed_workers)
      else:
        index, count = 0, 1
      self._record({"kind": "task", "id": self._next_id(), "job_id": job.job_id,
                    "worker_address": address, "worker_index": index,
                    "num_workers": count})

  def _ticket_key(self, worker_address: str) -> bytes:
    if self._ticket_master is None:
      return b""
    return rpc.worker_ticket_key(self._ticket_master, worker_address)

  def _task_info(self, task: _Task, for_client: bool = False) -> pb.TaskInfo:
    job = self.jobs[task.job_id]
    worker = self.workers.get(task.worker_address)
    key = self._ticket_key(task.worker_address) if for_client else b""
    return pb.TaskInfo(
        read_ticket=rpc.read_ticket(key, task.task_id) if key else "",
        task_id=task.task_id, job_id=job.job_id, dataset_id=job.dataset_id,
        worker_address=task.worker_address,
        data_address=worker.data_address if worker else "",
        sharding_policy=job.policy.value, worker_index=task.worker_index,
        num_workers=task.num_workers, num_consumers=job.num_consumers,
        round_timeout_s=job.round_timeout_s, exactly_once=job.exactly_once,
        ephemeral_sharing=job.ephemeral_sharing)

  def _job(self, job_id: int) -> _Job:
    job = self.jobs.get(job_id)
    if job is None:
      raise rpc.NotFoundError(f"Unknown job id {job_id}: it finished, was released or never existed.")
    return job

  def client_heartbeat(self, job_id: int, client_id: int,
                       acked_splits: Sequence[int] = (),
                       report: pb.ClientHeartbeatRequest | None = None
                       ) -> pb.ClientHeartbeatResponse:
    return pb.ClientHeartbeatResponse.FromString(
        self.client_heartbeat_wire(job_id, client_id, acked_splits, report))

  def client_heartbeat_wire(self, job_id: int, client_id: int,
                            acked_splits: Sequence[int] = (),
                            report: pb.ClientHeartbeatRequest | None = None) -> bytes:
    """`client_heartbeat`'s answer, serialized: the task list is serialized
    once per change, not once per heartbeat."""
    with self.lock:
      job = self._job(job_id)
      if client_id not in job.clients:
        raise rpc.NotFoundError(f"Client {client_id} is not reading job {job_id}.")
      job.clients[client_id] = time.monotonic()
      if report is not None and report.read_elapsed_s > 0:
        self._reports[client_id] = (report.elements_consumed, report.consumer_wait_s,
                                    report.read_elapsed_s,
                                    min(max(report.buffer_fill, 0.0), 1.0))
      acked = sorted(s for s in set(acked_splits) if s in job.unacked or s in job.reissue)
      if acked:
        self._record({"kind": "splits_acked", "job_id": job_id, "starts": acked})
      task_list = self._client_task_list(job)
      done = task_list.all_finished
      if job.policy == ShardingPolicy.DYNAMIC:
        finished = job.all_splits_delivered and done
      elif job.fixes_workers:
        finished = job.fixed_workers is not None and done
      else:
        finished = bool(job.tasks) and done
      if job.fixed_workers is not None and len(job.tasks) < len(job.fixed_workers):
        finished = finished and not any(  # a fixed worker may still come back
            a in self.workers for a in job.fixed_workers)
      response = pb.ClientHeartbeatResponse(
          job_finished=finished, tasks_version=task_list.version,
          heartbeat_interval_s=self.config.heartbeat_pacing.client_interval(
              self._live_clients(), self.config.client_timeout_s))
      if report is not None and report.known_tasks_version == task_list.version:
        response.tasks_unchanged = True
        return response.SerializeToString()
      # Serialized messages concatenate into their merge.
      return response.SerializeToString() + task_list.serialized

  def _client_task_list(self, job: _Job) -> task_lists.TaskList:
    """The job's tasks as its clients see them (lock held)."""
    def tasks():
      for t in job.tasks.values():
        worker = self.workers.get(t.worker_address)
        # A worker of the journal that has not registered again since a
        # restart is not dead yet: a client that stopped reading its task
        # would never read it again.
        live = worker is not None or t.worker_address in self._awaited
        yield (t.task_id, worker.data_address if worker else "", live, t.finished)
    return self._task_lists.get(
        job.job_id, tasks, lambda task_id: self._task_info(job.tasks[task_id], for_client=True))

  def _live_clients(self) -> int:
    """Clients of all jobs, counted at most once a second (lock held)."""
    counted_at, count = self._client_count
    now = time.monotonic()
    if now - counted_at > 1.0:
      count = sum(len(job.clients) for job in self.jobs.values())
      self._client_count = (now, count)
    return count

  def _tasks_of_worker(self, worker: _Worker) -> dict[int, _Task]:
    """Task id -> task of the tasks on `worker` (lock held); forgets its lost ones."""
    live = {}
    for task_id in list(worker.tasks):
      job = self.jobs.get(self._task_jobs.get(task_id, -1))
      task = job.tasks.get(task_id) if job is not None else None
      if task is None or task.worker_address != worker.address:
        worker.tasks.discard(task_id)
        self._task_jobs.pop(task_id, None)
        continue
      live[task_id] = task
    return live

  def release_client(self, job_id: int, client_id: int) -> None:
    with self.lock:
      job = self.jobs.get(job_id)
      if job is None or client_id not in job.clients:
        return
      self.release_client_locked(job_id, client_id)

  # -- workers ------------------------------------------------------------------
  def worker_heartbeat(self, request: pb.WorkerHeartbeatRequest) -> pb.WorkerHeartbeatResponse:
    address = request.worker_address
    if not address:
      raise ValueError("WorkerHeartbeat: worker_address is empty.")
    with self.lock:
      if request.leaving:
        self._finish_tasks(request.finished_tasks)
        if self.workers.pop(address, None) is not None:
          logging.info("Worker %s left.", address)
          self._lose_tasks_of(address)
        return pb.WorkerHeartbeatResponse()
      worker = self.workers.get(address)
      if (worker is not None and request.incarnation and worker.incarnation
          and request.incarnation != worker.incarnation):
        # Restarted on the same address before its heartbeats timed out: the
        # new process has none of the old one's tasks or streams.
        logging.warning("Worker %s restarted: its tasks are lost.", address)
        del self.workers[address]
        self._lose_tasks_of(address)
        worker = None
      if worker is None:
        logging.info("Worker %s registered.", address)
        self._awaited.pop(address, None)
        worker = _Worker(address, request.data_address, time.monotonic(),
                         incarnation=request.incarnation)
        self.workers[address] = worker
        if request.incarnation:
          # Tasks journaled before a restart that the process does not run:
          # it restarted too (or never got them).
          self._lose_tasks_of(address, keep=set(request.current_tasks)
                              | set(request.finished_tasks))
        for job in self.jobs.values():  # tasks journaled before a restart
          worker.tasks.update(t.task_id for t in job.tasks.values()
                              if t.worker_address == address)
        for job in list(self.jobs.values()):
          self._assign_tasks(job)
      worker.last_heartbeat = time.monotonic()
      if worker.data_address != request.data_address:
        self._task_lists.changed()  # clients read its tasks at the new address
      worker.data_address = request.data_address
      self._finish_tasks(request.finished_tasks)
      live = self._tasks_of_worker(worker)
      for held in request.held_splits:
        task = live.get(held.task_id)
        job = self.jobs[task.job_id] if task is not None else None
        starts = [s for s in held.starts if job is not None and s in job.unacked]
        if starts:
          self._record({"kind": "splits_held", "job_id": job.job_id,
                        "client_id": held.client_id, "starts": starts})
      current = set(request.current_tasks)
      return pb.WorkerHeartbeatResponse(
          new_tasks=[self._task_info(t) for tid, t in sorted(live.items())
                     if tid not in current and not t.finished],
          tasks_to_delete=sorted(current - set(live)),
          ticket_key=self._ticket_key(address),
          task_clients=[pb.TaskClients(task_id=tid,
                                       client_ids=sorted(self.jobs[t.job_id].clients))
                        for tid, t in sorted(live.items()) if tid in current],
          heartbeat_interval_s=self.config.heartbeat_pacing.worker_interval(
              len(self.workers), self.config.heartbeat_timeout_s))

  def get_splits(self, request: pb.GetSplitsRequest) -> pb.GetSplitsResponse:
    with self.lock:
      job = self._job(request.job_id)
      if job.policy != ShardingPolicy.DYNAMIC:
        raise ValueError(f"Job {job.job_id} uses {job.policy.name} sharding; only "
                         "DYNAMIC jobs hand out splits.")
      if request.task_id not in job.tasks:
        raise rpc.NotFoundError(f"Task {request.task_id} is not part of job {job.job_id}.")
      last = job.last_splits.get(request.task_id)
      if request.request_seq and last is not None and last[0] == request.request_seq:
        # The worker did not get the reply: the same ranges, still its own
        # (they are acknowledged or reissued only after it had them).
        return pb.GetSplitsResponse(ranges=[pb.SplitRange(start=a, stop=b)
                                            for a, b in last[1]])
      wanted = max(1, min(request.max_ranges, 64))
      ranges = [pb.SplitRange(start=start, stop=stop)
                for start, stop in sorted(job.reissue.items())[:wanted]]
      start = job.next_position
      split_size = self.config.heartbeat_pacing.split_size(self.config.split_size,
                                                           len(job.tasks))
      while len(ranges) < wanted:
        if 0 <= job.num_positions <= start:
          break
        stop = start + split_size
        if job.num_positions >= 0:
          stop = min(stop, job.num_positions)
        stop = read_state.clip(job.skip, start, stop)
        ranges.append(pb.SplitRange(start=start, stop=stop))
        start = read_state.skip_to(job.skip, stop)
      issued = {"task_id": request.task_id, "ranges": [[r.start, r.stop] for r in ranges]}
      if request.request_seq:
        issued["request_seq"] = request.request_seq
      if start != job.next_position:
        self._record({"kind": "splits", "job_id": job.job_id, "next_position": start,
                      **({} if job.exactly_once else issued)})
      if not job.exactly_once:
        return pb.GetSplitsResponse(ranges=ranges, end_of_splits=job.splits_exhausted)
      if ranges:
        self._record({"kind": "splits_issued", "job_id": job.job_id, **issued})
      # The end only once every split arrived: until then a lost worker's
      # splits may come back to this task.
      return pb.GetSplitsResponse(ranges=ranges,
                                  end_of_splits=not ranges and job.all_splits_delivered)

  def check_liveness(self) -> None:
    """Drops workers and clients whose heartbeats stopped."""
    now = time.monotonic()
    with self.lock:
      for address, worker in list(self.workers.items()):
        if now - worker.last_heartbeat <= self.config.heartbeat_timeout_s:
          continue
        logging.warning("Worker %s missed heartbeats for %.1fs: declared dead.",
                        address, now - worker.last_heartbeat)
        del self.workers[address]
        self._lose_tasks_of(address)
      for address, deadline in list(self._awaited.items()):
        if now > deadline:  # did not come back after a dispatcher restart
          logging.warning("Worker %s did not register again: its tasks are lost.", address)
          del self._awaited[address]
          self._lose_tasks_of(address)
      for job in list(self.jobs.values()):
        for client_id, seen in list(job.clients.items()):
          if now - seen > self.config.client_timeout_s:
            self.release_client_locked(job.job_id, client_id)
        if job.job_name and not job.clients and job.idle_since is None:
          job.idle_since = now  # replayed from the journal without clients
        if (job.idle_since is not None and not job.clients
            and now - job.idle_since > self.config.job_gc_timeout_s):
          self._record({"kind": "job_deleted", "job_id": job.job_id})
      self._collect_datasets(now)

  def _collect_datasets(self, now: float) -> None:
    """Deletes datasets no job has read for dataset_gc_timeout_s (lock held)."""
    read = {job.dataset_id for job in self.jobs.values()}
    for dataset_id in list(self.datasets):
      if dataset_id in read:
        self._unread_since.pop(dataset_id, None)
      elif now - self._unread_since.setdefault(dataset_id, now) > (
          self.config.dataset_gc_timeout_s):
        self._record({"kind": "dataset_deleted", "dataset_id": dataset_id})

  def _finish_tasks(self, task_ids: Sequence[int]) -> None:
    for task_id in task_ids:
      for job in self.jobs.values():
        task = job.tasks.get(task_id)
        if task is not None and not task.finished:
          self._record({"kind": "task_finished", "job_id": job.job_id, "task_id": task_id})

  def _lose_tasks_of(self, address: str, keep: set[int] = frozenset()) -> None:
    """Records as lost the unfinished tasks on `address`, but those in `keep`."""
    for job in self.jobs.values():
      for task in list(job.tasks.values()):
        if (task.worker_address == address and not task.finished
            and task.task_id not in keep):
          self._record({"kind": "task_lost", "job_id": job.job_id, "task_id": task.task_id})

  def sample_clients(self) -> autoscale_lib.Sample | None:
    """The live clients' reports since the last call, as one sample."""
    with self.lock:
      now = time.monotonic()
      live = {c for job in self.jobs.values() for c in job.clients}
      elements, waits, fills = 0, [], []
      for client_id, (count, wait_s, elapsed_s, fill) in self._reports.items():
        if client_id not in live:
          continue
        before = self._sampled.get(client_id, (0, 0.0, 0.0, 0.0))
        if elapsed_s <= before[2]:
          continue  # no report since the last sample
        elements += count - before[0]
        waits.append(min(1.0, (wait_s - before[1]) / (elapsed_s - before[2])))
        fills.append(fill)
      self._reports = {c: r for c, r in self._reports.items() if c in live}
      self._sampled = dict(self._reports)
      span, self._sampled_at = now - self._sampled_at, now
    if not waits or span <= 0:
      return None
    return autoscale_lib.Sample(elements_per_s=elements / span,
                                wait_fraction=sum(waits) / len(waits),
                                buffer_fill=sum(fills) / len(fills), num_clients=len(waits))

  def release_client_locked(self, job_id: int, client_id: int) -> None:
    self._record({"kind": "client_released", "job_id": job_id, "client_id": client_id})
    self._client_hosts.pop(client_id, None)
    job = self.jobs[job_id]
    if job.clients:
      return
    if job.job_name:  # shared: a late consumer may still join it
      job.idle_since = time.monotonic()
    else:
      self._record({"kind": "job_deleted", "job_id": job_id})


def _visitation(exactly_once: bool) -> str:
  return "exactly-once" if exactly_once else "at-most-once"


def _check_job_request(request: pb.GetOrCreateJobRequest, policy: ShardingPolicy) -> None:
  """Raises ValueError (INVALID_ARGUMENT) for inconsistent read options."""
  k = request.num_consumers
  if k < 0:
    raise ValueError(f"num_consumers must be >= 0, got {k}.")
  if k and not request.job_name:
    raise ValueError(f"num_consumers={k} needs a job_name: the consumers of a "
                     "round-robin read share one job.")
  if k and not 0 <= request.consumer_index < k:
    raise ValueError(f"consumer_index must be in [0, num_consumers={k}), got "
                     f"{request.consumer_index}.")
  if not k and (request.consumer_index or request.round_timeout_s):
    raise ValueError("consumer_index and round_timeout_s apply to round-robin "
                     "reads only: pass num_consumers too.")
  if request.round_timeout_s < 0 or request.round_timeout_s != request.round_timeout_s:
    raise ValueError(f"round_timeout_s must be > 0 (or 0 for the job's value), got "
                     f"{request.round_timeout_s}.")
  if request.exactly_once and (policy != ShardingPolicy.DYNAMIC or k):
    raise ValueError(
        f"Exactly-once visitation needs DYNAMIC sharding without num_consumers; "
        f"got {policy.name} and num_consumers={k}.")
  if (request.resume_done or request.resume_partial) and not request.exactly_once:
    raise ValueError("Only exactly-once reads resume from a saved state.")
  if request.ephemeral_sharing and (policy != ShardingPolicy.OFF or k):
    raise ValueError(
        f"Ephemeral sharing needs OFF sharding (parallel_epochs) without "
        f"num_consumers; got {policy.name} and num_consumers={k}.")


class _DispatcherServicer:
  """Maps RPCs onto DispatcherState."""

  def __init__(self, state: DispatcherState):
    self.state = state

  def RegisterDataset(self, request, context):
    del context
    return pb.RegisterDatasetResponse(dataset_id=self.state.register_dataset(request.dataset))

  def GetDatasetDef(self, request, context):
    del context
    return pb.GetDatasetDefResponse(dataset=self.state.dataset_def(request.dataset_id))

  def GetOrCreateJob(self, request, context):
    job_id, client_id = self.state.get_or_create_job(request, _peer_host(context.peer()))
    return pb.GetOrCreateJobResponse(job_id=job_id, client_id=client_id)

  def ClientHeartbeat(self, request, context):
    del context
    return self.state.client_heartbeat_wire(request.job_id, request.client_id,
                                            request.acked_splits, request)

  def ReleaseJobClient(self, request, context):
    del context
    self.state.release_client(request.job_id, request.client_id)
    return pb.ReleaseJobClientResponse()

  def WorkerHeartbeat(self, request, context):
    del context
    return self.state.worker_heartbeat(request)

  def GetSplits(self, request, context):
    del context
    return self.state.get_splits(request)

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
    }
    return rpc.method_handlers(
        SERVICE_NAME, {rpc.CLIENT: config.auth_token, rpc.WORKER: config.worker_token},
        {name: (getattr(self, name), cls, False, roles)
         for name, (cls, roles) in methods.items()})


def _peer_host(peer: str) -> str:
  """The host of a gRPC peer ("ipv4:1.2.3.4:5678", "ipv6:[::1]:5678")."""
  kind, _, rest = peer.partition(":")
  if kind in ("ipv4", "ipv6"):
    return rest.rsplit(":", 1)[0].strip("[]")
  return peer


def _liveness_loop(state_ref: weakref.ref, stop: threading.Event, period: float) -> None:
  while not stop.wait(period):
    state = state_ref()
    if state is None:
      return
    try:
      state.check_liveness()
    except Exception:  # pylint: disable=broad-except
      logging.exception("Dispatcher liveness check failed")
    del state


class DispatchServer:
  """A dispatcher gRPC server; `start()` (or `with`) serves, `stop()` ends it."""

  def __init__(self, config: DispatcherConfig | None = None, start: bool = True):
    self.config = config or DispatcherConfig()
    self.state = DispatcherState(self.config)
    servicer = _DispatcherServicer(self.state)
    self._server, self.port = rpc.make_server(
        f"{self.config.host}:{self.config.port}", servicer.handler(self.config),
        self.config.max_message_bytes, self.config.tls)
    self._stop = threading.Event()
    self._liveness = threading.Thread(
        target=_liveness_loop, name="jaxfeed-dispatcher-liveness", daemon=True,
        args=(weakref.ref(self.state), self._stop,
              min(0.5, self.config.heartbeat_timeout_s / 4)))
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
      backend = autoscale_lib.make_backend(self.config.autoscale, f"{local}:{self.port}",
                                           flags, secrets)
      self.autoscaler = autoscale_lib.Autoscaler(
          self.config.autoscale, backend, self.state.sample_clients)
    self._finalizer = weakref.finalize(self, _shutdown, self._server, self._stop, self.state,
                                       self.autoscaler)
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


def _shutdown(server: rpc.ServerHandle, stop: threading.Event, state: DispatcherState,
              autoscaler: autoscale_lib.Autoscaler | None = None) -> None:
  if autoscaler is not None:  # its workers go first, while they can still say goodbye
    autoscaler.close()
  stop.set()
  server.stop()
  state.close()


def main(argv: Any) -> None:
  """Runs a dispatcher from flags; a bad flag value ends it with the reason."""
  del argv
  from absl import flags  # pylint: disable=g-import-not-at-top
  f = flags.FLAGS
  try:
    udf_secret = rpc.read_secret(f.pickled_udf_secret, f.pickled_udf_secret_file,
                                 "pickled_udf_secret")
    config = DispatcherConfig(
        port=f.port, host=f.host, work_dir=f.work_dir or None,
        heartbeat_timeout_s=f.heartbeat_timeout_s, client_timeout_s=f.client_timeout_s,
        auth_token=rpc.read_secret(f.auth_token, f.auth_token_file, "auth_token"),
        worker_token=rpc.read_secret(f.worker_token, f.worker_token_file, "worker_token"),
        split_size=f.split_size, num_workers=f.num_workers or None,
        pickled_udf_secret=udf_secret.encode() if udf_secret else None,
        udf_modules=spec_lib.parse_udf_modules(f.udf_modules), insecure=f.insecure,
        max_jobs_per_host=f.max_jobs_per_host,
        tls=rpc.TLSConfig.from_files(f.tls_key, f.tls_cert, client_ca=f.tls_client_ca),
        journal_fsync=f.journal_fsync, snapshot_every_records=f.snapshot_every_records,
        snapshot_every_bytes=f.snapshot_every_bytes, job_gc_timeout_s=f.job_gc_timeout_s,
        dataset_gc_timeout_s=f.dataset_gc_timeout_s,
        autoscale=autoscale_lib.AutoscaleConfig(
            min_workers=f.autoscale_min_workers, max_workers=f.autoscale_max_workers,
            interval_s=f.autoscale_interval_s, worker_flags=tuple(f.worker_flag or ()),
            backend=f.worker_backend, ray_address=f.ray_address or None,
            kubernetes_deployment=f.kubernetes_deployment or None)
        if f.autoscale_max_workers else None)
  except ValueError as e:  # a flag's value: say which, without a traceback
    raise SystemExit(f"jaxfeed dispatcher: {e}") from e
  server = DispatchServer(config)
  print(f"jaxfeed dispatcher listening on {server.target}", flush=True)
  metrics = metrics_lib.serve_dispatcher(server, f.host, f.metrics_port)
  if metrics is not None:
    print(f"jaxfeed dispatcher metrics on {metrics.url}", flush=True)
  rpc.stop_on_sigterm()
  if f.port_file:
    _write_port_file(f.port_file, server.port)
  try:
    server.join()
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
  flags.DEFINE_string("host", "127.0.0.1", "Interface to bind; 0.0.0.0 for all (workers "
                      "and clients on other machines).")
  flags.DEFINE_string("work_dir", "", "Folder of the write-ahead journal.")
  flags.DEFINE_bool("journal_fsync", True, "fsync the journal before acknowledging a "
                    "change (--nojournal_fsync: survives a process crash, not a power loss).")
  flags.DEFINE_integer("snapshot_every_records", 50_000, "Compact the journal into a "
                       "snapshot after this many records (0: never by count).")
  flags.DEFINE_integer("snapshot_every_bytes", 32 << 20, "Compact the journal into a "
                       "snapshot after this many bytes (0: never by size).")
  flags.DEFINE_float("job_gc_timeout_s", 300.0, "A named job without clients is deleted "
                     "after this long.")
  flags.DEFINE_float("dataset_gc_timeout_s", 24 * 3600.0, "A dataset no job reads is "
                     "deleted after this long.")
  flags.DEFINE_float("heartbeat_timeout_s", 10.0, "Worker heartbeat timeout.")
  flags.DEFINE_float("client_timeout_s", 60.0, "A client silent this long is released "
                     "from its job (exactly-once: its unacknowledged splits are "
                     "issued again).")
  rpc.define_auth_flags(flags)
  flags.DEFINE_string("auth_token", "", "Token of the clients (tests; prefer "
                      "--auth_token_file: command lines are visible in ps).")
  flags.DEFINE_string("auth_token_file", "", "File holding the clients' token.")
  flags.DEFINE_integer("max_jobs_per_host", 256, "Most jobs one client host may read "
                       "at once.")
  flags.DEFINE_integer("split_size", 256, "Positions per DYNAMIC split.")
  flags.DEFINE_integer("num_workers", 0, "Workers static sharding waits for.")
  flags.DEFINE_string("port_file", "", "Write the bound port to this file.")
  flags.DEFINE_string("tls_key", "", "PEM private key file: serve TLS (with --tls_cert).")
  flags.DEFINE_string("tls_cert", "", "PEM certificate chain file of --tls_key.")
  flags.DEFINE_integer("autoscale_max_workers", 0, "Run an elastic pool of up to this "
                       "many workers (0: workers are started by hand).")
  flags.DEFINE_integer("autoscale_min_workers", 1, "Workers the elastic pool keeps.")
  flags.DEFINE_float("autoscale_interval_s", 5.0, "Seconds between pool resizes.")
  flags.DEFINE_multi_string("worker_flag", None, "A flag of the pool's workers, e.g. "
                            "--worker_flag=--buffer_size=16 (repeat for more).")
  flags.DEFINE_integer("metrics_port", metrics_lib.OFF, "Serve Prometheus metrics on "
                       "this port (0: a free one, printed; -1: off).")
  flags.DEFINE_enum("worker_backend", "local", list(autoscale_lib.BACKENDS),
                    "Where the elastic pool's workers run: local processes, actors "
                    "on a Ray cluster (--ray_address) or the pods of a Kubernetes "
                    "Deployment (--kubernetes_deployment).")
  flags.DEFINE_string("ray_address", "", "host:port of the Ray cluster's head "
                      "(--worker_backend=ray; default: Ray's auto-detection).")
  flags.DEFINE_string("kubernetes_deployment", "", "NAMESPACE/NAME of the worker "
                      "Deployment the pool scales (--worker_backend=kubernetes).")


if __name__ == "__main__":
  from absl import app  # pylint: disable=g-import-not-at-top
  define_flags()
  app.run(main)
