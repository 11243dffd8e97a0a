"""Round assembly and round closing of coordinated round-robin reads."""

from __future__ import annotations

import collections
import threading

import numpy as np
import pytest

from jaxfeed.service.protocol import wire
from jaxfeed.service.worker import round_assembly
from jaxfeed.service.worker import task_runner

pytestmark = pytest.mark.timeout(60)


def batch(rows: int, length: int, first_id: int = 0) -> dict:
  return {
    "tokens": np.zeros((rows, length), np.int32),
    "id": np.arange(first_id, first_id + rows, dtype=np.int64),
  }


class FakeClock:
  def __init__(self):
    self.now = 0.0

  def __call__(self) -> float:
    return self.now


# -- bucket keys -------------------------------------------------------------------
def test_bucket_key_ignores_the_batch_dimension_only():
  assert round_assembly.bucket_key(batch(4, 12)) == round_assembly.bucket_key(batch(2, 12))
  assert round_assembly.bucket_key(batch(4, 12)) != round_assembly.bucket_key(batch(4, 13))
  assert round_assembly.bucket_key(batch(4, 12)) == ((), (12,))
  assert round_assembly.bucket_key((np.zeros((3, 5, 2)), np.int32(1))) == ((5, 2), ())


@pytest.mark.parametrize("value, rows", [(batch(7, 3), 7), (np.zeros((0, 4)), 0), (np.int64(5), 0)])
def test_batch_rows_is_the_first_dimension_of_the_first_leaf(value, rows):
  assert round_assembly.batch_rows(value) == rows


# -- assembler -------------------------------------------------------------------------
@pytest.mark.parametrize("num_consumers", [1, 2, 3, 5])
@pytest.mark.parametrize("seed", range(3))
def test_every_round_is_one_key_and_every_batch_is_served_or_counted_dropped(num_consumers, seed):
  rng = np.random.default_rng(seed)
  assembler = round_assembly.RoundAssembler(num_consumers, max_window_batches=1000)
  keys = rng.integers(0, 6, 300)
  rounds = []
  for i, key in enumerate(keys):
    completed = assembler.add(("frame", i), (int(key),), rows=1)
    if completed is not None:
      rounds.append(completed)
  assembler.finish()
  served = [frame[1] for r in rounds for frame, _ in r]
  for r in rounds:
    assert len(r) == num_consumers
    assert len({int(keys[frame[1]]) for frame, _ in r}) == 1
  assert len(served) == len(set(served))
  assert len(served) + assembler.stats["batches_dropped_at_end"] == len(keys)
  assert assembler.stats["rows_dropped_at_end"] == assembler.stats["batches_dropped_at_end"]
  assert assembler.stats["windows_dropped_at_end"] <= 6
  # A window becomes a round the moment its K-th batch arrives.
  fill_points = []
  counts = collections.Counter()
  for i, key in enumerate(keys):
    counts[int(key)] += 1
    if counts[int(key)] % num_consumers == 0:
      fill_points.append(i)
  assert [r[-1][0][1] for r in rounds] == fill_points


def test_partial_windows_at_the_end_are_dropped_with_their_rows_counted():
  assembler = round_assembly.RoundAssembler(3, max_window_batches=100)
  for key, rows in [("a", 4), ("b", 2), ("a", 4), ("b", 1), ("b", 3), ("c", 5)]:
    assembler.add(object(), key, rows)
  assert assembler.pending_batches == 3  # b's window became a round
  assembler.finish()
  assert assembler.pending_batches == 0
  assert assembler.stats["windows_dropped_at_end"] == 2
  assert assembler.stats["batches_dropped_at_end"] == 3
  assert assembler.stats["rows_dropped_at_end"] == 13


def test_over_the_limit_the_oldest_partial_window_is_dropped():
  assembler = round_assembly.RoundAssembler(3, max_window_batches=4)
  for key in ["a", "b", "a", "b"]:
    assert assembler.add(key, key, 2) is None
  assert assembler.add("c", "c", 7) is None  # 5 waiting: window a goes
  assert assembler.stats["windows_dropped_over_limit"] == 1
  assert assembler.stats["batches_dropped_over_limit"] == 2
  assert assembler.stats["rows_dropped_over_limit"] == 4
  assert assembler.pending_batches == 3
  assert assembler.stats["peak_window_batches"] == 4  # never above the limit
  completed = assembler.add("b", "b", 2)  # b still fills
  assert [frame for frame, _ in completed] == ["b", "b", "b"]
  assert assembler.add("a", "a", 2) is None  # a starts over
  assert assembler.pending_batches == 2


def test_a_limit_below_one_window_is_refused():
  with pytest.raises(ValueError, match="max_window_batches=1.*>= 2"):
    round_assembly.RoundAssembler(3, max_window_batches=1)


# -- round buffer -------------------------------------------------------------------------
def make_buffer(num_consumers=3, capacity=4, timeout=10.0):
  clock = FakeClock()
  return round_assembly.RoundBuffer(num_consumers, capacity, timeout, clock), clock


def put_round(rounds, tag, num_consumers=3, rows=2):
  return rounds.put([((tag, c), rows) for c in range(num_consumers)])


def test_consumer_i_gets_batch_i_and_a_round_closes_once_all_took_theirs():
  rounds, _ = make_buffer()
  put_round(rounds, "r0")
  assert rounds.take(0, 0) == (("r0", 0), 0)
  assert rounds.take(2, 0) == (("r0", 2), 0)
  assert rounds.open_rounds == 1
  assert rounds.take(1, 0) == (("r0", 1), 0)
  assert rounds.open_rounds == 0
  assert rounds.take(1, 1) is None  # not assembled yet
  assert rounds.stats["rounds_closed_incomplete"] == 0


def test_full_buffer_holds_capacity_rounds():
  rounds, _ = make_buffer(capacity=2)
  put_round(rounds, "a")
  assert not rounds.full
  put_round(rounds, "b")
  assert rounds.full


def test_round_times_out_only_after_its_first_take():
  rounds, clock = make_buffer(timeout=5.0)
  put_round(rounds, "r0")
  clock.now = 100.0
  assert not rounds.close_expired()  # nobody took anything: no clock runs
  rounds.take(0, 0)
  clock.now = 104.9
  assert not rounds.close_expired()
  clock.now = 105.0
  assert rounds.close_expired()
  assert rounds.open_rounds == 0
  assert rounds.stats == {
    "rounds": 1,
    "rounds_closed_incomplete": 1,
    "batches_dropped_late": 2,
    "rows_dropped_late": 4,
  }


def test_late_consumer_continues_at_the_oldest_open_round():
  rounds, clock = make_buffer(timeout=5.0)
  for r in range(3):
    put_round(rounds, f"r{r}")
  for r in range(3):
    rounds.take(0, r)
    rounds.take(1, r)
  clock.now = 5.0
  rounds.close_expired()
  # Consumer 2 missed rounds 0-2 and is now absent: a new round closes as
  # soon as consumers 0 and 1 took it.
  put_round(rounds, "r3")
  rounds.take(0, 3)
  rounds.take(1, 3)
  assert rounds.open_rounds == 0
  put_round(rounds, "r4")
  rounds.take(0, 4)
  # Consumer 2 comes back asking for round 0 and is handed round 4, the
  # oldest open one; it counts again, so round 4 waits for consumer 1.
  assert rounds.take(2, 0) == (("r4", 2), 4)
  assert rounds.open_rounds == 1
  put_round(rounds, "r5")
  assert rounds.take(2, 5) == (("r5", 2), 5)
  rounds.take(1, 4)
  assert rounds.open_rounds == 1  # round 5 waits for 0 and 1 again
  assert rounds.stats["batches_dropped_late"] == 4  # rounds 0-3 of consumer 2
  assert rounds.stats["rows_dropped_late"] == 8


def test_consumer_asking_for_a_closed_round_waits_for_the_next_one_when_none_is_open():
  rounds, clock = make_buffer(num_consumers=2, timeout=1.0)
  put_round(rounds, "r0", num_consumers=2)
  rounds.take(0, 0)
  clock.now = 2.0
  rounds.close_expired()
  assert rounds.take(1, 0) is None
  assert rounds.exhausted(0)
  put_round(rounds, "r1", num_consumers=2)
  assert not rounds.exhausted(0)
  assert rounds.take(1, 0) == (("r1", 1), 1)


# -- task runner ------------------------------------------------------------------------
def run_consumers(runner, num_consumers, delays=None):
  """Each consumer reads its whole stream; returns [(round, batch)] each."""
  results = [None] * num_consumers
  ends = [None] * num_consumers

  def consume(i):
    got = []
    frames = runner.frames(lambda: True, i, 0)
    while True:
      try:
        frame, r = next(frames)
      except StopIteration as end:
        ends[i] = end.value
        break
      got.append((r, wire.decode(frame.tobytes())))
      if delays and delays.get(i) and len(got) == delays[i][0]:
        import time  # pylint: disable=g-import-not-at-top

        time.sleep(delays[i][1])
    results[i] = got

  threads = [threading.Thread(target=consume, args=(i,)) for i in range(num_consumers)]
  for t in threads:
    t.start()
  for t in threads:
    t.join(timeout=30)
  assert not any(t.is_alive() for t in threads)
  return results, ends


def shuffled_batches(num_batches=60, seed=0):
  rng = np.random.default_rng(seed)
  lengths = rng.choice([8, 16, 24], num_batches)
  return [batch(int(rng.integers(1, 5)), int(n), first_id=100 * i) for i, n in enumerate(lengths)]


def test_task_runner_serves_bucket_aligned_rounds_to_every_consumer():
  batches = shuffled_batches()
  runner = task_runner.TaskRunner(
    1, lambda: iter(batches), buffer_size=2, num_consumers=3, round_timeout_s=30
  )
  try:
    results, ends = run_consumers(runner, 3)
  finally:
    runner.stop()
  by_round = collections.defaultdict(dict)
  for i, got in enumerate(results):
    assert [r for r, _ in got] == list(range(len(results[0])))
    for r, b in got:
      by_round[r][i] = b["tokens"].shape[1]
  assert all(len(set(lengths.values())) == 1 for lengths in by_round.values())
  ids = np.concatenate([b["id"] for got in results for _, b in got]).tolist()
  assert len(ids) == len(set(ids))
  stats = ends[0]
  assert stats == ends[1] == ends[2]
  assert len(ids) + stats["rows_dropped_at_end"] == sum(len(b["id"]) for b in batches)
  assert stats["rounds"] == len(results[0])


def test_task_runner_drops_a_late_consumers_batches_and_the_others_finish():
  batches = shuffled_batches(90, seed=1)
  runner = task_runner.TaskRunner(
    2, lambda: iter(batches), buffer_size=2, num_consumers=3, round_timeout_s=0.5
  )
  try:
    results, ends = run_consumers(runner, 3, delays={2: (2, 2.0)})
  finally:
    runner.stop()
  late = [r for r, _ in results[2]]
  assert late[:2] == [0, 1]
  assert [r for r, _ in results[0]] == [r for r, _ in results[1]]
  assert set(late) < {r for r, _ in results[0]}  # it skipped rounds
  final = max(ends, key=lambda s: s["batches_dropped_late"])
  assert final["batches_dropped_late"] >= 1
  received = sum(len(b["id"]) for got in results for _, b in got)
  assert received + final["rows_dropped_at_end"] + final["rows_dropped_late"] == sum(
    len(b["id"]) for b in batches
  )


def test_task_runner_refuses_a_consumer_index_outside_the_job():
  runner = task_runner.TaskRunner(3, lambda: iter([]), buffer_size=2, num_consumers=2)
  try:
    with pytest.raises(task_runner.TaskFailed, match="consumer_index 2") as info:
      next(runner.frames(lambda: True, 2, 0))
    assert info.value.status == "INVALID_ARGUMENT"
  finally:
    runner.stop()


def test_task_runner_with_a_window_limit_too_small_fails_its_consumers():
  runner = task_runner.TaskRunner(
    4, lambda: iter([batch(1, 2)]), buffer_size=2, num_consumers=4, max_window_batches=2
  )
  try:
    with pytest.raises(task_runner.TaskFailed, match="max_window_batches=2") as info:
      next(runner.frames(lambda: True, 0, 0))
    assert info.value.status == "FAILED_PRECONDITION"
  finally:
    runner.stop()
