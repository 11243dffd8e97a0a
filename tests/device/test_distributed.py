"""Two JAX processes on CPU (jax.distributed + gloo) building global batches.

Each process runs `distributed_loader_worker.py` with its own host data and
2 CPU devices; together they form one 4-device mesh.
"""

import json
import pathlib

import pytest

from jax_processes import run_processes

WORKER = pathlib.Path(__file__).with_name("distributed_loader_worker.py")
NUM_PROCESSES = 2
LOCAL_BATCH = 4
NUM_BATCHES = 4
TIMEOUT_S = 120


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
  """Runs both processes once; returns each one's JSON report."""
  checkpoint_dir = tmp_path_factory.mktemp("distributed_ckpt")
  timed_out, results = run_processes(str(WORKER), NUM_PROCESSES, [str(checkpoint_dir)], TIMEOUT_S)
  assert not timed_out, f"the processes hung for more than {TIMEOUT_S} s"
  for i, (returncode, _, stderr) in enumerate(results):
    assert returncode == 0, f"process {i} failed:\n{stderr[-4000:]}"
  return [json.loads(stdout.strip().splitlines()[-1]) for _, stdout, _ in results]


def test_processes_form_one_global_mesh(reports):
  for report in reports:
    assert report["process_count"] == NUM_PROCESSES
    assert report["device_count"] == 2 * NUM_PROCESSES


def test_global_shape_is_local_batch_times_process_count(reports):
  for report in reports:
    assert len(report["batches"]) == NUM_BATCHES
    for batch in report["batches"]:
      assert batch["x_shape"] == [LOCAL_BATCH * NUM_PROCESSES, 3]
      assert batch["label_shape"] == [LOCAL_BATCH * NUM_PROCESSES]


def test_each_process_addressable_shards_hold_its_own_data(reports):
  for report in reports:
    assert all(batch["local_matches"] for batch in report["batches"])


def test_jitted_global_sum_covers_both_hosts_data(reports):
  sums = [[batch["global_sum"] for batch in report["batches"]] for report in reports]
  assert sums[0] == sums[1]
  for batch in reports[0]["batches"]:
    assert batch["global_sum"] == batch["expected_sum"]


def test_orbax_restore_resumes_each_process_on_its_own_shard(reports):
  for report in reports:
    assert report["restored_w"] == [0.0, 1.0, 2.0, 3.0]
    assert report["restored_batches"] == 1
    assert report["resumed_labels"] == report["expected_resumed_labels"]
  assert reports[0]["resumed_labels"] != reports[1]["resumed_labels"]


def test_processes_agree_on_the_placement_thread_even_for_a_pipeline_that_reads_ahead(reports):
  for report in reports:
    assert report["placement_thread"]
