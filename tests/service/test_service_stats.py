"""Per-op statistics of a service read: the worker's pipeline rows come back
to the client (real dispatcher and worker processes)."""

from __future__ import annotations

import os
import time

import numpy as np

import jaxfeed
import service_udfs
from jaxfeed.service.client import task_stats

DEADLINE_S = 90


def read_of(cluster, num_elements: int, fn, batch_size: int):
  """A dispatcher and a worker process, and a dataset of `num_elements`
  mapped by `fn` and batched on that worker; returns (dataset, worker)."""
  dispatcher = cluster("dispatcher", "--port=0")
  worker = cluster(
    "worker", f"--dispatcher_address={dispatcher.address}", "--heartbeat_interval_s=0.2"
  )
  dataset = (
    jaxfeed.Dataset.from_tensor_slices({"x": np.arange(num_elements)})
    .map(fn)
    .batch(batch_size)
    .distribute(dispatcher.address, "parallel_epochs")
  )
  return dataset, worker


def test_a_service_read_shows_the_workers_op_rows_and_names_the_slow_one(cluster):
  dataset, worker = read_of(cluster, 100_000, service_udfs.slow_add_one_to_x, 8)
  with jaxfeed.Loader(dataset, prefetch=1) as loader:
    deadline = time.monotonic() + DEADLINE_S
    # No model step: the loop waits for every batch (input bound however long
    # the rows take to show the slow op), and stats() in every step asks the
    # worker at most once a second.
    while True:
      next(loader)
      rows = loader.stats()["ops"]
      worker_rows = [r for r in rows if r.get("worker")]
      if worker_rows and worker_rows[1]["self_seconds"] > 0.3:
        break
      assert time.monotonic() < deadline, rows
    with open(os.devnull, "w") as sink:
      text = loader.report(file=sink)
  assert [r["op"] for r in rows] == ["from_tensor_slices", "map", "batch", "distribute"]
  assert all(r["worker"] == worker.address for r in worker_rows)
  assert len({r["task"] for r in worker_rows}) == 1
  assert worker_rows[1]["elements"] > 0 and rows[-1]["elements"] > 0
  assert "Input bound" in text
  assert f"Op to fix: 'map' on worker {worker.address} (" in text


def worker_rows(iterator) -> list[dict]:
  return [r for r in iterator.stats()["ops"] if r.get("worker")]


def test_a_read_that_ended_shows_its_workers_final_rows(cluster):
  # Nobody asked during the read: the rows came with the end of the stream.
  dataset, worker = read_of(cluster, 100, service_udfs.add_one_to_x, 10)
  with dataset.make_iterator() as iterator:
    assert len(list(iterator)) == 10
    rows = worker_rows(iterator)
    stats = iterator.stats()
  assert [(r["op"], r["elements"]) for r in rows] == [
    ("from_tensor_slices", 100),
    ("map", 100),
    ("batch", 10),
  ]
  assert all(r["worker"] == worker.address for r in rows)
  assert all("ops" not in counters for counters in stats["workers"].values())


def test_stats_asks_a_worker_at_most_once_per_max_age(cluster, monkeypatch):
  monkeypatch.setattr(task_stats, "MAX_AGE_S", 3600.0)
  dataset, _ = read_of(cluster, 100_000, service_udfs.slow_add_one_to_x, 8)
  with dataset.make_iterator() as iterator:
    next(iterator)
    first = worker_rows(iterator)  # asks the worker
    assert [r["op"] for r in first] == ["from_tensor_slices", "map", "batch"]
    made = first[-1]["elements"]
    for _ in range(made + 1):  # the worker has made more batches since
      next(iterator)
    for _ in range(20):
      assert worker_rows(iterator) == first  # not asked again
    monkeypatch.setattr(task_stats, "MAX_AGE_S", 0.0)
    assert worker_rows(iterator)[-1]["elements"] > made  # asked


def test_a_service_read_with_no_op_time_yet_says_the_time_is_in_the_read(cluster):
  dispatcher = cluster("dispatcher", "--port=0")
  cluster("worker", f"--dispatcher_address={dispatcher.address}", "--heartbeat_interval_s=0.2")
  # No sampling, here or on the worker: no op measures time.
  dataset = (
    jaxfeed.Dataset.from_tensor_slices({"x": np.arange(400)})
    .batch(8)
    .with_options(jaxfeed.Options(stats=False))
    .distribute(dispatcher.address, "parallel_epochs")
  )
  with jaxfeed.Loader(dataset, prefetch=1) as loader:
    for _ in range(5):
      next(loader)
    read = loader.stats()["ops"][-1]
    with open(os.devnull, "w") as sink:
      text = loader.report(file=sink)
  assert read["op"] == "distribute" and read["service_workers"] == 1
  assert read["received"] >= 5 and read["read_wait_seconds"] > 0
  assert "No op has measured time yet" not in text
  assert (
    "No op in this process has measured time: it is spent in the service read "
    "('distribute'), whose pipeline runs on the workers. This process waited "
  ) in text
  assert f"from 1 worker(s) ({read['received']} received, 0 reconnections)" in text
