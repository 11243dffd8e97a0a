"""target_workers ("auto", "any", "local") with a worker inside the trainer's
process and worker processes beside it; what each worker served is read
from its own metrics."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

import jaxfeed
from jaxfeed import _lifetime
from jaxfeed import service
from jaxfeed.service import metrics
from jaxfeed.service.dispatcher import server as dispatcher_lib
from jaxfeed.service.protocol import target_workers
from jaxfeed.service.protocol.protos import service_pb2 as pb

parser = pytest.importorskip("prometheus_client.parser")
import test_journal  # pylint: disable=g-import-not-at-top,wrong-import-position
from test_metrics import _metrics_url, scrape  # pylint: disable=g-import-not-at-top,wrong-import-position

pytestmark = pytest.mark.timeout(120)

BATCHES = 10  # batches of one epoch of DATASET
DATASET = jaxfeed.Dataset.range(40).batch(4)


def _served(url: str) -> tuple[int, dict[str, int]]:
  """(elements served over all jobs, connections by transport) of a worker."""
  samples = scrape(url)
  elements = sum(
    v for (name, _), v in samples.items() if name == "jaxfeed_worker_elements_served_total"
  )
  connections = {
    dict(labels)["transport"]: int(v)
    for (name, labels), v in samples.items()
    if name == "jaxfeed_worker_connections_total"
  }
  return int(elements), connections


class _Fleet:
  """A dispatcher process, worker processes (with tags) and one worker in
  this process, all registered before a read starts."""

  def __init__(self, cluster, *remote_tags: str):
    self.dispatcher = cluster("dispatcher", "--port=0", "--metrics_port=0")
    dispatcher_url = _metrics_url(self.dispatcher)
    self.remote_urls = []
    for tags in remote_tags:
      worker = cluster(
        "worker",
        f"--dispatcher_address={self.dispatcher.address}",
        "--port=0",
        "--metrics_port=0",
        "--heartbeat_interval_s=0.2",
        f"--worker_tags={tags}",
      )
      self.remote_urls.append(_metrics_url(worker))
    self.local = service.WorkerServer(
      service.WorkerConfig(dispatcher_address=self.dispatcher.address, heartbeat_interval_s=0.2)
    )
    self.local_metrics = metrics.serve_worker(self.local, "127.0.0.1", 0)
    deadline = time.monotonic() + 30
    while scrape(dispatcher_url)[("jaxfeed_dispatcher_workers", ())] < 1 + len(remote_tags):
      assert time.monotonic() < deadline, "the workers did not register"
      time.sleep(0.1)

  def read(self, mode: str = "parallel_epochs", **options) -> list:
    with DATASET.distribute(self.dispatcher.address, mode, **options).make_iterator() as iterator:
      return [int(x) for batch in iterator for x in batch]

  def close(self) -> None:
    self.local_metrics.close()
    self.local.stop()


@pytest.fixture
def fleet(cluster):
  made = []

  def make(*remote_tags: str) -> _Fleet:
    made.append(_Fleet(cluster, *remote_tags))
    return made[-1]

  yield make
  for f in made:
    f.close()


def test_local_reads_nothing_from_a_remote_worker_and_takes_batches_through_memory(fleet):
  f = fleet("")
  assert sorted(f.read(target_workers="local")) == list(range(40))  # one worker's epoch
  # DYNAMIC: the remote worker gets no task, so no split waits on it unread.
  assert sorted(f.read("distributed_epoch", target_workers="LOCAL")) == list(range(40))
  assert sorted(
    f.read("distributed_epoch", target_workers="local", visitation="exactly_once")
  ) == list(range(40))
  remote_elements, remote_connections = _served(f.remote_urls[0])
  assert (remote_elements, remote_connections) == (0, {})
  local_elements, local_connections = _served(f.local_metrics.url)
  assert local_elements == 3 * BATCHES
  assert set(local_connections) == {"memory"}, local_connections


def test_any_reads_every_worker(fleet):
  f = fleet("", "COLOCATED")
  assert sorted(f.read(target_workers="any")) == sorted(3 * list(range(40)))
  for url in (*f.remote_urls, f.local_metrics.url):
    elements, connections = _served(url)
    assert elements == BATCHES
    assert "memory" not in connections  # only "local" reads take the memory path


def test_auto_skips_colocated_workers_of_other_processes_only(fleet):
  """tf.data's AUTO: every worker but the COLOCATED-tagged ones of other
  processes; this process's own worker is read even when tagged."""
  f = fleet("", "COLOCATED")
  assert sorted(f.read()) == sorted(2 * list(range(40)))  # "auto" is the default
  untagged, colocated = (_served(url)[0] for url in f.remote_urls)
  assert (untagged, colocated, _served(f.local_metrics.url)[0]) == (BATCHES, 0, BATCHES)


def test_auto_reads_its_own_colocated_worker(cluster):
  dispatcher = cluster("dispatcher", "--port=0")
  with service.WorkerServer(
    service.WorkerConfig(dispatcher_address=dispatcher.address, worker_tags=("colocated",))
  ):
    got = DATASET.distribute(dispatcher.address, target_workers="auto").make_iterator()
    with got:
      assert sorted(int(x) for b in got for x in b) == list(range(40))


def test_local_without_a_worker_in_the_process_fails_at_once(cluster):
  dispatcher = cluster("dispatcher", "--port=0")
  cluster("worker", f"--dispatcher_address={dispatcher.address}", "--port=0")
  dataset = DATASET.distribute(dispatcher.address, target_workers="local")
  with pytest.raises(
    ValueError, match="Local reads require local workers, but no local worker is found"
  ):
    dataset.make_iterator()


def test_target_workers_is_checked_as_tf_data_checks_it():
  with pytest.raises(ValueError, match="target_workers must be one of"):
    DATASET.distribute("127.0.0.1:1", target_workers="nearby")
  with pytest.raises(ValueError, match="Coordinated reads require non-local workers"):
    DATASET.distribute(
      "127.0.0.1:1", job_name="j", num_consumers=2, consumer_index=0, target_workers="local"
    )


def test_consumers_of_a_named_job_pass_the_same_target(cluster):
  dispatcher = cluster("dispatcher", "--port=0")
  with service.WorkerServer(service.WorkerConfig(dispatcher_address=dispatcher.address)):
    first = (
      DATASET.repeat()
      .distribute(dispatcher.address, job_name="shared", target_workers="any")
      .make_iterator()
    )
    with first:
      next(first)
      other = (
        DATASET.repeat()
        .distribute(dispatcher.address, job_name="shared", target_workers="local")
        .make_iterator()
      )
      with other, pytest.raises(ValueError, match="same target_workers"):
        next(other)


def test_reads_decides_by_process_and_colocated_tag():
  reads = target_workers.reads
  assert reads("local", "p", "p", ()) and not reads("local", "p", "q", ())
  assert not reads("local", "", "", ())  # unknown processes are never local
  assert reads("any", "p", "q", ("COLOCATED",))
  assert reads("auto", "p", "q", ()) and reads("auto", "p", "p", ("COLOCATED",))
  assert not reads("auto", "p", "q", ("Colocated",))


_TRAINER = """
import sys
import jaxfeed
from jaxfeed import service
worker = service.WorkerServer(service.WorkerConfig(
    dispatcher_address=sys.argv[1], heartbeat_interval_s=0.2))
it = jaxfeed.Dataset.range(400).batch(4).distribute(
    sys.argv[1], job_name="shared", target_workers="local").make_iterator()
got = [next(it)]
print("joined", flush=True)
got += list(it)
print(len(got), sorted(it.elements_by_worker) == [worker.target], flush=True)
it.close()
worker.stop()
"""


def test_trainers_sharing_a_job_each_read_only_their_own_worker(cluster):
  """Two trainer processes, each with its worker, read one parallel_epochs
  job with target_workers="local": each reads its own worker's epoch and
  nothing of the other's, although the job lists both tasks to both."""
  dispatcher = cluster("dispatcher", "--port=0")
  env = {**os.environ, "GRPC_VERBOSITY": "ERROR", "JAX_PLATFORMS": "cpu"}
  with service.WorkerServer(
    service.WorkerConfig(dispatcher_address=dispatcher.address, heartbeat_interval_s=0.2)
  ) as worker:
    it = (
      jaxfeed.Dataset.range(400)
      .batch(4)
      .distribute(dispatcher.address, job_name="shared", target_workers="local")
      .make_iterator()
    )
    with it:
      got = [next(it)]
      other = _lifetime.popen(
        [sys.executable, "-c", _TRAINER, dispatcher.address],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
      )
      try:
        assert other.stdout.readline().split() == ["joined"]
        got += list(it)
        out = other.stdout.readline().split()
        assert other.wait(timeout=60) == 0
      finally:
        if other.poll() is None:
          other.kill()
          other.wait()
        other.stdout.close()
      assert out == ["100", "True"]
      assert len(got) == 100 and list(it.elements_by_worker) == [worker.target]


def test_the_dispatcher_gives_a_local_job_tasks_on_its_clients_workers_and_snapshots_it():
  state = dispatcher_lib.DispatcherState(dispatcher_lib.DispatcherConfig())
  dataset_id = state.register_dataset(test_journal.dataset_def(100), "train")
  # A chosen id that looks like a number does not move the dispatcher's ids.
  assert state.register_dataset(test_journal.dataset_def(50), "9" * 30) == "9" * 30
  for address, process in (("w1:1", "p1"), ("w2:1", "p2"), ("w3:1", "")):
    state.worker_heartbeat(pb.WorkerHeartbeatRequest(worker_address=address, process_id=process))
  job_id, _ = state.get_or_create_job(
    pb.GetOrCreateJobRequest(
      dataset_id=dataset_id,
      sharding_policy="distributed_epoch",
      job_name="j",
      target_workers="local",
      client_process="p1",
    )
  )
  job = state.jobs[job_id]
  assert [t.worker_address for t in job.tasks.values()] == ["w1:1"]
  assert job_id < 1 << 63
  state.get_or_create_job(
    pb.GetOrCreateJobRequest(  # a second trainer joins
      dataset_id=dataset_id,
      sharding_policy="distributed_epoch",
      job_name="j",
      target_workers="LOCAL",
      client_process="p2",
    )
  )
  assert sorted(t.worker_address for t in job.tasks.values()) == ["w1:1", "w2:1"]
  # A restart replays the snapshot's records into the same tables.
  replayed = dispatcher_lib.DispatcherState(dispatcher_lib.DispatcherConfig())
  replayed.replaying = True
  for record in state._live_records():  # pylint: disable=protected-access
    replayed._apply(record)  # pylint: disable=protected-access
  assert test_journal.live_records(replayed) == test_journal.live_records(state)
  again = replayed.jobs[job_id]
  assert again.target_workers == "local"
  assert sorted(again.client_processes.values()) == ["p1", "p2"]
  assert "train" in replayed.datasets and "9" * 30 in replayed.datasets
  assert replayed._next_id() < 1 << 63  # pylint: disable=protected-access
