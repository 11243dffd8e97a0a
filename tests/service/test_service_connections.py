"""Broken connections to live workers, and a client killed mid-read.

A dispatcher and workers run as processes on loopback. While a client reads,
a thread cuts every established connection to the workers' data port (or
their gRPC port, for data_transfer="grpc") with `ss -K`, again and again.
The workers live on, so nothing may be lost or repeated in any mode, and the
read must end in time.
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import coordinated_reads as corpus_lib
from connection_reads import NUM_RECORDS, records
from service_cluster import REPO_ROOT, TESTS_DIR

pytestmark = pytest.mark.timeout(150)

CUT_RECORDS = 600
READ_DEADLINE_S = 90  # generous: the machine is shared; a hang fails it
HEARTBEAT = "--heartbeat_interval_s=0.2"


class Cutter:
  """Cuts the established connections to `ports` every `interval_s` until
  stopped; `cuts` counts the connections it cut."""

  def __init__(self, ports: list[int], interval_s: float = 0.2):
    self.cuts = 0
    self._ports = ports
    self._interval_s = interval_s
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._run, name="connection-cutter")
    self._thread.start()

  def _run(self) -> None:
    while not self._stop.wait(self._interval_s):
      for port in self._ports:
        out = subprocess.run(
          ["ss", "-K", "-t", "state", "established", "dport", "=", f":{port}"],
          capture_output=True,
          text=True,
          check=False,
        )
        self.cuts += max(0, len(out.stdout.strip().splitlines()) - 1)

  def stop(self) -> int:
    self._stop.set()
    self._thread.join(timeout=30)
    return self.cuts


def port_of(address: str) -> int:
  return int(address.rsplit(":", 1)[1])


def start_service(cluster, num_workers: int, *dispatcher_flags: str):
  dispatcher = cluster("dispatcher", "--port=0", "--heartbeat_timeout_s=5", *dispatcher_flags)
  workers = [
    cluster("worker", f"--dispatcher_address={dispatcher.address}", HEARTBEAT, "--buffer_size=4")
    for _ in range(num_workers)
  ]
  return dispatcher, workers


def cut_ports(workers, data_transfer: str) -> list[int]:
  return [port_of(w.data_address if data_transfer == "socket" else w.address) for w in workers]


def read_within_deadline(make_iterator, consume=list):
  """consume(iterator) on a thread; fails if it does not end in time."""
  result: dict = {}

  def run():
    try:
      with make_iterator() as iterator:
        result["value"] = consume(iterator)
    except BaseException as e:  # pylint: disable=broad-except
      result["error"] = e

  thread = threading.Thread(target=run, name="reader")
  start = time.monotonic()
  thread.start()
  thread.join(timeout=READ_DEADLINE_S)
  assert not thread.is_alive(), f"the read did not end within {READ_DEADLINE_S} s"
  if "error" in result:
    raise result["error"]
  return result["value"], time.monotonic() - start


def slowly(iterator) -> list:
  """The iterator's batches, a 10 ms training step each: slower than the
  workers, so the client's buffer stays full and sent batches wait in socket
  buffers when a cut comes."""
  batches = []
  for batch in iterator:
    batches.append(batch)
    time.sleep(0.01)
  return batches


def values(batches: list) -> collections.Counter:
  return collections.Counter(np.concatenate([b["x"] for b in batches]).tolist())


@pytest.mark.parametrize("data_transfer", ["socket", "grpc"])
@pytest.mark.parametrize(
  "mode, visitation, copies",
  [
    ("parallel_epochs", "at_most_once", 2),
    ("distributed_epoch", "at_most_once", 1),
    ("distributed_epoch", "exactly_once", 1),
  ],
)
def test_cut_connections_to_live_workers_lose_and_repeat_nothing(
  cluster, data_transfer, mode, visitation, copies
):
  dispatcher, workers = start_service(cluster, 2, "--split_size=8")
  distributed = records(CUT_RECORDS, slow=False).distribute(
    dispatcher.address,
    mode,
    visitation=visitation,
    data_transfer=data_transfer,
    max_outstanding_requests=2,
  )
  cutter = Cutter(cut_ports(workers, data_transfer))
  try:
    batches, _ = read_within_deadline(distributed.make_iterator, slowly)
  finally:
    cuts = cutter.stop()
  assert cuts >= 3  # the read went on through several cuts
  assert values(batches) == collections.Counter({v: copies for v in range(1, CUT_RECORDS + 1)})


@pytest.mark.parametrize("data_transfer", ["socket", "grpc"])
def test_cut_connections_of_a_round_robin_read_skip_no_round(cluster, data_transfer):
  dispatcher = cluster(
    "dispatcher", "--port=0", "--heartbeat_timeout_s=5", f"--num_workers={corpus_lib.NUM_WORKERS}"
  )
  workers = [
    cluster("worker", f"--dispatcher_address={dispatcher.address}", HEARTBEAT, "--buffer_size=4")
    for _ in range(corpus_lib.NUM_WORKERS)
  ]
  results: list = [None] * corpus_lib.NUM_CONSUMERS

  def consume(index):
    def run(iterator):
      ids = []
      for batch in iterator:
        ids.append((iterator.last_round, tuple(batch["id"].tolist())))
        time.sleep(0.01)  # a training step: the cuts land mid-read
      return ids, iterator.stats()

    results[index] = read_within_deadline(
      lambda: corpus_lib.coordinated(
        dispatcher.address, f"cut-{data_transfer}", index, 60.0, data_transfer=data_transfer
      ).make_iterator(),
      run,
    )[0]

  cutter = Cutter(cut_ports(workers, data_transfer))
  try:
    threads = [threading.Thread(target=consume, args=(i,)) for i in range(corpus_lib.NUM_CONSUMERS)]
    for thread in threads:
      thread.start()
    for thread in threads:
      thread.join(timeout=READ_DEADLINE_S + 10)
  finally:
    cuts = cutter.stop()
  assert all(r is not None for r in results), "a consumer failed or hung"
  assert cuts >= 3
  rounds = [[r for r, _ in ids] for ids, _ in results]
  assert rounds[0] == rounds[1] == rounds[2] == sorted(set(rounds[0]))
  for _, stats in results:  # every round the workers made reached every consumer
    assert stats["rounds_skipped"] == 0 and stats["rows_dropped_late"] == 0
    made = sum(w["rounds"] for w in stats["workers"].values())
    assert len(stats["workers"]) == corpus_lib.NUM_WORKERS and made == len(rounds[0])
  ids = [i for batches, _ in results for _, batch in batches for i in batch]
  assert len(ids) == len(set(ids))
  dropped = results[0][1]["rows_dropped_at_end"] + results[0][1]["rows_dropped_over_limit"]
  assert len(ids) + dropped == corpus_lib.NUM_SEQUENCES


def test_a_killed_client_of_a_shared_exactly_once_job_leaves_its_splits_to_the_other(cluster):
  dispatcher, _ = start_service(cluster, 2, "--split_size=8", "--client_timeout_s=3")
  env = dict(
    os.environ,
    PYTHONPATH=os.pathsep.join([str(REPO_ROOT), str(TESTS_DIR), os.environ.get("PYTHONPATH", "")]),
  )
  doomed = subprocess.Popen(
    [sys.executable, "-m", "connection_reads", dispatcher.address, "shared-once", "5"],
    stdout=subprocess.PIPE,
    stderr=subprocess.DEVNULL,
    env=env,
    text=True,
  )
  try:
    lines = [doomed.stdout.readline() for _ in range(5)]
    distributed = records().distribute(
      dispatcher.address,
      "distributed_epoch",
      job_name="shared-once",
      visitation="exactly_once",
      max_outstanding_requests=2,
    )
    result: dict = {}

    def kill_soon():
      time.sleep(1.5)  # its acknowledgments of what it printed went out
      doomed.kill()
      result["killed_at"] = time.monotonic()

    killer = threading.Thread(target=kill_soon)
    killer.start()
    batches, _ = read_within_deadline(distributed.make_iterator)
    killer.join()
  finally:
    doomed.kill()
    doomed.wait(timeout=30)
  consumed = collections.Counter(v for line in lines for v in json.loads(line))
  got = values(batches)
  assert max(got.values()) == 1
  assert not set(got) & set(consumed)
  # What neither consumed is what the killed client had acknowledged but not
  # yet taken: at most its buffer (2 batches) and the split each of its two
  # fetchers was handing on.
  missing = set(range(1, NUM_RECORDS + 1)) - set(got) - set(consumed)
  assert len(missing) <= 2 * 4 + 2 * 8, sorted(missing)
  assert len(got) > NUM_RECORDS // 2
