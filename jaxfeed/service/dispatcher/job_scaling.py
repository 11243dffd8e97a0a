"""The per-job autoscaling rule (`JobScalingPolicy`), Cachew's: each job
scales on its own batch time.

The dispatcher's `jaxfeed.service.dispatcher.job_autoscaler` feeds it one
`JobSample` per job and interval (what the job's clients reported: the
consumers' seconds per element, the share of the time they waited, how full
their buffers are) and applies the `Decision`s it returns. The rule, apart
from the processes it moves, so that it can be tested with injected samples:

* A job starts with one worker.
* Growing: while its consumers wait (more than `wait_fraction` of the time),
  a job gets one more worker; each worker added is measured (after one
  interval for it to fill its buffers) and the job keeps growing while each
  addition cut its batch time by more than `min_gain`. One that did not goes
  again, and the job has converged. Consumers that do not wait converge the
  job at once: more workers cannot make them faster.
* Converged: the job's buffer fill is its converged level. When its
  consumers stop waiting (less than a fifth of `wait_fraction`) and its fill
  stays above that level by `queue_growth` (relative) for
  `scale_down_intervals` intervals, it gives one worker back. Where the
  converged level is too near full for that (a fill cannot pass 1), a
  batch time longer than the converged one by `queue_growth` stands in for
  the queue's growth (consumers that much slower than at convergence). When its batch
  time grows past the converged one by `min_gain` while its consumers wait,
  for as many intervals, it grows again (its input got dearer).
* Sharing `max_workers`: jobs that want a worker get one in the order of
  the gain they expect from it (a job without workers first; then the last
  measured gain, or the share of the time its consumers wait before any was
  measured). When the pool is full, a job that expects more than another
  job's last worker gave it (by more than `min_gain`) takes that worker:
  the other job gives it back (it drains) and the first one gets the next
  free worker.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Iterable, Mapping

from jaxfeed.service.dispatcher import autoscale as autoscale_lib

UP, DOWN, HOLD = 1, -1, 0

# Why a job's workers changed or did not (the `reason` of a `Decision`).
START = "start"  # a job without workers gets its first
GAIN = "gain"  # its consumers wait and the last worker helped
NO_GAIN = "no_gain"  # the last worker cut its batch time by min_gain or less
QUEUE = "queue"  # consumers fed, buffers past the converged level
REGROW = "regrow"  # batch time grew past the converged one
REBALANCE = "rebalance"  # another job gains more from this worker
WAITING = "waiting"  # wants a worker; none is free
STARTING = "starting"  # its added worker has yet to serve
SETTLING = "settling"  # the interval after a change
NO_REPORTS = "no_reports"  # its clients reported nothing this interval
IDLE = "idle"  # no client reads it: its workers go, one an interval
STEADY = "steady"
REASONS = (
  START,
  GAIN,
  NO_GAIN,
  QUEUE,
  REGROW,
  REBALANCE,
  WAITING,
  STARTING,
  SETTLING,
  NO_REPORTS,
  IDLE,
  STEADY,
)


@dataclasses.dataclass(frozen=True)
class JobSample:
  """What one job's clients reported over one interval.

  Attributes:
    batch_time_s: Seconds per element each consumer took, averaged over the
      job's clients (the inverse of a consumer's rate).
    wait_fraction: Share of the interval the consumers waited for input.
    buffer_fill: How full the clients' buffers were (0..1), averaged.
    num_clients: Clients that reported.
  """

  batch_time_s: float
  wait_fraction: float
  buffer_fill: float
  num_clients: int = 1


@dataclasses.dataclass(frozen=True)
class Decision:
  """One job's change of workers for one interval (+1, -1 or 0) and why."""

  job: int
  change: int
  reason: str


@dataclasses.dataclass
class _JobState:
  """What the policy remembers of one job."""

  times: dict[int, float] = dataclasses.field(default_factory=dict)  # workers -> batch time
  settling: int = 0
  last_change: int = HOLD
  converged: bool = False
  converged_time: float | None = None
  converged_fill: float | None = None
  gain: float = math.inf  # what its last worker cut off its batch time
  fed: int = 0  # intervals in a row past the queue rule
  slower: int = 0  # intervals in a row slower than converged, consumers waiting


class JobScalingPolicy:
  """Decides, every interval, each job's change of workers.

  Args:
    config: `max_workers`, `min_gain`, `scale_up_wait_fraction`,
      `queue_growth` and `scale_down_intervals` are the rule's.
  """

  def __init__(self, config: autoscale_lib.AutoscaleConfig):
    self.config = config
    assert config.min_gain is not None  # resolved at construction
    self._min_gain: float = config.min_gain
    self._jobs: dict[int, _JobState] = {}

  def gain_of(self, job: int) -> float:
    """What the job's last worker cut off its batch time (inf: unknown)."""
    state = self._jobs.get(job)
    return state.gain if state is not None else math.inf

  def decide(
    self,
    workers: Mapping[int, int],
    samples: Mapping[int, JobSample | None],
    starting: Iterable[int] = (),
    draining: int = 0,
    idle: Iterable[int] = (),
  ) -> list[Decision]:
    """Each live job's decision for this interval.

    Args:
      workers: Live job -> the workers it has (starting ones included).
      samples: Job -> its clients' reports of the interval (None: none).
      starting: Jobs whose added worker has yet to serve: not judged.
      idle: Jobs that no client reads: they give their workers back, one an
        interval.
      draining: Workers given back that still run: they count against
        `max_workers` until they are gone, and each already makes room for
        one job that waits.
    """
    for gone in set(self._jobs) - set(workers):
      del self._jobs[gone]
    starting = set(starting)
    decisions: dict[int, Decision] = {}
    wants: list[tuple[float, int, str]] = []  # (expected gain, job, reason)
    idle = set(idle)
    for job in sorted(workers):
      if job not in self._jobs:  # its consumers' wait for the first worker shows late
        self._jobs[job] = _JobState(settling=2 if workers[job] else 0)
      state = self._jobs[job]
      if job in idle:
        self._jobs.pop(job)  # judged afresh if a client comes back
        decisions[job] = Decision(job, DOWN if workers[job] else HOLD, IDLE)
      elif workers[job] == 0:
        wants.append((math.inf, job, START))
      elif job in starting:
        decisions[job] = Decision(job, HOLD, STARTING)
      else:
        change, reason, expected = self._judge(state, workers[job], samples.get(job))
        if change == UP:
          wants.append((expected, job, reason))
        else:
          decisions[job] = Decision(job, change, reason)
    free = self.config.max_workers - sum(workers.values()) - draining
    for job, decision in list(decisions.items()):
      if decision.change == DOWN and job not in idle:  # one fed past its level keeps it
        self._changed(job, DOWN, keep_level=decision.reason == QUEUE)
    in_flight = draining
    for expected, job, reason in sorted(wants, key=lambda w: (-w[0], w[1])):
      if free > 0:
        free -= 1
        decisions[job] = Decision(job, UP, reason)
        self._changed(job, UP)
        if reason == START:  # its consumers' wait for the first worker shows late
          self._jobs[job].settling = 2
        continue
      decisions[job] = Decision(job, HOLD, WAITING)
      if in_flight > 0:  # a worker given back already makes room for it
        in_flight -= 1
        continue
      donor = self._donor(workers, decisions, exclude=job)
      if donor is not None and expected > self._jobs[donor].gain + self._min_gain:
        decisions[donor] = Decision(donor, DOWN, REBALANCE)
        self._changed(donor, DOWN)
        self._jobs[donor].gain = self._measured_gain(self._jobs[donor], workers[donor] - 1)
    return [decisions[job] for job in sorted(decisions)]

  def _judge(
    self, state: _JobState, workers: int, sample: JobSample | None
  ) -> tuple[int, str, float]:
    """(change, reason, the gain expected from one more worker) for one job."""
    c = self.config
    if sample is None or sample.num_clients == 0:
      state.fed = state.slower = 0
      return HOLD, NO_REPORTS, 0.0
    if state.settling:
      state.settling -= 1
      return HOLD, SETTLING, 0.0
    time_s = sample.batch_time_s
    state.times[workers] = time_s
    waiting = sample.wait_fraction > c.scale_up_wait_fraction
    if not state.converged:
      before = state.times.get(workers - 1)
      if state.last_change == UP and before is not None:
        state.last_change = HOLD
        gain = (before - time_s) / before if before > 0 else 0.0
        if gain <= self._min_gain:  # it did not help: it goes, and the job converged
          state.gain = self._measured_gain(state, workers - 1)
          return DOWN, NO_GAIN, 0.0
        state.gain = gain
      if waiting:
        return UP, GAIN, state.gain if math.isfinite(state.gain) else sample.wait_fraction
      state.converged = True  # consumers that do not wait: more workers cannot help
    state.last_change = HOLD
    if state.converged_fill is None or state.converged_time is None:
      state.converged_fill, state.converged_time = sample.buffer_fill, time_s
      return HOLD, STEADY, 0.0
    # A buffer full at convergence cannot show its queue grow: then the
    # consumers' rate stands in for it (they take elements that much slower
    # than the workers make them).
    grown = c.queue_growth + 1
    fed = sample.wait_fraction < c.scale_up_wait_fraction / 5 and (
      sample.buffer_fill > state.converged_fill * grown
      or (
        state.converged_fill * grown >= 1
        and sample.buffer_fill >= state.converged_fill
        and time_s > state.converged_time * grown
      )
    )
    state.fed = state.fed + 1 if fed and workers > 1 else 0
    if state.fed >= c.scale_down_intervals:
      state.gain = self._measured_gain(state, workers - 1)
      return DOWN, QUEUE, 0.0
    slower = waiting and time_s > state.converged_time * (1 + self._min_gain)
    state.slower = state.slower + 1 if slower else 0
    if state.slower >= c.scale_down_intervals:  # its input got dearer: grow again
      state.converged, state.slower = False, 0
      state.converged_fill = state.converged_time = None
      state.times = {workers: time_s}
      return UP, REGROW, sample.wait_fraction
    return HOLD, STEADY, 0.0

  @staticmethod
  def _measured_gain(state: _JobState, workers: int) -> float:
    """What the `workers`-th worker cut off the batch time, as measured (inf: unknown)."""
    now, before = state.times.get(workers), state.times.get(workers - 1)
    if now is None or before is None or before <= 0:
      return state.gain if workers > 1 else math.inf
    return (before - now) / before

  def _changed(self, job: int, change: int, keep_level: bool = False) -> None:
    state = self._jobs[job]
    state.last_change, state.settling = change, 1
    state.fed = state.slower = 0
    if change == DOWN:
      state.converged = True
      if not keep_level:  # measured again at the size it goes to
        state.converged_fill = state.converged_time = None

  def _donor(
    self, workers: Mapping[int, int], decisions: Mapping[int, Decision], exclude: int
  ) -> int | None:
    """The job whose last worker gains least, of those that can give one."""
    candidates = [
      job
      for job, count in workers.items()
      if job != exclude
      and count >= 2
      and job in self._jobs
      and job in decisions
      and decisions[job].change == HOLD
      and decisions[job].reason != WAITING
    ]
    if not candidates:
      return None
    return min(candidates, key=lambda job: (self._jobs[job].gain, job))
