"""Coordinated reads through the service: every consumer trains on one bucket.

A dispatcher and two workers run as separate processes on loopback; three
consumers read `bucket_by_sequence_length` batches of a real text corpus (the
standard library's source paragraphs, see coordinated_reads.py) with
`num_consumers=3`. Batches are checked against tf.data's
`bucket_by_sequence_length` run over each worker's shard.
"""

from __future__ import annotations

import collections
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import grpc
import numpy as np
import pytest
import tensorflow as tf

import coordinated_reads as corpus_lib
from jaxfeed.service.protocol.protos import service_pb2 as pb
from service_cluster import REPO_ROOT, TESTS_DIR, ServiceProcess

pytestmark = pytest.mark.timeout(120)

JOIN_TIMEOUT_S = 60
DROP_COUNTERS = ("rows_dropped_at_end", "rows_dropped_over_limit", "rows_dropped_late")


@pytest.fixture(scope="module")
def service():
  """A dispatcher waiting for 2 workers, and the 2 workers; shared by the tests."""
  started = []
  try:
    dispatcher = ServiceProcess(
      "dispatcher", "--port=0", "--heartbeat_timeout_s=5", f"--num_workers={corpus_lib.NUM_WORKERS}"
    )
    started.append(dispatcher)
    for _ in range(corpus_lib.NUM_WORKERS):
      started.append(
        ServiceProcess(
          "worker",
          f"--dispatcher_address={dispatcher.address}",
          "--heartbeat_interval_s=0.2",
          "--buffer_size=4",
        )
      )
    yield dispatcher.address
  finally:
    for process in started:
      process.stop()


@pytest.fixture(scope="module")
def tf_batches() -> dict:
  """tf.data's batches of every worker's shard: ids -> padded length."""
  sequences = corpus_lib.corpus()
  expected = {}
  for order in corpus_lib.shard_orders():

    def shard(order=order):
      for i in order:
        yield {"tokens": sequences[i], "id": np.int64(i)}

    dataset = tf.data.Dataset.from_generator(
      shard,
      output_signature={
        "tokens": tf.TensorSpec([None], tf.int32),
        "id": tf.TensorSpec([], tf.int64),
      },
    )
    dataset = dataset.bucket_by_sequence_length(
      lambda e: tf.shape(e["tokens"])[0], corpus_lib.BOUNDARIES, corpus_lib.BATCH_SIZES
    )
    for batch in dataset.as_numpy_iterator():
      expected[tuple(batch["id"].tolist())] = batch["tokens"].shape[1]
  return expected


class Consumer:
  """One consumer of a coordinated read on a thread: (round, length, ids) per batch."""

  def __init__(
    self,
    address: str,
    job_name: str,
    index: int,
    round_timeout_s: float,
    pause_after: int | None = None,
    pause_s: float = 0.0,
    step_s: float = 0.0,
    **options,
  ):
    self.batches: list[tuple[int, int, tuple]] = []
    self.stats: dict = {}
    self.error: BaseException | None = None
    self.iterator = None
    self._dataset = corpus_lib.coordinated(address, job_name, index, round_timeout_s, **options)
    self._pause_after, self._pause_s, self._step_s = pause_after, pause_s, step_s
    self.thread = threading.Thread(target=self._run, name=f"consumer-{index}")
    self.thread.start()

  def _run(self) -> None:
    try:
      if self._pause_after == 0:  # joins the read late
        time.sleep(self._pause_s)
      with self._dataset.make_iterator() as iterator:
        self.iterator = iterator
        for batch in iterator:
          self.batches.append(
            (iterator.last_round, batch["tokens"].shape[1], tuple(batch["id"].tolist()))
          )
          if len(self.batches) == self._pause_after:
            time.sleep(self._pause_s)
          if self._step_s:
            time.sleep(self._step_s)
        self.stats = iterator.stats()
    except BaseException as e:  # pylint: disable=broad-except
      self.error = e

  def join(self) -> "Consumer":
    self.thread.join(timeout=JOIN_TIMEOUT_S)
    assert not self.thread.is_alive(), (
      f"a consumer stalled after {len(self.batches)} batches: "
      f"{self.iterator.stats() if self.iterator else 'not started'}"
    )
    if self.error is not None:
      raise self.error
    return self


def assert_rounds_share_one_padded_length(batch_lists: list[list]) -> dict:
  """Every round received by several consumers has one padded length."""
  by_round = collections.defaultdict(set)
  for batches in batch_lists:
    rounds = [r for r, _, _ in batches]
    assert rounds == sorted(set(rounds))  # increasing, none twice
    for r, length, _ in batches:
      by_round[r].add(length)
  disagreeing = {r: lengths for r, lengths in by_round.items() if len(lengths) > 1}
  assert not disagreeing
  return by_round


def assert_nothing_twice(batch_lists: list[list]) -> list[int]:
  ids = [i for batches in batch_lists for _, _, batch in batches for i in batch]
  assert len(ids) == len(set(ids)), "a sequence reached two consumers"
  return ids


def final_worker_stats(stats_list: list[dict]) -> dict:
  """Each worker's counters as of the last consumer's end (they only grow)."""
  final = {}
  for stats in stats_list:
    for address, counters in stats["workers"].items():
      current = final.setdefault(address, dict(counters))
      for key, value in counters.items():
        current[key] = max(current[key], value)
  return final


def test_three_consumers_get_one_padded_length_per_round_and_tf_datas_batches(service, tf_batches):
  consumers = [
    Consumer(service, "aligned", i, round_timeout_s=60.0) for i in range(corpus_lib.NUM_CONSUMERS)
  ]
  for consumer in consumers:
    consumer.join()
  batch_lists = [c.batches for c in consumers]
  by_round = assert_rounds_share_one_padded_length(batch_lists)
  for batches in batch_lists:  # every consumer got every round
    assert [r for r, _, _ in batches] == sorted(by_round)
  assert len(by_round) > 150
  ids = assert_nothing_twice(batch_lists)
  # Each batch is one of tf.data's, padded alike; the ones not received are
  # exactly the dropped partial windows.
  received = {batch: length for batches in batch_lists for _, length, batch in batches}
  assert {b: tf_batches.get(b) for b in received} == received
  workers = final_worker_stats([c.stats for c in consumers])
  assert len(workers) == corpus_lib.NUM_WORKERS
  dropped = sum(w["rows_dropped_at_end"] for w in workers.values())
  assert sum(len(b) for b in tf_batches if b not in received) == dropped
  assert len(ids) + dropped == corpus_lib.NUM_SEQUENCES
  assert all(w["rows_dropped_late"] == w["rows_dropped_over_limit"] == 0 for w in workers.values())
  for consumer in consumers:
    assert consumer.stats["rounds_skipped"] == 0
    assert consumer.stats["rounds_received"] == len(by_round)


@pytest.mark.parametrize("pause_after", [0, 3])
def test_a_delayed_consumer_loses_the_rounds_it_missed_and_nobody_stalls(service, pause_after):
  # Consumer 2 stops for 2.5x the round timeout before its first batch, or
  # after 3 batches. With 64 KiB rows, what the workers send a consumer soon
  # fills its client and socket buffers, so the workers see it late (and
  # the others do not run far ahead of their own steps). The others take a
  # 25 ms step per batch, so they are still reading when it comes back.
  job_name = f"delayed-{pause_after}"
  consumers = [
    Consumer(
      service,
      job_name,
      i,
      round_timeout_s=1.0,
      payload=True,
      max_outstanding_requests=1,
      pause_after=pause_after if i == 2 else None,
      pause_s=2.5,
      step_s=0.0 if i == 2 else 0.025,
    )
    for i in range(corpus_lib.NUM_CONSUMERS)
  ]
  for consumer in consumers:
    consumer.join()
  batch_lists = [c.batches for c in consumers]
  by_round = assert_rounds_share_one_padded_length(batch_lists)
  ids = assert_nothing_twice(batch_lists)
  late, on_time = consumers[2], consumers[:2]
  assert late.stats["rounds_skipped"] > 0
  for consumer in consumers:  # every round is received or counted skipped
    assert consumer.stats["rounds_received"] + consumer.stats["rounds_skipped"] == len(by_round)
  workers = final_worker_stats([c.stats for c in consumers])
  assert sum(w["batches_dropped_late"] for w in workers.values()) == sum(
    c.stats["rounds_skipped"] for c in consumers
  )
  dropped = sum(w[key] for w in workers.values() for key in DROP_COUNTERS)
  assert len(ids) + dropped == corpus_lib.NUM_SEQUENCES
  assert all(len(c.batches) > len(late.batches) for c in on_time)
  assert len(late.batches) > pause_after  # it came back and read on


def start_consumer_process(
  address: str, job_name: str, index: int, round_timeout_s: float
) -> tuple[subprocess.Popen, queue.Queue]:
  env = dict(
    os.environ,
    PYTHONPATH=os.pathsep.join([str(REPO_ROOT), str(TESTS_DIR), os.environ.get("PYTHONPATH", "")]),
    GRPC_VERBOSITY="ERROR",
    JAX_PLATFORMS="cpu",
  )
  process = subprocess.Popen(
    [
      sys.executable,
      "-m",
      "coordinated_reads",
      address,
      job_name,
      str(index),
      str(round_timeout_s),
      "payload",
    ],
    stdout=subprocess.PIPE,
    stderr=subprocess.DEVNULL,
    env=env,
    text=True,
  )
  lines: queue.Queue = queue.Queue()

  def read():
    for line in process.stdout:
      lines.put(json.loads(line))
    lines.put(None)

  threading.Thread(target=read, daemon=True).start()
  return process, lines


def test_a_killed_consumer_does_not_stop_the_others(service):
  # With 64 KiB rows the consumers' connections cannot run far ahead of
  # their steps, so the kill comes mid-read at the workers too.
  process, lines = start_consumer_process(service, "killed", 2, round_timeout_s=2.0)
  try:
    first = lines.get(timeout=JOIN_TIMEOUT_S)  # it reads before the others start
    assert first is not None, "the consumer process ended before its first batch"
    survivors = [
      Consumer(
        service,
        "killed",
        i,
        round_timeout_s=2.0,
        payload=True,
        max_outstanding_requests=1,
        step_s=0.005,
      )
      for i in range(2)
    ]
    deadline = time.monotonic() + JOIN_TIMEOUT_S
    while len(survivors[0].batches) < 20 and time.monotonic() < deadline:
      time.sleep(0.01)
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=30)
    for consumer in survivors:
      consumer.join()
  finally:
    if process.poll() is None:
      process.kill()
    process.wait(timeout=30)
  killed = [first]
  while (line := lines.get(timeout=10)) is not None:
    killed.append(line)
  killed_batches = [(b["round"], b["length"], tuple(b["ids"])) for b in killed]
  batch_lists = [c.batches for c in survivors] + [killed_batches]
  by_round = assert_rounds_share_one_padded_length(batch_lists)
  assert_nothing_twice(batch_lists)
  assert [r for r, _, _ in survivors[0].batches] == [r for r, _, _ in survivors[1].batches]
  assert max(r for r, _, _ in survivors[0].batches) > max(r for r, _, _ in killed_batches)
  assert len(by_round) > 150
  workers = final_worker_stats([c.stats for c in survivors])
  assert sum(w["batches_dropped_late"] for w in workers.values()) > 0


def test_consumers_that_disagree_on_num_consumers_get_a_value_error(service):
  first = corpus_lib.pipeline().distribute(
    service, "data", job_name="disagree", num_consumers=3, consumer_index=0
  )
  second = corpus_lib.pipeline().distribute(
    service, "data", job_name="disagree", num_consumers=2, consumer_index=1
  )
  with first.make_iterator() as reading:
    next(reading)
    with second.make_iterator() as refused:
      with pytest.raises(ValueError, match="num_consumers 3.*num_consumers 2"):
        next(refused)


def test_a_second_consumer_with_a_taken_consumer_index_is_refused(service):
  first = corpus_lib.coordinated(service, "same-index", 0, round_timeout_s=30.0)
  second = corpus_lib.coordinated(service, "same-index", 0, round_timeout_s=30.0)
  with first.make_iterator() as reading:
    next(reading)
    with second.make_iterator() as refused:
      with pytest.raises(ValueError, match="consumer_index 0 of job 'same-index' is already"):
        next(refused)
  # Released with the first iterator: the index is free again.
  with corpus_lib.coordinated(
    service, "same-index", 0, round_timeout_s=30.0
  ).make_iterator() as again:
    next(again)


def test_consumers_that_disagree_on_round_timeout_get_a_value_error(service):
  first = corpus_lib.coordinated(service, "timeouts", 0, round_timeout_s=30.0)
  second = corpus_lib.coordinated(service, "timeouts", 1, round_timeout_s=5.0)
  with first.make_iterator() as reading:
    next(reading)
    with second.make_iterator() as refused:
      with pytest.raises(ValueError, match="round_timeout_s 30.0.*5.0"):
        next(refused)


@pytest.mark.parametrize(
  "fields, message",
  [
    ({"num_consumers": 3, "consumer_index": 0}, "needs a job_name"),
    ({"num_consumers": 3, "consumer_index": 3, "job_name": "j"}, r"\[0, num_consumers=3\)"),
    ({"num_consumers": 3, "consumer_index": -1, "job_name": "j"}, r"\[0, num_consumers=3\)"),
    ({"consumer_index": 1, "job_name": "j"}, "round-robin reads only"),
    ({"num_consumers": 2, "round_timeout_s": -1.0, "job_name": "j"}, "round_timeout_s"),
  ],
)
def test_dispatcher_answers_invalid_argument_to_bad_round_robin_requests(service, fields, message):
  from jaxfeed.service.client import distribute as client  # pylint: disable=g-import-not-at-top

  dataset_id = client.register_dataset(service, corpus_lib.pipeline())
  with grpc.insecure_channel(service) as channel:
    call = channel.unary_unary(
      "/jaxfeed.service.Dispatcher/GetOrCreateJob",
      request_serializer=lambda m: m.SerializeToString(),
      response_deserializer=pb.GetOrCreateJobResponse.FromString,
    )
    with pytest.raises(grpc.RpcError) as info:
      call(
        pb.GetOrCreateJobRequest(dataset_id=dataset_id, sharding_policy="DATA", **fields),
        timeout=10,
      )
  assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
  assert re.search(message, info.value.details())


@pytest.mark.parametrize(
  "options, message",
  [
    ({"num_consumers": 3, "consumer_index": 0}, "needs a job_name"),
    ({"num_consumers": 3, "consumer_index": 3, "job_name": "j"}, r"\[0, num_consumers=3\)"),
    ({"num_consumers": 3, "job_name": "j"}, "consumer_index"),
    ({"job_name": "j", "round_timeout_s": 5.0}, "round-robin reads only"),
    (
      {"num_consumers": 3, "consumer_index": 0, "job_name": "j", "round_timeout_s": 0},
      "round_timeout_s must be",
    ),
    (
      {"num_consumers": 3, "consumer_index": 0, "job_name": "j", "round_timeout_s": "5"},
      "round_timeout_s must be",
    ),
  ],
)
def test_bad_round_robin_options_are_refused_before_anything_starts(options, message):
  with pytest.raises(ValueError, match=message):
    corpus_lib.pipeline().distribute("127.0.0.1:1", "data", **options)
