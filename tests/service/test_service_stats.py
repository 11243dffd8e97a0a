"""Per-op statistics of a service read: the worker's pipeline rows come back
to the client (real dispatcher and worker processes)."""

from __future__ import annotations

import os
import time

import numpy as np

import jaxfeed
import service_udfs

DEADLINE_S = 90


def test_a_service_read_shows_the_workers_op_rows_and_names_the_slow_one(cluster):
  dispatcher = cluster("dispatcher", "--port=0")
  worker = cluster("worker", f"--dispatcher_address={dispatcher.address}",
                   "--heartbeat_interval_s=0.2")
  dataset = (jaxfeed.Dataset.from_tensor_slices({"x": np.arange(100_000)})
             .map(service_udfs.slow_add_one_to_x).batch(8)
             .distribute(dispatcher.address, "parallel_epochs"))
  with jaxfeed.Loader(dataset, prefetch=1) as loader:
    deadline = time.monotonic() + DEADLINE_S
    while True:
      next(loader)
      rows = loader.stats()["ops"]
      worker_rows = [r for r in rows if r.get("worker")]
      if worker_rows and worker_rows[1]["self_seconds"] > 0.3:
        break
      assert time.monotonic() < deadline, rows
      time.sleep(0.05)
    with open(os.devnull, "w") as sink:
      text = loader.report(file=sink)
  assert [r["op"] for r in rows] == ["from_tensor_slices", "map", "batch", "distribute"]
  assert all(r["worker"] == worker.address for r in worker_rows)
  assert len({r["task"] for r in worker_rows}) == 1
  assert worker_rows[1]["elements"] > 0 and rows[-1]["elements"] > 0
  assert "Input bound" in text
  assert f"Op to fix: 'map' on worker {worker.address} (" in text
