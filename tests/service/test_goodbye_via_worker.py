"""Goodbyes through workers: from `--goodbye_via_worker_clients` live clients
on, a closing client tells one worker it reads from, which forwards the
goodbye in its next heartbeat, instead of calling ReleaseJobClient (a pod's
hosts all leave at once). Real dispatcher and worker processes; what the
dispatcher did is read from its metrics.
"""

from __future__ import annotations

import collections
import pathlib
import threading
import time

import pytest

from jaxfeed import service
from jaxfeed.service import register_dataset
from jaxfeed.service.client.job_calls import dispatcher_caller
from jaxfeed.service.protocol import data_socket
from jaxfeed.service.protocol import rpc
from jaxfeed.service.protocol.protos import service_pb2 as pb
from connection_reads import NUM_RECORDS, records
from test_metrics import _metrics_url, scrape

pytestmark = pytest.mark.timeout(240)

TOKEN, WORKER_TOKEN = "goodbye-client-token", "goodbye-worker-token"
TLS_DIR = pathlib.Path(__file__).resolve().parent / "tls"
WORKER_INTERVAL_S = 0.5
# Far below client_timeout_s (60 s): a release this soon is no timeout.
RELEASED_WITHIN_S = 4 * WORKER_INTERVAL_S + 3.0


def goodbyes(url: str) -> collections.Counter:
  """How the dispatcher's clients left: via -> count (0s left out)."""
  return +collections.Counter(
    {
      dict(labels)["via"]: v
      for (name, labels), v in scrape(url).items()
      if name == "jaxfeed_dispatcher_client_goodbyes_total"
    }
  )


def live_clients(url: str) -> float:
  return sum(v for (name, _), v in scrape(url).items() if name == "jaxfeed_job_clients")


def wait_for(predicate, timeout_s: float) -> float:
  """Seconds until predicate() held; fails the test after timeout_s."""
  started = time.monotonic()
  while not predicate():
    assert time.monotonic() - started < timeout_s, "timed out"
    time.sleep(0.05)
  return time.monotonic() - started


def start(
  cluster,
  *dispatcher_flags: str,
  workers: int = 1,
  worker_interval_s: float = WORKER_INTERVAL_S,
  worker_flags: tuple = (),
):
  dispatcher = cluster(
    "dispatcher",
    "--port=0",
    "--metrics_port=0",
    f"--auth_token={TOKEN}",
    f"--worker_token={WORKER_TOKEN}",
    "--nojournal_fsync",
    *dispatcher_flags,
  )
  url = _metrics_url(dispatcher)
  started = [
    cluster(
      "worker",
      f"--dispatcher_address={dispatcher.address}",
      f"--heartbeat_interval_s={worker_interval_s}",
      f"--worker_token={WORKER_TOKEN}",
      *worker_flags,
    )
    for _ in range(workers)
  ]
  return dispatcher, url, started


def reader(dispatcher, mode: str = "parallel_epochs", **options):
  return (
    records()
    .distribute(dispatcher.address, mode, auth_token=TOKEN, timeout_s=60, **options)
    .make_iterator()
  )


def take_and_wait(iterator, batches: int = 3) -> list:
  """Takes batches, then waits for the dispatcher to have counted the
  client (it counts live clients once a second) and its heartbeats to have
  acknowledged what arrived."""
  taken = [next(iterator)["x"].tolist() for _ in range(batches)]
  time.sleep(1.5)
  return taken


@pytest.mark.parametrize("via_worker", [True, False])
def test_a_closing_client_says_goodbye_through_a_worker_only_at_pod_scale(cluster, via_worker):
  # One client reaches --goodbye_via_worker_clients=1; the default (256) it does not.
  flags = ["--goodbye_via_worker_clients=1"] if via_worker else []
  dispatcher, url, _ = start(cluster, *flags, workers=2)
  iterator = reader(dispatcher, job_name="pod")
  try:
    take_and_wait(iterator)
  finally:
    iterator.close()
  if not via_worker:  # released by the call, before close() returned
    assert live_clients(url) == 0
    assert goodbyes(url) == {"call": 1}
    return
  released_s = wait_for(lambda: live_clients(url) == 0, 30)
  assert released_s < RELEASED_WITHIN_S
  assert goodbyes(url) == {"worker": 1}  # no ReleaseJobClient call, no timeout


def test_a_goodbye_through_a_worker_over_tls(cluster):
  tls_flags = (f"--tls_key={TLS_DIR / 'server.key'}", f"--tls_cert={TLS_DIR / 'server.pem'}")
  dispatcher, url, _ = start(
    cluster,
    "--goodbye_via_worker_clients=1",
    *tls_flags,
    worker_flags=(f"--tls_root_certs={TLS_DIR / 'ca.pem'}", *tls_flags),
  )
  iterator = reader(
    dispatcher, tls=service.TLSConfig(root_certificates=(TLS_DIR / "ca.pem").read_bytes())
  )
  try:
    take_and_wait(iterator)
  finally:
    iterator.close()
  wait_for(lambda: live_clients(url) == 0, RELEASED_WITHIN_S)
  assert goodbyes(url) == {"worker": 1}


def test_a_worker_killed_before_forwarding_a_goodbye_leaves_the_client_to_the_timeout(cluster):
  # The worker heartbeats every 20 s: it is killed long before its next one.
  dispatcher, url, (doomed,) = start(
    cluster,
    "--goodbye_via_worker_clients=1",
    "--client_timeout_s=4",
    "--heartbeat_timeout_s=30",
    worker_interval_s=20,
  )
  iterator = reader(dispatcher)
  try:
    take_and_wait(iterator)
  finally:
    iterator.close()  # the worker took the goodbye
  doomed.kill()
  wait_for(lambda: live_clients(url) == 0, 30)
  assert goodbyes(url) == {"timeout": 1}
  # The dispatcher goes on: a new worker serves a new read, whole, once the
  # dead worker's task is given up (heartbeat timeout).
  cluster(
    "worker",
    f"--dispatcher_address={dispatcher.address}",
    f"--heartbeat_interval_s={WORKER_INTERVAL_S}",
    f"--worker_token={WORKER_TOKEN}",
  )
  with reader(dispatcher, "distributed_epoch", visitation="exactly_once") as again:
    values = [v for batch in again for v in batch["x"].tolist()]
  assert sorted(values) == list(range(1, NUM_RECORDS + 1))
  assert goodbyes(url)["timeout"] == 1 and goodbyes(url)["worker"] == 0


def test_a_worker_that_does_not_answer_the_goodbye_leaves_it_to_the_call_in_bounded_time(cluster):
  dispatcher, url, (stopped,) = start(cluster, "--goodbye_via_worker_clients=1")
  iterator = reader(dispatcher)
  try:
    take_and_wait(iterator)
    stopped.pause()  # SIGSTOP: its kernel still accepts the connection, nobody answers
    started = time.monotonic()
  finally:
    iterator.close()
  closed_s = time.monotonic() - started
  stopped.resume()
  # 1 s to connect plus 1 s for the answer, then the call (the fetchers and
  # the heartbeat thread end at once).
  assert closed_s < 8, closed_s
  assert live_clients(url) == 0
  # Resumed, the worker takes the goodbye still in its backlog and forwards
  # it: the client is released already, the goodbye ignored.
  time.sleep(4 * WORKER_INTERVAL_S)
  assert goodbyes(url)["call"] == 1 and goodbyes(url)["worker"] == 0


def test_clients_leaving_mid_epoch_through_workers_lose_and_repeat_nothing(cluster):
  dispatcher, url, _ = start(cluster, "--goodbye_via_worker_clients=1", "--split_size=8", workers=2)
  options = {"job_name": "once", "visitation": "exactly_once", "max_outstanding_requests": 2}
  leavers = [reader(dispatcher, "distributed_epoch", **options) for _ in range(2)]
  stayer = reader(dispatcher, "distributed_epoch", **options)
  try:
    consumed = [v for leaver in leavers for batch in take_and_wait(leaver, 5) for v in batch]
  finally:
    for leaver in leavers:
      leaver.close()
  rest: list = []
  # The splits the leavers held but had not acknowledged come back only once
  # they are released: through the workers within seconds, else after
  # client_timeout_s (60 s), past this deadline.
  thread = threading.Thread(
    target=lambda: rest.extend(v for batch in stayer for v in batch["x"].tolist()), daemon=True
  )
  started = time.monotonic()
  try:
    thread.start()
    thread.join(timeout=45)
    assert not thread.is_alive(), f"the read hung after {len(rest)} elements"
  finally:
    stayer.close()
  assert time.monotonic() - started < 45
  counts = collections.Counter(consumed + rest)
  assert max(counts.values()) == 1
  assert set(counts) <= set(range(1, NUM_RECORDS + 1))
  # What nobody consumed is what a leaver had acknowledged (all of it
  # arrived) but not yet taken: at most its buffer (2 batches) and the split
  # each of its two fetchers was handing on.
  missing = set(range(1, NUM_RECORDS + 1)) - set(counts)
  assert len(missing) <= 2 * (2 * 4 + 2 * 8), sorted(missing)
  # The leavers through workers; the one that read to the end had no stream
  # left (its tasks ended) and called.
  assert goodbyes(url)["worker"] == 2 and goodbyes(url)["call"] <= 1


def test_a_goodbye_naming_another_client_releases_nobody(cluster):
  dispatcher, url, _ = start(cluster, "--goodbye_via_worker_clients=1")
  victim = reader(dispatcher, job_name="shared")
  channel = rpc.make_channel(dispatcher.address)
  try:
    take_and_wait(victim)
    # A hostile client of the same job: it has the task's read ticket and
    # its own goodbye ticket, and names every client id in turn.
    dataset_id = register_dataset(dispatcher.address, records(), auth_token=TOKEN)
    job = dispatcher_caller(channel, "GetOrCreateJob", pb.GetOrCreateJobResponse, TOKEN)(
      pb.GetOrCreateJobRequest(
        dataset_id=dataset_id, sharding_policy="OFF", job_name="shared", first_heartbeat=True
      ),
      timeout=30,
    )
    time.sleep(1.2)  # counted: its heartbeat answer carries its goodbye ticket
    answer = dispatcher_caller(channel, "ClientHeartbeat", pb.ClientHeartbeatResponse, TOKEN)(
      pb.ClientHeartbeatRequest(job_id=job.job_id, client_id=job.client_id), timeout=30
    )
    assert answer.goodbye_via_worker and len(answer.goodbye_ticket) == 64
    (task,) = answer.tasks
    taken = []
    # Ids are handed out in turn from the dispatcher's first: the victim's
    # is among the few before the hostile client's.
    for client_id in range(job.client_id - 16, job.client_id + 8):
      # (A lone surrogate cannot be encoded in a heartbeat: the worker must
      # refuse it, or every later heartbeat of it would fail.)
      for ticket in (answer.goodbye_ticket, "", "0" * 64, "\ud800"):
        try:
          data_socket.send_goodbye(
            task.data_address,
            {
              "token": task.read_ticket,
              "task_id": task.task_id,
              "client_id": client_id,
              "goodbye": ticket,
            },
            5.0,
          )
        except data_socket.DataConnectionError as e:
          # No stream of that client here, or not a ticket at all.
          assert e.status == ("INVALID_ARGUMENT" if ticket == "\ud800" else "NOT_FOUND"), e
        else:
          taken.append(client_id)
    # The worker took the goodbyes naming the victim (it streams to it) and
    # forwarded them; the dispatcher, checking the tickets, refused them.
    assert len(set(taken)) == 1 and job.client_id not in taken
    wait_for(lambda: goodbyes(url)["refused"] + goodbyes(url)["worker"] >= 1, 10)
    time.sleep(4 * WORKER_INTERVAL_S)
    assert goodbyes(url)["worker"] == 0 and live_clients(url) == 2
    assert goodbyes(url)["refused"] >= 1
    assert len(take_and_wait(victim, 2)) == 2  # still reading
  finally:
    victim.close()
    channel.close()
  wait_for(lambda: goodbyes(url)["worker"] == 1, RELEASED_WITHIN_S)  # its own goodbye
  assert live_clients(url) == 1  # the hostile client, never released by it
