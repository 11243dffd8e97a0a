"""Two JAX processes on CPU (jax.distributed + gloo) building global batches.

Each process runs `distributed_loader_worker.py` with its own host data and
2 CPU devices; together they form one 4-device mesh.
"""

import json
import os
import pathlib
import socket
import subprocess
import sys

import pytest

WORKER = pathlib.Path(__file__).with_name("distributed_loader_worker.py")
NUM_PROCESSES = 2
LOCAL_BATCH = 4
NUM_BATCHES = 4
TIMEOUT_S = 120


def free_port() -> int:
  with socket.socket() as sock:
    sock.bind(("127.0.0.1", 0))
    return sock.getsockname()[1]


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
  """Runs both processes once; returns each one's JSON report."""
  port = free_port()
  checkpoint_dir = tmp_path_factory.mktemp("distributed_ckpt")
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  procs = [
      subprocess.Popen(
          [sys.executable, str(WORKER), str(i), str(NUM_PROCESSES), str(port),
           str(checkpoint_dir)],
          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
      for i in range(NUM_PROCESSES)
  ]
  outputs = []
  try:
    for proc in procs:
      outputs.append(proc.communicate(timeout=TIMEOUT_S))
  finally:
    for proc in procs:  # A hang fails the test instead of blocking it.
      if proc.poll() is None:
        proc.kill()
        proc.communicate()
  for i, (proc, (stdout, stderr)) in enumerate(zip(procs, outputs)):
    assert proc.returncode == 0, f"process {i} failed:\n{stderr[-4000:]}"
  return [json.loads(stdout.strip().splitlines()[-1]) for stdout, _ in outputs]


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
