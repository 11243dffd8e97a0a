"""What the dispatcher does for workers: registration and heartbeats, the
tasks it assigns them, and the splits of DYNAMIC jobs."""

from __future__ import annotations

import collections
import logging
import os
import time
from typing import Callable, Sequence

from jaxfeed.service.dispatcher import job_grants
from jaxfeed.service.dispatcher import tables as dispatcher_tables
from jaxfeed.service.dispatcher.config import DispatcherConfig
from jaxfeed.service.dispatcher.tables import Job, Task, Worker
from jaxfeed.service.protocol import read_state
from jaxfeed.service.protocol import rpc
from jaxfeed.service.protocol import split_failures
from jaxfeed.service.protocol import target_workers
from jaxfeed.service.protocol.protos import service_pb2 as pb
from jaxfeed.service.protocol.sharding import ShardingPolicy


# Split answers whose journal batch is remembered before the durable ones are dropped.
_MAX_ANSWER_BATCHES = 4096


class WorkerRegistry(dispatcher_tables.DispatcherTables):
  """The workers, their tasks and the splits they read (callers hold `lock`
  for the methods that say so)."""

  def __init__(self, config: DispatcherConfig):
    super().__init__()
    self.config = config
    # Workers of replayed tasks: address -> when they count as lost if they
    # have not registered again by then.
    self._awaited: dict[str, float] = {}
    # Split answers given, by (the call that carried them, whether it was a
    # task's first request): for --metrics_port.
    self.split_answers: collections.Counter[tuple[str, bool]] = collections.Counter()
    # Task id -> the journal batch of its last split answer, until durable: a
    # repeated request waits for that batch only (replayed ones are durable).
    self._answer_batches: dict[int, int] = {}
    # The return code of a worker process this dispatcher's pool started
    # (None while it runs; KeyError for a process it did not start): set by
    # the server when it runs a local pool.
    self.worker_exit_status: Callable[[int], int | None] | None = None
    # Which job each worker serves, under per_job autoscaling (None: any).
    self.job_grants: job_grants.JobGrants | None = None

  def _assign_tasks(self, job: Job) -> None:
    """Creates tasks for live workers that lack one (lock held)."""
    if job.fixes_workers and job.fixed_workers is None:
      if self.listed_workers(job):
        addresses = list(self.config.worker_addresses)
      else:
        wanted = self.config.num_workers or 1
        if len(self.workers) < wanted:
          return
        addresses = sorted(self.workers)[: self.config.num_workers or len(self.workers)]
      self._record(
        {
          "kind": "fix_workers",
          "job_id": job.job_id,
          "workers": [[a, i] for i, a in enumerate(addresses)],
        }
      )
    have = {t.worker_address for t in job.tasks.values()}
    indices = {t.worker_index for t in job.tasks.values()}
    for address in sorted(self.workers):
      if address in have:
        continue
      if job.fixed_workers is None and not self._read_by_a_client(job, self.workers[address]):
        continue  # no client of the job reads it: its task would hold splits unread
      if (
        job.fixed_workers is None
        and self.job_grants is not None
        and (not self.job_grants.may_serve(job, address, self._jobs_on(address)))
      ):
        continue  # per_job autoscaling: it serves another job, or none yet
      if job.fixed_workers is not None:
        index = _fixed_index(job.fixed_workers, address, indices)
        if index is None:
          continue
        indices.add(index)
        count = len(job.fixed_workers)
      else:  # parallel_epochs: the worker's order; DYNAMIC: 0
        index, count = job.next_worker_index(indices), 1
        indices.add(index)
      self._record(
        {
          "kind": "task",
          "id": self._next_id(),
          "job_id": job.job_id,
          "worker_address": address,
          "worker_index": index,
          "num_workers": count,
        }
      )

  def _jobs_on(self, address: str) -> set[int]:
    """The jobs with unfinished tasks on the worker at `address` (lock held)."""
    return {
      t.job_id for t in self._tasks_of_worker(self.workers[address]).values() if not t.finished
    }

  def assign_granted(self, job_id: int) -> None:
    """Gives the job tasks on the workers granted to it (per_job autoscaling)."""
    with self.lock:
      job = self.jobs.get(job_id)
      if job is not None:
        self.lock.check_writable()
        self._assign_tasks(job)

  def listed_workers(self, job: Job) -> bool:
    """Whether `job` shards over the dispatcher's `worker_addresses`: worker
    i of the list reads shard i, and the job ends once each shard was read."""
    return bool(self.config.worker_addresses) and job.policy.is_static

  def _read_by_a_client(self, job: Job, worker: Worker) -> bool:
    """Whether some client of the job reads the worker (its target_workers);
    with no client yet, whether a client of any process would."""
    processes = set(job.client_processes.values()) or {""}
    if len(processes) < len(job.clients):
      processes.add("")  # a client that sent no process
    return any(
      target_workers.reads(job.target_workers, process, worker.process_id, worker.tags)
      for process in processes
    )

  def _release_goodbyes(self, goodbyes: Sequence[pb.ClientGoodbye], served_jobs: set[int]) -> None:
    """Releases the clients that said goodbye through a worker (ClientRegistry's)."""
    raise NotImplementedError

  def _ticket_key(self, worker_address: str) -> bytes:
    if self._ticket_master is None:
      return b""
    return rpc.worker_ticket_key(self._ticket_master, worker_address)

  def _task_info(self, task: Task, for_client: bool = False) -> pb.TaskInfo:
    job = self.jobs[task.job_id]
    worker = self.workers.get(task.worker_address)
    dataset = self.datasets.get(job.dataset_id)
    key = self._ticket_key(task.worker_address) if for_client else b""
    dataset_def = self.datasets.get(job.dataset_id)
    return pb.TaskInfo(
      dataset_fingerprint=dataset_def.fingerprint if dataset_def is not None else "",
      read_ticket=rpc.read_ticket(key, task.task_id) if key else "",
      task_id=task.task_id,
      job_id=job.job_id,
      job_name=job.job_name,
      dataset_id=job.dataset_id,
      worker_address=task.worker_address,
      data_address=worker.data_address if worker else "",
      sharding_policy=job.policy.value,
      worker_index=task.worker_index,
      num_workers=task.num_workers,
      num_consumers=job.num_consumers,
      round_timeout_s=job.round_timeout_s,
      exactly_once=job.exactly_once,
      ephemeral_sharing=job.ephemeral_sharing,
      worker_process=worker.process_id if worker else "",
      worker_tags=worker.tags if worker else (),
      compression=dataset.compression if dataset is not None else "",
    )

  def _job(self, job_id: int) -> Job:
    job = self.jobs.get(job_id)
    if job is None:
      raise rpc.NotFoundError(
        self.unknown_id("job id", job_id, "it finished, was released or never existed.")
      )
    return job

  def _tasks_of_worker(self, worker: Worker) -> dict[int, Task]:
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

  # -- workers ------------------------------------------------------------------
  def worker_heartbeat(self, request: pb.WorkerHeartbeatRequest) -> pb.WorkerHeartbeatResponse:
    address = request.worker_address
    if not address:
      raise ValueError("WorkerHeartbeat: worker_address is empty.")
    with self.lock:
      self.lock.answer_without_fsync()  # unless it hands out tasks (below)
      if request.leaving:
        self._finish_tasks(request.finished_tasks)
        leaving = self.workers.get(address)
        if leaving is not None and request.client_goodbyes:
          self._release_goodbyes(
            request.client_goodbyes, {t.job_id for t in self._tasks_of_worker(leaving).values()}
          )
        if self.workers.pop(address, None) is not None:
          logging.info("Worker %s left.", address)
          self._lose_tasks_of(address)
        return pb.WorkerHeartbeatResponse()
      worker = self.workers.get(address)
      if (
        worker is not None
        and request.incarnation
        and worker.incarnation
        and request.incarnation != worker.incarnation
      ):
        # Restarted on the same address before its heartbeats timed out: the
        # new process has none of the old one's tasks or streams.
        logging.warning("Worker %s restarted: its tasks are lost.", address)
        del self.workers[address]
        self._lose_tasks_of(address, how=_RESTARTED)
        worker = None
      if worker is None:
        logging.info("Worker %s registered.", address)
        self._awaited.pop(address, None)
        worker = Worker(
          address,
          request.data_address,
          time.monotonic(),
          incarnation=request.incarnation,
          process_id=request.process_id,
          tags=tuple(request.worker_tags),
        )
        self.workers[address] = worker
        if request.incarnation:
          # Tasks journaled before a restart that the process does not run:
          # it restarted too (or never got them).
          self._lose_tasks_of(
            address, keep=set(request.current_tasks) | set(request.finished_tasks), how=_RESTARTED
          )
        for job in self.jobs.values():  # tasks journaled before a restart
          worker.tasks.update(t.task_id for t in job.tasks.values() if t.worker_address == address)
        for job in list(self.jobs.values()):
          self._assign_tasks(job)
      worker.last_heartbeat = time.monotonic()
      worker.pid, worker.parent_pid = request.pid, request.parent_pid
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
          self._record(
            {
              "kind": "splits_held",
              "job_id": job.job_id,
              "client_id": held.client_id,
              "starts": starts,
            }
          )
      for made in request.made_splits:
        task = live.get(made.task_id)
        if task is not None:
          job = self.jobs[task.job_id]
          job.made.update(s for s in made.starts if job.unacked.get(s, (0, -1))[1] == made.task_id)
      if request.client_goodbyes:  # after the splits held for them
        self._release_goodbyes(request.client_goodbyes, {t.job_id for t in live.values()})
      current = set(request.current_tasks)
      # Every task's clients again only when some job's clients changed:
      # 1,024 clients of a job are 1,024 ids sorted and sent per heartbeat.
      unchanged = request.known_clients_version == self.clients_version
      new_tasks = [
        self._new_task_info(t, request)
        for tid, t in sorted(live.items())
        if tid not in current and not t.finished
      ]
      if new_tasks:  # they, and the splits they come with, must be durable first
        self.lock.answer_after_fsync()
      return pb.WorkerHeartbeatResponse(
        new_tasks=new_tasks,
        tasks_to_delete=sorted(current - set(live)),
        ticket_key=self._ticket_key(address),
        task_clients=[]
        if unchanged
        else [
          pb.TaskClients(task_id=tid, client_ids=sorted(self.jobs[t.job_id].clients))
          for tid, t in sorted(live.items())
          if tid in current
        ],
        clients_version=self.clients_version,
        clients_unchanged=unchanged,
        heartbeat_timeout_s=self.config.heartbeat_timeout_s,
        heartbeat_interval_s=self.config.heartbeat_pacing.worker_interval(
          len(self.workers), self.config.heartbeat_timeout_s
        ),
        dispatcher_incarnation=str(self.incarnation),
      )

  def _new_task_info(self, task: Task, request: pb.WorkerHeartbeatRequest) -> pb.TaskInfo:
    """A task handed to a worker; a DYNAMIC one with the answer to its first
    GetSplits (lock held).

    A pod's workers all get their tasks when a job starts, and each asked
    for its first splits right after: one call per task in the join storm.
    The answer is recorded as that GetSplits's (request_seq 1), so a lost
    reply costs nothing: the task comes again (the worker does not list it)
    with the same ranges, and a worker that ignores the field asks with
    request_seq 1 and gets them too. Workers without an incarnation predate
    numbered requests, and draining ones start no new task: they get none.
    """
    info = self._task_info(task)
    job = self.jobs[task.job_id]
    last = job.last_splits.get(task.task_id)
    if (
      job.policy == ShardingPolicy.DYNAMIC
      and request.incarnation
      and request.splits_per_request >= 0
      and (last is None or last[0] == 1)
    ):
      info.first_splits.CopyFrom(
        self._answer_splits(
          job, task.task_id, request.splits_per_request or 2, 1, "WorkerHeartbeat"
        )
      )
    return info

  def get_splits(self, request: pb.GetSplitsRequest) -> pb.GetSplitsResponse:
    with self.lock:
      job = self._job(request.job_id)
      if job.policy != ShardingPolicy.DYNAMIC:
        raise ValueError(
          f"Job {job.job_id} uses {job.policy.name} sharding; only DYNAMIC jobs hand out splits."
        )
      if request.task_id not in job.tasks:
        raise rpc.NotFoundError(f"Task {request.task_id} is not part of job {job.job_id}.")
      return self._answer_splits(
        job, request.task_id, request.max_ranges, request.request_seq, "GetSplits"
      )

  def _answer_splits(
    self, job: Job, task_id: int, max_ranges: int, request_seq: int, via: str
  ) -> pb.GetSplitsResponse:
    """The answer to a task's GetSplits, recorded (lock held)."""
    self.split_answers[(via, request_seq == 1)] += 1
    last = job.last_splits.get(task_id)
    if request_seq and last is not None and last[0] == request_seq:
      # The worker did not get the reply: the same ranges, still its own
      # (they are acknowledged or reissued only after it had them). They wait
      # for no fsync but the one that makes them durable, if still due.
      batch = self._answer_batches.get(task_id, 0)
      if self.lock.durable(batch):
        self._answer_batches.pop(task_id, None)
        batch = 0
      self.lock.answer_without_fsync(batch)
      return pb.GetSplitsResponse(ranges=[pb.SplitRange(start=a, stop=b) for a, b in last[1]])
    if job.error:  # it failed: its tasks end
      return pb.GetSplitsResponse(end_of_splits=True)
    wanted = max(1, min(max_ranges, 64))
    ranges = _reissued(job, wanted)
    start = job.next_position
    split_size = self._split_size(job)
    if ranges and ranges[0].start in job.split_losses:
      wanted = 1  # a worker was lost on it: alone, so that a loss names it alone
    while len(ranges) < wanted:
      if 0 <= job.num_positions <= start:
        break
      stop = start + split_size
      if job.num_positions >= 0:
        stop = min(stop, job.num_positions)
      stop = read_state.clip(job.skip, start, stop)
      ranges.append(pb.SplitRange(start=start, stop=stop))
      start = read_state.skip_to(job.skip, stop)
    issued = {"task_id": task_id, "ranges": [[r.start, r.stop] for r in ranges]}
    if request_seq:
      issued["request_seq"] = request_seq
    if not ranges:  # nothing handed out, nothing recorded: no fsync to wait for
      self.lock.answer_without_fsync()
    else:
      self.lock.check_writable()  # new splits must be durable before they go out
      if request_seq:
        if len(self._answer_batches) > _MAX_ANSWER_BATCHES:
          self._answer_batches = {
            t: b for t, b in self._answer_batches.items() if not self.lock.durable(b)
          }
        self._answer_batches[task_id] = self.lock.batch
    if start != job.next_position:
      self._record(
        {
          "kind": "splits",
          "job_id": job.job_id,
          "next_position": start,
          **({} if job.exactly_once else issued),
        }
      )
    if not job.exactly_once:
      return pb.GetSplitsResponse(ranges=ranges, end_of_splits=job.splits_exhausted)
    if ranges:
      self._record({"kind": "splits_issued", "job_id": job.job_id, **issued})
    # The end only once every split arrived: until then a lost worker's
    # splits may come back to this task.
    return pb.GetSplitsResponse(
      ranges=ranges, end_of_splits=not ranges and job.all_splits_delivered
    )

  def _split_size(self, job: Job) -> int:
    """Positions per new split of `job` (lock held): one where they are
    files, as tf.data service hands out files; else the configured size,
    grown with the job's tasks."""
    dataset_def = self.datasets.get(job.dataset_id)
    if dataset_def is not None and dataset_def.positions_are_files:
      return 1
    return self.config.heartbeat_pacing.split_size(self.config.split_size, len(job.tasks))

  def _finish_tasks(self, task_ids: Sequence[int]) -> None:
    for task_id in task_ids:
      for job in self.jobs.values():
        task = job.tasks.get(task_id)
        if task is not None and not task.finished:
          self._record({"kind": "task_finished", "job_id": job.job_id, "task_id": task_id})

  def _lose_tasks_of(
    self, address: str, keep: set[int] = frozenset(), how: str | None = None
  ) -> None:
    """Records as lost the unfinished tasks on `address`, but those in `keep`.

    `how` the worker ended, unless it left on its own (None): then the
    splits it was making (reading, at-most-once) count the loss
    (`jaxfeed.service.protocol.split_failures`)."""
    for job in self.jobs.values():
      for task in list(job.tasks.values()):
        if task.worker_address == address and not task.finished and task.task_id not in keep:
          blamed = self._splits_in_the_making(job, task.task_id) if how is not None else []
          if blamed:
            self._record(
              {
                "kind": "splits_failed",
                "job_id": job.job_id,
                "ranges": blamed,
                "worker": address,
                "how": how,
              }
            )
          self._record({"kind": "task_lost", "job_id": job.job_id, "task_id": task.task_id})
          if job.exactly_once:
            self._fail_poisoned(job, [start for start, _ in blamed])

  def _splits_in_the_making(self, job: Job, task_id: int) -> list[list[int]]:
    """The splits a lost task may have died of (lock held): those of its
    last GetSplits answer (a worker asks again only once it made or, at
    most once, read them all) that it had not reported made."""
    last = job.last_splits.get(task_id)
    if last is None:
      return []
    if not job.exactly_once:
      return [[a, b] for a, b in last[1]]
    return [
      [a, b]
      for a, b in last[1]
      if job.unacked.get(a, (0, -1))[1] == task_id and a not in job.made and a not in job.holders
    ]

  def _fail_poisoned(self, job: Job, starts: Sequence[int]) -> None:
    """Hands out no more the splits that reached max_split_attempts losses,
    and fails the job (lock held)."""
    for start in starts:
      stop, losses = job.split_losses[start]
      if len(losses) >= self.config.max_split_attempts and start not in job.failed_splits:
        error = split_failures.poison_message(
          job.dataset_id, job.job_id, start, stop, losses, self.config.max_split_attempts
        )
        logging.error("%s", error)
        self._record(
          {
            "kind": "split_poisoned",
            "job_id": job.job_id,
            "start": start,
            "stop": stop,
            "error": error,
          }
        )

  def how_lost(self, worker: Worker) -> str:
    """How a worker whose heartbeats stopped ended, as far as this
    dispatcher knows: its exit where this process's pool started it."""
    if self.worker_exit_status is None or not worker.pid or worker.parent_pid != os.getpid():
      return split_failures.LOST
    try:
      return split_failures.describe_exit(self.worker_exit_status(worker.pid))
    except KeyError:  # a process of this machine the pool did not start
      return split_failures.LOST


_RESTARTED = "restarted (a new process on its address)"


def _fixed_index(fixed: dict[str, int], address: str, taken: set[int]) -> int | None:
  """The shard of a job's fixed workers that `address` reads: its own entry,
  else the first entry it matches whose shard no task reads (entries as
  tf.data's `worker_addresses`: "host:port", "host" or "host:%port%" for any
  port); None: it reads none."""
  if address in fixed:
    return fixed[address]
  host = address.rsplit(":", 1)[0]
  for entry, index in sorted(fixed.items(), key=lambda item: item[1]):
    if index not in taken and entry in (host, f"{host}:%port%"):
      return index
  return None


def _reissued(job: Job, wanted: int) -> list[pb.SplitRange]:
  """Up to `wanted` splits to issue again, oldest first; one a worker was
  lost on goes alone: first in an answer of its own (the caller adds no new
  split), else not before the next answer."""
  ranges = []
  for start, stop in sorted(job.reissue.items()):
    if len(ranges) >= wanted or (ranges and start in job.split_losses):
      break
    ranges.append(pb.SplitRange(start=start, stop=stop))
    if start in job.split_losses:
      break
  return ranges
