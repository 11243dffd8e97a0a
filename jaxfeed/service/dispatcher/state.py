"""The dispatcher's bookkeeping (`DispatcherState`): its journal, datasets,
jobs and the clients that join them, liveness; clients' heartbeats are
`jaxfeed.service.dispatcher.clients`'s, workers and splits
`jaxfeed.service.dispatcher.workers`'s."""

from __future__ import annotations

import base64
import logging
import os
import time

from jaxfeed.service.dispatcher import clients as dispatcher_clients
from jaxfeed.service.dispatcher.config import DispatcherConfig
from jaxfeed.service.protocol import import_paths
from jaxfeed.service.protocol import read_state
from jaxfeed.service.protocol import rpc
from jaxfeed.service.protocol import spec as spec_lib
from jaxfeed.service.protocol import spec_signature
from jaxfeed.service.protocol import split_failures
from jaxfeed.service.protocol import target_workers
from jaxfeed.service.protocol import wire
from jaxfeed.service.protocol.protos import service_pb2 as pb
from jaxfeed.service.protocol.sharding import ShardingPolicy, to_sharding_policy
from jaxfeed.service.storage import journal as journal_lib
from jaxfeed.service.storage import journal_lock
from jaxfeed.service.worker import round_assembly


_MAX_DATASET_ID = 256  # characters of a dataset id a user chose
_MAX_RESUME_ORDERS = 65536  # worker streams a resumed parallel_epochs read continues


class DispatcherState(dispatcher_clients.ClientRegistry):
  """The dispatcher's bookkeeping; every change is journaled before it is acknowledged."""

  def __init__(self, config: DispatcherConfig):
    super().__init__(config)
    self._journal = None
    self.replay_stats = journal_lib.ReplayStats()
    if config.work_dir:
      self._journal = journal_lib.Journal(
        config.work_dir,
        config.journal_fsync,
        config.snapshot_every_records,
        config.snapshot_every_bytes,
        config.journal_damage,
      )
      replay_started = time.monotonic()
      self.replaying = True
      self.replay_stats = self._journal.replay(self._apply)
      self.replaying = False
      self.replay_seconds = time.monotonic() - replay_started  # for --metrics_port
      deadline = time.monotonic() + config.heartbeat_timeout_s
      self._awaited = {
        t.worker_address: deadline
        for job in self.jobs.values()
        for t in job.tasks.values()
        if not t.finished
      }
    self.lock = journal_lock.JournalLock(self._journal, self._live_records)
    self.lock.snapshot_now()  # files of the previous release: written again, checked
    with self.lock:
      # Durable before any call that must be (they wait for what they saw).
      self.lock.answer_without_fsync()
      if not self.incarnation:  # a new state: workers drop what they learnt before
        self._record({"kind": "incarnation", "id": self._next_id()})
      if config.auth_token and self._ticket_master is None:
        self._record({"kind": "ticket_master", "key": os.urandom(32).hex()})

  def close(self) -> None:
    if self._journal is not None:
      self._journal.close()

  @property
  def journal(self) -> journal_lib.Journal | None:
    """The journal (None without a work_dir): its health, for the servers."""
    return self._journal

  # -- datasets -------------------------------------------------------------
  def register_dataset(
    self, dataset_def: pb.DatasetDef, dataset_id: str = "", compression: str = ""
  ) -> str:
    """Registers a pipeline; returns its dataset id.

    Args:
      dataset_def: the pipeline's spec.
      dataset_id: an id the user chose ("": the dispatcher's own, shared by
        equal pipelines). The same pipeline under it again gets it back;
        another pipeline under it is refused (ValueError).
      compression: the dataset's compression for reads that name none
        ("", "AUTO", "lz4" or "zstd"); not part of its fingerprint.
    """
    _check_dataset_id(dataset_id)
    if compression not in (*wire.COMPRESSIONS, wire.COMPRESSION_AUTO):
      raise ValueError(
        f"RegisterDataset: compression must be one of "
        f"{(*wire.COMPRESSIONS, wire.COMPRESSION_AUTO)}, got {compression!r:.40}."
      )
    spec_signature.check_signature(dataset_def, self.config.pickled_udf_secret)
    import_paths.check_spec_paths(dataset_def, self.config.udf_modules)
    if not dataset_def.graph_json:
      raise ValueError("RegisterDataset: the dataset definition has no graph.")
    # Computed here from the spec's content, never taken from the client: a
    # forged fingerprint would let one pipeline be served another's data.
    trusted = pb.DatasetDef()
    trusted.CopyFrom(dataset_def)
    trusted.fingerprint = spec_lib.fingerprint(dataset_def)
    trusted.compression = compression
    with self.lock:
      self.lock.check_writable()
      if dataset_id:
        existing = dataset_id if dataset_id in self.datasets else None
        if existing is not None and (self.datasets[existing].fingerprint != trusted.fingerprint):
          raise ValueError(
            f"Dataset id {dataset_id!r} is registered for another pipeline "
            f"(fingerprint {self.datasets[existing].fingerprint}, this one "
            f"{trusted.fingerprint}): a dataset id names one pipeline. Register "
            "this one under another id, or without one."
          )
      else:
        existing = self.dataset_by_fingerprint.get(trusted.fingerprint)
      if existing is not None:
        self._unread_since.pop(existing, None)  # registered again: in use
        return existing
      # A user's id is no number of the dispatcher's (one like "7" would
      # otherwise move its ids): the dispatcher's own skip the ids taken.
      numbered = {}
      if not dataset_id:
        dataset_id = str(self._next_id())
        while dataset_id in self.datasets:  # a user chose it
          dataset_id = str(self._next_id())
        numbered = {"id": dataset_id}
      self._record(
        {
          "kind": "dataset",
          **numbered,
          "dataset_id": dataset_id,
          "def": base64.b64encode(trusted.SerializeToString()).decode(),
        }
      )
      return dataset_id

  def dataset_def(self, dataset_id: str) -> pb.DatasetDef:
    with self.lock:
      # Asked by a worker for a task it was given: its dataset is durable.
      self.lock.answer_without_fsync()
      found = self.datasets.get(dataset_id)
    if found is None:
      raise rpc.NotFoundError(
        self.unknown_id("dataset id", dataset_id, "register the dataset first.")
      )
    return found

  # -- jobs -------------------------------------------------------------------
  def get_or_create_job(self, request: pb.GetOrCreateJobRequest, host: str = "") -> tuple[int, int]:
    """Returns (job id, client id); `host` is the client's, for max_jobs_per_host."""
    policy = to_sharding_policy(request.sharding_policy)
    _check_job_request(request, policy)
    target = target_workers.check_target_workers(request.target_workers or target_workers.AUTO)
    with self.lock:
      self.lock.check_writable()
      open_jobs = self._host_clients[host]
      if host and open_jobs >= self.config.max_jobs_per_host:
        raise rpc.StatusError(
          "RESOURCE_EXHAUSTED",
          f"Client host {host} already reads {open_jobs} jobs, the most "
          f"max_jobs_per_host={self.config.max_jobs_per_host} allows "
          "(--max_jobs_per_host): finish or release some first.",
        )
      dataset_def = self.datasets.get(request.dataset_id)
      if dataset_def is None:
        raise rpc.NotFoundError(
          self.unknown_id("dataset id", request.dataset_id, "register the dataset first.")
        )
      job = None
      if request.job_name:
        job_id = self.job_by_name.get(request.job_name)
        job = self.jobs.get(job_id) if job_id is not None else None
        if job is not None and (
          job.dataset_id != request.dataset_id
          or job.policy != policy
          or job.num_consumers != request.num_consumers
          or job.exactly_once != request.exactly_once
          or job.ephemeral_sharing != request.ephemeral_sharing
        ):
          raise ValueError(
            f"Job {request.job_name!r} exists for dataset {job.dataset_id} with "
            f"processing mode {job.policy.name}, num_consumers "
            f"{job.num_consumers}, {_visitation(job.exactly_once)} visitation and "
            f"ephemeral_sharing={job.ephemeral_sharing}; it cannot be read as "
            f"dataset {request.dataset_id} with {policy.name} / num_consumers "
            f"{request.num_consumers} / {_visitation(request.exactly_once)} / "
            f"ephemeral_sharing={request.ephemeral_sharing}: every consumer of a "
            "job must pass the same dataset, processing mode, num_consumers, "
            "visitation and ephemeral_sharing."
          )
        if job is not None and (job.identical_worker_streams != request.identical_worker_streams):
          raise ValueError(
            f"Job {request.job_name!r} is read with identical_worker_streams="
            f"{job.identical_worker_streams}; a consumer asked for "
            f"{request.identical_worker_streams}: every consumer of a job must "
            "pass the same identical_worker_streams."
          )
        if job is not None and job.target_workers != target:
          raise ValueError(
            f"Job {request.job_name!r} is read with target_workers="
            f"{job.target_workers!r}; a consumer asked for {target!r}: every "
            "consumer of a job must pass the same target_workers."
          )
        if (
          job is not None
          and request.round_timeout_s
          and (request.round_timeout_s != job.round_timeout_s)
        ):
          raise ValueError(
            f"Job {request.job_name!r} has round_timeout_s "
            f"{job.round_timeout_s}; a consumer asked for "
            f"{request.round_timeout_s}: pass the same value (or none)."
          )
      if job is None:
        if policy == ShardingPolicy.DYNAMIC and dataset_def.num_positions == 0:
          pass  # an empty pipeline: the job finishes at once
        done = [[r.start, r.stop] for r in request.resume_done]
        partial = [[r.start, r.stop] for r in request.resume_partial]
        read_state.check_resume_ranges(done, partial, int(dataset_def.num_positions))
        job_id = self._next_id()
        self._record(
          {
            "kind": "job",
            "id": job_id,
            "dataset_id": request.dataset_id,
            **({"skip": read_state.merge_ranges(done + partial)} if done or partial else {}),
            "policy": policy.value,
            "job_name": request.job_name,
            "num_consumers": request.num_consumers,
            "num_positions": int(dataset_def.num_positions),
            "round_timeout_s": (request.round_timeout_s or round_assembly.DEFAULT_ROUND_TIMEOUT_S),
            "exactly_once": request.exactly_once,
            "ephemeral_sharing": request.ephemeral_sharing,
            **({"target_workers": target} if target != target_workers.AUTO else {}),
            **({"identical_worker_streams": True} if request.identical_worker_streams else {}),
            **(
              {"resume_orders": list(request.resume_worker_indices)}
              if request.resume_worker_indices
              else {}
            ),
          }
        )
        if partial:  # issued again first, whole
          self._record({"kind": "splits_lost", "job_id": job_id, "ranges": partial})
        job = self.jobs[job_id]
      holder = (
        next((c for c, i in job.consumers.items() if i == request.consumer_index), None)
        if job.num_consumers
        else None
      )
      if holder is not None:
        raise ValueError(
          f"consumer_index {request.consumer_index} of job {job.job_name!r} is "
          f"already being read by client {holder}: each consumer of a "
          f"round-robin job needs its own index in [0, {job.num_consumers}). A "
          "consumer that died is released after "
          f"client_timeout_s={self.config.client_timeout_s:g} s without heartbeats."
        )
      client_id = self._next_id()
      self._record(
        {
          "kind": "client",
          "id": client_id,
          "job_id": job.job_id,
          "consumer_index": request.consumer_index,
          **({"process": request.client_process} if request.client_process else {}),
        }
      )
      if not job.tasks or len(job.tasks) < len(self.workers):
        self._assign_tasks(job)  # workers this client reads may lack a task
      self._joins.note(time.monotonic())
      if host:
        self._client_hosts[client_id] = host
        self._host_clients[host] += 1
      job.idle_since = None
      return job.job_id, client_id

  def check_liveness(self, away_s: float = 0.0) -> None:
    """Drops workers and clients whose heartbeats stopped. `away_s`: how
    long this dispatcher itself was not running since the last check
    (stopped, or starved of CPU): nobody could reach it meanwhile, so every
    deadline moves by as much."""
    now = time.monotonic()
    with self.lock:
      self.lock.answer_without_fsync()  # nobody waits for its answer
      if away_s > 0:
        self._excuse_absence(away_s, now)
      for address, worker in list(self.workers.items()):
        if now - worker.last_heartbeat <= self.config.heartbeat_timeout_s:
          continue
        how = self.how_lost(worker)
        logging.warning(
          "Worker %s missed heartbeats for %.1fs: declared dead (%s).",
          address,
          now - worker.last_heartbeat,
          how,
        )
        del self.workers[address]
        self._lose_tasks_of(address, how=how)
      for address, deadline in list(self._awaited.items()):
        if now > deadline:  # did not come back after a dispatcher restart
          logging.warning("Worker %s did not register again: its tasks are lost.", address)
          del self._awaited[address]
          self._lose_tasks_of(address, how=split_failures.LOST)
      for job in list(self.jobs.values()):
        for client_id, seen in list(job.clients.items()):
          if now - seen > self.config.client_timeout_s:
            self.goodbyes["timeout"] += 1
            self.release_client_locked(job.job_id, client_id)
        if job.job_name and not job.clients and job.idle_since is None:
          job.idle_since = now  # replayed from the journal without clients
        if (
          job.idle_since is not None
          and not job.clients
          and now - job.idle_since > self.config.job_gc_timeout_s
        ):
          self._record({"kind": "job_deleted", "job_id": job.job_id})
      self.job_counts.keep(self.jobs)
      self._collect_datasets(now)

  def _excuse_absence(self, away_s: float, now: float) -> None:
    """Moves every liveness deadline `away_s` later, but none past what a
    party heard `now` gets (lock held): a dispatcher woken from SIGSTOP
    takes none of the workers and clients that heartbeated in vain for
    dead, and one that died before it stopped is still found out."""
    logging.warning(
      "The dispatcher did not run for %.1f s (stopped, or starved of "
      "CPU): workers and clients get as much longer to heartbeat.",
      away_s,
    )
    for worker in self.workers.values():
      worker.last_heartbeat = min(worker.last_heartbeat + away_s, now)
    timeout_s = self.config.heartbeat_timeout_s
    self._awaited = {
      address: min(deadline + away_s, now + timeout_s)
      for address, deadline in self._awaited.items()
    }
    for job in self.jobs.values():
      for client_id, seen in job.clients.items():
        job.clients[client_id] = min(seen + away_s, now)
      if job.idle_since is not None:
        job.idle_since = min(job.idle_since + away_s, now)
    for dataset_id, since in self._unread_since.items():
      self._unread_since[dataset_id] = min(since + away_s, now)

  def _collect_datasets(self, now: float) -> None:
    """Deletes datasets no job has read for dataset_gc_timeout_s (lock held)."""
    read = {job.dataset_id for job in self.jobs.values()}
    for dataset_id in list(self.datasets):
      if dataset_id in read:
        self._unread_since.pop(dataset_id, None)
      elif now - self._unread_since.setdefault(dataset_id, now) > (
        self.config.dataset_gc_timeout_s
      ):
        self._record({"kind": "dataset_deleted", "dataset_id": dataset_id})

  def num_workers(self) -> int:
    """The workers registered and alive."""
    with self.lock:
      self.lock.answer_without_fsync()
      return len(self.workers)


def _visitation(exactly_once: bool) -> str:
  return "exactly-once" if exactly_once else "at-most-once"


def _check_dataset_id(dataset_id: str) -> None:
  if len(dataset_id) > _MAX_DATASET_ID or not dataset_id.isprintable():
    raise ValueError(
      f"RegisterDataset: dataset_id must be at most {_MAX_DATASET_ID} "
      f"printable characters, got {dataset_id!r:.80}."
    )


def _check_job_request(request: pb.GetOrCreateJobRequest, policy: ShardingPolicy) -> None:
  """Raises ValueError (INVALID_ARGUMENT) for inconsistent read options."""
  k = request.num_consumers
  if k < 0:
    raise ValueError(f"num_consumers must be >= 0, got {k}.")
  if k and not request.job_name:
    raise ValueError(
      f"num_consumers={k} needs a job_name: the consumers of a round-robin read share one job."
    )
  if k and not 0 <= request.consumer_index < k:
    raise ValueError(
      f"consumer_index must be in [0, num_consumers={k}), got {request.consumer_index}."
    )
  if not k and (request.consumer_index or request.round_timeout_s):
    raise ValueError(
      "consumer_index and round_timeout_s apply to round-robin reads only: pass num_consumers too."
    )
  if request.round_timeout_s < 0 or request.round_timeout_s != request.round_timeout_s:
    raise ValueError(
      f"round_timeout_s must be > 0 (or 0 for the job's value), got {request.round_timeout_s}."
    )
  if request.exactly_once and (policy != ShardingPolicy.DYNAMIC or k):
    raise ValueError(
      f"Exactly-once visitation needs DYNAMIC sharding without num_consumers; "
      f"got {policy.name} and num_consumers={k}."
    )
  if (request.resume_done or request.resume_partial) and not request.exactly_once:
    raise ValueError("Only exactly-once reads resume from a saved state.")
  if request.ephemeral_sharing and (policy != ShardingPolicy.OFF or k):
    raise ValueError(
      f"Ephemeral sharing needs OFF sharding (parallel_epochs) without "
      f"num_consumers; got {policy.name} and num_consumers={k}."
    )
  if (request.identical_worker_streams or request.resume_worker_indices) and (
    policy != ShardingPolicy.OFF
  ):
    raise ValueError(
      f"identical_worker_streams and resume_worker_indices apply to OFF "
      f"sharding (parallel_epochs) only; got {policy.name}."
    )
  indices = list(request.resume_worker_indices)
  if (
    len(indices) > _MAX_RESUME_ORDERS
    or len(set(indices)) != len(indices)
    or any(i < 0 for i in indices)
  ):
    raise ValueError(
      f"resume_worker_indices must be at most {_MAX_RESUME_ORDERS} distinct "
      f"indices >= 0, got {len(indices)}: {indices[:10]}."
    )
