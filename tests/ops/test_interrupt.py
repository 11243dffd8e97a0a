"""KeyboardInterrupt in a running pipeline leaves no processes behind (their
shared memory, memfds, goes with them)."""

import json
import os
import signal
import subprocess
import sys
import time

from op_testing import REPO_ROOT, process_alive, wait_until

HERE = os.path.dirname(os.path.abspath(__file__))


def test_sigint_during_iteration_cleans_up_workers_and_shared_memory(tmp_path):
  report = tmp_path / "report.json"
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO_ROOT, HERE]))
  proc = subprocess.Popen(
    [sys.executable, os.path.join(HERE, "interrupt_script.py"), str(report)],
    env=env,
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    text=True,
  )
  try:
    assert proc.stdout.readline().strip() == "ready", proc.stderr.read()
    info = json.loads(report.read_text())
    assert info["pids"] and all(process_alive(p) for p in info["pids"])
    time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
  finally:
    if proc.poll() is None:
      proc.kill()
      proc.wait()
  assert proc.returncode != 0 and "KeyboardInterrupt" in err, err
  assert "leaked" not in err, err
  wait_until(lambda: not any(process_alive(p) for p in info["pids"]), timeout_s=10)
