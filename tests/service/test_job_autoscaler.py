"""Per-job autoscaling with real worker processes: each job its own workers."""

from __future__ import annotations

import contextlib
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import psutil
import pytest

import jaxfeed
import service_udfs
from jaxfeed import service
from jaxfeed.service import metrics

parser = pytest.importorskip("prometheus_client.parser")

pytestmark = pytest.mark.timeout(120)

TESTS_DIR = pathlib.Path(__file__).resolve().parent
REPO_ROOT = TESTS_DIR.parents[1]


def jobs_by_worker(dispatcher):
  """Worker address -> the jobs (by name) it has unfinished tasks of."""
  state = dispatcher.state
  with state.lock:
    state.lock.answer_without_fsync()
    found: dict[str, set[str]] = {}
    for job in state.jobs.values():
      for task in job.tasks.values():
        if not task.finished:
          found.setdefault(task.worker_address, set()).add(job.job_name)
  return found


def worker_processes() -> list[psutil.Process]:
  """This process's worker processes, draining ones included."""
  found = []
  for child in psutil.Process().children():
    try:
      if "jaxfeed.service.worker" in child.cmdline():
        found.append(child)
    except psutil.NoSuchProcess:
      pass
  return found


def per_job_config(monkeypatch, **autoscale) -> service.DispatcherConfig:
  """A dispatcher with a per_job pool of local workers that import service_udfs."""
  monkeypatch.setenv(
    "PYTHONPATH",
    os.pathsep.join([str(REPO_ROOT), str(TESTS_DIR), os.environ.get("PYTHONPATH", "")]),
  )
  return service.DispatcherConfig(
    heartbeat_timeout_s=2,
    udf_modules=("service_udfs",),
    autoscale=service.AutoscaleConfig(
      policy="per_job", worker_flags=("--heartbeat_interval_s=0.2", "--buffer_size=4"), **autoscale
    ),
  )


def scrape(dispatcher) -> dict[tuple[str, tuple], float]:
  """The dispatcher's metrics: (name, sorted labels) -> value."""
  server = metrics.serve_dispatcher(dispatcher, "127.0.0.1", 0)
  try:
    with urllib.request.urlopen(server.url, timeout=10) as response:
      text = response.read().decode()
  finally:
    server.close()
  return {
    (s.name, tuple(sorted(s.labels.items()))): s.value
    for family in parser.text_string_to_metric_families(text)
    for s in family.samples
  }


def test_two_jobs_converge_to_their_own_workers_and_share_none(monkeypatch):
  # "light" costs nothing on a worker: one worker keeps its consumer fed.
  # "heavy" sleeps 20 ms per element for a consumer that takes one every
  # 6 ms: it needs about 4 workers, and each one it gets cuts its batch time.
  config = per_job_config(monkeypatch, min_workers=2, max_workers=6, interval_s=0.5)
  stop = threading.Event()
  iterators = {}
  errors = []

  def consume(name, udf):
    dataset = jaxfeed.Dataset.range(10**6).map(udf)
    try:
      with dataset.distribute(
        dispatcher.target, "distributed_epoch", job_name=name, max_outstanding_requests=4
      ).make_iterator() as it:
        iterators[name] = it
        while not stop.is_set():
          next(it)
          time.sleep(0.006)  # the model's step
        iterators[name] = it.elements_by_worker
    except Exception as e:  # pylint: disable=broad-except
      errors.append(e)

  with service.DispatchServer(config) as dispatcher:
    scaler = dispatcher.autoscaler
    threads = [
      threading.Thread(target=consume, args=("light", service_udfs.add_one)),
      threading.Thread(target=consume, args=("heavy", service_udfs.sleepy_20ms)),
    ]
    for thread in threads:
      thread.start()
    shared, seen = [], []
    try:
      deadline = time.monotonic() + 25
      steady_since = None
      while time.monotonic() < deadline and not errors:
        time.sleep(0.1)
        shared += [jobs for jobs in jobs_by_worker(dispatcher).values() if len(jobs) > 1]
        workers = dict(scaler.job_workers)
        if not seen or workers != seen[-1] or workers.get("heavy", 0) < 3:
          steady_since = None
        seen.append(workers)
        steady_since = steady_since or time.monotonic()
        if time.monotonic() - steady_since > 2.5:  # converged: no change for 5 intervals
          break
      # The scaler may still move between a sample and a scrape: compare the
      # metric with counts that held across the scrape.
      for _ in range(100):
        before = dict(scaler.job_workers)
        exported = scrape(dispatcher)
        if dict(scaler.job_workers) == before:
          break
      seen.append(before)
    finally:
      stop.set()
      for thread in threads:
        thread.join(timeout=30)
    decisions = dict(scaler.job_decisions)
  assert not errors, errors
  final = seen[-1]
  # Each its own count: light one worker (two on a loaded machine, where a
  # second one may cut its batch time by more than 3%), heavy more.
  assert final["light"] <= 2 and final["heavy"] >= 3, (final, decisions)
  assert not shared, shared  # no worker ever had tasks of both jobs
  light, heavy = iterators["light"], iterators["heavy"]
  assert len(light) < len(heavy) and not set(light) & set(heavy), (light, heavy)
  assert decisions[("heavy", "up", "gain")] >= 2, decisions
  assert exported[("jaxfeed_job_workers", (("job", "light"),))] == final["light"]
  assert exported[("jaxfeed_job_workers", (("job", "heavy"),))] == final["heavy"]
  assert (
    exported[
      (
        "jaxfeed_job_scaling_decisions_total",
        (("direction", "up"), ("job", "heavy"), ("reason", "gain")),
      )
    ]
    >= 2
  )


@pytest.mark.parametrize(
  "flags, message",
  [
    (
      ("--autoscale_max_workers=4", "--autoscale_policy=each"),
      "--autoscale_policy) must be one of pool, per_job, got 'each'",
    ),
    (
      ("--autoscale_max_workers=4", "--autoscale_policy=per_job", "--autoscale_min_gain=2"),
      "--autoscale_min_gain) must be a fraction in (0, 1), got 2.0",
    ),
    (
      ("--autoscale_max_workers=4", "--autoscale_queue_growth=-1"),
      "--autoscale_queue_growth) must be a number > 0, got -1.0",
    ),
    (
      ("--autoscale_max_workers=4", "--autoscale_scale_down_fill=1.5"),
      "--autoscale_scale_down_fill) must be a fraction in (0, 1], got 1.5",
    ),
    (
      ("--autoscale_max_workers=4", "--autoscale_interval_s=0"),
      "--autoscale_interval_s) must be a number > 0, got 0.0",
    ),
    (("--autoscale_policy=per_job",), "--autoscale_policy=per_job needs an elastic pool"),
  ],
)
def test_a_bad_autoscaling_flag_stops_the_dispatcher_naming_it(flags, message):
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO_ROOT), str(TESTS_DIR)]))
  done = subprocess.run(
    [sys.executable, "-m", "jaxfeed.service.dispatcher", "--port=0", *flags],
    capture_output=True,
    text=True,
    env=env,
    timeout=60,
  )
  assert done.returncode != 0 and "listening" not in done.stdout
  assert message in done.stderr, done.stderr


def test_a_job_that_gains_more_takes_a_drained_worker_from_one_that_gains_less(monkeypatch):
  # "heavy" alone grows to all 3 workers; then "light" starts with none
  # free: heavy's last worker drains and goes, light gets the next one, and
  # heavy's read (at-most-once, so that a worker stopped without draining
  # would lose its splits) still delivers every element once.
  config = per_job_config(monkeypatch, min_workers=1, max_workers=3, interval_s=0.4)
  heavy = jaxfeed.Dataset.range(1500).map(service_udfs.sleepy_20ms)
  light = jaxfeed.Dataset.range(10**6).map(service_udfs.add_one)
  stop = threading.Event()
  light_workers, pids_then, errors = [], [], []

  def read_light():
    try:
      with light.distribute(
        dispatcher.target, "distributed_epoch", job_name="light", max_outstanding_requests=4
      ).make_iterator() as light_it:
        next(light_it)
        pids_then.append(backend.pids())  # the pool as light got its worker
        while not stop.is_set():
          next(light_it)
          time.sleep(0.005)
        light_workers.append(light_it.elements_by_worker)
    except Exception as e:  # pylint: disable=broad-except
      errors.append(e)

  with service.DispatchServer(config) as dispatcher:
    scaler = dispatcher.autoscaler
    backend = scaler.backend
    seen, shared, most = [], [], 0
    thread = threading.Thread(target=read_light)
    try:
      with heavy.distribute(
        dispatcher.target, "distributed_epoch", job_name="heavy", max_outstanding_requests=4
      ).make_iterator() as it:
        for x in it:
          seen.append(int(x))
          if scaler.job_workers.get("heavy") == 3 and not thread.is_alive():
            first_pids = backend.pids()
            thread.start()
          if len(seen) % 10 == 0:  # checks cost the consumer: not every element
            shared += [jobs for jobs in jobs_by_worker(dispatcher).values() if len(jobs) > 1]
            most = max(most, len(worker_processes()))
    finally:
      stop.set()
      if thread.is_alive():
        thread.join(timeout=30)
    decisions = dict(scaler.job_decisions)
  assert not errors, errors
  assert sorted(seen) == list(range(1500))  # nothing lost, nothing twice
  assert decisions.get(("heavy", "down", "rebalance")) == 1, decisions
  assert len(light_workers[0]) == 1 and not shared, (light_workers, shared)
  # The drained worker was gone before light's started: never more than 3
  # worker processes.
  assert set(first_pids) - set(pids_then[0]) and most <= 3, (first_pids, pids_then, decisions)


def read_until(it, done, step_s: float, scaler) -> None:
  """Reads one element every step_s until done() (at most 20 s)."""
  deadline = time.monotonic() + 20
  while not done():
    assert time.monotonic() < deadline, dict(scaler.job_decisions)
    next(it)
    time.sleep(step_s)


@contextlib.contextmanager
def converged_job(monkeypatch, name: str):
  """(the autoscaler, a read) of a job of 20 ms per element on a worker,
  read one element every 6 ms, once it converged (4 workers make one every
  5 ms: its consumer stopped waiting)."""
  config = per_job_config(
    monkeypatch, min_workers=1, max_workers=4, interval_s=0.4, scale_down_intervals=2
  )
  dataset = jaxfeed.Dataset.range(10**6).map(service_udfs.sleepy_20ms)
  with service.DispatchServer(config) as dispatcher:
    scaler = dispatcher.autoscaler
    with dataset.distribute(
      dispatcher.target, "distributed_epoch", job_name=name, max_outstanding_requests=4
    ).make_iterator() as it:
      read_until(it, lambda: scaler.job_decisions[(name, "hold", "steady")] >= 2, 0.006, scaler)
      yield scaler, it


def test_a_job_whose_consumer_slows_down_gives_its_workers_back(monkeypatch):
  # Then each step takes 45 ms and its buffers stay full: it gives workers
  # back, each draining before it goes, to one worker (20 ms per element is
  # still faster than 45 ms).
  with converged_job(monkeypatch, "slowing") as (scaler, it):
    grown = scaler.job_workers["slowing"]
    read_until(it, lambda: scaler.backend.num_workers == 1, 0.045, scaler)
    decisions = dict(scaler.job_decisions)
  assert grown >= 3, decisions
  assert decisions[("slowing", "down", "queue")] == grown - 1, decisions


def test_a_job_that_loses_a_worker_grows_back(monkeypatch):
  # SIGKILL one of its workers: its batch time grows while its consumer
  # waits, so the job grows again to what it had.
  with converged_job(monkeypatch, "hurt") as (scaler, it):
    converged = scaler.job_workers["hurt"]
    victim = scaler.backend.pids()[-1]
    os.kill(victim, signal.SIGKILL)
    read_until(
      it,
      lambda: victim not in scaler.backend.pids() and (scaler.backend.num_workers == converged),
      0.006,
      scaler,
    )
    decisions = dict(scaler.job_decisions)
  assert converged >= 3 and decisions[("hurt", "up", "regrow")] == 1, decisions
