"""Ids that no restart of the dispatcher hands out twice, and workers that
never serve one pipeline's data for another's.

A dispatcher without a work_dir that is killed and started again on its
port knows nothing of its predecessor, while its workers (and readers) still
hold what the predecessor gave them: dataset definitions, tasks, ids.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import jaxfeed
import service_udfs
from jaxfeed import service
from jaxfeed.service import ServiceError
from jaxfeed.service.dispatcher.state import DispatcherState
from jaxfeed.service.protocol import rpc
from jaxfeed.service.protocol import spec
from jaxfeed.service.protocol.protos import service_pb2 as pb
from service_cluster import free_port, release_port

pytestmark = pytest.mark.timeout(120)

MODES = {
  "parallel_epochs": ("parallel_epochs", "at_most_once"),
  "at_most_once": ("distributed_epoch", "at_most_once"),
  "exactly_once": ("distributed_epoch", "exactly_once"),
}


def pipeline(first: int, num: int = 100) -> jaxfeed.Dataset:
  """Batches of {"x": first, ..., first + num - 1} (2 ms per element)."""
  x = np.arange(first - 1, first - 1 + num, dtype=np.int64)
  return jaxfeed.Dataset.from_tensor_slices({"x": x}).map(service_udfs.slow_add_one_to_x).batch(4)


def read(address: str, dataset: jaxfeed.Dataset, mode: str) -> jaxfeed.Dataset:
  policy, visitation = MODES[mode]
  return dataset.distribute(address, policy, visitation=visitation, timeout_s=30)


def values(batches) -> list[int]:
  return sorted(int(v) for batch in batches for v in batch["x"])


@pytest.fixture
def port():
  chosen = free_port()
  yield chosen
  release_port(chosen)


@pytest.mark.parametrize("mode", list(MODES))
def test_a_pipeline_registered_after_a_stateless_restart_gets_its_own_data(cluster, port, mode):
  dispatcher = cluster("dispatcher", f"--port={port}")
  cluster("worker", f"--dispatcher_address={dispatcher.address}", "--heartbeat_interval_s=0.1")
  with read(dispatcher.address, pipeline(1, 1000), mode).make_iterator() as old:
    got = list(next(old)["x"])  # the worker runs the old read's task
    dispatcher.kill()
    dispatcher = cluster("dispatcher", f"--port={port}")
    new = values(read(dispatcher.address, pipeline(500001), mode))
    assert new == list(range(500001, 500101))
    # The new dispatcher knows nothing of the old read's job: the read fails
    # saying so, with only its own elements, none twice.
    with pytest.raises(ServiceError, match="restarted without its state"):
      for batch in old:
        got.extend(batch["x"].tolist())
  assert set(got) <= set(range(1, 1001)) and len(got) == len(set(got))


def test_tenants_registering_in_turn_after_restarts_never_see_each_others_data(cluster, port):
  dispatcher = cluster("dispatcher", f"--port={port}")
  cluster("worker", f"--dispatcher_address={dispatcher.address}", "--heartbeat_interval_s=0.1")
  tenants = {"a": 1, "b": 1_000_001}
  for turn, mode in enumerate(MODES):
    if turn:
      dispatcher.kill()
      dispatcher = cluster("dispatcher", f"--port={port}")
    for name in sorted(tenants, reverse=turn % 2 == 1):  # a first, then b first, ...
      first = tenants[name]
      assert values(read(dispatcher.address, pipeline(first, 40), mode)) == list(
        range(first, first + 40)
      ), (name, mode)


def test_a_worker_keeps_a_bounded_number_of_dataset_definitions():
  bound = service.WorkerConfig.dataset_cache_entries
  with (
    service.DispatchServer() as dispatcher,
    service.WorkerServer(
      service.WorkerConfig(dispatcher_address=dispatcher.target, heartbeat_interval_s=0.1)
    ) as worker,
  ):
    for i in range(bound + 6):  # distinct pipelines, each read to its end
      dataset = jaxfeed.Dataset.from_tensor_slices(np.arange(i, i + 3))
      got = [int(v) for v in dataset.distribute(dispatcher.target)]
      assert got == [i, i + 1, i + 2]
    assert len(worker._worker.dataset_defs) <= bound  # pylint: disable=protected-access


def _dataset_def(values_: np.ndarray) -> pb.DatasetDef:
  return spec.to_dataset_def(jaxfeed.Dataset.from_tensor_slices(values_).node)


def test_ids_of_a_dispatcher_restarted_without_state_are_new(tmp_path):
  del tmp_path
  config = service.DispatcherConfig()
  first = DispatcherState(config)
  dataset_id = first.register_dataset(_dataset_def(np.arange(5)))
  job_id, client_id = first.get_or_create_job(
    pb.GetOrCreateJobRequest(dataset_id=dataset_id, sharding_policy="parallel_epochs")
  )
  first.close()
  second = DispatcherState(config)
  assert second.incarnation > max(int(dataset_id), job_id, client_id)
  assert int(second.register_dataset(_dataset_def(np.arange(7)))) > second.incarnation
  with pytest.raises(
    rpc.NotFoundError, match=f"Unknown job id {job_id}: .*restarted without its state .*--work_dir"
  ):
    second.client_heartbeat(job_id, client_id)
  with pytest.raises(rpc.NotFoundError, match="restarted without its state"):
    second.dataset_def(dataset_id)
  second.close()


def test_a_dispatcher_that_replays_its_work_dir_keeps_its_incarnation(tmp_path):
  config = service.DispatcherConfig(work_dir=str(tmp_path))
  first = DispatcherState(config)
  dataset_id = first.register_dataset(_dataset_def(np.arange(5)))
  job_id, _ = first.get_or_create_job(
    pb.GetOrCreateJobRequest(dataset_id=dataset_id, sharding_policy="parallel_epochs")
  )
  incarnation = first.incarnation
  first.close()
  again = DispatcherState(dataclasses.replace(config, snapshot_every_records=1))
  assert again.incarnation == incarnation and job_id in again.jobs
  new_id = int(again.register_dataset(_dataset_def(np.arange(7))))  # snapshots too
  assert new_id > job_id
  again.close()
  third = DispatcherState(config)  # from the snapshot
  assert third.incarnation == incarnation and str(new_id) in third.datasets
  third.close()
