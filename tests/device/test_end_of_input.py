"""Two JAX processes (jax.distributed on CPU, gloo) whose inputs end at
different steps or have different shapes, with a collective in every step.

All scenarios run in one pair of processes (`end_of_input_worker.py`); each
prints a JSON line when it ends, so a hang is reported with its scenario.
"""

import pathlib

import pytest

import end_of_input_worker as worker
from jax_processes import scenario_reports

WORKER = str(pathlib.Path(worker.__file__).resolve())
NUM_PROCESSES = 2
SCENARIOS = [
  "filter",
  "filter_sync",
  "uneven_shards",
  "pad",
  "ragged",
  "ragged_fixed",
  "ragged_common",
  "local_mesh",
  "pad_empty_process",
  "close_while_waiting",
]
TIMEOUT_S = 150


@pytest.fixture(scope="module")
def reports():
  """{scenario: [report of process 0, report of process 1]}."""
  return scenario_reports(WORKER, NUM_PROCESSES, SCENARIOS, TIMEOUT_S)


def expected_sums(batches_per_process: int, drop_remainder: bool = True):
  """Global sum of each step's batch over both processes' filtered data."""
  kept = [worker.kept(p) for p in range(NUM_PROCESSES)]
  return [
    int(sum(k[s * worker.BATCH : (s + 1) * worker.BATCH].sum() for k in kept))
    for s in range(batches_per_process)
  ]


@pytest.mark.parametrize("name", ["filter", "filter_sync"])
def test_filter_keeping_unequal_counts_stops_every_process_at_shortest(reports, name):
  # 20 and 14 records kept: 5 and 3 full batches of 4.
  for report in reports[name]:
    assert report["steps"] == 3
    assert report["batches"] == 3
    assert report["sums"] == expected_sums(3)


def test_uneven_shards_without_drop_remainder_stop_at_the_same_step(reports):
  # 11 records over ShardByJaxProcess(): 6 and 5, i.e. 3 and 2 batches of 2.
  for report in reports["uneven_shards"]:
    assert report["steps"] == 2
    assert report["sums"] == [0 + 2 + 1 + 3, 4 + 6 + 5 + 7]


def test_pad_goes_on_to_the_longest_process_with_a_mask(reports):
  # 20 records: 5 batches; 14 records: 3 full batches, one of 2, then none.
  for report in reports["pad"]:
    assert report["steps"] == 5
    sums, valid = zip(*report["sums"])
    assert list(valid) == [8, 8, 8, 4 + 2, 4]
    assert sum(sums) == sum(int(worker.kept(p).sum()) for p in range(NUM_PROCESSES))


def test_pad_with_a_process_that_never_had_a_batch_fails_everywhere(reports):
  for report in reports["pad_empty_process"]:
    assert report["steps"] == 0
    assert "processes [1] have had no batch at all by step 0" in report["error"]


def test_differing_local_shapes_fail_on_every_process_naming_leaf_and_shapes(reports):
  for report in reports["ragged"]:
    assert report["steps"] == 0
    message = report["error"]
    assert "leaf ['x']" in message
    assert "(2, 3) int64 on process 0" in message
    assert "(2, 5) int64 on process 1" in message
    assert "padded_shapes" in message
    assert "pad_to_common_shape" in message


def test_fixed_padded_shapes_form_one_global_array(reports):
  for report in reports["ragged_fixed"]:
    assert report["shapes"] == [[4, 8]]
    assert report["sums"] == [2 * 3 + 2 * 5]


def test_pad_to_common_shape_pads_to_the_longest_process(reports):
  for report in reports["ragged_common"]:
    assert report["shapes"] == [[4, 5]]
    assert report["sums"] == [2 * 3 + 2 * 5]


def test_process_local_shardings_read_each_process_to_its_own_end(reports):
  # 20 and 14 records kept: 5 and 3 batches of 4, each on its own devices.
  assert [r["steps"] for r in reports["local_mesh"]] == [5, 3]
  for process, report in enumerate(reports["local_mesh"]):
    assert report["shapes"] == [[worker.BATCH]] * report["steps"]
    kept = worker.kept(process)
    assert report["sums"] == [int(kept[s * 4 : (s + 1) * 4].sum()) for s in range(report["steps"])]


def test_close_interrupts_a_wait_for_another_process(reports):
  # Process 1 starts its Loader 4 s after process 0 closes its own.
  assert reports["close_while_waiting"][0]["close_seconds"] < 2.0
