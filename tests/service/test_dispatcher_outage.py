"""Reads that outlive their dispatcher (DESIGN.md §4: a read keeps going
while any of its workers lives, however long the dispatcher is away).

The dispatcher is stopped (SIGSTOP) or killed and restarted mid-read for
longer than the read's timeout_s and than its own heartbeat and client
timeouts, scaled down here (`test_reads_outlive_a_90_s_dispatcher_stop` is
the literal case, a benchmark): the read finishes with every element, and
the dispatcher, woken, takes no healthy worker for dead.
"""

from __future__ import annotations

import collections
import re
import threading
import time

import numpy as np
import pytest

import jaxfeed
import service_udfs
from jaxfeed.service import ServiceError

pytestmark = pytest.mark.timeout(180)

TIMEOUT_S = 2.0  # the read's timeout_s, the dispatcher's client_timeout_s
HEARTBEAT_TIMEOUT_S = 1.0  # the dispatcher's
OUTAGE_S = 4.0  # longer than all of them
RECORDS = 200
MODES = {
  "parallel_epochs": ("parallel_epochs", "at_most_once"),
  "exactly_once": ("distributed_epoch", "exactly_once"),
}


def start_servers(cluster, tmp_path, num_workers: int = 2, *dispatcher_flags: str):
  """A dispatcher (logging to tmp_path/dispatcher.log) and its workers."""
  log = tmp_path / "dispatcher.log"
  flags = (
    f"--heartbeat_timeout_s={HEARTBEAT_TIMEOUT_S}",
    f"--client_timeout_s={TIMEOUT_S}",
    "--split_size=8",
    *dispatcher_flags,
  )
  dispatcher = cluster("dispatcher", "--port=0", *flags, log_path=log)
  workers = [
    cluster("worker", f"--dispatcher_address={dispatcher.address}", "--heartbeat_interval_s=0.1")
    for _ in range(num_workers)
  ]
  deadline = time.monotonic() + 60
  while log.read_text().count("registered.") < num_workers:
    assert time.monotonic() < deadline, "the workers did not register"
    time.sleep(0.05)
  return dispatcher, workers, log, flags


def start_read(address: str, mode: str, timeout_s: float = TIMEOUT_S):
  """Reads RECORDS records (2 ms each, 4 per batch) on a thread; returns,
  once it had five batches, the thread, the values read, the errors raised
  and (once it ended) {"ended": time.monotonic() at its end}."""
  policy, visitation = MODES[mode]
  source = jaxfeed.ArraySource({"x": np.arange(RECORDS, dtype=np.int64)})
  dataset = jaxfeed.Dataset.from_source(source).map(service_udfs.slow_add_one_to_x).batch(4)
  iterator = dataset.distribute(
    address, policy, visitation=visitation, timeout_s=timeout_s, max_outstanding_requests=2
  ).make_iterator()
  got: collections.Counter = collections.Counter()
  errors: list[BaseException] = []
  started = threading.Event()
  times: dict[str, float] = {}

  def consume():
    try:
      with iterator:
        for n, batch in enumerate(iterator):
          got.update(batch["x"].tolist())
          if n == 4:
            started.set()
          time.sleep(0.01)
    except BaseException as e:  # pylint: disable=broad-except
      errors.append(e)
    times["ended"] = time.monotonic()
    started.set()

  thread = threading.Thread(target=consume, name="test-consumer")
  thread.start()
  assert started.wait(60), "the read did not start"
  return thread, got, errors, times


def expected(mode: str, num_workers: int) -> collections.Counter:
  times = num_workers if mode == "parallel_epochs" else 1
  return collections.Counter({v: times for v in range(1, RECORDS + 1)})


def finish(thread, got, errors, mode: str, num_workers: int) -> None:
  thread.join(60)
  assert not thread.is_alive(), "the read did not end"
  assert not errors, errors
  assert got == expected(mode, num_workers)


@pytest.mark.parametrize("mode", list(MODES))
def test_a_read_outlives_a_dispatcher_stopped_past_every_timeout(cluster, tmp_path, mode):
  dispatcher, _, log, _ = start_servers(cluster, tmp_path)
  thread, got, errors, _ = start_read(dispatcher.address, mode)
  dispatcher.pause()  # SIGSTOP
  try:
    time.sleep(OUTAGE_S)
  finally:
    dispatcher.resume()
  finish(thread, got, errors, mode, 2)
  assert "declared dead" not in log.read_text()  # the workers were healthy


def test_a_worker_that_dies_while_the_dispatcher_is_stopped_costs_an_exactly_once_read_nothing(
  cluster, tmp_path
):
  # The read cannot reach the dead worker for longer than timeout_s, but only
  # the dispatcher can say it died: woken, it does, and its splits go to the
  # other worker.
  dispatcher, workers, log, _ = start_servers(cluster, tmp_path)
  thread, got, errors, _ = start_read(dispatcher.address, "exactly_once")
  dispatcher.pause()
  try:
    workers[1].kill()
    time.sleep(OUTAGE_S)
  finally:
    dispatcher.resume()
  finish(thread, got, errors, "exactly_once", 2)
  assert log.read_text().count("declared dead") == 1


@pytest.mark.parametrize("mode", list(MODES))
def test_a_read_outlives_a_dispatcher_down_and_restarted_with_its_work_dir(cluster, tmp_path, mode):
  dispatcher, _, _, flags = start_servers(cluster, tmp_path, 2, f"--work_dir={tmp_path}")
  thread, got, errors, _ = start_read(dispatcher.address, mode)
  dispatcher.kill()
  time.sleep(OUTAGE_S)
  cluster("dispatcher", f"--port={dispatcher.address.rsplit(':', 1)[1]}", *flags)
  finish(thread, got, errors, mode, 2)


def test_a_parallel_epochs_read_with_every_element_ends_without_its_dispatcher(cluster, tmp_path):
  dispatcher, _, _, _ = start_servers(cluster, tmp_path, 1)
  dataset = jaxfeed.Dataset.range(1000).batch(1)
  with dataset.distribute(
    dispatcher.address, timeout_s=TIMEOUT_S, max_outstanding_requests=2
  ).make_iterator() as iterator:
    got = [int(next(iterator)[0]) for _ in range(30)]  # the worker cannot end yet
    dispatcher.kill()  # for good
    start = time.monotonic()
    got += [int(b[0]) for b in iterator]
  assert sorted(got) == list(range(1000))
  assert time.monotonic() - start < 15


def test_a_worker_stops_after_dispatcher_timeout_s_and_the_read_fails_clearly(cluster, tmp_path):
  dispatcher, _, _, _ = start_servers(cluster, tmp_path, 0)
  worker = cluster(
    "worker",
    f"--dispatcher_address={dispatcher.address}",
    "--heartbeat_interval_s=0.1",
    "--dispatcher_timeout_s=2",
  )
  thread, _, errors, _ = start_read(dispatcher.address, "exactly_once")
  dispatcher.kill()  # for good
  assert worker.proc.wait(timeout=30) != 0  # it gave up on the dispatcher
  thread.join(30)
  assert not thread.is_alive(), "the read did not end"
  assert len(errors) == 1 and isinstance(errors[0], ServiceError), errors
  # Its task failed waiting for splits, or the read found no worker left.
  assert re.search("dispatcher at .* (did|has) not answer", str(errors[0])), errors[0]


@pytest.mark.benchmark
@pytest.mark.timeout(600)
@pytest.mark.parametrize("mode", list(MODES))
def test_reads_outlive_a_90_s_dispatcher_stop(cluster, mode):
  """The reported outage as it was measured: default timeouts (heartbeat 10 s,
  clients 60 s), a read with timeout_s=30, the dispatcher stopped for 90 s."""
  dispatcher = cluster("dispatcher", "--port=0", "--split_size=8")
  for _ in range(2):
    cluster("worker", f"--dispatcher_address={dispatcher.address}")
  time.sleep(2)  # both registered
  thread, got, errors, times = start_read(dispatcher.address, mode, timeout_s=30)
  dispatcher.pause()
  stopped = time.monotonic()
  try:
    time.sleep(90)
  finally:
    dispatcher.resume()
  finish(thread, got, errors, mode, 2)
  print(
    f"{mode}: all {sum(got.values())} elements; the read ended "
    f"{times['ended'] - stopped:.1f} s after the dispatcher stopped for 90 s"
  )
