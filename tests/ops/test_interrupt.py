"""KeyboardInterrupt in a running pipeline leaves no processes or shared memory."""

import json
import os
import signal
import subprocess
import sys
import time

import psutil

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))


def alive(pid):
  try:
    return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
  except psutil.NoSuchProcess:
    return False


def test_sigint_during_iteration_cleans_up_workers_and_shared_memory(tmp_path):
  report = tmp_path / "report.json"
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, HERE]))
  proc = subprocess.Popen([sys.executable, os.path.join(HERE, "interrupt_script.py"), str(report)],
                          env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  try:
    assert proc.stdout.readline().strip() == "ready", proc.stderr.read()
    info = json.loads(report.read_text())
    assert info["pids"] and all(alive(p) for p in info["pids"])
    assert all(os.path.exists(f"/dev/shm/{n.lstrip('/')}") for n in info["shm"])
    time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
  finally:
    if proc.poll() is None:
      proc.kill()
      proc.wait()
  assert proc.returncode != 0 and "KeyboardInterrupt" in err, err
  # Our own close ran: the resource tracker had nothing left to clean up.
  assert "leaked" not in err, err
  deadline = time.time() + 10
  while any(alive(p) for p in info["pids"]) and time.time() < deadline:
    time.sleep(0.05)
  assert not any(alive(p) for p in info["pids"])
  assert not any(os.path.exists(f"/dev/shm/{n.lstrip('/')}") for n in info["shm"])
