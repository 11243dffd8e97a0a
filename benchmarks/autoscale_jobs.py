r"""W13: per-job autoscaling, two jobs of different needs on one pool.

Two jobs read the service at once for --seconds each, every consumer a
training loop that takes one element per --model_ms:

* "light": a worker spends --light_ms per element (less than the model
  step): one worker feeds it.
* "heavy": a worker spends --heavy_ms per element (several model steps):
  it needs about heavy_ms / model_ms workers.

The per-element work is a sleep, so that the machine's cores are not what
limits the workers (a pool on this machine measures the policy, not the
CPUs). Each policy runs in turn, with the same pool bound (--max_workers):

* `per_job`: `--autoscale_policy=per_job` (each job its own workers);
* `pool`: `--autoscale_policy=pool` (one pool, every worker serves both);
* `fixed`: --max_workers workers started by hand, serving both jobs.

One row per policy: for each job, the workers that served it at the end
(workers with a task of it), when its worker count last changed (seconds
after the start: time to converge), and its throughput (elements/s over
the second half of the run); for the pool, the worker-seconds used (its
workers, integrated over the run) and the most workers it ran.

  python -m benchmarks.autoscale_jobs [--seconds=40] [--max_workers=6]
      [--model_ms=6] [--light_ms=2] [--heavy_ms=20] [--interval_s=0.5]
      [--policies=per_job,pool,fixed] [--rounds=1]

With --rounds=N the policies take turns N times (each round in another
order, so that a change of the machine's load falls on each of them) and
each figure is the median of its rounds.
"""

from __future__ import annotations

import importlib
import os
import statistics
import sys
import threading
import time
from typing import Any, Iterable

from benchmarks import record
import jaxfeed
from jaxfeed import service
from jaxfeed.service.pools import local_backend

POLICIES = ("per_job", "pool", "fixed")
# The UDFs' module by its import path (run as a script, this one is __main__).
_MODULE = "benchmarks.autoscale_jobs"
_SAMPLE_S = 0.1
# The workers' per-element work, set from the flags through the environment
# (the worker processes inherit it).
_LIGHT_ENV, _HEAVY_ENV = "JAXFEED_W13_LIGHT_MS", "JAXFEED_W13_HEAVY_MS"


def light(x):
  """--light_ms of waiting per element."""
  time.sleep(float(os.environ.get(_LIGHT_ENV, "2")) / 1e3)
  return x


def heavy(x):
  """--heavy_ms of waiting per element."""
  time.sleep(float(os.environ.get(_HEAVY_ENV, "20")) / 1e3)
  return x


class _Consumer:
  """A training loop on a thread: one element per model step, timestamps kept."""

  def __init__(self, target: str, name: str, udf: Any, model_s: float):
    self.name = name
    self.times: list[float] = []
    self.error: Exception | None = None
    self._dataset = jaxfeed.Dataset.range(10**9).map(udf)
    self._target, self._model_s = target, model_s
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._run, name=f"w13-{name}")

  def start(self) -> None:
    self._thread.start()

  def _run(self) -> None:
    try:
      with self._dataset.distribute(
        self._target, "distributed_epoch", job_name=self.name, max_outstanding_requests=4
      ).make_iterator() as it:
        while not self._stop.is_set():
          next(it)
          self.times.append(time.monotonic())
          time.sleep(self._model_s)
    except Exception as e:  # pylint: disable=broad-except
      self.error = e

  def stop(self) -> None:
    self._stop.set()
    self._thread.join(timeout=60)
    if self.error is not None:
      raise RuntimeError(f"W13: job {self.name} failed: {self.error}") from self.error


def _workers_by_job(dispatcher: service.DispatchServer) -> dict[str, int]:
  """Job name -> the workers that have a task of it."""
  state = dispatcher.state
  with state.lock:
    state.lock.answer_without_fsync()
    return {
      job.job_name: len({t.worker_address for t in job.tasks.values() if not t.finished})
      for job in state.jobs.values()
    }


def measure(policy: str, options: dict[str, float]) -> dict:
  """One policy's run: its row."""
  max_workers = int(options["max_workers"])
  os.environ[_LIGHT_ENV] = str(options["light_ms"])  # for the workers it starts
  os.environ[_HEAVY_ENV] = str(options["heavy_ms"])
  autoscale = None
  if policy != "fixed":
    autoscale = service.AutoscaleConfig(
      policy=policy,
      min_workers=1,
      max_workers=max_workers,
      interval_s=options["interval_s"],
      worker_flags=("--heartbeat_interval_s=0.2", "--buffer_size=4"),
    )
  config = service.DispatcherConfig(
    heartbeat_timeout_s=5, udf_modules=(_MODULE,), autoscale=autoscale
  )
  hand = None
  with service.DispatchServer(config) as dispatcher:
    if policy == "fixed":
      hand = local_backend.LocalWorkerBackend(
        dispatcher.target,
        ["--heartbeat_interval_s=0.2", "--buffer_size=4", f"--udf_modules={_MODULE}"],
      )
      for _ in range(max_workers):
        hand.start_worker()
    pool: Any = hand
    if dispatcher.autoscaler is not None:
      pool = dispatcher.autoscaler.backend
    udfs = importlib.import_module(_MODULE)
    try:
      consumers = [
        _Consumer(dispatcher.target, name, getattr(udfs, name), options["model_ms"] / 1e3)
        for name in ("light", "heavy")
      ]
      started = time.monotonic()
      for consumer in consumers:
        consumer.start()
      history: list[tuple[float, dict[str, int]]] = []
      worker_seconds, most = 0.0, 0
      try:
        while time.monotonic() - started < options["seconds"]:
          time.sleep(_SAMPLE_S)
          running = pool.num_workers
          worker_seconds += running * _SAMPLE_S
          most = max(most, running)
          history.append((time.monotonic() - started, _workers_by_job(dispatcher)))
      finally:
        for consumer in consumers:
          consumer.stop()
    finally:
      if hand is not None:
        hand.close()
  half = started + options["seconds"] / 2
  jobs = {}
  for consumer in consumers:
    counts = [(t, by_job.get(consumer.name, 0)) for t, by_job in history]
    final = counts[-1][1]
    changed = max(
      (t for (t, n), (_, before) in zip(counts[1:], counts) if n != before), default=0.0
    )
    late = [t for t in consumer.times if t >= half]
    jobs[consumer.name] = {
      "workers": final,
      "converged_s": round(changed, 1),
      "elements_per_s": round(len(late) / (options["seconds"] / 2), 1),
    }
  return {
    "workload": "W13 per-job autoscaling",
    "system": "jaxfeed",
    "way": policy,
    "jobs": jobs,
    "worker_seconds": round(worker_seconds, 1),
    "most_workers": most,
    "seconds": options["seconds"],
    "max_workers": max_workers,
    "model_ms": options["model_ms"],
    "light_ms": options["light_ms"],
    "heavy_ms": options["heavy_ms"],
    "interval_s": options["interval_s"],
  }


def main(argv: list[str]) -> None:
  options: dict[str, Any] = {
    "seconds": 40.0,
    "max_workers": 6,
    "model_ms": 6.0,
    "light_ms": 2.0,
    "heavy_ms": 20.0,
    "interval_s": 0.5,
    "rounds": 1,
    "policies": ",".join(POLICIES),
  }
  for arg in argv[1:]:
    name, _, value = arg.lstrip("-").partition("=")
    if name not in options or not value:
      raise SystemExit(
        f"autoscale_jobs: unknown option {arg!r}; allowed: "
        f"{', '.join('--' + n + '=' for n in options)}."
      )
    options[name] = value if name == "policies" else float(value)
  policies = options.pop("policies").split(",")
  bad = [p for p in policies if p not in POLICIES]
  if bad:
    raise SystemExit(f"autoscale_jobs: --policies must name some of {POLICIES}, got {bad}.")
  # The workers import this module by its import path.
  os.environ["PYTHONPATH"] = os.pathsep.join(
    [str(record.REPO), *filter(None, [os.environ.get("PYTHONPATH")])]
  )
  rounds = int(options.pop("rounds"))
  runs: dict[str, list[dict]] = {policy: [] for policy in policies}
  for i in range(rounds):  # the policies take turns, each round in another order
    for policy in policies[i % len(policies) :] + policies[: i % len(policies)]:
      load = record.load_average()
      runs[policy].append({**measure(policy, options), "load_before": load})
  for policy in policies:
    record.row(median_row(runs[policy]))


def median_row(rows: list[dict]) -> dict:
  """One policy's rounds as one row: the median of each figure."""
  row = dict(rows[0], rounds=len(rows), load_before=[r["load_before"] for r in rows])
  for name in ("worker_seconds", "most_workers"):
    row[name] = _median(r[name] for r in rows)
  row["jobs"] = {
    job: {name: _median(r["jobs"][job][name] for r in rows) for name in figures}
    for job, figures in rows[0]["jobs"].items()
  }
  return row


def _median(values: Iterable[float]) -> float:
  return round(statistics.median(values), 2)


if __name__ == "__main__":
  with record.run("autoscale_jobs"):
    main(sys.argv)
