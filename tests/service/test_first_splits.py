"""A DYNAMIC task's first splits come with the task, in the worker heartbeat
that hands it out: real dispatcher and worker processes on loopback, the
reply lost by stopping both and cutting the worker's connection."""

from __future__ import annotations

import collections
import subprocess
import threading
import time

import numpy as np
import psutil
import pytest

import jaxfeed
from test_metrics import scrape

pytestmark = pytest.mark.timeout(120)

WAIT_S = 30


def metrics_url(process) -> str:
  line = process._lines.get(timeout=WAIT_S)  # pylint: disable=protected-access
  assert " metrics on http://127.0.0.1:" in line, line
  return line.split()[-1]


def split_answers(url: str) -> dict[tuple[str, str], float]:
  """(via, first) -> split answers the dispatcher gave."""
  return {
    (dict(labels)["via"], dict(labels)["first"]): v
    for (name, labels), v in scrape(url).items()
    if name == "jaxfeed_dispatcher_split_answers_total"
  }


def wait_for(what: str, condition, timeout_s: float = WAIT_S) -> None:
  deadline = time.monotonic() + timeout_s
  while not condition():
    assert time.monotonic() < deadline, f"timed out waiting for {what}"
    time.sleep(0.05)


def gauge(url: str, name: str) -> float:
  return scrape(url).get((name, ()), 0.0)


def read_in_background(dispatcher, num: int) -> tuple[threading.Thread, list]:
  """An exactly-once epoch of range(num) read on a thread; its values land in the list."""
  got: list = []
  dataset = jaxfeed.Dataset.range(num).batch(5)
  iterator = dataset.distribute(
    dispatcher.address, "distributed_epoch", visitation="exactly_once"
  ).make_iterator()

  def read() -> None:
    with iterator:
      got.extend(np.concatenate(list(iterator)).tolist())

  thread = threading.Thread(target=read, daemon=True)
  thread.start()
  return thread, got


def test_the_first_splits_come_with_the_task_and_no_first_get_splits_is_made(cluster):
  dispatcher = cluster(
    "dispatcher", "--port=0", "--metrics_port=0", "--split_size=10", "--heartbeat_timeout_s=2"
  )
  url = metrics_url(dispatcher)
  for _ in range(2):
    cluster("worker", f"--dispatcher_address={dispatcher.address}", "--heartbeat_interval_s=0.2")
  wait_for("both workers", lambda: gauge(url, "jaxfeed_dispatcher_workers") == 2)
  thread, got = read_in_background(dispatcher, 200)
  thread.join(WAIT_S)
  assert not thread.is_alive()
  assert collections.Counter(got) == collections.Counter(range(200))
  answers = split_answers(url)
  # Each task's first splits went out with it; only later ones were asked for.
  assert answers.get(("WorkerHeartbeat", "true"), 0) == 2, answers
  assert answers.get(("GetSplits", "true"), 0) == 0, answers
  assert answers.get(("GetSplits", "false"), 0) >= 1, answers


def cut_connections(pid: int, port: int) -> int:
  """Resets the process's TCP connections to `port` (`ss -K`); returns how many."""
  local_ports = {
    c.laddr.port
    for c in psutil.Process(pid).net_connections(kind="tcp")
    if c.raddr and c.raddr.port == port and c.status == psutil.CONN_ESTABLISHED
  }
  for local in local_ports:
    subprocess.run(
      [
        "ss",
        "-K",
        "-t",
        "state",
        "established",
        "sport",
        "=",
        f":{local}",
        "dport",
        "=",
        f":{port}",
      ],
      capture_output=True,
      check=True,
    )
  return len(local_ports)


def test_a_lost_reply_carrying_the_task_loses_no_split_of_an_exactly_once_epoch(cluster, tmp_path):
  dispatcher = cluster(
    "dispatcher", "--port=0", f"--work_dir={tmp_path}", "--metrics_port=0", "--split_size=10"
  )
  url = metrics_url(dispatcher)
  worker = cluster(
    "worker", f"--dispatcher_address={dispatcher.address}", "--heartbeat_interval_s=0.2"
  )
  wait_for("the worker", lambda: gauge(url, "jaxfeed_dispatcher_workers") == 1)
  # The job (and the worker's task) comes while the worker is stopped.
  worker.pause()
  thread, got = read_in_background(dispatcher, 200)
  try:
    wait_for("the job", lambda: gauge(url, "jaxfeed_dispatcher_jobs") == 1)
    # The worker's next heartbeat waits in the stopped dispatcher's socket;
    # its answer, with the task and its first splits, then waits in the
    # stopped worker's, and goes with the connection.
    dispatcher.pause()
    worker.resume()
    time.sleep(1.5)  # it heartbeats every 0.2 s
    worker.pause()
    dispatcher.resume()
    wait_for(
      "the task's first splits", lambda: split_answers(url).get(("WorkerHeartbeat", "true"), 0) >= 1
    )
    port = int(dispatcher.address.rsplit(":", 1)[1])
    assert cut_connections(worker.proc.pid, port) >= 1
  finally:
    dispatcher.resume()
    worker.resume()
  thread.join(WAIT_S)
  assert not thread.is_alive(), "the epoch did not end"
  assert collections.Counter(got) == collections.Counter(range(200))
  answers = split_answers(url)
  # The task came again (the worker did not list it), with the same ranges.
  assert answers.get(("WorkerHeartbeat", "true"), 0) >= 2, answers
  assert answers.get(("GetSplits", "true"), 0) == 0, answers


def test_a_draining_worker_is_sent_no_splits_with_a_new_task(cluster):
  # A draining worker starts no new task: splits sent with one would wait
  # unread until it leaves, and an at-most-once epoch would lose them.
  dispatcher = cluster(
    "dispatcher", "--port=0", "--metrics_port=0", "--split_size=10", "--heartbeat_timeout_s=2"
  )
  url = metrics_url(dispatcher)
  draining = cluster(
    "worker",
    f"--dispatcher_address={dispatcher.address}",
    "--heartbeat_interval_s=0.2",
    "--drain_timeout_s=60",
  )
  wait_for("the first worker", lambda: gauge(url, "jaxfeed_dispatcher_workers") == 1)
  # It holds a task whose consumer takes nothing more: it drains (SIGTERM)
  # until that task is idle for 2 s, taking no new task meanwhile.
  held = (
    jaxfeed.Dataset.range(1000)
    .batch(5)
    .distribute(dispatcher.address, "distributed_epoch")
    .make_iterator()
  )
  with held:
    next(held)
    cluster("worker", f"--dispatcher_address={dispatcher.address}", "--heartbeat_interval_s=0.2")
    wait_for("both workers", lambda: gauge(url, "jaxfeed_dispatcher_workers") == 2)
    draining.proc.terminate()
    time.sleep(0.5)  # a few heartbeats: it drains
    got: list = []
    with (
      jaxfeed.Dataset.range(200)
      .batch(5)
      .distribute(dispatcher.address, "distributed_epoch")
      .make_iterator() as iterator
    ):
      got.extend(np.concatenate(list(iterator)).tolist())
  assert collections.Counter(got) == collections.Counter(range(200))
