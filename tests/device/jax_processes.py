"""Runs one script as N JAX processes on loopback and collects their output."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest


def free_port() -> int:
  with socket.socket() as sock:
    sock.bind(("127.0.0.1", 0))
    return sock.getsockname()[1]


def run_processes(
  script: str, num_processes: int, args: list[str], timeout_s: float
) -> tuple[bool, list[tuple[int, str, str]]]:
  """Starts `script PROCESS_ID NUM_PROCESSES PORT *args` per process.

  Returns whether they ran past `timeout_s` (all are killed then, so a hang
  fails the caller's test instead of blocking it), and (returncode, stdout,
  stderr) per process.
  """
  port = free_port()
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  procs = [
    subprocess.Popen(
      [sys.executable, script, str(i), str(num_processes), str(port), *args],
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      text=True,
      env=env,
    )
    for i in range(num_processes)
  ]
  deadline = time.monotonic() + timeout_s
  outputs = {}
  timed_out = False
  try:
    for i, proc in enumerate(procs):
      try:
        outputs[i] = proc.communicate(timeout=max(0.0, deadline - time.monotonic()))
      except subprocess.TimeoutExpired:
        timed_out = True
        break
  finally:
    for i, proc in enumerate(procs):
      if proc.poll() is None:
        proc.kill()
      if i not in outputs:
        outputs[i] = proc.communicate()
  return timed_out, [(proc.returncode, *outputs[i]) for i, proc in enumerate(procs)]


def scenario_reports(
  script: str, num_processes: int, scenarios: list[str], timeout_s: float
) -> dict[str, list[dict]]:
  """Runs `scenarios` (comma-joined, one argument) in one group of processes
  whose script prints one JSON line per scenario with its "scenario" name.

  Returns {scenario: [report of process 0, ...]}; fails the calling test,
  naming the scenarios each process finished, if they hang or fail.
  """
  timed_out, results = run_processes(script, num_processes, [",".join(scenarios)], timeout_s)
  by_scenario: dict[str, list] = {}
  for i, (returncode, stdout, stderr) in enumerate(results):
    lines = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    for line in lines:
      by_scenario.setdefault(line["scenario"], [None] * num_processes)[i] = line
    if timed_out:
      done = [line["scenario"] for line in lines]
      pytest.fail(
        f"process {i} hung after scenarios {done} (killed after {timeout_s} s):\n{stderr[-3000:]}"
      )
    assert returncode == 0, f"process {i} failed:\n{stderr[-4000:]}"
  return by_scenario
