"""A service read ends as soon as its last stream does: neither the worker's
nor the client's heartbeat interval is waited out after the last batch (a
short epoch would otherwise spend most of its time there)."""

from __future__ import annotations

import time

import numpy as np
import pytest

import jaxfeed
from jaxfeed import service
from jaxfeed.service.dispatcher import heartbeat_pacing

pytestmark = pytest.mark.timeout(240)

# Far longer than a read of a few batches takes, even on a loaded machine.
SLOW_HEARTBEAT_S = 60
FAST_READ_S = 20


def read_once(address: str, **options) -> tuple[list[int], float]:
  """One DYNAMIC read of 0..39 in batches of 4: its values and its seconds."""
  dataset = jaxfeed.Dataset.range(40).batch(4)
  start = time.monotonic()
  with dataset.distribute(address, "distributed_epoch", **options).make_iterator() as it:
    values = sorted(np.concatenate(list(it)).tolist())
  return values, time.monotonic() - start


@pytest.mark.parametrize("visitation", ["at_most_once", "exactly_once"])
def test_a_read_ends_without_waiting_for_the_workers_next_heartbeat(cluster, visitation):
  dispatcher = cluster("dispatcher", "--port=0", f"--heartbeat_timeout_s={10 * SLOW_HEARTBEAT_S}")
  cluster(
    "worker",
    f"--dispatcher_address={dispatcher.address}",
    f"--heartbeat_interval_s={SLOW_HEARTBEAT_S}",
  )
  for _ in range(2):  # a new job each time, as epochs are read
    values, seconds = read_once(dispatcher.address, visitation=visitation)
    assert values == list(range(40))
    assert seconds < FAST_READ_S


@pytest.mark.parametrize("data_transfer", ["socket", "grpc"])
def test_a_read_ends_without_waiting_for_the_clients_next_heartbeat(cluster, data_transfer):
  # One client heartbeat a minute, as a dispatcher with many clients asks.
  pacing = heartbeat_pacing.HeartbeatPacing(client_heartbeats_per_s=1 / SLOW_HEARTBEAT_S)
  config = service.DispatcherConfig(client_timeout_s=10 * SLOW_HEARTBEAT_S, heartbeat_pacing=pacing)
  with service.DispatchServer(config) as dispatcher:
    assert pacing.client_interval(1, config.client_timeout_s) >= SLOW_HEARTBEAT_S
    cluster("worker", f"--dispatcher_address={dispatcher.target}")
    # Registered before the read: else its first heartbeat lists no task
    # and the next one comes a minute later.
    deadline = time.monotonic() + 60
    while not dispatcher.state.workers and time.monotonic() < deadline:
      time.sleep(0.05)
    for _ in range(2):
      values, seconds = read_once(dispatcher.target, data_transfer=data_transfer)
      assert values == list(range(40))
      assert seconds < FAST_READ_S
