"""The dispatcher's thread for `AutoscaleConfig(policy="per_job")`
(`JobAutoscaler`): each job gets its own workers, sized on its own batch
time by `jaxfeed.service.dispatcher.job_scaling`.

Every interval it samples each job's client reports, asks the policy and
applies its decisions through `jaxfeed.service.dispatcher.job_grants`:

* A worker for a job: a free registered worker is granted to it at once;
  else the job is promised the next worker to register and the pool's
  backend starts one.
* A worker taken from a job: the worker granted to it last drains (the
  backend stops that very worker: SIGTERM, so it takes no new splits,
  finishes those it holds and waits for its consumers to take its batches;
  DYNAMIC jobs lose nothing), and counts against max_workers until gone.
* Free workers nobody waits for are stopped, down to min_workers.

Jobs that fix their workers (static sharding, `num_consumers`) read the
workers they fixed when they started and are not scaled.

`job_decisions` (by job label: its job_name, else its id) is what
`--metrics_port` exports as jaxfeed_job_scaling_decisions_total, beside
the dispatcher's jaxfeed_job_workers; `job_workers` is each job's count as
the policy sees it.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Any, Iterator

from jaxfeed.service import metrics
from jaxfeed.service.dispatcher import autoscale as autoscale_lib
from jaxfeed.service.dispatcher import job_grants
from jaxfeed.service.dispatcher import job_scaling

_LOG = logging.getLogger(__name__)

# Client reports: (elements consumed, seconds waited, seconds read, buffer fill).
_Report = tuple[int, float, float, float]


def job_sample(reports: list[tuple[_Report, _Report]]) -> job_scaling.JobSample | None:
  """One job's sample from its clients' (report now, report at the last
  sample); None when none reported since or took an element (a consumer
  blocked on its first element reports its wait only once it has it)."""
  times, waits, fills = [], [], []
  for (count, wait_s, elapsed_s, fill), before in reports:
    span = elapsed_s - before[2]
    if span <= 0 or count <= before[0]:
      continue
    times.append(span / (count - before[0]))
    waits.append(min(1.0, max(0.0, (wait_s - before[1]) / span)))
    fills.append(fill)
  if not times:
    return None
  return job_scaling.JobSample(
    batch_time_s=sum(times) / len(times),
    wait_fraction=sum(waits) / len(waits),
    buffer_fill=sum(fills) / len(fills),
    num_clients=len(times),
  )


class JobAutoscaler(autoscale_lib.Autoscaler):
  """Sizes each job's workers (see the module's docstring).

  Args:
    config: The policy's settings (`policy="per_job"`).
    backend: Starts the pool's workers and stops chosen ones (`stop_worker_at`).
    state: The dispatcher's `DispatcherState`.
  """

  def __init__(self, config: autoscale_lib.AutoscaleConfig, backend: Any, state: Any):
    super().__init__(config, backend, sample=lambda: None)
    self.job_policy = job_scaling.JobScalingPolicy(config)
    self.grants = job_grants.JobGrants()
    self._state = state
    state.job_grants = self.grants
    self._sampled: dict[int, _Report] = {}
    self._stops: list[threading.Thread] = []
    self._free_since: dict[str, float] = {}  # free worker -> since when
    # Job label -> its workers at the last interval; (label, direction,
    # reason) -> decisions made (for --metrics_port).
    self.job_workers: dict[str, int] = {}
    self.job_decisions: collections.Counter[tuple[str, str, str]] = collections.Counter()

  def _step(self) -> None:
    state = self._state
    with state.lock:
      state.lock.answer_without_fsync()
      jobs = state.jobs
      self.grants.sync(state.workers, jobs, autoscale_lib.START_TIMEOUT_S)
      # Static sharding and round-robin reads fix their workers: not scaled.
      live = {job_id: job for job_id, job in jobs.items() if job.clients and not job.fixes_workers}
      reports: dict[int, _Report] = state._reports  # pylint: disable=protected-access
      pairs = {
        job_id: [
          (reports[c], self._sampled.get(c, (0, 0.0, 0.0, 0.0)))
          for c in job.clients
          if c in reports
        ]
        for job_id, job in live.items()
      }
      self._sampled = {
        c: r for c, r in reports.items() if any(c in job.clients for job in live.values())
      }
      idle = {
        job_id for job_id in self.grants.owner.values() if job_id not in live and job_id in jobs
      }
      workers = self.grants.workers_of(set(live) | idle)
      starting = {job_id for job_id, _ in self.grants.waiting}
      draining = len(self.grants.draining)
      free = self.grants.free(state.workers, jobs)
      pids = {a: w.pid for a, w in state.workers.items()}
      labels = {job_id: metrics.job_label(jobs[job_id].job_name, job_id) for job_id in workers}
      known = {metrics.job_label(job.job_name, job.job_id) for job in jobs.values()}
    # A job's counts live as long as the job.
    for key in [k for k in self.job_decisions if k[0] not in known]:
      del self.job_decisions[key]
    free = self._keep_promises(free)
    samples = {job_id: job_sample(p) for job_id, p in pairs.items()}
    decisions = self.job_policy.decide(workers, samples, starting, draining, idle)
    for d in decisions:
      if d.change > 0:
        free = self._add(d.job, free)
      elif d.change < 0:
        self._remove(d.job, pids)
      if d.change:
        _LOG.info(
          "Autoscaler: job %s %d -> %d workers (%s).",
          labels[d.job],
          workers[d.job],
          workers[d.job] + d.change,
          d.reason,
        )
      self.job_decisions[(labels[d.job], autoscale_lib.direction(d.change), d.reason)] += 1
      self.decision_counts[autoscale_lib.direction(d.change)] += 1
    if not any(d.change > 0 for d in decisions):
      self._stop_spare(free, pids)
    total = sum(workers.values())
    change = sum(d.change for d in decisions)
    self.decisions.append((total, change))
    self.job_workers = {
      labels[job_id]: count + sum(d.change for d in decisions if d.job == job_id)
      for job_id, count in workers.items()
    }

  def _keep_promises(self, free: list[str]) -> list[str]:
    """Grants free workers to the jobs promised one; returns those left."""
    granted = []
    with self._state.lock:
      self._state.lock.answer_without_fsync()
      while free and self.grants.waiting:
        job_id, _ = self.grants.waiting.pop(0)
        self.grants.grant(free[0], job_id)
        granted.append(job_id)
        free = free[1:]
    for job_id in granted:
      self._state.assign_granted(job_id)
    return free

  def _add(self, job_id: int, free: list[str]) -> list[str]:
    """Grants a free worker to the job, or promises it the next one to
    register and starts one; returns the workers still free."""
    if free:
      with self._state.lock:
        self._state.lock.answer_without_fsync()
        self.grants.grant(free[0], job_id)
      self._state.assign_granted(job_id)
      return free[1:]
    with self._state.lock:
      self._state.lock.answer_without_fsync()
      self.grants.waiting.append((job_id, time.monotonic()))
    self.backend.start_worker()
    return free

  def _remove(self, job_id: int, pids: dict[str, int]) -> None:
    """Drains the worker granted to the job last; the backend stops it."""
    with self._state.lock:
      self._state.lock.answer_without_fsync()
      address = self.grants.newest_of(job_id)
      if address is None:  # only promised: the promise goes
        for i, (waiting, _) in enumerate(self.grants.waiting):
          if waiting == job_id:
            del self.grants.waiting[i]
            break
        return
      self.grants.drain(address)
    self._stop_worker(address, pids.get(address, 0))

  def _stop_spare(self, free: list[str], pids: dict[str, int]) -> None:
    """Stops one worker beyond min_workers that was free (and nobody waited
    for one) for scale_down_intervals intervals."""
    now = time.monotonic()
    self._free_since = {a: self._free_since.get(a, now) for a in free}
    patience = self.config.scale_down_intervals * self.config.interval_s
    spare = [a for a in free if now - self._free_since[a] >= patience]
    if not spare or self.grants.waiting or self.backend.num_workers <= self.config.min_workers:
      return
    with self._state.lock:
      self._state.lock.answer_without_fsync()
      self.grants.draining[spare[-1]] = job_grants.SPARE
    self._stop_worker(spare[-1], pids.get(spare[-1], 0))

  def _stop_worker(self, address: str, pid: int) -> None:
    # Draining takes as long as its consumers take its batches: not on this thread.
    with self._state.lock:
      self._state.lock.answer_without_fsync()
      self.grants.stopping.add(address)
    self._stops = [t for t in self._stops if t.is_alive()]
    thread = threading.Thread(
      target=self._stop_one, args=(address, pid), name="jaxfeed-autoscaler-stop", daemon=True
    )
    self._stops.append(thread)
    thread.start()

  def _stop_one(self, address: str, pid: int) -> None:
    stopped = False
    try:
      stopped = self.backend.stop_worker_at(address, pid)
      if not stopped:
        _LOG.info("Worker %s is not the pool's: it stays (serving no job).", address)
    except Exception:  # pylint: disable=broad-except
      _LOG.exception("Stopping worker %s failed", address)
    with self._state.lock:
      self._state.lock.answer_without_fsync()
      self.grants.stopping.discard(address)
      if not stopped:
        self.grants.draining.pop(address, None)

  def metric_families(self, gauge: Any, counter: Any) -> Iterator[Any]:
    """jaxfeed_job_scaling_decisions (a prometheus family, from the given
    family classes); each job's workers are the dispatcher's
    jaxfeed_job_workers."""
    del gauge
    made = counter(
      "jaxfeed_job_scaling_decisions",
      "Per-job autoscaling decisions, by job, direction and reason.",
      labels=["job", "direction", "reason"],
    )
    for (label, direction, reason), count in sorted(self.job_decisions.copy().items()):
      made.add_metric([label, direction, reason], count)
    yield made

  def close(self) -> None:
    self._stop.set()
    if self._thread.is_alive():
      self._thread.join(timeout=15)
    for thread in self._stops:  # the workers being stopped finish draining
      thread.join(timeout=60)
    super().close()
