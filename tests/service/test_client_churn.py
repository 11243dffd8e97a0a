"""A client process that starts and ends many short reads stays up.

- A read whose iterator is dropped (not closed) is closed on the reaper
  thread (`jaxfeed.service.client.reaper`), never on the thread where the
  finalizer ran: that may be the garbage collector inside gRPC's own code.
- `close()` honours `timeout_s` even when the dispatcher stopped answering
  (SIGSTOP) while a heartbeat was in flight.
"""

from __future__ import annotations

import gc
import threading
import time

import pytest

import jaxfeed
from jaxfeed.service.client import read as client_read
from jaxfeed.service.client import reaper

pytestmark = pytest.mark.timeout(120)


def _start(cluster):
  dispatcher = cluster("dispatcher", "--heartbeat_timeout_s=60", "--client_timeout_s=60")
  cluster("worker", f"--dispatcher_address={dispatcher.address}", "--heartbeat_interval_s=0.2")
  return dispatcher


def test_a_dropped_read_is_closed_on_the_reaper_thread_not_where_it_was_dropped(
  cluster, monkeypatch
):
  dispatcher = _start(cluster)
  closed_on = []
  close = client_read.ReadState.close

  def recording_close(self):
    closed_on.append(threading.current_thread().name)
    close(self)

  monkeypatch.setattr(client_read.ReadState, "close", recording_close)
  dataset = jaxfeed.Dataset.range(10**6).batch(4).distribute(dispatcher.address, timeout_s=30)

  def read_and_drop():
    iterator = iter(dataset)
    next(iterator)
    del iterator  # the finalizer runs here (or in a collection on any thread)
    gc.collect()

  dropper = threading.Thread(target=read_and_drop, name="dropper")
  dropper.start()
  dropper.join(timeout=60)
  deadline = time.monotonic() + 30
  while not closed_on and time.monotonic() < deadline:
    time.sleep(0.05)
  assert closed_on == [reaper.THREAD_NAME]


def test_close_honours_timeout_s_while_the_dispatcher_is_stopped(cluster):
  dispatcher = _start(cluster)
  iterator = (
    jaxfeed.Dataset.range(10**6)
    .batch(4)
    .distribute(dispatcher.address, timeout_s=2)
    .make_iterator()
  )
  try:
    for _ in range(8):
      next(iterator)
    dispatcher.pause()  # SIGSTOP: calls to it neither succeed nor fail
    time.sleep(1.0)  # a heartbeat is on its way to it
    started = time.monotonic()
    iterator.close()
    took = time.monotonic() - started
  finally:
    dispatcher.resume()
    iterator.close()
  # The heartbeat in flight gives up after timeout_s, the goodbye too.
  assert took < 2 * 2 + 1.5, f"close() took {took:.1f}s with timeout_s=2"
