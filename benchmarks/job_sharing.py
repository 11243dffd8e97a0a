"""Many jobs, one pipeline: N concurrent jobs read one dataset through the
service, each its own `parallel_epochs` job, with and without ephemeral
sharing (`ephemeral_sharing=True`: the jobs share each worker's pipeline, so
each element is computed once for all of them).

  python -m benchmarks.job_sharing [--jobs=1,2,4,8,16] [--records=2048]
      [--cost_us=2000] [--workers=1]

A dispatcher and `--workers` worker processes on loopback; the pipeline maps
`--records` records through `expensive` (about `--cost_us` microseconds of
numpy per record) and batches them by 32. For each number of jobs, in each
mode, the jobs start together (one thread each in this process) and read one
epoch; a row gives the jobs' throughput (records/s per job: median and
slowest), that over one job's alone, the workers' CPU seconds per record
read (by all jobs), and how many times each record was computed (worker CPU
over one job's). The tf.data service paper's shape: no slowdown with sharing
as jobs grow; without it, N jobs split the workers' CPU. Its regime is
preprocessing-bound jobs (hence 2 ms of work per record by default): with
cheap records the jobs' clients, all in this process here, become the
bottleneck before the workers do.
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time

import numpy as np
import psutil

from benchmarks import harness
from benchmarks import record
from benchmarks import w4_service

WORKLOAD = "many jobs, one pipeline"
BATCH = 32


_SIZE = int(os.environ.get("JOB_SHARING_SIZE", "4096"))
"""`expensive`'s size in the workers: set by `main` before they start."""


def preprocess(element):
  return expensive(element["i"], _SIZE)


def expensive(x, size=4096):
  """A record's preprocessing: `size`-long numpy work, a 256-float row."""
  values = np.sin(np.arange(size, dtype=np.float64) + float(x))
  return {"x": np.float32(x), "row": values[:256].astype(np.float32) * float(values.sum())}


def calibrate(cost_us: float) -> int:
  """The `size` at which `expensive` takes about `cost_us` here."""
  size, elapsed = 4096, 0.0
  while True:
    start = time.perf_counter()
    for i in range(200):
      expensive(i, size)
    elapsed = (time.perf_counter() - start) / 200
    if elapsed >= 0.8 * cost_us * 1e-6 or size > 1 << 24:
      break
    size *= 2
  return max(256, int(size * cost_us * 1e-6 / elapsed))


def pipeline(records: int):
  import jaxfeed
  from benchmarks import job_sharing  # an importable path for the workers

  return (
    jaxfeed.Dataset.from_source(jaxfeed.ArraySource({"i": np.arange(records)}))
    .map(job_sharing.preprocess)
    .batch(BATCH)
  )


def _workers_cpu_s(pids: list[int]) -> float:
  total = 0.0
  for pid in pids:
    times = psutil.Process(pid).cpu_times()
    total += times.user + times.system
  return total


def run_jobs(
  dataset, address: str, jobs: int, share: bool, worker_pids: list[int], tag: str
) -> dict:
  """`jobs` concurrent jobs, one epoch each: per-job rates and worker CPU."""
  barrier = threading.Barrier(jobs)
  seconds: list[float] = [0.0] * jobs
  counts = [0] * jobs
  errors: list[BaseException] = []

  def read(index: int) -> None:
    try:
      distributed = dataset.distribute(address, "parallel_epochs", ephemeral_sharing=share)
      with distributed.make_iterator() as iterator:
        barrier.wait()
        start = time.perf_counter()
        for batch in iterator:
          counts[index] += len(batch["x"])
        seconds[index] = time.perf_counter() - start
    except BaseException as e:  # noqa: BLE001 -- raised below
      errors.append(e)
      barrier.abort()

  cpu_before = _workers_cpu_s(worker_pids)
  threads = [threading.Thread(target=read, args=(i,), name=f"{tag}-{i}") for i in range(jobs)]
  for thread in threads:
    thread.start()
  for thread in threads:
    thread.join()
  if errors:
    raise errors[0]
  rates = [c / s for c, s in zip(counts, seconds)]
  cpu_s = _workers_cpu_s(worker_pids) - cpu_before
  return {"rates": rates, "records": counts, "worker_cpu_s": cpu_s}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--jobs", default="1,2,4,8,16", help="comma-separated job counts")
  parser.add_argument("--records", type=int, default=2048)
  parser.add_argument("--cost_us", type=float, default=2000.0)
  parser.add_argument("--workers", type=int, default=1)
  args = parser.parse_args()
  job_counts = [int(j) for j in args.jobs.split(",") if j]
  if not job_counts or min(job_counts) < 1:
    parser.error(f"--jobs must name positive job counts, got {args.jobs!r}")
  os.environ["JOB_SHARING_SIZE"] = str(calibrate(args.cost_us))  # for the workers
  dataset = pipeline(args.records)
  procs, address, _ = w4_service.jaxfeed_cluster(args.workers, split_size=BATCH)
  worker_pids = [p.pid for p in procs[1:]]
  try:
    with record.run("job_sharing"):
      run_jobs(dataset, address, 1, False, worker_pids, "warm-up")
      alone = run_jobs(dataset, address, 1, False, worker_pids, "alone")
      one_rate = alone["rates"][0]
      one_cpu = alone["worker_cpu_s"]
      for share in (True, False):
        for jobs in job_counts:
          result = run_jobs(dataset, address, jobs, share, worker_pids, f"{jobs}")
          total = sum(result["records"])
          record.row(
            {
              "workload": WORKLOAD,
              "system": "jaxfeed service",
              "mode": "ephemeral sharing" if share else "no sharing",
              "way": f"{jobs} jobs",
              "jobs": jobs,
              "workers": args.workers,
              "unit": "records/s per job",
              "rate": round(statistics.median(result["rates"]), 1),
              "slowest_job_rate": round(min(result["rates"]), 1),
              "vs_one_job": round(statistics.median(result["rates"]) / one_rate, 3),
              "worker_cpu_ms_per_record_read": round(1e3 * result["worker_cpu_s"] / total, 3),
              "computations_per_record": round(result["worker_cpu_s"] / one_cpu, 2),
              "records_per_job": args.records,
              "cost_us": args.cost_us,
            }
          )
  finally:
    harness.stop_processes(procs)


if __name__ == "__main__":
  main()
