"""tf.data service's fault-tolerance scenarios, by name, on jaxfeed processes.

Each scenario of tf.data's fault_tolerance_test (dispatcher stopped or
restarted before, during and between reads, many restarts, dispatcher and
workers restarted together, servers started late, a worker added mid-job, a
worker restarted, most workers removed) runs on real dispatcher and worker
processes, and checks what jaxfeed's fault model promises (DESIGN.md §4):
the dispatcher restarts on its port and work_dir and the read goes on;
exactly-once reads every record once, at-most-once never twice and loses only
what a killed worker held, parallel_epochs a whole epoch per live worker; and
every read ends, or fails with a clear error, within a bounded time.
Beyond tf.data's scenarios: a killed worker's batches that reached the
client, heartbeats hung on a connection dropped without a reset, clients
that join before a worker registers again, and tasks a restarted dispatcher
gave up.
"""

from __future__ import annotations

import collections
import threading
import time

import pytest

from jaxfeed.service import ServiceError, from_dataset_id, register_dataset
from chaos_cluster import HEARTBEAT_TIMEOUT_S
from schedule import SPLITS_PER_REQUEST, read_until_end, records
from tcp_proxy import TcpProxy

pytestmark = pytest.mark.timeout(300)

DEADLINE_S = 90.0
EPOCH = 200
BATCH = 4
SPLIT = 16  # ChaosCluster's default split_size
BUFFER = 8
DISTRIBUTED = {
  "at_most_once": ("distributed_epoch", "at_most_once"),
  "exactly_once": ("distributed_epoch", "exactly_once"),
}
MODES = {"parallel_epochs": ("parallel_epochs", "at_most_once"), **DISTRIBUTED}


def epoch(times: int = 1) -> collections.Counter:
  return collections.Counter({v: times for v in range(1, EPOCH + 1)})


def read(cluster, mode: str, dataset=None, **options):
  """The iterator of a read of `dataset` (EPOCH records) in `mode`."""
  policy, visitation = MODES[mode]
  dataset = dataset if dataset is not None else records(EPOCH, BATCH)
  options = {"max_outstanding_requests": 4, "timeout_s": 60.0, **options}
  return dataset.distribute(
    cluster.address, policy, visitation=visitation, **options
  ).make_iterator()


def _checked(result) -> collections.Counter:
  assert not result.hang, f"the read hung after {sum(result.counts.values())} elements"
  if result.error is not None:
    raise result.error
  return result.counts


def take(iterator, num_batches: int) -> collections.Counter:
  """The next num_batches batches; fails the test if the read hangs, fails or ends."""
  result = read_until_end(iterator, DEADLINE_S, max_batches=num_batches)
  assert result.batches == num_batches, f"the read ended after {result.batches} batches"
  return _checked(result)


def finish(iterator, deadline_s: float = DEADLINE_S) -> collections.Counter:
  """The rest of the read; fails the test if it hangs or fails."""
  return _checked(read_until_end(iterator, deadline_s))


def assert_at_most_once(counts: collections.Counter, killed: int) -> None:
  """Nothing twice or foreign; lost at most what `killed` worker processes held."""
  assert max(counts.values()) == 1
  assert set(counts) <= set(epoch())
  held = SPLITS_PER_REQUEST * SPLIT + (BUFFER + 2) * BATCH
  assert EPOCH - len(counts) <= killed * held


def wait_for_registration(cluster, worker, timeout_s: float = 60.0) -> None:
  """Waits until the dispatcher logged that `worker` registered (it gives
  the new worker its tasks under the same lock)."""
  line = f"Worker {worker.address} registered."
  end = time.monotonic() + timeout_s
  while time.monotonic() < end:
    if line in cluster.log_path.read_text(errors="replace"):
      return
    time.sleep(0.05)
  raise AssertionError(f"{worker.address} did not register within {timeout_s}s")


def test_dispatcher_stop_mid_read_ends_or_fails_clearly_in_bounded_time(chaos):
  cluster = chaos(1)
  iterator = read(cluster, "parallel_epochs", timeout_s=10.0)
  counts = take(iterator, 1)
  cluster.kill_dispatcher()  # for good
  start = time.monotonic()
  result = read_until_end(iterator, deadline_s=60.0)
  counts.update(result.counts)
  assert not result.hang
  # Without a dispatcher the read cannot learn that the job ended: it either
  # gets the whole epoch or fails with a clear error once timeout_s passed.
  if result.error is not None:
    assert isinstance(result.error, ServiceError), repr(result.error)
    assert "job" in str(result.error).lower() or "dispatcher" in str(result.error).lower()
  else:
    assert counts == epoch()
  assert max(counts.values()) == 1
  assert time.monotonic() - start < 60.0


@pytest.mark.parametrize("mode", list(MODES))
def test_dispatcher_restart_before_reading(chaos, mode):
  cluster = chaos(1)
  policy, visitation = MODES[mode]
  dataset_id = register_dataset(cluster.address, records(EPOCH, BATCH))
  cluster.restart_dispatcher()
  dataset = from_dataset_id(
    policy, cluster.address, dataset_id, visitation=visitation, timeout_s=60.0
  )
  assert finish(dataset.make_iterator()) == epoch()


@pytest.mark.parametrize("mode", list(MODES))
def test_dispatcher_restart_during_reading(chaos, mode):
  # tf.data: DispatcherRestartDuringReading (parallel_epochs) and
  # DispatcherRestartDuringDistributedEpoch; no worker dies, so every mode
  # delivers the whole epoch.
  cluster = chaos(1)
  iterator = read(cluster, mode)
  counts = take(iterator, EPOCH // BATCH // 2)
  cluster.restart_dispatcher()
  counts.update(finish(iterator))
  assert counts == epoch()


@pytest.mark.parametrize("mode", list(DISTRIBUTED))
def test_dispatcher_restart_during_distributed_epoch_repeatedly(chaos, mode):
  cluster = chaos(1)
  iterator = read(cluster, mode, records(3 * EPOCH, BATCH))
  counts: collections.Counter = collections.Counter()
  taken = 0
  for breakpoint_ in (10, 50, 100, 125):  # batches, of 150
    counts.update(take(iterator, breakpoint_ - taken))
    taken = breakpoint_
    cluster.restart_dispatcher()
  counts.update(finish(iterator))
  assert counts == collections.Counter(range(1, 3 * EPOCH + 1))


def test_dispatcher_restart_between_iterations(chaos):
  cluster = chaos(1)
  dataset = records(EPOCH, BATCH).distribute(cluster.address, "parallel_epochs", timeout_s=60.0)
  assert finish(dataset.make_iterator()) == epoch()
  cluster.restart_dispatcher()
  assert finish(dataset.make_iterator()) == epoch()


def test_dispatcher_many_restarts(chaos):
  cluster = chaos(1)
  datasets = {}
  for size in range(10, 15):
    dataset = records(size, 2, slow_map=False)
    dataset_id = register_dataset(cluster.address, dataset)
    datasets[size] = from_dataset_id("parallel_epochs", cluster.address, dataset_id, timeout_s=60.0)
    cluster.restart_dispatcher()
  for size, dataset in datasets.items():
    got = finish(dataset.make_iterator())
    assert got == collections.Counter(range(1, size + 1))


def test_dispatcher_and_worker_restart(chaos):
  cluster = chaos(1)
  dataset_id = register_dataset(cluster.address, records(EPOCH, BATCH))
  dataset = from_dataset_id("parallel_epochs", cluster.address, dataset_id, timeout_s=60.0)
  for _ in range(2):
    cluster.restart_dispatcher()
    cluster.workers[0].kill()
    cluster.workers[0].start()
    assert finish(dataset.make_iterator()) == epoch()


def test_dispatcher_and_multi_worker_restart(chaos):
  cluster = chaos(2)
  iterator = read(cluster, "parallel_epochs")
  cluster.restart_dispatcher()
  for worker in cluster.workers:
    worker.kill()
    worker.start()
  counts = finish(iterator)
  # Both restarted workers are live workers of the job: each delivers the
  # whole epoch; the killed processes at most what they sent before.
  assert all(2 <= counts[v] <= 4 for v in epoch()), counts
  assert set(counts) == set(epoch())


@pytest.mark.parametrize("mode", list(MODES))
def test_servers_started_late(chaos, mode):
  # The client reads before the dispatcher and the worker exist.
  cluster = chaos(1, start=False)
  result = {}
  iterator = read(cluster, mode)
  reader = threading.Thread(target=lambda: result.update(counts=finish(iterator)))
  reader.start()
  time.sleep(1.0)
  cluster.start_dispatcher()
  cluster.workers[0].start()
  reader.join(timeout=DEADLINE_S + 60)
  assert result.get("counts") == epoch()


def test_worker_added_mid_job(chaos):
  cluster = chaos(1)
  iterator = read(cluster, "parallel_epochs")
  counts = take(iterator, EPOCH // BATCH // 2)
  # The first worker cannot finish while we do not read (its buffer and the
  # client's fill up), so the job is still on when the new worker joins.
  late = cluster.add_worker()
  wait_for_registration(cluster, late)
  counts.update(finish(iterator))
  assert counts == epoch(2)


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("same_port", [True, False], ids=["same_port", "new_port"])
def test_worker_restart(chaos, mode, same_port):
  cluster = chaos(1)
  iterator = read(cluster, mode)
  counts = take(iterator, EPOCH // BATCH // 2)
  cluster.workers[0].kill()
  if same_port:
    cluster.workers[0].start()
  else:
    cluster.add_worker()
  counts.update(finish(iterator))
  if mode == "parallel_epochs":
    # The new process is a live worker of the job: a whole epoch; the killed
    # one at most one.
    assert all(1 <= counts[v] <= 2 for v in epoch()), counts
  elif mode == "exactly_once":
    assert counts == epoch()
  else:
    assert_at_most_once(counts, killed=1)


@pytest.mark.parametrize("mode", list(MODES))
def test_a_worker_restarted_after_its_task_finished_but_not_delivered(chaos, mode):
  # The worker produces the rest of the epoch into its buffer and window
  # while nobody reads, and reports its task finished; then it is killed and
  # restarted on its port before the dispatcher's heartbeat timeout. What it
  # held went with the process although the task "finished": the client must
  # not wait for it at the old data address (parallel_epochs, at-most-once),
  # and exactly-once must get its unacknowledged splits issued again.
  cluster = chaos(1, worker_buffer_size=EPOCH // BATCH)  # holds a whole epoch
  iterator = read(cluster, mode, records(EPOCH, BATCH, slow_map=False), data_transfer="socket")
  counts = take(iterator, 5)
  time.sleep(3.0)  # the worker runs out of input and tells the dispatcher
  cluster.workers[0].kill()
  cluster.workers[0].start()
  counts.update(finish(iterator, deadline_s=60.0))
  if mode == "exactly_once":
    assert counts == epoch()
  else:
    assert max(counts.values()) == 1 and set(counts) <= set(epoch())
    assert len(counts) < EPOCH  # it held some of the epoch when killed


@pytest.mark.parametrize(
  "pause_s",
  [0.0, 2 * HEARTBEAT_TIMEOUT_S],
  ids=["reading_on", "pausing_past_the_heartbeat_timeout"],
)
def test_a_killed_worker_loses_what_it_held_not_what_reached_the_client(chaos, pause_s):
  # Nobody reads for a while, so each worker sends a whole window of
  # unacknowledged batches into the client's socket; then one is killed.
  # Those batches arrived: they are read and handed on, although the
  # client's next acknowledgment to the worker fails (reading_on) or the
  # dispatcher drops the worker's task before the consumer reads again
  # (pausing), and only what the worker itself held is lost.
  cluster = chaos(2, worker_buffer_size=2)
  size = 4 * EPOCH
  iterator = read(
    cluster, "at_most_once", records(size, BATCH, slow_map=False), data_transfer="socket"
  )
  counts = take(iterator, 4)
  time.sleep(2.0)
  cluster.workers[1].kill()
  time.sleep(pause_s)
  counts.update(finish(iterator))
  assert max(counts.values()) == 1
  assert set(counts) <= set(range(1, size + 1))
  held = SPLITS_PER_REQUEST * SPLIT + (2 + 2) * BATCH
  assert size - len(counts) <= held


def test_a_worker_whose_dispatcher_connection_is_dropped_silently_stays_alive(chaos):
  # The worker's path to the dispatcher forgets its connection while a
  # heartbeat waits there for its answer: neither an answer nor a reset
  # comes. The worker gives the call up well within the dispatcher's
  # heartbeat timeout and calls again on a new connection, so it is not
  # taken for dead while the consumer pauses past that timeout, and the
  # read gets the whole epoch once.
  cluster = chaos(1)
  size = 3 * EPOCH
  direct = f"127.0.0.1:{cluster.dispatcher_port}"  # the client's path stays up
  iterator = (
    records(size, BATCH)
    .distribute(direct, "parallel_epochs", max_outstanding_requests=4, timeout_s=60.0)
    .make_iterator()
  )
  counts = take(iterator, 5)
  proxy = cluster.dispatcher_proxy
  proxy.stall()
  time.sleep(1.0)  # a heartbeat (every 0.2 s) now waits in the proxy
  assert proxy.forget() >= 1
  proxy.resume()
  time.sleep(2 * HEARTBEAT_TIMEOUT_S)
  counts.update(finish(iterator))
  assert "declared dead" not in cluster.log_path.read_text(errors="replace")
  assert counts == collections.Counter(range(1, size + 1))


def test_a_client_that_joins_before_the_worker_registers_again_reads_its_socket(chaos):
  # After a dispatcher restart, a second client joins the shared job while
  # the worker's path to the dispatcher is stalled: the dispatcher lists the
  # worker's task without its data address. The client waits for the worker
  # to register again and then reads its data socket.
  cluster = chaos(1)
  direct = f"127.0.0.1:{cluster.dispatcher_port}"  # the clients' path stays up
  dataset = records(EPOCH, BATCH)

  def join():
    return dataset.distribute(
      direct,
      "parallel_epochs",
      job_name="shared",
      max_outstanding_requests=4,
      data_transfer="socket",
      timeout_s=60.0,
    ).make_iterator()

  first = join()
  try:
    counts = take(first, 2)
    cluster.dispatcher_proxy.stall()
    cluster.restart_dispatcher()
    second = join()
    try:
      time.sleep(1.5)
      cluster.dispatcher_proxy.resume()
      counts.update(finish(second))
    finally:
      second.close()
    counts.update(finish(first))
  finally:
    first.close()
  assert counts == epoch()


def test_a_task_the_restarted_dispatcher_gave_up_ends_without_failing_the_read(chaos):
  # The dispatcher restarts while its paths to the worker and to the client
  # are both stalled, past the time it waits for the worker to register
  # again: it gives the worker's task up. When the worker's path comes
  # back, the task's pipeline asks for splits the dispatcher no longer has
  # for it; the task ends as lost (not failed), the worker gets a new task
  # and the read goes on, losing at most what the given-up task held.
  cluster = chaos(1, worker_buffer_size=2)
  size = 4 * EPOCH
  with TcpProxy(f"127.0.0.1:{cluster.dispatcher_port}") as client_path:
    iterator = (
      records(size, BATCH, slow_map=False)
      .distribute(
        client_path.address,
        "distributed_epoch",
        max_outstanding_requests=4,
        data_transfer="socket",
        timeout_s=60.0,
      )
      .make_iterator()
    )
    counts = take(iterator, 5)
    result = {}
    reader = threading.Thread(
      target=lambda: result.update(rest=read_until_end(iterator, DEADLINE_S))
    )
    client_path.stall()
    cluster.dispatcher_proxy.stall()
    cluster.restart_dispatcher()
    reader.start()
    time.sleep(HEARTBEAT_TIMEOUT_S + 2.0)
    cluster.dispatcher_proxy.resume()
    time.sleep(2.0)
    client_path.resume()
    reader.join(timeout=DEADLINE_S + 60)
  counts.update(_checked(result["rest"]))
  assert "did not register again" in cluster.log_path.read_text(errors="replace")
  assert max(counts.values()) == 1
  held = SPLITS_PER_REQUEST * SPLIT + (2 + 2) * BATCH
  assert size - len(counts) <= held


def test_remove_more_workers_than_max_outstanding_requests(chaos):
  cluster = chaos(3)
  iterator = read(cluster, "parallel_epochs", max_outstanding_requests=1)
  counts = take(iterator, 10)
  for worker in cluster.workers[1:]:
    worker.kill()
  counts.update(finish(iterator))
  assert all(1 <= counts[v] <= 3 for v in epoch()), counts


@pytest.mark.parametrize("mode", list(DISTRIBUTED))
def test_a_client_cut_off_from_the_dispatcher_longer_than_a_heartbeat_deadline(chaos, mode):
  # The client's path to the dispatcher hangs for longer than its heartbeat's
  # deadline (10 s) but less than the read's timeout_s: the heartbeat times
  # out rather than failing fast, and the read goes on once the path is back.
  cluster = chaos(1)
  with TcpProxy(cluster.address) as client_path:
    policy, visitation = MODES[mode]
    iterator = (
      records(EPOCH, BATCH)
      .distribute(
        client_path.address,
        policy,
        visitation=visitation,
        max_outstanding_requests=4,
        timeout_s=60.0,
      )
      .make_iterator()
    )
    counts = take(iterator, 5)
    client_path.stall()
    time.sleep(13.0)
    client_path.resume()
    counts.update(finish(iterator))
  assert counts == epoch()


def test_a_worker_only_the_dispatcher_reaches_fails_the_read_after_timeout_s(chaos):
  # A read outlives its dispatcher, not a worker it cannot reach while the
  # dispatcher hears that worker and keeps listing it as alive.
  cluster = chaos(1, proxied_workers=True)
  iterator = read(cluster, "exactly_once", timeout_s=3.0)
  take(iterator, 2)
  cluster.workers[0].proxy.close()  # the clients' way to the worker only
  start = time.monotonic()
  result = read_until_end(iterator, deadline_s=60.0)
  assert not result.hang
  assert isinstance(result.error, ServiceError), repr(result.error)
  assert "although the dispatcher lists it as alive" in str(result.error)
  assert time.monotonic() - start < 30
