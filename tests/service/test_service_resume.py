"""Exactly-once service reads resumed from a checkpoint in a new process.

A training process (`resume_trainer.py`) reads an exactly-once
`distributed_epoch` job of real dispatcher and worker processes through a
Loader, saves an orbax checkpoint at step k, reads on and is SIGKILLed. A new
process restores the checkpoint, on a new job, and must read the rest of the
epoch: what the first read up to step k plus what the second read is every
record once.
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import threading
import sys
import time

import numpy as np
import pytest

import jaxfeed
import resume_trainer as trainer
import service_udfs
from jaxfeed.ops import base
from jaxfeed.service.protocol import read_state
from test_first_splits import gauge, metrics_url, wait_for
from service_cluster import REPO_ROOT, TESTS_DIR, free_port

pytestmark = pytest.mark.timeout(240)

SAVE_AT = 7
HEARTBEAT = ("--heartbeat_interval_s=0.2",)


def trainer_process(
  dispatcher: str, directory, mode: str, processing_mode: str = "distributed_epoch"
) -> subprocess.Popen:
  env = dict(
    os.environ,
    PYTHONPATH=os.pathsep.join([str(REPO_ROOT), str(TESTS_DIR), os.environ.get("PYTHONPATH", "")]),
  )
  env.pop("XLA_FLAGS", None)
  return subprocess.Popen(
    [
      sys.executable,
      "-m",
      "resume_trainer",
      dispatcher,
      str(directory),
      str(SAVE_AT),
      mode,
      processing_mode,
    ],
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    env=env,
    text=True,
  )


def lines_until(process: subprocess.Popen, key: str) -> list[dict]:
  """The process's JSON lines up to the first with `key`."""
  lines = []
  for line in process.stdout:
    lines.append(json.loads(line))
    if key in lines[-1]:
      return lines
  process.wait(timeout=30)
  raise AssertionError(
    f"the trainer ended (status {process.returncode}) before "
    f"printing {key!r}:\n{process.stderr.read()[-4000:]}"
  )


def records(lines: list[dict], up_to: int | None = None) -> collections.Counter:
  return collections.Counter(
    x
    for line in lines
    if "step" in line and (up_to is None or line["step"] <= up_to)
    for x in line["x"]
  )


def first_run_killed_after_its_checkpoint(
  dispatcher: str, directory, processing_mode: str
) -> list[dict]:
  """The first trainer's lines up to its checkpoint at SAVE_AT; it reads
  AHEAD batches more and is SIGKILLed."""
  first = trainer_process(dispatcher, directory, "first", processing_mode)
  try:
    before = lines_until(first, "saved")
    ahead = [json.loads(first.stdout.readline()) for _ in range(trainer.AHEAD)]
  finally:
    first.kill()
    first.wait(timeout=30)
  assert [line["step"] for line in ahead] == list(range(SAVE_AT + 1, SAVE_AT + 1 + trainer.AHEAD))
  return before + ahead


def restored_run(dispatcher: str, directory, processing_mode: str) -> list[dict]:
  """A new trainer process's lines: it restores the checkpoint and reads on
  to the end."""
  second = trainer_process(dispatcher, directory, "restore", processing_mode)
  try:
    after = lines_until(second, "end")
    assert second.wait(timeout=60) == 0, second.stderr.read()[-4000:]
  finally:
    second.kill()
    second.wait(timeout=30)
  assert after[0] == {"restored": SAVE_AT}
  assert after[1]["step"] == SAVE_AT + 1
  return after


@pytest.mark.parametrize("old_job", ["dispatcher_restarted_empty", "still_there"])
def test_a_read_saved_at_step_k_resumes_in_a_new_process_exactly_once(cluster, tmp_path, old_job):
  port = free_port()
  dispatcher = cluster(
    "dispatcher",
    f"--port={port}",
    f"--work_dir={tmp_path / 'a'}",
    "--split_size=10",
    "--heartbeat_timeout_s=5",
  )
  workers = [
    cluster("worker", f"--dispatcher_address={dispatcher.address}", *HEARTBEAT) for _ in range(2)
  ]
  before = first_run_killed_after_its_checkpoint(
    dispatcher.address, tmp_path / "checkpoints", "distributed_epoch"
  )
  if old_job == "dispatcher_restarted_empty":
    # The same address, a new work_dir: the old job is gone.
    dispatcher.stop()
    dispatcher = cluster(
      "dispatcher",
      f"--port={port}",
      f"--work_dir={tmp_path / 'b'}",
      "--split_size=10",
      "--heartbeat_timeout_s=5",
    )
  after = restored_run(dispatcher.address, tmp_path / "checkpoints", "distributed_epoch")
  got = records(before, SAVE_AT) + records(after)
  assert got == collections.Counter(range(trainer.RECORDS))
  # The batches read after the checkpoint by the killed process came again.
  assert set(records(before[-trainer.AHEAD :])) <= set(records(after))
  for worker in workers:  # before the dispatcher, so that they leave at once
    worker.stop()


def test_a_parallel_epochs_read_saved_at_step_k_resumes_each_worker_stream_in_a_new_process(
  cluster, tmp_path
):
  dispatcher = cluster("dispatcher", "--port=0", "--heartbeat_timeout_s=5")
  workers = [
    cluster("worker", f"--dispatcher_address={dispatcher.address}", *HEARTBEAT) for _ in range(2)
  ]
  before = first_run_killed_after_its_checkpoint(
    dispatcher.address, tmp_path / "checkpoints", "parallel_epochs"
  )
  after = restored_run(dispatcher.address, tmp_path / "checkpoints", "parallel_epochs")
  # Each of the 2 workers reads the whole epoch: every record twice.
  got = records(before, SAVE_AT) + records(after)
  assert got == collections.Counter({x: 2 for x in range(trainer.RECORDS)})
  assert after[-1] == {"end": 2 * trainer.RECORDS // trainer.BATCH}
  for worker in workers:
    worker.stop()


def partial_read(dispatcher: str, visitation: str, mode: str = "distributed_epoch", **options):
  dataset = (
    jaxfeed.Dataset.range(40)
    .batch(4)
    .distribute(dispatcher, mode, visitation=visitation, **options)
  )
  with dataset.make_iterator() as iterator:
    next(iterator)
    return dataset, iterator.get_state()


@pytest.mark.parametrize(
  "visitation,mode,options",
  [
    ("at_most_once", "distributed_epoch", {}),
    ("at_most_once", "parallel_epochs", {"job_name": "shared"}),
    ("at_most_once", "parallel_epochs", {"ephemeral_sharing": True}),
  ],
)
def test_reads_that_cannot_resume_say_which_can(cluster, visitation, mode, options):
  dispatcher = cluster("dispatcher", "--port=0")
  cluster("worker", f"--dispatcher_address={dispatcher.address}", *HEARTBEAT)
  dataset, state = partial_read(dispatcher.address, visitation, mode, **options)
  with dataset.make_iterator() as iterator:
    with pytest.raises(
      base.PipelineStateError, match="visitation='exactly_once'.*parallel_epochs reads without"
    ):
      iterator.set_state(state)


def parallel_read(dispatcher: str, **options) -> jaxfeed.Dataset:
  return (
    jaxfeed.Dataset.range(40)
    .batch(4)
    .distribute(dispatcher, "parallel_epochs", max_outstanding_requests=2, **options)
  )


@pytest.mark.parametrize(
  "workers_after,message",
  [
    (3, "saved with 2 open worker streams, but its new job started with 3 workers"),
    (
      1,
      "1 of the open worker streams this parallel_epochs read was saved with "
      "have no worker in its new job",
    ),
  ],
)
def test_a_parallel_epochs_read_resumed_on_another_worker_count_says_so(
  cluster, workers_after, message
):
  dispatcher = cluster("dispatcher", "--port=0", "--heartbeat_timeout_s=2", "--metrics_port=0")
  url = metrics_url(dispatcher)
  workers = [
    cluster("worker", f"--dispatcher_address={dispatcher.address}", *HEARTBEAT) for _ in range(2)
  ]
  # The saved state must name both workers' streams: read once both are in.
  wait_for("both workers", lambda: gauge(url, "jaxfeed_dispatcher_workers") == 2)
  dataset = parallel_read(dispatcher.address, timeout_s=3)
  with dataset.make_iterator() as iterator:
    next(iterator)
    state = iterator.get_state()
  assert [closed for _, closed, _ in state["own"]["streams"]["streams"]] == [False, False]
  for _ in range(workers_after - 2):
    cluster("worker", f"--dispatcher_address={dispatcher.address}", *HEARTBEAT)
  for worker in workers[workers_after:]:
    worker.stop()
  with dataset.make_iterator() as iterator:
    iterator.set_state(state)
    with pytest.raises(ValueError, match=message):
      list(iterator)


def test_a_parallel_epochs_read_saved_after_its_streams_ended_resumes_at_its_end(cluster):
  dispatcher = cluster("dispatcher", "--port=0")
  cluster("worker", f"--dispatcher_address={dispatcher.address}", *HEARTBEAT)
  dataset = parallel_read(dispatcher.address)
  with dataset.make_iterator() as iterator:
    assert len(list(iterator)) == 10
    state = iterator.get_state()
  assert state["own"]["streams"]["streams"] == [[10, True, 0]]
  with dataset.make_iterator() as iterator:
    iterator.set_state(state)
    assert list(iterator) == []
    assert iterator.job_id == 0  # no job was made


def test_a_parallel_epochs_read_of_a_pipeline_without_an_index_based_input_refuses_a_position(
  cluster,
):
  dispatcher = cluster("dispatcher", "--port=0")
  # Two inputs read apart (a from_tfrecord's files are positions now).
  dataset = (
    jaxfeed.Dataset.range(4)
    .map(service_udfs.add_one)
    .concatenate(jaxfeed.Dataset.range(3))
    .distribute(dispatcher.address, "parallel_epochs")
  )
  state = {
    "op": "distribute",
    "parents": [],
    "own": {"elements_read": 1, "streams": {"version": 1, "streams": [[1, False]]}},
  }
  with dataset.make_iterator() as iterator:
    with pytest.raises(base.PipelineStateError, match="one index-based input"):
      iterator.set_state(state)


def test_a_state_of_another_dataset_is_refused_naming_the_positions(cluster):
  dispatcher = cluster("dispatcher", "--port=0", "--split_size=4")
  cluster("worker", f"--dispatcher_address={dispatcher.address}", *HEARTBEAT)
  _, state = partial_read(dispatcher.address, "exactly_once")
  smaller = (
    jaxfeed.Dataset.range(8)
    .batch(4)
    .distribute(dispatcher.address, "distributed_epoch", visitation="exactly_once")
  )
  state["own"]["splits"]["done"] = [[0, 12]]
  with smaller.make_iterator() as iterator:
    iterator.set_state(state)
    with pytest.raises(ValueError, match="outside the dataset's 8 positions"):
      next(iterator)


def test_consumers_of_a_shared_job_resume_it_together_exactly_once(cluster):
  dispatcher = cluster("dispatcher", "--port=0", "--split_size=6")
  for _ in range(2):
    cluster("worker", f"--dispatcher_address={dispatcher.address}", *HEARTBEAT)
  dataset = (
    jaxfeed.Dataset.range(120)
    .batch(4)
    .distribute(
      dispatcher.address,
      "distributed_epoch",
      job_name="shared",
      visitation="exactly_once",
      max_outstanding_requests=2,
    )
  )
  consumers = [dataset.make_iterator() for _ in range(2)]
  try:
    taken = [next(c) for c in consumers for _ in range(4)]
    states = [c.get_state() for c in consumers]
  finally:
    for consumer in consumers:
      consumer.close()
  merged = read_state.merge_process_states(states)
  assert merged[0] == merged[1]
  consumers = [dataset.make_iterator() for _ in range(2)]
  rest: list[list] = [[], []]
  try:
    for consumer, state in zip(consumers, merged):
      consumer.set_state(state)

    def read(i: int) -> None:
      rest[i] = list(consumers[i])

    threads = [threading.Thread(target=read, args=(i,)) for i in range(2)]
    for thread in threads:
      thread.start()
    for thread in threads:
      thread.join(timeout=120)
    assert not any(thread.is_alive() for thread in threads)
  finally:
    for consumer in consumers:
      consumer.close()
  got = collections.Counter(np.concatenate(taken + rest[0] + rest[1]).tolist())
  assert got == collections.Counter(range(120))


@pytest.mark.parametrize("consumers", [1, 2])
def test_a_shared_read_restored_twice_from_one_checkpoint_reads_the_rest_each_time(
  cluster, consumers
):
  # The first restore's job goes on and stays (job_gc_timeout_s) after its
  # consumers leave: the second restore must not join it.
  dispatcher = cluster("dispatcher", "--port=0", "--split_size=6", "--job_gc_timeout_s=600")
  for _ in range(2):
    cluster("worker", f"--dispatcher_address={dispatcher.address}", *HEARTBEAT)
  dataset = (
    jaxfeed.Dataset.range(120)
    .batch(4)
    .distribute(
      dispatcher.address,
      "distributed_epoch",
      job_name="twice",
      visitation="exactly_once",
      max_outstanding_requests=2,
    )
  )

  def read(states: list, batches: int | None) -> list:
    iterators = [dataset.make_iterator() for _ in states]
    try:
      for iterator, state in zip(iterators, states):
        if state is not None:
          iterator.set_state(state)
      if batches is not None:
        taken = [next(i) for i in iterators for _ in range(batches)]
        time.sleep(2)  # training on: the heartbeats acknowledge what arrived
        return taken
      got = [None] * len(iterators)
      threads = [
        threading.Thread(target=lambda k: got.__setitem__(k, list(iterators[k])), args=(k,))
        for k in range(len(iterators))
      ]
      for thread in threads:
        thread.start()
      for thread in threads:
        thread.join(timeout=120)
      assert not any(thread.is_alive() for thread in threads)
      return [b for batches_of_one in got for b in batches_of_one]
    finally:
      states[:] = [i.get_state() for i in iterators]
      for iterator in iterators:
        iterator.close()

  saved = [None] * consumers
  taken = read(saved, 3)  # the checkpoint: what each process saved

  def restore() -> list:
    # As a Loader's restore does: one consumer restores its own state; the
    # consumers of a shared job restore the merge of theirs, marked anew.
    return list(saved) if consumers == 1 else read_state.merge_process_states(saved)

  read(restore(), 4)  # preempted again, after 4 batches more each
  rest = read(restore(), None)
  got = collections.Counter(np.concatenate(taken + rest).tolist())
  assert got == collections.Counter(range(120))


def test_the_state_of_a_fresh_read_restarts_an_iterator_at_the_epoch_start(cluster):
  dispatcher = cluster("dispatcher", "--port=0", "--split_size=8")
  cluster("worker", f"--dispatcher_address={dispatcher.address}", *HEARTBEAT)
  dataset = (
    jaxfeed.Dataset.range(40)
    .batch(4)
    .distribute(dispatcher.address, "distributed_epoch", visitation="exactly_once")
  )
  with dataset.make_iterator() as iterator:
    start = iterator.get_state()
    for _ in range(3):
      next(iterator)
    iterator.set_state(start)
    again = list(iterator)
  assert collections.Counter(np.concatenate(again).tolist()) == collections.Counter(range(40))
