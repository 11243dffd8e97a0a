"""Closing a service read from the training loop's side, with the faults that
block or end it coming from outside: a worker process stopped with SIGSTOP,
a data connection cut with `ss -K`.

- `Loader.close()` returns soon even when its read-ahead thread is blocked in
  a read whose worker will never answer: after a grace period it closes the
  input under the thread (`jaxfeed.device.prefetcher._INTERRUPT_AFTER_S`).
- The end of a data connection the client stopped reading itself is no
  error in the process's failed-call counts (`rpc_errors.CLIENT_ERRORS`, the
  `jaxfeed_client_rpc_errors_total` metric); a connection cut from outside is.
"""

from __future__ import annotations

import subprocess
import threading
import time
import warnings

import pytest

import jaxfeed
from jaxfeed.device import prefetcher
from jaxfeed.service.protocol import rpc_errors
import service_udfs

pytestmark = pytest.mark.timeout(180)

# Well under the 60 s close() waits for a producer that is never interrupted,
# and far over the grace period plus the read's own close on a busy machine.
CLOSE_BOUND_S = 30.0
# Longer than the test: nothing in the read gives up on the stopped worker.
PATIENCE_S = 900
UNAVAILABLE = (rpc_errors.DATA_SOCKET, "UNAVAILABLE")


def start_service(cluster):
  dispatcher = cluster(
    "dispatcher",
    "--port=0",
    f"--heartbeat_timeout_s={PATIENCE_S}",
    f"--client_timeout_s={PATIENCE_S}",
  )
  worker = cluster(
    "worker", f"--dispatcher_address={dispatcher.address}", "--heartbeat_interval_s=0.2"
  )
  # A first read ends only once the worker registered and served it.
  with jaxfeed.Dataset.range(4).distribute(dispatcher.address).make_iterator() as it:
    assert sorted(int(x) for x in it) == [0, 1, 2, 3]
  return dispatcher, worker


def prefetch_threads() -> list[threading.Thread]:
  return [t for t in threading.enumerate() if t.name == "jaxfeed-device-prefetch" and t.is_alive()]


def test_loader_close_interrupts_a_read_blocked_on_a_stopped_worker(cluster):
  dispatcher, worker = start_service(cluster)
  worker.pause()
  try:
    # The read's job goes to the stopped worker, which neither makes a task
    # nor answers on its data socket: the Loader's thread waits in next().
    dataset = (
      jaxfeed.Dataset.range(10**6)
      .batch(4)
      .distribute(dispatcher.address, "distributed_epoch", timeout_s=PATIENCE_S)
    )
    loader = jaxfeed.Loader(dataset, prefetch=2)
    assert len(prefetch_threads()) == 1
    time.sleep(1.0)
    with warnings.catch_warnings():
      warnings.simplefilter("error")  # "its thread is left running" fails it
      start = time.monotonic()
      loader.close()
      seconds = time.monotonic() - start
    assert seconds < CLOSE_BOUND_S
    # It waited for the producer to stop on its own first.
    assert seconds >= prefetcher._INTERRUPT_AFTER_S - 0.5  # pylint: disable=protected-access
    assert not prefetch_threads()
  finally:
    worker.resume()


def read_first_element(dispatcher):
  """An iterator of a read that makes one element a second, after its first
  element: its fetcher then waits on the data connection for the next."""
  dataset = jaxfeed.Dataset.range(10**6).map(service_udfs.dawdle)
  iterator = dataset.distribute(
    dispatcher.address, "distributed_epoch", data_transfer="socket"
  ).make_iterator()
  assert next(iterator)["x"] == 0
  return iterator


def unavailable_count() -> int:
  return rpc_errors.CLIENT_ERRORS.snapshot().get(UNAVAILABLE, 0)


def test_a_read_closed_mid_epoch_counts_no_data_socket_error(cluster):
  dispatcher, _ = start_service(cluster)
  for _ in range(3):
    before = unavailable_count()
    iterator = read_first_element(dispatcher)
    iterator.close()  # the connection ends while its fetcher waits in recv
    assert unavailable_count() == before


def test_a_data_connection_cut_from_outside_counts_an_error_and_reads_on(cluster):
  dispatcher, worker = start_service(cluster)
  port = worker.data_address.rsplit(":", 1)[1]
  before = unavailable_count()
  with read_first_element(dispatcher) as iterator:
    out = subprocess.run(
      ["ss", "-K", "-t", "state", "established", "dport", "=", f":{port}"],
      capture_output=True,
      text=True,
      check=True,
    )
    assert len(out.stdout.strip().splitlines()) > 1, out.stdout  # one connection cut
    deadline = time.monotonic() + 30
    while unavailable_count() == before and time.monotonic() < deadline:
      time.sleep(0.05)
    assert unavailable_count() > before
    # The fetcher connected again: the read goes on where it was.
    assert next(iterator)["x"] == 1
