"""DYNAMIC sharding of every index-addressable input, and workers that run
the client's Options (optimizer, autotuner); real dispatcher and worker
processes on loopback."""

from __future__ import annotations

import collections
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np
import pytest

import jaxfeed
import service_udfs
from jaxfeed.ops import parallel
from jaxfeed.ops import tree
from jaxfeed.service.protocol import rpc

pytestmark = pytest.mark.timeout(180)

Dataset = jaxfeed.Dataset


def start_service(cluster, num_workers: int, *dispatcher_flags: str):
  dispatcher = cluster("dispatcher", "--port=0", "--heartbeat_timeout_s=2", *dispatcher_flags)
  for _ in range(num_workers):
    cluster("worker", f"--dispatcher_address={dispatcher.address}", "--heartbeat_interval_s=0.2")
  return dispatcher


def rows(batches) -> collections.Counter:
  """The multiset of elements of batches, each as the tuple of its leaves."""
  counts: collections.Counter = collections.Counter()
  for batch in batches:
    leaves = [np.asarray(leaf).tolist() for leaf in tree.flatten(batch)]
    counts.update(zip(*leaves))
  return counts


PIPELINES = {
  "range": lambda: Dataset.range(200).batch(5),
  "from_tensor_slices": lambda: Dataset.from_tensor_slices(
    {"x": np.arange(150), "y": np.arange(150) % 7}
  ).batch(4),
  "concatenate": lambda: (
    Dataset.range(90).concatenate(Dataset.range(1000, 1070)).map(service_udfs.add_one).batch(6)
  ),
  # Pairs stay those of a local run: (i, 7 i).
  "zip": lambda: Dataset.zip(
    (Dataset.range(130), Dataset.from_tensor_slices(np.arange(150) * 7))
  ).batch(5),
}


@pytest.mark.parametrize("visitation", ["at_most_once", "exactly_once"])
def test_dynamic_sharding_delivers_the_epoch_of_each_index_addressable_input(cluster, visitation):
  dispatcher = start_service(cluster, 2, "--split_size=8")
  for name, make in PIPELINES.items():
    dataset = make()
    with dataset.distribute(
      dispatcher.address, "distributed_epoch", visitation=visitation
    ).make_iterator() as iterator:
      got = rows(iterator)
    assert got == rows(dataset), name


def test_distribute_refuses_a_dynamic_pipeline_without_one_splittable_input():
  dataset = Dataset.range(5).map(service_udfs.add_one).concatenate(Dataset.range(3))
  with pytest.raises(ValueError, match="'range -> map -> concatenate'.*Index-addressable"):
    dataset.distribute("127.0.0.1:1", "distributed_epoch")


@pytest.mark.parametrize("count", [3, None])
def test_distribute_refuses_a_dynamic_pipeline_that_repeats_its_split_input(count):
  # Each split is handed out once per job: a repeat would silently read one pass.
  dataset = Dataset.range(5).repeat(count).map(service_udfs.add_one)
  with pytest.raises(ValueError, match="repeats its split input"):
    dataset.distribute("127.0.0.1:1", "distributed_epoch")
  dataset.distribute("127.0.0.1:1", "parallel_epochs")
  Dataset.range(5).repeat(1).distribute("127.0.0.1:1", "distributed_epoch")


def test_a_registered_unsplittable_dataset_read_dynamically_fails_clearly(cluster):
  dispatcher = start_service(cluster, 1)
  dataset = Dataset.zip((Dataset.range(5).map(service_udfs.add_one), Dataset.range(5)))
  dataset_id = jaxfeed.service.register_dataset(dispatcher.address, dataset)
  reader = jaxfeed.service.from_dataset_id("distributed_epoch", dispatcher.address, dataset_id)
  with pytest.raises(rpc.ServiceError, match="'range -> map -> zip'"):
    with reader.make_iterator() as iterator:
      list(iterator)


@pytest.mark.parametrize("vectorize", [True, False])
def test_a_worker_runs_the_optimizer_with_the_clients_options(cluster, vectorize):
  dispatcher = start_service(cluster, 1)
  dataset = Dataset.range(40).map(service_udfs.mark_batched, batched=True).batch(4)
  dataset = dataset.with_options(jaxfeed.Options(map_and_batch_vectorization=vectorize))
  with dataset.distribute(dispatcher.address, "parallel_epochs").make_iterator() as iterator:
    batches = list(iterator)
  assert rows(batches) == rows(dataset)  # the same data either way
  flags = np.concatenate([b["batched"] for b in batches])
  assert len(flags) == 40 and flags.all() == vectorize and flags.any() == vectorize


@pytest.mark.parametrize("visitation", ["at_most_once", "exactly_once"])
def test_a_worker_autotunes_autotune_parallelism(cluster, visitation):
  dispatcher = start_service(cluster, 1, "--split_size=64")
  start = parallel.default_autotune_parallelism()
  dataset = Dataset.range(1000).map(
    service_udfs.most_concurrent, num_parallel_calls=jaxfeed.AUTOTUNE
  )
  # A budget of threads above the start, whatever the number of cores.
  dataset = dataset.with_options(jaxfeed.Options(autotune_cpu_budget=start + 16))
  most = 0
  with dataset.distribute(
    dispatcher.address, "distributed_epoch", visitation=visitation
  ).make_iterator() as iterator:
    for element in iterator:
      most = max(most, int(element["most"]))
      if most > start + 2:
        break
  assert most > start + 2
