"""Per-op statistics (`iterator.stats()`): rows in pipeline order, fused ops
named by their parts, sampled self and wait time, counts, and the report."""

from __future__ import annotations

import gc
import multiprocessing
import pathlib
import re
import threading
import time

import numpy as np
import pytest

import jaxfeed
from jaxfeed import Dataset
from jaxfeed.ops import op_report
from jaxfeed.ops import op_stats
from process_udfs import plus_ten

# The defaults, read before the fixture below changes them.
DEFAULT_SAMPLE_INTERVAL_S = op_stats.SAMPLE_INTERVAL_S
DEFAULT_LINGER_S = op_stats.LINGER_S

ROW_KEYS = {"op", "elements", "self_seconds", "wait_seconds", "buffer_fill", "parallelism"}


def sleepy(x):
  time.sleep(0.003)
  return x


def is_even(x):
  return x % 2 == 0


@pytest.fixture(autouse=True)
def frequent_samples(monkeypatch):
  """Many samples in these short runs, whatever the machine's load."""
  monkeypatch.setattr(op_stats, "SAMPLE_INTERVAL_S", 0.005)
  monkeypatch.setattr(op_stats, "MAX_CPU_SHARE", 1.0)


def ops(iterator) -> list[str]:
  return [row["op"] for row in iterator.stats()["ops"]]


def sampler_threads() -> list[threading.Thread]:
  return [t for t in threading.enumerate() if t.name == op_stats.THREAD_NAME]


def sampler_running() -> bool:
  return bool(sampler_threads())


def test_rows_have_every_field_in_pipeline_order():
  ds = Dataset.range(100).map(np.negative).shuffle(10, seed=1).batch(4).prefetch(2)
  with ds.make_iterator() as it:
    batches = list(it)
    rows = it.stats()["ops"]
  assert [r["op"] for r in rows] == ["range", "map", "shuffle", "batch", "prefetch"]
  assert all(set(r) >= ROW_KEYS for r in rows)
  by_op = {r["op"]: r for r in rows}
  assert by_op["range"]["elements"] == 100
  assert by_op["map"]["elements"] == 100  # one output per input: its input's count
  assert by_op["batch"]["elements"] == by_op["prefetch"]["elements"] == len(batches) == 25
  assert by_op["shuffle"]["elements"] == 100
  assert by_op["map"]["buffer_fill"] is None and by_op["map"]["parallelism"] == 1


@pytest.mark.parametrize(
  "build, names",
  [
    (lambda: Dataset.range(10).map(np.negative).map(np.negative), ["range", "map+map"]),
    (lambda: Dataset.range(10).map(np.negative).filter(is_even), ["range", "map+filter"]),
    (lambda: Dataset.range(10).filter(is_even).filter(is_even), ["range", "filter+filter"]),
    (
      lambda: Dataset.range(10).map(np.negative).map(np.negative).filter(is_even).filter(is_even),
      ["range", "map+map+filter+filter"],
    ),
    # Vectorization swaps map and batch: two ops, nothing fused.
    (lambda: Dataset.range(10).map(np.negative, batched=True).batch(2), ["range", "batch", "map"]),
    # Nothing rewritten: every op as written.
    (
      lambda: (
        Dataset.range(10)
        .map(np.negative)
        .map(np.negative)
        .with_options(jaxfeed.Options(optimize=False))
      ),
      ["range", "map", "map"],
    ),
  ],
)
def test_fused_ops_are_named_by_their_parts(build, names):
  with build().make_iterator() as it:
    list(it)
    assert ops(it) == names


@pytest.mark.parametrize(
  "build, op",
  [
    (lambda: Dataset.range(25).filter(is_even), "filter"),
    (lambda: Dataset.range(25).filter(is_even).filter(is_even), "filter+filter"),
    (lambda: Dataset.range(25).map(np.negative).filter(is_even), "map+filter"),
    (
      lambda: Dataset.range(25).map(np.negative, num_parallel_calls=2).filter(is_even),
      "map+filter",
    ),
  ],
)
def test_filters_count_the_elements_they_keep(build, op):
  with build().make_iterator() as it:
    assert next(it) == 0
    assert it.stats()["ops"][-1]["elements"] == 1
    rest = list(it)
    rows = it.stats()["ops"]
  assert rows[-1]["op"] == op and rows[-1]["elements"] == 1 + len(rest) == 13
  assert rows[0]["elements"] == 25


def test_shuffle_counts_its_elements_across_windows_and_a_restore():
  ds = Dataset.range(23).shuffle(5, seed=2)  # 4 full windows and one of 3
  with ds.make_iterator() as it:
    for _ in range(7):
      next(it)
    assert it.stats()["ops"][-1]["elements"] == 7
    state = it.get_state()
    assert len(list(it)) == 16
    assert it.stats()["ops"][-1]["elements"] == 23
  with ds.make_iterator() as it:
    it.set_state(state)  # counts from the saved position, as range does
    assert it.stats()["ops"][-1]["elements"] == 7
    assert len(list(it)) == 16
    rows = it.stats()["ops"]
  assert [(r["op"], r["elements"]) for r in rows] == [("range", 23), ("shuffle", 23)]


def test_a_process_batch_chain_names_its_input_ops_and_batch():
  ds = Dataset.range(40).map(plus_ten, backend="process").batch(8)
  with ds.make_iterator() as it:
    assert len(list(it)) == 5
    rows = it.stats()["ops"]
  assert rows[-1]["op"] == "range+map+batch"
  assert rows[-1]["backend"] == "process" and rows[-1]["parallelism"] >= 1
  assert rows[-1]["elements"] == 5
  assert (
    "range+map+batch runs in worker processes (2); as asked: backend='process'."
  ) in op_report.report(rows)
  ds.close()


def test_the_report_says_what_autotune_picked_the_rates_and_why():
  row = {
    "op": "from_source+random_map+batch",
    "self_seconds": 1.0,
    "backend": "process",
    "picked": "process",
    "measuring": False,
    "num_workers": 2,
    "rates": {"process": 41000.0, "inline": 30000.0},
    "reason": "processes 41,000/s > inline 30,000/s",
  }
  assert op_report.backend_lines([row]) == [
    "from_source+random_map+batch runs in worker processes (2); AUTOTUNE "
    "picked processes: processes 41,000/s > inline 30,000/s."
  ]
  measuring = dict(row, backend="inline", picked=None, measuring=True, reason="measuring")
  assert op_report.backend_lines([measuring]) == [
    "from_source+random_map+batch runs in the consumer's thread; AUTOTUNE "
    "is measuring the backends: measuring."
  ]
  assert op_report.backend_lines([{"op": "map", "self_seconds": 1.0}]) == []


def test_a_slow_op_gets_the_self_time_not_its_input_or_consumer():
  ds = (
    Dataset.range(200)
    .map(np.negative)
    .map(sleepy)
    .batch(5)
    .with_options(jaxfeed.Options(map_fusion=False))
  )
  with ds.make_iterator() as it:
    start = time.perf_counter()
    list(it)
    elapsed = time.perf_counter() - start
    rows = it.stats()["ops"]
  assert [r["op"] for r in rows] == ["range", "map", "map", "batch"]
  slow = rows[2]
  # 200 x 3 ms of sleeping: most of the run, and charged to the slow map only.
  assert 0.5 * 0.6 <= slow["self_seconds"] <= elapsed * 1.2
  assert sum(r["self_seconds"] for r in rows) - slow["self_seconds"] < 0.5 * slow["self_seconds"]
  assert op_report.bottleneck(rows) is slow
  assert rows[3]["elements"] == 40


def test_parallel_work_counts_as_self_time_and_waiting_as_wait_time():
  ds = Dataset.range(300).map(sleepy, num_parallel_calls=3).prefetch(1)
  with ds.make_iterator() as it:
    list(it)
    rows = {r["op"]: r for r in it.stats()["ops"]}
  # The workers slept 300 x 3 ms in total; the consumer waited on prefetch.
  assert rows["map"]["self_seconds"] >= 0.8 * 0.9
  assert rows["map"]["parallelism"] == 3 and rows["map"]["elements"] == 300
  assert 0.0 <= rows["map"]["buffer_fill"] <= 1.0
  assert 0.0 <= rows["prefetch"]["buffer_fill"] <= 1.0
  assert rows["prefetch"]["wait_seconds"] > 0.1
  assert rows["prefetch"]["self_seconds"] < rows["prefetch"]["wait_seconds"]
  # 3 threads busy 0.9 s cost 0.3 s of wall time: still the bottleneck.
  assert op_report.bottleneck(list(rows.values()))["op"] == "map"


def test_op_fields_of_their_own_are_in_their_row():
  ds = Dataset.range(10).map(lambda x: 1 // int(x % 3)).ignore_errors()
  with ds.make_iterator() as it:
    list(it)
    assert it.stats()["ops"][-1]["errors_ignored"] == 4


def test_stats_off_samples_nothing_but_still_counts():
  ds = Dataset.range(100).map(sleepy).with_options(jaxfeed.Options(stats=False))
  before = op_stats.tracked_count()
  with ds.make_iterator() as it:
    assert op_stats.tracked_count() == before
    list(it)
    rows = it.stats()["ops"]
  assert rows[0]["elements"] == rows[1]["elements"] == 100
  assert all(r["self_seconds"] == 0.0 for r in rows)


def test_the_sampling_thread_stops_when_pipelines_close_or_are_dropped(monkeypatch):
  monkeypatch.setattr(op_stats, "LINGER_S", 0.1)
  closed = Dataset.range(10).map(sleepy).make_iterator()
  dropped = Dataset.range(10).map(sleepy).make_iterator()
  next(closed), next(dropped)
  assert sampler_running()
  closed.close()
  del dropped
  gc.collect()
  deadline = time.monotonic() + 10
  while sampler_running():
    assert time.monotonic() < deadline
    time.sleep(0.02)
  assert op_stats.tracked_count() == 0


def test_one_thread_samples_pipeline_after_pipeline_and_ends_when_idle(monkeypatch):
  # An iterator per epoch must not start and join a thread per epoch: on a
  # busy machine that cost more than a short epoch (W2) takes.
  monkeypatch.setattr(op_stats, "LINGER_S", 60.0)
  threads = []
  for _ in range(3):
    with Dataset.range(10).map(sleepy).make_iterator() as it:
      next(it)
      threads.extend(sampler_threads())
  assert len(threads) == 3 and len(set(threads)) == 1
  assert threads[0].is_alive() and op_stats.tracked_count() == 0
  monkeypatch.setattr(op_stats, "LINGER_S", 0.0)  # idle from now on: it ends
  threads[0].join(timeout=10)
  assert not threads[0].is_alive() and not op_stats.sampler_running()


def test_report_names_the_op_with_most_time_per_unit_of_parallelism():
  rows = [
    {"op": "range", "self_seconds": 0.1, "parallelism": 1},
    {"op": "map", "self_seconds": 4.0, "parallelism": 8},
    {"op": "filter", "self_seconds": 1.0, "parallelism": 1},
  ]
  assert op_report.bottleneck(rows)["op"] == "filter"
  text = op_report.report(rows, {"batches": 10, "input_bound_fraction": 0.5})
  assert text.splitlines()[0].split() == [
    "op",
    "elements",
    "self",
    "s",
    "wait",
    "s",
    "fill",
    "par",
    "self",
    "%",
  ]
  assert "Input bound: the training loop waited 50%" in text
  assert "Op to fix: 'filter' (20% of the pipeline's self time, parallelism 1)" in text


def test_the_manual_states_the_default_sampling_rate_and_linger():
  docs = pathlib.Path(__file__).parents[2] / "docs"
  tuning = (docs / "guides" / "performance.md").read_text()
  rate = re.search(r"looks at the Python stacks (\d+) times a second", tuning)
  assert rate is not None
  assert int(rate.group(1)) == round(1 / DEFAULT_SAMPLE_INTERVAL_S)
  benchmarks = (docs / "benchmarks.md").read_text()
  assert "one thread per process outlives the last\n  pipeline by a second" in benchmarks
  assert DEFAULT_LINGER_S == 1.0


def looks_while_running(seconds: float) -> int:
  with Dataset.range(10**6).map(sleepy).make_iterator() as it:
    next(it)
    before, start = op_stats.samples_taken(), time.monotonic()
    while time.monotonic() - start < seconds:
      next(it)
    return op_stats.samples_taken() - before


def test_the_thread_looks_less_often_when_looks_cost_more(monkeypatch):
  assert looks_while_running(2.5) >= 5  # every 5 ms, at any cost
  monkeypatch.setattr(op_stats, "MAX_CPU_SHARE", 1e-9)  # any look is too dear
  looks_while_running(1.5)  # the next wait is MAX_INTERVAL_S
  assert op_stats.MAX_INTERVAL_S == 1.0
  assert looks_while_running(2.5) <= 4


def _child_samples(connection) -> None:
  with Dataset.range(1000).map(sleepy).make_iterator() as it:
    for _ in range(200):
      next(it)
    connection.send((op_stats.sampler_running(), it.stats()["ops"][-1]["self_seconds"]))


def test_a_forked_child_samples_its_own_pipelines():
  with Dataset.range(100).map(sleepy).make_iterator() as it:
    next(it)
    assert sampler_running()  # in the parent, while it forks
    context = multiprocessing.get_context("fork")
    parent_end, child_end = context.Pipe()
    child = context.Process(target=_child_samples, args=(child_end,))
    child.start()
    try:
      assert parent_end.poll(60)
      running, self_seconds = parent_end.recv()
    finally:
      child.join(timeout=60)
  assert child.exitcode == 0
  assert running and self_seconds > 0.0


def test_an_autotuned_op_is_not_advised_to_use_autotune():
  # A lambda: the map stays on threads (a function processes could not take).
  ds = Dataset.range(10**6).map(lambda x: sleepy(x), num_parallel_calls=jaxfeed.AUTOTUNE)
  with ds.make_iterator() as it:
    deadline = time.monotonic() + 30
    while it.stats()["ops"][1]["self_seconds"] < 0.05:
      assert time.monotonic() < deadline, it.stats()
      next(it)
    rows = it.stats()["ops"]
  assert rows[1]["autotune"] is True and "autotune" not in rows[0]
  text = op_report.report(rows)
  assert "Op to fix: 'map'" in text and "it already uses AUTOTUNE (parallelism" in text
  assert "num_parallel_calls=jaxfeed.AUTOTUNE" not in text
  fixed = [{"op": "range", "self_seconds": 0.1}, {"op": "map", "self_seconds": 2.0}]
  assert "num_parallel_calls=jaxfeed.AUTOTUNE" in op_report.report(fixed)


def test_an_ended_fused_op_on_processes_reports_its_worker_count():
  # After the epoch the workers went back to the dataset: the row and the
  # advice still say how many ran it.
  ds = Dataset.range(512).map(plus_ten, num_parallel_calls=2, backend="process").batch(64)
  with ds.make_iterator() as it:
    assert sum(len(b) for b in it) == 512
    rows = it.stats()["ops"]
  fused = [row for row in rows if row.get("backend") == "process"]
  assert fused and fused[0]["parallelism"] == 2, rows
  assert "it runs on 2 worker processes already" in op_report.report(rows)


def test_a_fused_op_that_runs_its_parts_is_one_group_in_the_table():
  # A map..batch chain that AUTOTUNE may move to processes, running on
  # threads: its parts' iterators come before it, in pipeline order.
  rows = [
    {"op": "range", "elements": 640, "self_seconds": 0.0, "parallelism": 1},
    {"op": "map+filter", "elements": 640, "self_seconds": 1.5, "parallelism": 2, "autotune": True},
    {"op": "batch", "elements": 20, "self_seconds": 0.1, "parallelism": 1},
    {
      "op": "range+map+filter+batch",
      "elements": None,
      "self_seconds": 0.2,
      "parallelism": 1,
      "backend": "thread",
      "reason": "threads were faster",
    },
    {"op": "prefetch", "elements": 20, "self_seconds": 0.0, "parallelism": 1},
  ]
  table = op_report.format_table(rows).splitlines()
  names = [re.split(r"\s{2,}", line.strip())[0] for line in table[1:]]
  assert names == ["range+map+filter+batch [thread]", "range", "map+filter", "batch", "prefetch"]
  indents = [len(line) - len(line.lstrip()) for line in table[1:]]
  assert indents == [0, 2, 2, 2, 0]
  assert "Op to fix: 'map+filter' (" in op_report.report(rows)
  on_processes = [
    {
      "op": "range+map+batch",
      "elements": None,
      "self_seconds": 3.0,
      "parallelism": 2,
      "backend": "process",
    }
  ]
  text = op_report.report(on_processes)
  assert "range+map+batch [process]" in text and "runs on 2 worker processes" in text


def test_a_report_with_only_a_service_reads_wait_names_the_read():
  rows = [
    {"op": "range", "self_seconds": 0.0, "worker": "w:1", "task": 1},
    {
      "op": "distribute",
      "elements": 40,
      "self_seconds": 0.0,
      "wait_seconds": 0.0,
      "read_wait_seconds": 2.5,
      "service_workers": 2,
      "received": 44,
      "reconnects": 1,
    },
  ]
  text = op_report.report(rows, {"batches": 40, "input_bound_fraction": 0.9})
  assert "No op has measured time yet" not in text
  assert (
    "it is spent in the service read ('distribute'), whose pipeline runs on the "
    "workers. This process waited 2.500 s for 40 elements from 2 worker(s) "
    "(44 received, 1 reconnections)"
  ) in text
  assert "No op has measured time yet." in op_report.report([{"op": "range"}])
