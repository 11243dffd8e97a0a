"""Two real JAX processes (jax.distributed on CPU) read a BucketPlan together."""

from __future__ import annotations

import collections
import json
import os
import pathlib
import socket
import subprocess
import sys

import numpy as np
import pytest

import multihost_worker as worker

NUM_PROCESSES = 2
TIMEOUT_S = 180


def _free_port() -> int:
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@pytest.fixture(scope="module")
def host_logs(tmp_path_factory):
  out = tmp_path_factory.mktemp("multihost")
  env = dict(os.environ)
  env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
  env["JAX_PLATFORMS"] = "cpu"
  env["PYTHONPATH"] = os.pathsep.join(
    [str(pathlib.Path(__file__).resolve().parents[2])]
    + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
  )
  port = str(_free_port())
  script = str(pathlib.Path(worker.__file__).resolve())
  processes = [
    subprocess.Popen(
      [sys.executable, script, str(i), str(NUM_PROCESSES), port, str(out)],
      env=env,
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
    )
    for i in range(NUM_PROCESSES)
  ]
  outputs = []
  try:
    for process in processes:
      outputs.append(process.communicate(timeout=TIMEOUT_S)[0].decode())
  except subprocess.TimeoutExpired:
    for process in processes:
      process.kill()
      process.wait()
    pytest.fail(f"multi-host workers hung for more than {TIMEOUT_S} s")
  finally:
    for process in processes:
      if process.poll() is None:
        process.kill()
        process.wait()
  for i, (process, output) in enumerate(zip(processes, outputs)):
    assert process.returncode == 0, f"host {i} failed:\n{output[-4000:]}"
  logs = []
  for i in range(NUM_PROCESSES):
    with open(out / f"host_{i}.jsonl") as f:
      logs.append([json.loads(line) for line in f])
  return logs


def _by_step(log, phase):
  return {line["step"]: line for line in log if line["phase"] == phase}


def _bucket(length):
  return int(np.searchsorted(worker.BOUNDARIES, length, side="right"))


def test_every_host_reads_the_same_bucket_and_padded_length_each_step(host_logs):
  steps = [_by_step(log, "first") for log in host_logs]
  assert len(steps[0]) > 2 * worker.RESUME_AT
  assert all(s.keys() == steps[0].keys() for s in steps)
  lengths = worker.lengths_index()
  per_host = worker.GLOBAL_BATCH // NUM_PROCESSES
  for step in steps[0]:
    lines = [s[step] for s in steps]
    # Buckets from the records' real lengths, not from the plan.
    buckets = {_bucket(n) for line in lines for n in line["row_lengths"]}
    assert len(buckets) == 1, f"step {step}: buckets {buckets}"
    assert len({line["padded_length"] for line in lines}) == 1
    padded = lines[0]["padded_length"]
    assert padded == max(n for line in lines for n in line["row_lengths"])
    assert all(line["global_shape"] == [worker.GLOBAL_BATCH, padded] for line in lines)
    assert all(len(line["ids"]) == per_host for line in lines)
    for line in lines:
      np.testing.assert_array_equal(lengths[line["ids"]], line["row_lengths"])


def test_global_arrays_hold_every_hosts_rows(host_logs):
  steps = [_by_step(log, "first") for log in host_logs]
  for step in steps[0]:
    lines = [s[step] for s in steps]
    all_ids = [i for line in lines for i in line["ids"]]
    assert {line["global_id_sum"] for line in lines} == {sum(all_ids)}
    if "global_token_count" in lines[0]:
      real = sum(n for line in lines for n in line["row_lengths"])
      assert {line["global_token_count"] for line in lines} == {real}


def test_hosts_read_disjoint_records_and_each_once_per_epoch(host_logs):
  steps = [_by_step(log, "first") for log in host_logs]
  steps_per_epoch = len(steps[0]) // worker.NUM_EPOCHS
  for epoch in range(worker.NUM_EPOCHS):
    epoch_steps = range(epoch * steps_per_epoch, (epoch + 1) * steps_per_epoch)
    per_host = [[i for step in epoch_steps for i in s[step]["ids"]] for s in steps]
    assert not set(per_host[0]) & set(per_host[1])
    counts = collections.Counter(per_host[0] + per_host[1])
    assert max(counts.values()) == 1
    assert len(counts) > 0.8 * worker.NUM_RECORDS


def test_resuming_from_a_saved_step_continues_identically(host_logs):
  for log in host_logs:
    first, resumed = _by_step(log, "first"), _by_step(log, "resumed")
    assert min(resumed) == worker.RESUME_AT
    assert sorted(resumed) == [s for s in sorted(first) if s >= worker.RESUME_AT]
    for step, line in resumed.items():
      for key in ("ids", "row_lengths", "padded_length", "global_shape", "global_id_sum"):
        assert line[key] == first[step][key], (step, key)
