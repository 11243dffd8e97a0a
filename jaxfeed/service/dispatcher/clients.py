"""The dispatcher's clients (`ClientRegistry`): their heartbeats and the
answers to them, their release (a ReleaseJobClient call, a goodbye a worker
forwarded, or a timeout), the hosts they read from, and their reports,
sampled for autoscaling; `DispatcherState` builds on it."""

from __future__ import annotations

import collections
import time
from typing import Sequence

from jaxfeed.service.dispatcher import autoscale as autoscale_lib
from jaxfeed.service.dispatcher import heartbeat_pacing
from jaxfeed.service.dispatcher import job_counts
from jaxfeed.service.dispatcher import task_lists
from jaxfeed.service.dispatcher import workers as dispatcher_workers
from jaxfeed.service.dispatcher.config import DispatcherConfig
from jaxfeed.service.dispatcher.tables import Job
from jaxfeed.service.protocol import rpc
from jaxfeed.service.protocol.protos import service_pb2 as pb
from jaxfeed.service.protocol.sharding import ShardingPolicy


class ClientRegistry(dispatcher_workers.WorkerRegistry):
  """The clients of the jobs and what they report (callers hold `lock` for
  the methods that say so)."""

  def __init__(self, config: DispatcherConfig):
    super().__init__(config)
    # (when counted, live clients) and the recent joins pace client heartbeats.
    self._client_count = (float("-inf"), 0)
    self._joins = heartbeat_pacing.JoinRate()
    # Autoscaling: each client's latest cumulative report, and the reports
    # as of the last sample (not journaled: they are only rates).
    self._reports: dict[int, tuple[int, float, float, float]] = {}
    self._sampled: dict[int, tuple[int, float, float, float]] = {}
    self._sampled_at = time.monotonic()
    # What each job's consumers took, for --metrics_port (kept when clients leave).
    self.job_counts = job_counts.JobCounts()
    # The live clients' hosts, for max_jobs_per_host (clients replayed from
    # the journal count for no host).
    self._client_hosts: dict[int, str] = {}
    # Host -> its live clients (a count per join, not a scan of every client).
    self._host_clients: collections.Counter[str] = collections.Counter()
    # How clients left, for --metrics_port: "call" (ReleaseJobClient calls),
    # "worker" (goodbyes a worker forwarded), "timeout"; and the goodbyes
    # ignored: "refused" (wrong ticket, or a job the worker does not serve),
    # "stale" (the client was released already, or never joined).
    self.goodbyes: collections.Counter[str] = collections.Counter()
    # Exactly-once: client id -> the journal batch of its latest acknowledged
    # splits, until that batch is durable (heartbeats wait for no fsync).
    self._ack_batches: dict[int, int] = {}

  def client_heartbeat(
    self,
    job_id: int,
    client_id: int,
    acked_splits: Sequence[int] = (),
    report: pb.ClientHeartbeatRequest | None = None,
  ) -> pb.ClientHeartbeatResponse:
    return pb.ClientHeartbeatResponse.FromString(
      self.client_heartbeat_wire(job_id, client_id, acked_splits, report)
    )

  def client_heartbeat_wire(
    self,
    job_id: int,
    client_id: int,
    acked_splits: Sequence[int] = (),
    report: pb.ClientHeartbeatRequest | None = None,
  ) -> bytes:
    """`client_heartbeat`'s answer, serialized: the task list is serialized
    once per change, not once per heartbeat."""
    with self.lock:
      # A heartbeat's answer waits for no fsync: the splits it acknowledges
      # are durable soon after (or once a full disk takes them), and until
      # then the answer asks the client to send them again (acks_pending).
      self.lock.answer_without_fsync()
      job = self._job(job_id)
      if client_id not in job.clients:
        raise rpc.NotFoundError(f"Client {client_id} is not reading job {job_id}.")
      job.clients[client_id] = time.monotonic()
      if report is not None and report.read_elapsed_s > 0:
        self._reports[client_id] = (
          report.elements_consumed,
          report.consumer_wait_s,
          report.read_elapsed_s,
          min(max(report.buffer_fill, 0.0), 1.0),
        )
        self.job_counts.report(job_id, client_id, report.elements_consumed, report.consumer_wait_s)
      acked = sorted(s for s in set(acked_splits) if s in job.unacked or s in job.reissue)
      if acked:
        self._record({"kind": "splits_acked", "job_id": job_id, "starts": acked})
        self._ack_batches[client_id] = self.lock.batch
      acks_pending = client_id in self._ack_batches
      if acks_pending and self.lock.durable(self._ack_batches[client_id]):
        del self._ack_batches[client_id]
        acks_pending = False
      task_list = self._client_task_list(job)
      done = task_list.all_finished
      if job.policy == ShardingPolicy.DYNAMIC:
        finished = job.all_splits_delivered and done
      elif job.fixes_workers:
        finished = job.fixed_workers is not None and done
      else:
        finished = bool(job.tasks) and done
      if job.fixed_workers is not None and self.listed_workers(job):
        finished = finished and len(
          {  # every listed worker's shard was read
            t.worker_index for t in job.tasks.values() if t.finished
          }
        ) == len(job.fixed_workers)
      elif job.fixed_workers is not None and len(job.tasks) < len(job.fixed_workers):
        finished = finished and not any(  # a fixed worker may still come back
          a in self.workers for a in job.fixed_workers
        )
      live_clients, joins_per_s = self._client_load()
      pacing = self.config.heartbeat_pacing
      response = pb.ClientHeartbeatResponse(
        job_finished=finished,
        tasks_version=task_list.version,
        acks_pending=acks_pending,
        heartbeat_interval_s=pacing.client_interval(
          live_clients, self.config.client_timeout_s, joins_per_s
        ),
        job_error=job.error,
        lost_ranges=[pb.SplitRange(start=a, stop=b) for a, b in job.lost],
      )
      if pacing.goodbye_via_worker(live_clients):
        response.goodbye_via_worker = True
        if self._ticket_master is not None:
          response.goodbye_ticket = rpc.goodbye_ticket(self._ticket_master, job_id, client_id)
      if report is not None and report.known_tasks_version == task_list.version:
        response.tasks_unchanged = True
        return response.SerializeToString()
      # Serialized messages concatenate into their merge.
      return response.SerializeToString() + task_list.serialized

  def _client_task_list(self, job: Job) -> task_lists.TaskList:
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
      job.job_id, tasks, lambda task_id: self._task_info(job.tasks[task_id], for_client=True)
    )

  def _client_load(self) -> tuple[int, float]:
    """(clients of all jobs, counted at most every COUNT_EVERY_S; joins a
    second) (lock held)."""
    counted_at, count = self._client_count
    now = time.monotonic()
    if now - counted_at > heartbeat_pacing.COUNT_EVERY_S:
      count = sum(len(job.clients) for job in self.jobs.values())
      self._client_count = (now, count)
    return count, self._joins.per_s(now)

  def release_client(
    self, job_id: int, client_id: int, last_report: pb.ReleaseJobClientRequest | None = None
  ) -> None:
    """A client leaves; `last_report` carries its final counts."""
    with self.lock:
      self.lock.answer_without_fsync()  # a client that leaves waits for nothing
      self.goodbyes["call"] += 1
      job = self.jobs.get(job_id)
      if job is None or client_id not in job.clients:
        return
      if last_report is not None:
        self.job_counts.report(
          job_id, client_id, last_report.elements_consumed, last_report.consumer_wait_s
        )
      self.release_client_locked(job_id, client_id)

  def sample_clients(self) -> autoscale_lib.Sample | None:
    """The live clients' reports since the last call, as one sample."""
    with self.lock:
      self.lock.answer_without_fsync()
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
    return autoscale_lib.Sample(
      elements_per_s=elements / span,
      wait_fraction=sum(waits) / len(waits),
      buffer_fill=sum(fills) / len(fills),
      num_clients=len(waits),
    )

  def _release_goodbyes(self, goodbyes: Sequence[pb.ClientGoodbye], served_jobs: set[int]) -> None:
    """Releases the clients whose goodbyes a worker forwarded, as
    ReleaseJobClient does (lock held). Ignored: a goodbye for a client
    released already (a repeated heartbeat, a client that called after all)
    or unknown, for a job the worker serves no task of, or with a ticket that
    is not the client's."""
    for goodbye in goodbyes:
      job = self.jobs.get(goodbye.job_id)
      master = self._ticket_master
      if job is None or goodbye.client_id not in job.clients:
        self.goodbyes["stale"] += 1
      elif goodbye.job_id not in served_jobs or (
        master is not None
        and not rpc.hex_digest_matches(
          rpc.goodbye_ticket(master, goodbye.job_id, goodbye.client_id), goodbye.ticket
        )
      ):
        self.goodbyes["refused"] += 1
      else:
        self.goodbyes["worker"] += 1
        self.job_counts.report(
          goodbye.job_id, goodbye.client_id, goodbye.elements_consumed, goodbye.consumer_wait_s
        )
        self.release_client_locked(goodbye.job_id, goodbye.client_id)

  def release_client_locked(self, job_id: int, client_id: int) -> None:
    self._record({"kind": "client_released", "job_id": job_id, "client_id": client_id})
    self._forget_host(client_id)
    self._ack_batches.pop(client_id, None)
    self.job_counts.client_left(job_id, client_id)
    job = self.jobs[job_id]
    if job.clients:
      return
    if job.job_name:  # shared: a late consumer may still join it
      job.idle_since = time.monotonic()
    else:
      self._record({"kind": "job_deleted", "job_id": job_id})

  def _forget_host(self, client_id: int) -> None:
    host = self._client_hosts.pop(client_id, None)
    if host is not None:
      self._host_clients[host] -= 1
      if not self._host_clients[host]:
        del self._host_clients[host]
