"""Dispatcher restart time after a long history, with and without compaction.

  python -m benchmarks.journal_restart [--jobs=10000] [--splits_per_job=100]
                                       [--work_dir=DIR]

Builds the history of `jobs` exactly-once DYNAMIC jobs that each hand out
`splits_per_job` splits one by one, acknowledged ten at a time (10k jobs x 100
= 1M splits, about 2M journal records), in a `DispatcherState` on `work_dir`:
once with compaction off and once with the default snapshot thresholds. Then
times a restart (replaying the work_dir) of each. Also measures what the
journal's fsync costs: state changes (one journaled `GetSplits` each) per
second and their median latency with fsync off, on, and on with 8 threads
committing at once (group commit). Prints one JSON line.

The history is written without fsync (the restart reads the same files
either way); the fsync numbers depend on the disk under `work_dir`.
"""

from __future__ import annotations

import shutil
import statistics
import sys
import tempfile
import threading
import time

import numpy as np

from benchmarks import record

SPLIT_SIZE = 10


def _dataset_def(num_positions: int):
  import jaxfeed  # pylint: disable=g-import-not-at-top
  from jaxfeed.service.protocol import spec  # pylint: disable=g-import-not-at-top

  dataset = jaxfeed.Dataset.from_source(jaxfeed.ArraySource({"x": np.arange(4)}))
  dataset_def = spec.to_dataset_def(dataset.node)
  dataset_def.num_positions = num_positions
  return dataset_def


def _state(work_dir: str, **options):
  from jaxfeed.service.dispatcher import server as dispatcher  # pylint: disable=g-import-not-at-top

  return dispatcher.DispatcherState(
    dispatcher.DispatcherConfig(
      work_dir=work_dir, split_size=SPLIT_SIZE, heartbeat_timeout_s=3600, **options
    )
  )


def _start_job(state, dataset_id: str) -> tuple[int, int, int]:
  from jaxfeed.service.protocol.protos import service_pb2 as pb  # pylint: disable=g-import-not-at-top

  job_id, client_id = state.get_or_create_job(
    pb.GetOrCreateJobRequest(
      dataset_id=dataset_id, sharding_policy="distributed_epoch", exactly_once=True
    )
  )
  return job_id, client_id, next(iter(state.jobs[job_id].tasks))


def _get_split(state, job_id: int, task_id: int) -> int:
  from jaxfeed.service.protocol.protos import service_pb2 as pb  # pylint: disable=g-import-not-at-top

  response = state.get_splits(pb.GetSplitsRequest(job_id=job_id, task_id=task_id, max_ranges=1))
  return response.ranges[0].start


def _history(work_dir: str, jobs: int, splits_per_job: int, **options) -> dict:
  """Writes the history; returns what it wrote."""
  from jaxfeed.service.protocol.protos import service_pb2 as pb  # pylint: disable=g-import-not-at-top

  state = _state(work_dir, journal_fsync=False, **options)
  dataset_id = state.register_dataset(_dataset_def(splits_per_job * SPLIT_SIZE))
  state.worker_heartbeat(pb.WorkerHeartbeatRequest(worker_address="worker:1"))
  started = time.perf_counter()
  for _ in range(jobs):
    job_id, client_id, task_id = _start_job(state, dataset_id)
    acks = []
    for _ in range(splits_per_job):
      acks.append(_get_split(state, job_id, task_id))
      if len(acks) == 10:
        state.client_heartbeat(job_id, client_id, acked_splits=acks)
        acks = []
    state.client_heartbeat(job_id, client_id, acked_splits=acks)
  elapsed = time.perf_counter() - started
  state.close()
  return {"build_s": round(elapsed, 1), "live_jobs": jobs}


def _restart(work_dir: str, **options) -> dict:
  import os  # pylint: disable=g-import-not-at-top

  files = {name: os.path.getsize(os.path.join(work_dir, name)) for name in os.listdir(work_dir)}
  started = time.perf_counter()
  state = _state(work_dir, **options)
  elapsed = time.perf_counter() - started
  stats = state.replay_stats
  state.close()
  return {
    "restart_s": round(elapsed, 3),
    "records_replayed": stats.records,
    "snapshot_records": stats.snapshot_records,
    "journal_records": stats.journal_records,
    "disk_mb": round(sum(files.values()) / 2**20, 1),
  }


def _fsync_cost(work_dir: str, fsync: bool, threads: int, changes: int = 2000) -> dict:
  """Journaled changes per second, and their median latency in ms."""
  from jaxfeed.service.protocol.protos import service_pb2 as pb  # pylint: disable=g-import-not-at-top

  state = _state(work_dir, journal_fsync=fsync)
  dataset_id = state.register_dataset(_dataset_def(10**9))
  state.worker_heartbeat(pb.WorkerHeartbeatRequest(worker_address="worker:1"))
  latencies: list[float] = []

  def run() -> None:
    job_id, _, task_id = _start_job(state, dataset_id)
    for _ in range(changes // threads):
      started = time.perf_counter()
      _get_split(state, job_id, task_id)
      latencies.append(time.perf_counter() - started)

  started = time.perf_counter()
  workers = [threading.Thread(target=run) for _ in range(threads)]
  for worker in workers:
    worker.start()
  for worker in workers:
    worker.join()
  elapsed = time.perf_counter() - started
  state.close()
  return {
    "changes_per_s": round(len(latencies) / elapsed),
    "p50_ms": round(statistics.median(latencies) * 1e3, 3),
  }


def main(argv: list[str]) -> None:
  options = dict(arg.lstrip("-").split("=", 1) for arg in argv[1:])
  jobs = int(options.pop("jobs", 10_000))
  splits_per_job = int(options.pop("splits_per_job", 100))
  base = options.pop("work_dir", None)
  if options:
    raise SystemExit(
      f"Unknown options {sorted(options)}; allowed: --jobs, --splits_per_job, --work_dir."
    )
  root = tempfile.mkdtemp(prefix="jaxfeed-journal-", dir=base)
  result = {"benchmark": "journal_restart", "jobs": jobs, "splits": jobs * splits_per_job}
  try:
    for name, compaction in (
      ("without_compaction", {"snapshot_every_records": 0, "snapshot_every_bytes": 0}),
      ("with_compaction", {}),
    ):
      work_dir = f"{root}/{name}"
      result[name] = _history(work_dir, jobs, splits_per_job, **compaction)
      result[name].update(_restart(work_dir, **compaction))
    for name, fsync, threads in (
      ("fsync_off", False, 1),
      ("fsync_on", True, 1),
      ("fsync_on_8_threads", True, 8),
    ):
      result[name] = _fsync_cost(f"{root}/{name}", fsync, threads)
  finally:
    shutil.rmtree(root, ignore_errors=True)
  record.row({"workload": "journal restart", **result})


if __name__ == "__main__":
  with record.run("journal_restart"):
    main(sys.argv)
