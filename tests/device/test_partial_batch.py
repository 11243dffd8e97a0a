"""Two JAX processes (jax.distributed on CPU, gloo) whose inputs have unequal
batch counts and a last partial batch (no `drop_remainder`), under each
`Loader(partial_batch=...)`, with a collective in every step: the epoch ends
on both at the same step, `"pad"` delivers every real row once with the
mask right, `"drop"` drops only the incomplete steps, `"error"` names the
step and the shapes.

All scenarios run in one pair of processes (`end_of_input_worker.py`).
"""

import collections
import pathlib

import pytest

import end_of_input_worker as worker
from jax_processes import scenario_reports

WORKER = str(pathlib.Path(worker.__file__).resolve())
NUM_PROCESSES = 2
SCENARIOS = ["partial_default", "partial_drop", "partial_pad", "partial_error", "partial_pad_stop"]
TIMEOUT_S = 150


@pytest.fixture(scope="module")
def reports():
  """{scenario: [report of process 0, report of process 1]}."""
  return scenario_reports(WORKER, NUM_PROCESSES, SCENARIOS, TIMEOUT_S)


def local_batches(process):
  """This process's batches of 4 of its kept records (the last partial)."""
  kept = worker.kept(process).tolist()
  return [kept[i : i + worker.BATCH] for i in range(0, len(kept), worker.BATCH)]


BATCHES = [local_batches(p) for p in range(NUM_PROCESSES)]  # 5 and 4 batches


def same_on_both(reports, name):
  first, second = reports[name]
  assert {k: v for k, v in first.items() if k not in ("seconds",)} == {
    k: v for k, v in second.items() if k not in ("seconds",)
  }
  return first


@pytest.mark.parametrize("name", ["partial_default", "partial_drop"])
def test_drop_delivers_the_complete_steps_and_ends_the_epoch_together(reports, name):
  report = same_on_both(reports, name)
  assert "error" not in report
  # Steps 0-2 are complete; at step 3 process 1 has 2 rows (dropped) and at
  # step 4 none (the end).
  assert [step["x"] for step in report["steps"]] == [
    BATCHES[0][s] + BATCHES[1][s] for s in range(3)
  ]
  assert all(set(step) == {"x"} for step in report["steps"])  # no mask leaf
  assert report["batches"] == 3 and report["end_of_epoch"]


def test_pad_delivers_every_real_row_once_with_the_mask_right(reports):
  report = same_on_both(reports, "partial_pad")
  assert "error" not in report
  steps = report["steps"]
  assert len(steps) == 5  # to the end of the longer input
  rows = collections.Counter()
  for s, step in enumerate(steps):
    expected = []
    for p in range(NUM_PROCESSES):
      local = BATCHES[p][s] if s < len(BATCHES[p]) else []
      expected += [(x, True) for x in local]
      expected += [(0, False)] * (worker.BATCH - len(local))
    assert list(zip(step["x"], step["mask"])) == expected, s
    rows.update(x for x, real in zip(step["x"], step["mask"]) if real)
  everything = collections.Counter(worker.kept(0).tolist() + worker.kept(1).tolist())
  assert rows == everything
  assert report["batches"] == 5 and report["end_of_epoch"]


def test_pad_stopping_at_the_shortest_input_pads_the_partial_step(reports):
  report = same_on_both(reports, "partial_pad_stop")
  steps = report["steps"]
  assert len(steps) == 4
  assert steps[3]["x"] == BATCHES[0][3] + BATCHES[1][3] + [0, 0]
  assert steps[3]["mask"] == [True] * 6 + [False] * 2
  assert all(all(step["mask"]) for step in steps[:3])


def test_error_names_the_step_and_each_process_shape(reports):
  report = same_on_both(reports, "partial_error")
  assert len(report["steps"]) == 3
  message = report["error"]
  assert "partial_batch='error'" in message
  assert "at step 3 is partial" in message
  assert "(4,) int64 on process 0, (2,) int64 on process 1" in message
  assert "a complete batch has 4 rows" in message
