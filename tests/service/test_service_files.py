"""Sharding over files: DYNAMIC splits of whole files, FILE / FILE_OR_DATA /
HINT static sharding, and the dispatcher's `worker_addresses`; real
dispatcher and worker processes on loopback."""

from __future__ import annotations

import collections
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np
import pytest

import jaxfeed
import service_udfs
from jaxfeed.service import SHARD_HINT
from service_cluster import free_port, release_port

pytestmark = pytest.mark.timeout(120)

HEARTBEAT = ("--heartbeat_interval_s=0.2",)
NUM_FILES = 8


def start_service(cluster, num_workers: int, *dispatcher_flags: str):
  dispatcher = cluster("dispatcher", "--port=0", "--heartbeat_timeout_s=2", *dispatcher_flags)
  workers = [
    cluster("worker", f"--dispatcher_address={dispatcher.address}", *HEARTBEAT)
    for _ in range(num_workers)
  ]
  return dispatcher, workers


def write_files(folder, records_of=lambda f: 30) -> list[str]:
  """NUM_FILES TFRecord files; record r of file f holds label f and x = 1000 f + r."""
  paths = []
  for f in range(NUM_FILES):
    path = str(folder / f"part-{f}.tfrecord")
    jaxfeed.write_tfrecord(
      path, [np.int32(f).tobytes() + np.int64(1000 * f + r).tobytes() for r in range(records_of(f))]
    )
    paths.append(path)
  return paths


def expected(records_of=lambda f: 30) -> collections.Counter:
  return collections.Counter(1000 * f + r for f in range(NUM_FILES) for r in range(records_of(f)))


def read(dataset: jaxfeed.Dataset) -> tuple[collections.Counter, dict]:
  """Every x read, and batches by worker address."""
  with dataset.make_iterator() as iterator:
    batches = list(iterator)
    by_worker = dict(getattr(iterator, "elements_by_worker", {}))
  xs = np.concatenate([np.asarray(b["x"]).reshape(-1) for b in batches]).tolist() if batches else []
  return collections.Counter(xs), by_worker


def tfrecords(paths: list[str]) -> jaxfeed.Dataset:
  return jaxfeed.Dataset.from_tfrecord(paths).map(service_udfs.decode_record)


def interleaved(paths: list[str]) -> jaxfeed.Dataset:
  names = np.array([p.encode() for p in paths])
  return jaxfeed.Dataset.from_tensor_slices(names).interleave(
    service_udfs.tfrecord_file, cycle_length=2
  )


@pytest.mark.parametrize("visitation", ["at_most_once", "exactly_once"])
@pytest.mark.parametrize("make", [tfrecords, interleaved], ids=["from_tfrecord", "interleave"])
def test_dynamic_hands_out_whole_files_to_both_workers(cluster, tmp_path, make, visitation):
  dispatcher, workers = start_service(cluster, 2)  # split_size 256: positions are files
  dataset = make(write_files(tmp_path)).map(service_udfs.slow_add_one_to_x).batch(4)
  got, by_worker = read(
    dataset.distribute(dispatcher.address, "distributed_epoch", visitation=visitation)
  )
  assert got == collections.Counter({x + 1: 1 for x in expected()})
  # One file per split: both workers read some of the 8 files.
  assert sorted(by_worker) == sorted(w.address for w in workers)
  assert all(by_worker.values())


def slow_exactly_once_read(address: str, folder) -> jaxfeed.Dataset:
  """8 files of 60 records at 2 ms each, read exactly once in batches of 4."""
  dataset = (
    tfrecords(write_files(folder, lambda f: 60)).map(service_udfs.slow_add_one_to_x).batch(4)
  )
  return dataset.distribute(
    address, "distributed_epoch", visitation="exactly_once", max_outstanding_requests=2
  )


def assert_every_slow_record_once(batches) -> None:
  xs = np.concatenate([b["x"] for b in batches]).tolist()
  assert collections.Counter(xs) == collections.Counter({x + 1: 1 for x in expected(lambda f: 60)})


def test_dynamic_exactly_once_over_files_survives_a_worker_killed_mid_epoch(cluster, tmp_path):
  dispatcher, workers = start_service(cluster, 2)
  with slow_exactly_once_read(dispatcher.address, tmp_path).make_iterator() as iterator:
    batches = [next(iterator) for _ in range(10)]
    while not iterator.elements_by_worker.get(workers[0].address):  # it delivered files
      batches.append(next(iterator))
    assert len(batches) < 60  # half of the 120 batches: mid-epoch
    workers[0].kill()  # mid-file: 2 ms per record, 120 ms per file
    batches += list(iterator)
  assert_every_slow_record_once(batches)


@pytest.mark.parametrize(
  "make, policy",
  [(tfrecords, "FILE"), (interleaved, "FILE"), (interleaved, "FILE_OR_DATA")],
  ids=["from_tfrecord-FILE", "interleave-FILE", "interleave-FILE_OR_DATA"],
)
def test_file_sharding_gives_each_worker_its_own_files(cluster, tmp_path, make, policy):
  dispatcher, workers = start_service(cluster, 2, "--num_workers=2")
  sizes = lambda f: 5 * (f + 1)  # worker 0: files 0, 2, 4, 6 (80 records); 1: 100
  got, by_worker = read(make(write_files(tmp_path, sizes)).distribute(dispatcher.address, policy))
  assert got == expected(sizes)
  assert sorted(by_worker.values()) == [80, 100]  # batch-less: one element each
  assert sorted(by_worker) == sorted(w.address for w in workers)


def test_file_or_data_shards_a_sampler_by_records_without_files(cluster):
  dispatcher, _ = start_service(cluster, 2, "--num_workers=2")
  source = jaxfeed.ArraySource({"x": np.arange(90, dtype=np.int64)})
  dataset = jaxfeed.Dataset.from_source(source, jaxfeed.IndexSampler(90, shuffle=True, seed=2))
  got, by_worker = read(dataset.batch(5).distribute(dispatcher.address, "FILE_OR_DATA"))
  assert got == collections.Counter(range(90))
  assert sorted(by_worker.values()) == [9, 9]


def test_data_without_a_sampler_keeps_every_nth_output_element_per_worker(cluster):
  dispatcher, _ = start_service(cluster, 2, "--num_workers=2")
  dataset = jaxfeed.Dataset.range(60).map(service_udfs.add_one).batch(6)  # tf.data's DATA
  with dataset.distribute(dispatcher.address, "DATA").make_iterator() as iterator:
    batches = [np.asarray(b).tolist() for b in iterator]
  assert sorted(sum(batches, [])) == list(range(1, 61))
  assert sorted(batches) == sorted(np.asarray(list(dataset)).tolist())  # whole batches


def test_hint_fills_shard_placeholders_with_each_workers_index(cluster, tmp_path):
  dispatcher, workers = start_service(cluster, 2, "--num_workers=2")
  names = np.array([p.encode() for p in write_files(tmp_path)])
  dataset = (
    jaxfeed.Dataset.from_tensor_slices(names)
    .shard(SHARD_HINT, SHARD_HINT)
    .interleave(service_udfs.tfrecord_file)
    .batch(10)
  )
  got, by_worker = read(dataset.distribute(dispatcher.address, "HINT"))
  assert got == expected()
  assert sorted(by_worker.values()) == [12, 12]  # 4 files of 30 each


def test_worker_addresses_fix_each_workers_index_and_wait_for_a_late_one(cluster, tmp_path):
  ports = [free_port(), free_port()]
  try:
    # Listed against sorted order: index 0 is the larger address.
    listed = sorted((f"127.0.0.1:{p}" for p in ports), reverse=True)
    dispatcher = cluster(
      "dispatcher", "--port=0", "--heartbeat_timeout_s=2", f"--worker_addresses={','.join(listed)}"
    )

    def worker(address: str):
      return cluster(
        "worker",
        f"--dispatcher_address={dispatcher.address}",
        f"--port={address.rsplit(':', 1)[1]}",
        *HEARTBEAT,
      )

    worker(listed[1])
    sizes = lambda f: 5 * (f + 1)
    dataset = tfrecords(write_files(tmp_path, sizes))
    with dataset.distribute(dispatcher.address, "FILE").make_iterator() as iterator:
      xs = [int(next(iterator)["x"]) for _ in range(20)]  # from worker 1's files
      worker(listed[0])  # registers late: the job waits for its shard
      xs += [int(e["x"]) for e in iterator]
      by_worker = dict(iterator.elements_by_worker)
    assert collections.Counter(xs) == expected(sizes)
    assert by_worker == {listed[0]: 80, listed[1]: 100}  # files 0, 2, 4, 6 on index 0
  finally:
    for port in ports:
      release_port(port)


def test_file_sharding_refuses_a_pipeline_without_files():
  dataset = jaxfeed.Dataset.range(10).map(service_udfs.add_one)
  with pytest.raises(
    ValueError, match="FILE sharding gives each worker its own files.*from_tfrecord.*FILE_OR_DATA"
  ):
    dataset.distribute("127.0.0.1:1", "FILE")


def test_hint_needs_a_placeholder_and_only_hint_fills_one():
  with pytest.raises(ValueError, match=r"no shard\(jaxfeed.service.SHARD_HINT"):
    jaxfeed.Dataset.range(10).distribute("127.0.0.1:1", "HINT")
  hinted = jaxfeed.Dataset.range(10).shard(SHARD_HINT, SHARD_HINT)
  with pytest.raises(
    ValueError, match="only processing_mode HINT fills in; the processing mode is DYNAMIC"
  ):
    hinted.distribute("127.0.0.1:1", "distributed_epoch")
  with pytest.raises(ValueError, match="placeholder that only a jaxfeed service job"):
    list(hinted)
  with pytest.raises(ValueError, match="placeholder for both num_shards and index"):
    jaxfeed.Dataset.range(10).shard(SHARD_HINT, 0)


def test_dynamic_refuses_an_unsplittable_file_reader_naming_what_splits():
  dataset = jaxfeed.Dataset.from_generator(lambda: iter([b"a"])).map(service_udfs.add_one)
  with pytest.raises(
    ValueError,
    match=r"'from_generator -> map'.*cannot be split.*"
    r"from_tfrecord \(its files\).*from_tensor_slices"
    r"\(files\).interleave",
  ):
    dataset.distribute("127.0.0.1:1", "distributed_epoch", udf_secret=b"s" * 32)


@pytest.mark.parametrize(
  "addresses, message",
  [
    (["127.0.0.1:1", "127.0.0.1:1"], "more than once"),
    (["127.0.0.1:1", ""], "must be a list of"),
    ([7], "must be a list of"),
  ],
)
def test_dispatcher_config_checks_worker_addresses(addresses, message):
  with pytest.raises(ValueError, match=message):
    jaxfeed.service.DispatcherConfig(worker_addresses=addresses)
  with pytest.raises(ValueError, match="num_workers=3 but worker_addresses lists 1"):
    jaxfeed.service.DispatcherConfig(num_workers=3, worker_addresses=["127.0.0.1:1"])
  config = jaxfeed.service.DispatcherConfig(worker_addresses=["127.0.0.1:1", "10.0.0.2"])
  assert config.worker_addresses == ("127.0.0.1:1", "10.0.0.2")


def test_a_worker_takes_the_first_free_entry_its_address_matches():
  from jaxfeed.service.dispatcher import workers  # pylint: disable=g-import-not-at-top

  fixed = {"10.0.0.1:5000": 0, "10.0.0.2": 1, "10.0.0.2:%port%": 2, "10.0.0.3:%port%": 3}
  assert workers._fixed_index(fixed, "10.0.0.1:5000", set()) == 0
  assert workers._fixed_index(fixed, "10.0.0.1:5001", set()) is None
  assert workers._fixed_index(fixed, "10.0.0.2:7", set()) == 1
  assert workers._fixed_index(fixed, "10.0.0.2:8", {1}) == 2
  assert workers._fixed_index(fixed, "10.0.0.2:9", {1, 2}) is None
  assert workers._fixed_index(fixed, "10.0.0.3:1", set()) == 3


def test_dynamic_exactly_once_over_files_survives_a_dispatcher_restart(cluster, tmp_path):
  port = free_port()
  try:
    flags = (f"--port={port}", f"--work_dir={tmp_path / 'journal'}", "--heartbeat_timeout_s=2")
    dispatcher = cluster("dispatcher", *flags)
    for _ in range(2):
      cluster("worker", f"--dispatcher_address={dispatcher.address}", *HEARTBEAT)
    with slow_exactly_once_read(dispatcher.address, tmp_path).make_iterator() as iterator:
      batches = [next(iterator) for _ in range(15)]
      dispatcher.kill()  # the file splits handed out and acknowledged are in its journal
      dispatcher = cluster("dispatcher", *flags)
      batches += list(iterator)
    assert_every_slow_record_once(batches)
  finally:
    release_port(port)


def test_a_dynamic_read_of_files_repeats_outside_the_service(cluster, tmp_path):
  dispatcher, _ = start_service(cluster, 2)
  dataset = tfrecords(write_files(tmp_path, lambda f: 3))
  with pytest.raises(
    ValueError,
    match=r"repeats its split input \(repeat 2 times\).*"
    r"Apply .repeat\(\) to the distributed dataset",
  ):
    dataset.repeat(2).distribute(dispatcher.address, "distributed_epoch")
  got, _ = read(dataset.distribute(dispatcher.address, "distributed_epoch").repeat(2))
  assert got == collections.Counter({x: 2 for x in expected(lambda f: 3)})
