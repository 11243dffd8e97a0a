"""W4t's read with 2 workers (`benchmarks.w4_service`) is served by both:
its splits are small enough that each worker gets some of the epoch."""

from __future__ import annotations

import time

import pytest

from benchmarks import harness
from benchmarks import w4_service
from benchmarks import workloads

pytestmark = pytest.mark.timeout(180)


def _bytes_by_worker(metrics_urls: list[str]) -> list[int]:
  """Each worker's bytes served of the cluster's one job (0 before it served)."""
  served = w4_service.served_bytes(metrics_urls)
  jobs = set().union(*served)
  assert len(jobs) <= 1, f"bytes served by each worker, by job: {served}"
  return [sum(counts.values()) for counts in served]


def test_w4t_read_with_two_workers_is_served_by_both_workers():
  procs, address, metrics_urls = w4_service.jaxfeed_cluster(2, w4_service.W4T_SPLIT_SIZE)
  try:
    n = workloads.w1_size(1.0)  # the benchmark's epoch
    with w4_service.read_epoch(w4_service._jaxfeed_w4t(n), address) as iterator:  # pylint: disable=protected-access
      batches = [len(next(iterator)["image"])]
      # While the consumer waits, the worker that started first runs ahead by
      # its buffers only (a few of the 20 splits), so the other one, however
      # late it starts, gets splits too; with one split for the whole epoch
      # it would get none.
      deadline = time.monotonic() + 30
      while not all(_bytes_by_worker(metrics_urls)) and time.monotonic() < deadline:
        time.sleep(0.05)
      batches += [len(batch["image"]) for batch in iterator]
    by_worker = _bytes_by_worker(metrics_urls)
  finally:
    harness.stop_processes(procs)

  assert sum(batches) == -(-n // w4_service.BATCH) * w4_service.BATCH
  assert all(by_worker), f"bytes served by each worker: {by_worker}"
  # Between them, the workers served every batch (and a little framing).
  batch_bytes = w4_service.BATCH * workloads.CROP**2 * 3 * 4
  assert sum(by_worker) >= len(batches) * batch_bytes
