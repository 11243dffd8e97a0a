"""tf.data service's smaller API names: register_dataset's compression and
dataset_id, compression "AUTO", WorkerConfig.data_transfer_address and
CrossTrainerCache(trainer_id)."""

from __future__ import annotations

import time

import pytest

import jaxfeed
from jaxfeed import service
from jaxfeed.service.protocol import wire

pytestmark = pytest.mark.timeout(120)

DATASET = jaxfeed.Dataset.range(40).batch(4)


def _elements(dataset) -> list[int]:
  with dataset.make_iterator() as iterator:
    return sorted(int(x) for batch in iterator for x in batch)


def test_a_chosen_dataset_id_names_one_pipeline_across_a_dispatcher_restart(cluster, tmp_path):
  flags = ("--port=0", f"--work_dir={tmp_path}", "--nojournal_fsync")
  dispatcher = cluster("dispatcher", *flags)
  cluster("worker", f"--dispatcher_address={dispatcher.address}", "--port=0")
  assert service.register_dataset(dispatcher.address, DATASET, dataset_id="train") == "train"
  # Trainers may all register it: the same pipeline gets the id back.
  assert service.register_dataset(dispatcher.address, DATASET, None, "train") == "train"
  with pytest.raises(
    service.ServiceError, match="Dataset id 'train' is registered for another pipeline"
  ):
    service.register_dataset(dispatcher.address, jaxfeed.Dataset.range(7), dataset_id="train")
  # Without an id, equal pipelines share one registered dataset, as always.
  assert service.register_dataset(dispatcher.address, DATASET) == "train"
  assert service.register_dataset(dispatcher.address, DATASET, dataset_id="eval") == "eval"
  assert _elements(service.from_dataset_id("parallel_epochs", dispatcher.address, "train")) == list(
    range(40)
  )
  dispatcher.stop()
  dispatcher = cluster("dispatcher", *flags)  # replays its journal
  with pytest.raises(service.ServiceError, match="another pipeline"):
    service.register_dataset(dispatcher.address, jaxfeed.Dataset.range(7), dataset_id="train")
  assert service.register_dataset(dispatcher.address, DATASET, dataset_id="train") == "train"


def test_register_dataset_checks_its_arguments_as_tf_data_does():
  with pytest.raises(ValueError, match="Unknown compression 'snappy'"):
    service.register_dataset("127.0.0.1:1", DATASET, compression="snappy")
  with pytest.raises(ValueError, match="dataset_id must be a non-empty string"):
    service.register_dataset("127.0.0.1:1", DATASET, dataset_id="")


@pytest.mark.parametrize("data_transfer", ["grpc", "socket"])
def test_auto_compression_is_picked_per_transport(cluster, data_transfer):
  dispatcher = cluster("dispatcher", "--port=0")
  cluster("worker", f"--dispatcher_address={dispatcher.address}", "--port=0")
  dataset_id = service.register_dataset(dispatcher.address, DATASET)  # "AUTO"
  read = service.from_dataset_id(
    "parallel_epochs", dispatcher.address, dataset_id, data_transfer=data_transfer
  )
  with read.make_iterator() as iterator:
    got = sorted(int(x) for batch in iterator for x in batch)
    (fetcher,) = iterator._read.fetchers.values()  # pylint: disable=protected-access
    assert fetcher.task.compression == "AUTO"
  assert got == list(range(40))
  picked = wire.resolve_compression("AUTO", data_transfer)
  assert picked == ("lz4" if data_transfer == "grpc" else "")
  assert wire.resolve_compression("AUTO", "memory") == ""
  # A read's own compression wins over the registered one.
  assert _elements(
    DATASET.distribute(dispatcher.address, compression="AUTO", data_transfer=data_transfer)
  ) == list(range(40))


def test_data_transfer_address_is_where_clients_fetch_batches(cluster):
  dispatcher = cluster("dispatcher", "--port=0")
  worker = cluster(
    "worker",
    f"--dispatcher_address={dispatcher.address}",
    "--port=0",
    "--data_transfer_address=localhost:%port%",
  )
  host, port = worker.data_address.rsplit(":", 1)
  assert host == "localhost" and worker.address.startswith("127.0.0.1:")
  assert port.isdigit() and port != worker.address.rsplit(":", 1)[1]
  with DATASET.distribute(dispatcher.address, data_transfer="socket").make_iterator() as it:
    assert sorted(int(x) for batch in it for x in batch) == list(range(40))
    (fetcher,) = it._read.fetchers.values()  # pylint: disable=protected-access
    assert fetcher.task.data_address == worker.data_address


def test_data_transfer_address_binds_a_port_it_names():
  with service.DispatchServer() as dispatcher:
    with service.WorkerServer(
      service.WorkerConfig(
        dispatcher_address=dispatcher.target, data_transfer_address="127.0.0.1:%port%"
      )
    ) as w:
      port = int(w.data_address.rsplit(":", 1)[1])
    with service.WorkerServer(
      service.WorkerConfig(
        dispatcher_address=dispatcher.target, data_transfer_address=f"127.0.0.1:{port}"
      )
    ) as w:
      assert w.data_address == f"127.0.0.1:{port}"
      assert _elements(DATASET.distribute(dispatcher.target, data_transfer="socket")) == list(
        range(40)
      )
  for bad in ("nohost", "h:port", "h:70000"):
    with pytest.raises(ValueError, match="data_transfer_address must be"):
      service.WorkerConfig(dispatcher_address="h:1", data_transfer_address=bad)


def test_cross_trainer_cache_is_ephemeral_sharing_by_trainer():
  endless = jaxfeed.Dataset.range(40).repeat().batch(4)  # what trainers share
  with (
    service.DispatchServer() as dispatcher,
    service.WorkerServer(service.WorkerConfig(dispatcher_address=dispatcher.target)) as worker,
  ):
    reads = [
      endless.distribute(
        dispatcher.target,
        job_name="cache",
        cross_trainer_cache=service.CrossTrainerCache(trainer_id=t),
      ).make_iterator()
      for t in ("a", "b")
    ]
    nodes = [r._read.node for r in reads]  # pylint: disable=protected-access
    assert [n.job_name for n in nodes] == ["cache/trainer:a", "cache/trainer:b"]
    assert all(n.ephemeral_sharing for n in nodes)
    # Both trainers read the worker's one stream before either moves on: a
    # trainer that joins later starts at the window's oldest frame, and
    # frames every reader already passed are gone.
    streams = worker._worker.shared_streams  # pylint: disable=protected-access
    deadline = time.monotonic() + 30
    while not any(stream.num_readers == 2 for stream in list(streams.values())):
      assert time.monotonic() < deadline, "the trainers never both read the stream"
      time.sleep(0.01)
    for read in reads:  # every trainer reads all of it, from the start
      with read:
        batches = [next(read) for _ in range(10)]
        assert [int(x) for batch in batches for x in batch] == list(range(40))
  with pytest.raises(ValueError, match="requires named jobs"):
    DATASET.distribute("h:1", cross_trainer_cache=service.CrossTrainerCache("a"))
  with pytest.raises(ValueError, match="parallel_epochs"):
    DATASET.distribute(
      "h:1", "distributed_epoch", job_name="j", cross_trainer_cache=service.CrossTrainerCache("a")
    )
  with pytest.raises(ValueError, match="trainer_id must be a non-empty string"):
    service.CrossTrainerCache("")
