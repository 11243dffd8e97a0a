"""Dispatcher and workers as separate OS processes on loopback, read by clients."""

from __future__ import annotations

import collections
import os
import threading
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np
import pytest
import tensorflow as tf

import jaxfeed
import service_udfs
from jaxfeed.service import ShardingPolicy
from service_cluster import free_port

pytestmark = pytest.mark.timeout(120)

HEARTBEAT = ("--heartbeat_interval_s=0.2",)


def start_service(cluster, num_workers: int, *dispatcher_flags: str):
  dispatcher = cluster("dispatcher", "--port=0", "--heartbeat_timeout_s=2", *dispatcher_flags)
  workers = [
    cluster("worker", f"--dispatcher_address={dispatcher.address}", *HEARTBEAT)
    for _ in range(num_workers)
  ]
  return dispatcher, workers


def records_dataset(num_records: int, seed: int = 0) -> jaxfeed.Dataset:
  source = jaxfeed.ArraySource({"x": np.arange(num_records, dtype=np.int64)})
  sampler = jaxfeed.IndexSampler(num_records, shuffle=True, seed=seed)
  return jaxfeed.Dataset.from_source(source, sampler)


def read_all(dataset: jaxfeed.Dataset) -> tuple[list, dict]:
  with dataset.make_iterator() as iterator:
    batches = list(iterator)
    return batches, iterator.elements_by_worker


def values(batches: list) -> collections.Counter:
  if not batches:
    return collections.Counter()
  return collections.Counter(np.concatenate([b["x"] for b in batches]).tolist())


@pytest.mark.parametrize("num_workers", [1, 3])
@pytest.mark.parametrize("data_transfer", ["socket", "grpc"])
def test_parallel_epochs_every_worker_serves_the_whole_pipeline(
  cluster, num_workers, data_transfer
):
  dispatcher, _ = start_service(cluster, num_workers)
  dataset = jaxfeed.Dataset.range(50).map(service_udfs.add_one).batch(8)
  batches, by_worker = read_all(
    dataset.distribute(dispatcher.address, "parallel_epochs", data_transfer=data_transfer)
  )
  counts = collections.Counter(np.concatenate(batches).tolist())
  assert counts == collections.Counter({v: num_workers for v in range(1, 51)})
  assert len(by_worker) == num_workers


def test_one_worker_parallel_epochs_matches_tf_data_batch_by_batch(cluster):
  dispatcher, _ = start_service(cluster, 1)
  dataset = jaxfeed.Dataset.range(37).map(service_udfs.add_one).batch(5)
  batches, _ = read_all(dataset.distribute(dispatcher.address, ShardingPolicy.OFF))
  expected = list(tf.data.Dataset.range(37).map(lambda x: x + 1).batch(5).as_numpy_iterator())
  assert len(batches) == len(expected)
  for got, want in zip(batches, expected):
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("num_workers", [1, 3])
def test_distributed_epoch_delivers_every_record_exactly_once(cluster, num_workers):
  dispatcher, _ = start_service(cluster, num_workers, "--split_size=16")
  dataset = records_dataset(1000).map(service_udfs.add_one_to_x).batch(10)
  batches, by_worker = read_all(dataset.distribute(dispatcher.address, "distributed_epoch"))
  assert values(batches) == collections.Counter(range(1, 1001))
  assert sum(by_worker.values()) == len(batches)


def test_distributed_epoch_reads_a_tfrecord_file_exactly_once(cluster, tmp_path):
  path = str(tmp_path / "records.tfrecord")
  records = [np.int32(i % 7).tobytes() + np.int64(i).tobytes() for i in range(300)]
  jaxfeed.write_tfrecord(path, records)
  dispatcher, _ = start_service(cluster, 2, "--split_size=8")
  dataset = (
    jaxfeed.Dataset.from_source(
      jaxfeed.TFRecordSource(path), jaxfeed.IndexSampler(300, shuffle=True, seed=1)
    )
    .map(service_udfs.decode_record)
    .batch(6)
  )
  batches, _ = read_all(dataset.distribute(dispatcher.address, "distributed_epoch"))
  got = values(batches)
  assert got == collections.Counter(range(300))
  labels = np.concatenate([b["label"] for b in batches])
  xs = np.concatenate([b["x"] for b in batches]).reshape(-1)
  np.testing.assert_array_equal(labels, xs % 7)


@pytest.mark.parametrize("mode", ["distributed_epoch", "parallel_epochs"])
def test_shared_job_splits_elements_between_two_clients(cluster, mode):
  dispatcher, _ = start_service(cluster, 1, "--split_size=8")
  dataset = records_dataset(400).map(service_udfs.slow_add_one_to_x).batch(4)
  results: list = [None, None]

  def read(i):
    results[i] = read_all(
      dataset.distribute(dispatcher.address, mode, job_name="shared", max_outstanding_requests=2)
    )[0]

  threads = [threading.Thread(target=read, args=(i,)) for i in range(2)]
  for t in threads:
    t.start()
  for t in threads:
    t.join(timeout=90)
  first, second = values(results[0]), values(results[1])
  assert not set(first) & set(second)
  assert first + second == collections.Counter(range(1, 401))
  assert first and second


def test_client_finishes_after_a_worker_is_killed_mid_epoch(cluster):
  dispatcher, workers = start_service(cluster, 2, "--split_size=8")
  dataset = records_dataset(600).map(service_udfs.slow_add_one_to_x).batch(4)
  distributed = dataset.distribute(
    dispatcher.address, "distributed_epoch", max_outstanding_requests=2
  )
  with distributed.make_iterator() as iterator:
    batches = [next(iterator) for _ in range(20)]
    workers[0].kill()
    batches += list(iterator)
  got = values(batches)
  assert max(got.values()) == 1  # nothing twice
  assert set(got) <= set(range(1, 601))
  # Lost: what the dead worker buffered (8 batches of 4), had in flight to the
  # client and had left of its splits (2 requests of 8 positions each).
  lost = 600 - sum(got.values())
  assert 0 <= lost <= 8 * 4 + 2 * 4 + 2 * 2 * 8 + 16


@pytest.mark.parametrize("data_transfer", ["socket", "grpc"])
def test_exactly_once_delivers_every_record_once_when_a_worker_is_killed(cluster, data_transfer):
  dispatcher, workers = start_service(cluster, 3, "--split_size=8")
  dataset = records_dataset(600).map(service_udfs.slow_add_one_to_x).batch(4)
  distributed = dataset.distribute(
    dispatcher.address,
    "distributed_epoch",
    visitation="exactly_once",
    max_outstanding_requests=2,
    data_transfer=data_transfer,
  )
  with distributed.make_iterator() as iterator:
    batches = [next(iterator) for _ in range(20)]
    workers[0].kill()  # mid-split: 2 ms per record, 16 ms per split
    batches += list(iterator)
    by_worker = iterator.elements_by_worker
  # What the killed worker had read but not delivered whole was read again by
  # the others; what it half-sent was never handed on.
  assert values(batches) == collections.Counter(range(1, 601))
  assert by_worker.get(workers[0].address, 0) > 0
  assert all(len(b["x"]) in (4,) for b in batches)  # splits of 8 make whole batches


def test_a_terminated_worker_hands_over_its_splits_and_leaves_at_once(cluster):
  # A long heartbeat timeout: only the worker's goodbye lets the job end soon.
  dispatcher = cluster("dispatcher", "--port=0", "--heartbeat_timeout_s=60", "--split_size=8")
  workers = [
    cluster("worker", f"--dispatcher_address={dispatcher.address}", *HEARTBEAT) for _ in range(2)
  ]
  dataset = records_dataset(600).map(service_udfs.slow_add_one_to_x).batch(4)
  distributed = dataset.distribute(
    dispatcher.address, "distributed_epoch", max_outstanding_requests=2
  )
  with distributed.make_iterator() as iterator:
    batches = [next(iterator) for _ in range(20)]
    start = time.monotonic()
    workers[0].proc.terminate()  # SIGTERM: drain, then leave
    batches += list(iterator)
    elapsed = time.monotonic() - start
  assert workers[0].proc.wait(timeout=30) == 0
  # At-most-once, yet nothing lost: the worker finished its splits first.
  assert values(batches) == collections.Counter(range(1, 601))
  assert elapsed < 30, elapsed


def test_a_worker_terminated_as_soon_as_it_says_it_listens_stops_cleanly(cluster):
  # The signal comes right after the worker's readiness line, while it still
  # starts its metrics server: it exits cleanly (0), after telling the
  # dispatcher it left, instead of dying of the signal.
  dispatcher = cluster("dispatcher", "--port=0", "--heartbeat_timeout_s=60")
  for _ in range(3):
    worker = cluster(
      "worker", f"--dispatcher_address={dispatcher.address}", *HEARTBEAT, "--metrics_port=0"
    )
    worker.proc.terminate()
    assert worker.proc.wait(timeout=30) == 0


def test_worker_added_mid_job_starts_serving(cluster):
  dispatcher, _ = start_service(cluster, 1, "--split_size=4")
  dataset = records_dataset(1200).map(service_udfs.slow_add_one_to_x).batch(2)
  distributed = dataset.distribute(
    dispatcher.address, "distributed_epoch", max_outstanding_requests=2
  )
  with distributed.make_iterator() as iterator:
    batches = [next(iterator) for _ in range(5)]
    late = cluster("worker", f"--dispatcher_address={dispatcher.address}", *HEARTBEAT)
    batches += list(iterator)
    by_worker = iterator.elements_by_worker
  assert values(batches) == collections.Counter(range(1, 1201))
  assert by_worker.get(late.address, 0) > 0


def test_workers_and_client_wait_for_a_dispatcher_started_last(cluster):
  port = free_port()
  address = f"127.0.0.1:{port}"
  for _ in range(2):
    cluster("worker", f"--dispatcher_address={address}", *HEARTBEAT)
  dataset = records_dataset(100).map(service_udfs.add_one_to_x).batch(10)
  result = {}

  def read():
    result["batches"] = read_all(dataset.distribute(address, "distributed_epoch"))[0]

  reader = threading.Thread(target=read)
  reader.start()
  time.sleep(1.0)
  assert reader.is_alive()  # still waiting for the dispatcher
  cluster("dispatcher", f"--port={port}")
  reader.join(timeout=60)
  assert not reader.is_alive()
  assert values(result["batches"]) == collections.Counter(range(1, 101))
