"""Runs one script as N JAX processes on loopback and collects their output."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time


def free_port() -> int:
  with socket.socket() as sock:
    sock.bind(("127.0.0.1", 0))
    return sock.getsockname()[1]


def run_processes(script: str, num_processes: int, args: list[str],
                  timeout_s: float) -> tuple[bool, list[tuple[int, str, str]]]:
  """Starts `script PROCESS_ID NUM_PROCESSES PORT *args` per process.

  Returns whether they ran past `timeout_s` (all are killed then, so a hang
  fails the caller's test instead of blocking it), and (returncode, stdout,
  stderr) per process.
  """
  port = free_port()
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  procs = [
      subprocess.Popen(
          [sys.executable, script, str(i), str(num_processes), str(port),
           *args],
          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
      for i in range(num_processes)
  ]
  deadline = time.monotonic() + timeout_s
  outputs = {}
  timed_out = False
  try:
    for i, proc in enumerate(procs):
      try:
        outputs[i] = proc.communicate(
            timeout=max(0.0, deadline - time.monotonic()))
      except subprocess.TimeoutExpired:
        timed_out = True
        break
  finally:
    for i, proc in enumerate(procs):
      if proc.poll() is None:
        proc.kill()
      if i not in outputs:
        outputs[i] = proc.communicate()
  return timed_out, [(proc.returncode, *outputs[i])
                     for i, proc in enumerate(procs)]
