"""Which job each worker serves under the per_job autoscaling policy
(`JobGrants`): a worker serves one job at a time.

A worker is granted to one job; the dispatcher gives it tasks of that job
only (`may_serve`, asked where it assigns tasks). A new job takes a free
worker at once. A job that was promised a worker waits in `waiting` until
one registers (a new process of the pool) or is granted a free one. A
worker taken from a job drains: it gets no task until it is gone. The
grants are not journaled: after a restart they come back from the tasks
(`sync`), which are.
"""

from __future__ import annotations

import time
from typing import Iterable, Mapping

from jaxfeed.service.dispatcher.tables import Job


# The job a spare worker being stopped "served" (JobGrants.draining).
SPARE = -1


def jobs_on(address: str, jobs: Iterable[Job]) -> set[int]:
  """The jobs that have an unfinished task on the worker at `address`."""
  return {
    job.job_id
    for job in jobs
    for task in job.tasks.values()
    if task.worker_address == address and not task.finished
  }


class JobGrants:
  """The worker -> job grants (callers hold the dispatcher state's lock)."""

  def __init__(self):
    self.owner: dict[str, int] = {}  # worker address -> its job
    self.granted_at: dict[str, float] = {}
    # Jobs promised a worker that has yet to come, one entry per worker,
    # with when it was promised.
    self.waiting: list[tuple[int, float]] = []
    self.draining: dict[str, int] = {}  # address -> the job it served
    # Workers whose stop is under way: they count (as draining) until the
    # pool has stopped them, even once they told the dispatcher they left.
    self.stopping: set[str] = set()

  def may_serve(self, job: Job, address: str, busy: set[int]) -> bool:
    """Whether the worker at `address`, which has unfinished tasks of the
    jobs `busy`, may get a task of `job`; a free worker is granted to the
    job if it waits for one."""
    job_id = job.job_id
    if address in self.draining:
      return False
    if busy - {job_id}:
      return False
    owner = self.owner.get(address)
    if owner is not None:
      return owner == job_id
    if busy:  # a task of the job from before a restart
      self.grant(address, job_id)
      return True
    for i, (waiting, _) in enumerate(self.waiting):
      if waiting == job_id:
        del self.waiting[i]
        self.grant(address, job_id)
        return True
    if not self.waiting and job.clients and job_id not in self.owner.values():
      self.grant(address, job_id)  # a job starts with one worker, at once if one is free
      return True
    return False

  def grant(self, address: str, job_id: int) -> None:
    self.owner[address] = job_id
    self.granted_at[address] = time.monotonic()

  def drain(self, address: str) -> None:
    """Takes the worker from its job: it gets no task until it is gone."""
    job_id = self.owner.pop(address)
    self.granted_at.pop(address, None)
    self.draining[address] = job_id

  def newest_of(self, job_id: int) -> str | None:
    """The worker granted to the job last (None: it has none)."""
    mine = [a for a, j in self.owner.items() if j == job_id]
    return max(mine, key=lambda a: (self.granted_at.get(a, 0.0), a)) if mine else None

  def sync(self, workers: Iterable[str], jobs: Mapping[int, Job], waiting_timeout_s: float) -> None:
    """Forgets workers that are gone and jobs that ended; grants each worker
    to the job it has tasks of (tasks replayed after a restart); drops the
    promises older than `waiting_timeout_s` (a worker that never came)."""
    live = set(workers)
    for address in [a for a, j in self.owner.items() if a not in live or j not in jobs]:
      del self.owner[address]
      self.granted_at.pop(address, None)
    for address in [a for a in self.draining if a not in live and a not in self.stopping]:
      del self.draining[address]
    for address in live - set(self.owner) - set(self.draining):
      busy = jobs_on(address, jobs.values())
      if len(busy) == 1:
        self.grant(address, busy.pop())
    now = time.monotonic()
    self.waiting = [
      (j, since) for j, since in self.waiting if j in jobs and now - since < waiting_timeout_s
    ]

  def workers_of(self, job_ids: Iterable[int]) -> dict[int, int]:
    """Job -> its workers: granted (draining ones not) and promised."""
    counts = {job_id: 0 for job_id in job_ids}
    for job_id in list(self.owner.values()) + [j for j, _ in self.waiting]:
      if job_id in counts:
        counts[job_id] += 1
    return counts

  def free(self, workers: Iterable[str], jobs: Mapping[int, Job]) -> list[str]:
    """The registered workers granted to no job, draining not, with no task."""
    return sorted(
      a
      for a in workers
      if a not in self.owner and a not in self.draining and not jobs_on(a, jobs.values())
    )
