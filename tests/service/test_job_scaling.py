"""The per-job autoscaling rule, fed modelled jobs, and its grants (no processes)."""

from __future__ import annotations

import time

import pytest

from jaxfeed.service.dispatcher import autoscale
from jaxfeed.service.dispatcher import job_grants
from jaxfeed.service.dispatcher import job_scaling
from jaxfeed.service.dispatcher import tables
from jaxfeed.service.protocol.sharding import ShardingPolicy


def config(**kwargs):
  return autoscale.AutoscaleConfig(policy="per_job", **kwargs)


def modelled(model_s, element_s, workers, fill=None, cores=64):
  """A job whose consumer takes model_s per element from workers that each
  make one every element_s (on at most `cores` cores): its batch time,
  waits and buffer fill."""
  time_s = max(model_s, element_s / min(workers, cores)) if workers else 1.0
  wait = 1 - model_s / time_s
  return job_scaling.JobSample(
    batch_time_s=time_s,
    wait_fraction=wait,
    buffer_fill=fill if fill is not None else (0.5 if wait > 0.01 else 0.6),
  )


def run(policy, jobs, intervals, workers=None, fills=None, cores=64):
  """Applies the policy's decisions to modelled jobs; returns the workers
  per job and the decisions."""
  workers = dict(workers or {job: 0 for job in jobs})
  log = []
  for _ in range(intervals):
    samples = {
      job: modelled(*jobs[job], workers[job], (fills or {}).get(job), cores)
      for job in jobs
      if workers[job]
    }
    decisions = policy.decide(workers, samples)
    for d in decisions:
      workers[d.job] += d.change
    log.append(decisions)
  return workers, log


def test_a_job_grows_while_workers_help_and_converges():
  # 10 ms per element on a worker, 3 ms per element in the consumer: 4
  # workers feed it (2.5 ms); its consumer then waits no more.
  workers, log = run(job_scaling.JobScalingPolicy(config(max_workers=8)), {1: (0.003, 0.010)}, 20)
  assert workers == {1: 4}
  reasons = [d.reason for step in log for d in step if d.change]
  assert reasons == ["start", "gain", "gain", "gain"], reasons
  assert [d.change for d in log[-1]] == [0]


def test_a_worker_that_does_not_help_goes_again():
  # The same job on a machine of 3 cores: the 4th worker gains nothing
  # although the consumer still waits.
  workers, log = run(
    job_scaling.JobScalingPolicy(config(max_workers=8)), {1: (0.003, 0.010)}, 20, cores=3
  )
  assert workers == {1: 3}
  reasons = [d.reason for step in log for d in step if d.change]
  assert reasons == ["start", "gain", "gain", "gain", "no_gain"], reasons
  assert all(d.change == 0 for step in log[-8:] for d in step)


def test_a_job_whose_additions_gain_less_than_min_gain_stops():
  # Each worker after the first gains 2.5%: below 3%, the second goes again.
  def sample_of(workers):
    return job_scaling.JobSample(
      batch_time_s=0.01 * (1 - 0.025 * (workers - 1)), wait_fraction=0.5, buffer_fill=0.1
    )

  policy = job_scaling.JobScalingPolicy(config(max_workers=8))
  workers = {7: 0}
  for _ in range(12):
    for d in policy.decide(workers, {7: sample_of(workers[7])} if workers[7] else {}):
      workers[d.job] += d.change
  assert workers == {7: 1}
  # With a threshold of 2%, the same job keeps growing.
  policy = job_scaling.JobScalingPolicy(config(max_workers=8, min_gain=0.02))
  workers = {7: 0}
  for _ in range(12):
    for d in policy.decide(workers, {7: sample_of(workers[7])} if workers[7] else {}):
      workers[d.job] += d.change
  assert workers[7] >= 4


def test_a_consumer_that_does_not_wait_keeps_one_worker():
  workers, log = run(job_scaling.JobScalingPolicy(config(max_workers=8)), {1: (0.010, 0.002)}, 10)
  assert workers == {1: 1}


def test_a_fed_job_whose_queue_grows_past_its_converged_level_gives_workers_back():
  policy = job_scaling.JobScalingPolicy(config(max_workers=8, scale_down_intervals=3))
  workers, _ = run(policy, {1: (0.003, 0.010)}, 20)
  assert workers == {1: 4}
  # The consumer got slower (10 ms per element): it stops waiting and its
  # buffers fill up, 0.9 against 0.6 at convergence (> 40% more).
  workers, log = run(policy, {1: (0.010, 0.010)}, 30, workers, fills={1: 0.9})
  downs = [d.reason for step in log for d in step if d.change]
  assert workers == {1: 1} and downs == ["queue"] * 3, downs
  # Buffers only 30% fuller than at convergence: it keeps its workers.
  policy = job_scaling.JobScalingPolicy(config(max_workers=8, scale_down_intervals=3))
  workers, _ = run(policy, {1: (0.003, 0.010)}, 20)
  workers, _ = run(policy, {1: (0.003, 0.010)}, 30, workers, fills={1: 0.78})
  assert workers == {1: 4}


def test_a_job_converged_with_full_buffers_gives_workers_back_when_its_consumers_slow():
  # Full buffers at convergence cannot grow 40%: a batch time 40% longer
  # than the converged one (the consumer slowed from 3 to 10 ms) stands in.
  policy = job_scaling.JobScalingPolicy(config(max_workers=8, scale_down_intervals=3))
  workers, _ = run(policy, {1: (0.003, 0.010)}, 20, fills={1: 1.0})
  assert workers == {1: 4}
  workers, log = run(policy, {1: (0.010, 0.010)}, 30, workers, fills={1: 1.0})
  assert workers == {1: 1}, log
  # 30% slower only: it keeps them.
  policy = job_scaling.JobScalingPolicy(config(max_workers=8, scale_down_intervals=3))
  workers, _ = run(policy, {1: (0.003, 0.010)}, 20, fills={1: 1.0})
  workers, _ = run(policy, {1: (0.0039, 0.010)}, 30, workers, fills={1: 1.0})
  assert workers == {1: 4}


def test_max_workers_go_to_the_jobs_that_gain_most():
  # Job 1 would use 4 workers, job 2 two; 4 in all: job 2's second worker
  # gains 50%, job 1's fourth 25%, so job 1 gets 2 more and job 2 stays at 2.
  policy = job_scaling.JobScalingPolicy(config(max_workers=4))
  workers, log = run(policy, {1: (0.003, 0.012), 2: (0.005, 0.010)}, 40)
  assert workers == {1: 2, 2: 2}, log
  assert sum(workers.values()) <= 4
  assert all(sum(max(0, d.change) for d in step) <= 4 for step in log)


def test_a_job_that_gains_more_takes_a_worker_from_one_that_gains_less():
  # Job 1 alone takes all 4 workers (its 4th gains 25%); then job 2 comes,
  # whose second worker gains 50%: job 1 gives its last one back.
  policy = job_scaling.JobScalingPolicy(config(max_workers=4))
  jobs = {1: (0.002, 0.008)}
  workers, _ = run(policy, jobs, 30)
  assert workers == {1: 4}
  workers[2] = 0
  jobs[2] = (0.005, 0.010)
  workers, log = run(policy, jobs, 30, workers)
  reasons = [(d.job, d.reason) for step in log for d in step if d.change]
  assert workers[2] == 2 and sum(workers.values()) <= 4, reasons
  assert (1, "rebalance") in reasons and (2, "start") in reasons


def test_a_worker_given_back_makes_room_for_one_job_only():
  policy = job_scaling.JobScalingPolicy(config(max_workers=2))
  decisions = policy.decide({1: 0, 2: 0, 3: 0}, {}, draining=1)
  assert [d.change for d in decisions] == [1, 0, 0]
  assert [d.reason for d in decisions] == ["start", "waiting", "waiting"]


def test_jobs_starting_a_worker_are_not_judged():
  policy = job_scaling.JobScalingPolicy(config(max_workers=4))
  policy.decide({1: 0}, {})
  sample = job_scaling.JobSample(batch_time_s=0.01, wait_fraction=0.9, buffer_fill=0.0)
  assert policy.decide({1: 1}, {1: sample}, starting={1}) == [
    job_scaling.Decision(1, 0, "starting")
  ]


@pytest.mark.parametrize(
  "kwargs, message",
  [
    (
      {"policy": "each"},
      r"policy \(--autoscale_policy\) must be one of pool, per_job, "
      r"got 'each'",
    ),
    (
      {"min_gain": 0},
      r"min_gain \(--autoscale_min_gain\) must be a fraction in \(0, 1\), "
      "got 0",
    ),
    ({"min_gain": 1.5}, r"min_gain .* got 1.5"),
    ({"scale_up_wait_fraction": -0.1}, r"scale_up_wait_fraction \(--autoscale_wait_fraction\)"),
    (
      {"queue_growth": 0},
      r"queue_growth \(--autoscale_queue_growth\) must be a number > 0, "
      "got 0",
    ),
    ({"queue_growth": "big"}, "queue_growth .* got 'big'"),
    ({"scale_down_intervals": 0}, "scale_down_intervals must be an integer >= 1, got 0"),
  ],
)
def test_bad_per_job_settings_name_the_value_and_what_is_allowed(kwargs, message):
  with pytest.raises(ValueError, match=message):
    autoscale.AutoscaleConfig(**kwargs)


def test_min_gain_defaults_to_each_policys_own():
  assert autoscale.AutoscaleConfig().min_gain == 0.1
  assert autoscale.AutoscaleConfig(policy="per_job").min_gain == 0.03


def test_a_job_no_client_reads_gives_its_workers_back_one_an_interval():
  policy = job_scaling.JobScalingPolicy(config(max_workers=4))
  workers, _ = run(policy, {1: (0.003, 0.010)}, 20)
  assert workers == {1: 4}
  downs = []
  while workers[1]:
    decisions = policy.decide(workers, {}, idle={1})
    assert [(d.change, d.reason) for d in decisions] == [(-1, "idle")]
    workers[1] -= 1
    downs.append(decisions)
  assert len(downs) == 4
  assert policy.decide(workers, {}, idle={1}) == [job_scaling.Decision(1, 0, "idle")]


def job(job_id, *tasks):
  """A job with unfinished tasks on the workers at `tasks`."""
  made = tables.Job(job_id, "d", ShardingPolicy.DYNAMIC, f"job{job_id}", 0, 100)
  for i, address in enumerate(tasks):
    made.tasks[100 * job_id + i] = tables.Task(100 * job_id + i, job_id, address, 0, 1)
  return made


def test_a_worker_is_granted_to_one_job_and_a_waiting_job_takes_a_new_one():
  grants = job_grants.JobGrants()
  jobs = {1: job(1), 2: job(2)}
  assert not grants.may_serve(jobs[1], "w1", set())  # no client reads it, nobody waits
  grants.waiting.append((2, time.monotonic()))
  assert not grants.may_serve(jobs[1], "w1", set()) and grants.may_serve(jobs[2], "w1", set())
  assert grants.owner == {"w1": 2} and not grants.waiting
  assert not grants.may_serve(jobs[1], "w1", {2})
  grants.drain("w1")
  assert not grants.may_serve(jobs[2], "w1", {2})  # draining: no task of any job
  assert grants.workers_of([1, 2]) == {1: 0, 2: 0}
  jobs[1].clients[5] = time.monotonic()  # read, without a worker: it takes a free one
  assert grants.may_serve(jobs[1], "w2", set()) and grants.owner == {"w2": 1}
  assert not grants.may_serve(jobs[1], "w3", set())  # one only: more are the policy's to give
  # A worker with a task of a job (replayed after a restart) serves that job only.
  assert not grants.may_serve(jobs[1], "w4", {2}) and grants.may_serve(jobs[2], "w4", {2})
  assert grants.owner["w4"] == 2


def test_grants_come_back_from_the_tasks_after_a_restart():
  # A restarted dispatcher replays the tasks, not the grants.
  grants = job_grants.JobGrants()
  jobs = {1: job(1, "w1", "w2"), 2: job(2, "w3")}
  grants.sync(["w1", "w2", "w3", "w4"], jobs, waiting_timeout_s=60)
  assert grants.owner == {"w1": 1, "w2": 1, "w3": 2}
  assert grants.free(["w1", "w2", "w3", "w4"], jobs) == ["w4"]
  assert not grants.may_serve(jobs[2], "w1", {1})  # it serves job 1
  del jobs[1]  # the job ended: its workers are free
  grants.sync(["w1", "w3", "w4"], jobs, waiting_timeout_s=60)
  assert grants.owner == {"w3": 2}
  assert grants.free(["w1", "w3", "w4"], jobs) == ["w1", "w4"]


def test_a_drained_worker_counts_until_the_pool_stopped_it():
  # It told the dispatcher it left, but its process still runs: it still
  # counts against max_workers (as draining) until the pool's stop returns.
  grants = job_grants.JobGrants()
  jobs = {1: job(1, "w1")}
  grants.sync(["w1"], jobs, waiting_timeout_s=60)
  grants.drain("w1")
  grants.stopping.add("w1")
  grants.sync([], jobs, waiting_timeout_s=60)
  assert grants.draining == {"w1": 1}
  grants.stopping.discard("w1")
  grants.sync([], jobs, waiting_timeout_s=60)
  assert not grants.draining
