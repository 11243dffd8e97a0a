"""A hyperparameter sweep: jobs that differ only in sampling (OneAccess's
trace: about 9 concurrent jobs, most of their I/O and preprocessing
redundant), with and without shared preprocessing.

  python -m benchmarks.sweep_sharing [--jobs=4] [--records=4000] [--cost_us=1000]

Each job is a process of its own reading one epoch of the same records (a
TFRecord file of 4 KiB records) through the same decode + preprocessing,
with its own shuffle seed; the jobs start together. "shared" adds
`autocache(directory=...)` after the preprocessing, all jobs given one
folder; "not shared" does not. A row gives, for the whole sweep:
preprocessing calls per record, bytes read from the file per byte of it,
the jobs' CPU seconds, the sweep's wall time, and whether every job read
exactly its own order (checked against the sampler).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

from benchmarks import record

WORKLOAD = "sweep, jobs differing in sampling"
RECORD_BYTES = 4096
_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_COUNT_ENV, _READ_ENV, _SIZE_ENV = "SWEEP_CALLS", "SWEEP_READ", "SWEEP_SIZE"


def _log(env: str, count: int) -> None:
  with open(os.environ[env], "ab") as f:
    f.write(b"." * count)


class CountedSource:
  """A TFRecord file's records, logging how many are read."""

  def __init__(self, path: str):
    import jaxfeed

    self._source = jaxfeed.TFRecordSource(path)

  def __len__(self) -> int:
    return len(self._source)

  def __getitem__(self, index: int) -> bytes:
    _log(_READ_ENV, 1)
    return self._source[index]

  def get_many(self, indices) -> list:
    _log(_READ_ENV, len(indices))
    return self._source.get_many(indices)


def preprocess(record: bytes) -> dict:
  """Decode and a fixed amount of numpy work; logs the call."""
  _log(_COUNT_ENV, 1)
  values = np.frombuffer(record, dtype=np.float32)
  work = np.sin(np.arange(int(os.environ[_SIZE_ENV]), dtype=np.float64) + float(values[0]))
  return {"id": np.int64(values[0]), "feature": values[:64] * np.float32(work.sum())}


def _job(path: str, seed: int, store: str) -> None:
  import jaxfeed
  from benchmarks import sweep_sharing

  source = sweep_sharing.CountedSource(path)
  sampler = jaxfeed.IndexSampler(len(source), shuffle=True, seed=seed)
  dataset = jaxfeed.Dataset.from_source(source, sampler).map(sweep_sharing.preprocess)
  if store:
    dataset = dataset.autocache(store)
  ids = [int(e["id"]) for e in dataset]
  expected = sampler.get_many(np.arange(len(sampler)))[1].tolist()
  print(json.dumps({"exact": ids == expected, "cpu_s": time.process_time()}))


def _calibrate(cost_us: float) -> int:
  size, elapsed = 4096, 0.0
  while True:
    start = time.perf_counter()
    for i in range(100):
      np.sin(np.arange(size, dtype=np.float64) + float(i)).sum()
    elapsed = (time.perf_counter() - start) / 100
    if elapsed >= 0.8 * cost_us * 1e-6 or size > 1 << 24:
      return max(256, int(size * cost_us * 1e-6 / elapsed))
    size *= 2


def sweep(path: str, jobs: int, shared: bool, workdir: str) -> dict:
  calls, read = os.path.join(workdir, "calls"), os.path.join(workdir, "read")
  for log in (calls, read):
    open(log, "wb").close()
  store = os.path.join(workdir, "store") if shared else ""
  env = {
    **os.environ,
    _COUNT_ENV: calls,
    _READ_ENV: read,
    "PYTHONPATH": os.pathsep.join([_REPO, os.environ.get("PYTHONPATH", "")]),
  }
  start = time.perf_counter()
  procs = [
    subprocess.Popen(
      [sys.executable, "-m", "benchmarks.sweep_sharing", "--job", path, str(seed), store],
      stdout=subprocess.PIPE,
      text=True,
      env=env,
    )
    for seed in range(jobs)
  ]
  results = [json.loads(p.communicate()[0]) for p in procs]
  wall = time.perf_counter() - start
  if any(p.returncode for p in procs):
    raise RuntimeError(f"a job failed: exit codes {[p.returncode for p in procs]}")
  return {
    "wall_s": wall,
    "cpu_s": sum(r["cpu_s"] for r in results),
    "exact": all(r["exact"] for r in results),
    "calls": os.path.getsize(calls),
    "read": os.path.getsize(read),
  }


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--jobs", type=int, default=4)
  parser.add_argument("--records", type=int, default=4000)
  parser.add_argument("--cost_us", type=float, default=1000.0)
  parser.add_argument("--job", nargs=3, help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.job:
    _job(args.job[0], int(args.job[1]), args.job[2])
    return
  if args.jobs < 1 or args.records < 1:
    parser.error(f"--jobs and --records must be >= 1, got {args.jobs} and {args.records}")
  import jaxfeed

  os.environ[_SIZE_ENV] = str(_calibrate(args.cost_us))
  rng = np.random.default_rng(0)
  with tempfile.TemporaryDirectory() as workdir, record.run("sweep_sharing"):
    path = os.path.join(workdir, "records.tfrecord")
    jaxfeed.write_tfrecord(
      path,
      [
        np.concatenate([[i], rng.normal(size=RECORD_BYTES // 4 - 1)]).astype(np.float32).tobytes()
        for i in range(args.records)
      ],
    )
    for shared in (True, False):
      folder = tempfile.mkdtemp(dir=workdir)
      result = sweep(path, args.jobs, shared, folder)
      record.row(
        {
          "workload": WORKLOAD,
          "system": "jaxfeed",
          "mode": "shared preprocessing" if shared else "not shared",
          "way": f"{args.jobs} jobs",
          "jobs": args.jobs,
          "records": args.records,
          "cost_us": args.cost_us,
          "unit": "preprocessings per record",
          "rate": round(result["calls"] / args.records, 3),
          "bytes_read_per_byte": round(result["read"] / args.records, 3),
          "cpu_s": round(result["cpu_s"], 2),
          "wall_s": round(result["wall_s"], 2),
          "every_job_exact": result["exact"],
        }
      )


if __name__ == "__main__":
  main()
