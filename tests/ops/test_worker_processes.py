"""Worker processes as a new user meets them, and as the OOM killer does.

* A plain script without an `if __name__ == "__main__":` guard, run from a
  file, through `python - <<EOF` and through `python -c`, with a named
  function, a lambda and a closure over a local array under
  `num_parallel_calls=AUTOTUNE`: it finishes with the right result, its body
  runs once (the workers never run it), and AUTOTUNE picks worker processes
  (the function holds the GIL, so only processes use both cores).
* A trainer SIGKILLed while its worker processes are inside a function
  that blocks: no process it started survives it.
* What travels to workers: functions and closures by value, large arrays
  through shared memory.
"""

import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import psutil
import pytest

import jaxfeed
from jaxfeed.ops import shipping, worker_processes
import op_testing

# A function that holds the GIL for 1 ms (a libc sleep called through
# `ctypes.PyDLL`, which keeps the GIL, stands for pure Python that does not
# depend on how busy the machine is): inline and threads run one call at a
# time, worker processes one each. The data set is long enough to measure
# inline, threads and processes in a few epochs.
SCRIPT = """\
import ctypes
import numpy as np
import jaxfeed

print("BODY RUNS", flush=True)


def busy(x):
  ctypes.PyDLL(None).usleep(1000)
  return x


def closure_over(values):
  def add(x):
    return busy(x) + values[x % 4]
  return add


fns = {{"named": busy, "lambda": lambda x: busy(x) * 2,
       "closure": closure_over(np.array([0, 10, 20, 30]))}}
ds = (jaxfeed.Dataset.from_source(jaxfeed.ArraySource(np.arange(2000)))
      .map(fns["{kind}"], num_parallel_calls=jaxfeed.AUTOTUNE).batch(20))
for epoch in range(20):  # until AUTOTUNE has measured (a busy machine: later)
  total = 0
  it = iter(ds)
  for batch in it:
    total += int(batch.sum())
  row = it.stats()["ops"][-1]
  if not row.get("measuring"):
    break
print("TOTAL", total)
print("PICKED", row.get("picked", row.get("backend")), "|", row["reason"])
"""

EXPECTED_TOTAL = {
  "named": sum(range(2000)),
  "lambda": 2 * sum(range(2000)),
  "closure": sum(range(2000)) + 500 * 60,
}


def _run_script(kind: str, how: str, tmp_path) -> str:
  script = SCRIPT.format(kind=kind)
  python = [sys.executable]
  if how == "file":
    path = tmp_path / "train.py"
    path.write_text(script)
    command, stdin = python + [str(path)], None
  elif how == "stdin":
    command, stdin = python + ["-"], script
  else:
    command, stdin = python + ["-c", script], None
  done = subprocess.run(
    command, input=stdin, capture_output=True, text=True, cwd=tmp_path, timeout=120
  )
  assert done.returncode == 0, done.stderr[-3000:]
  return done.stdout


@pytest.mark.parametrize("kind", ["named", "lambda", "closure"])
@pytest.mark.parametrize("how", ["file", "stdin", "-c"])
def test_a_plain_script_runs_once_and_autotune_picks_processes(tmp_path, how, kind):
  out = _run_script(kind, how, tmp_path)
  assert out.count("BODY RUNS") == 1, out
  assert f"TOTAL {EXPECTED_TOTAL[kind]}" in out, out
  picked = [line for line in out.splitlines() if line.startswith("PICKED")]
  assert picked and picked[0].startswith("PICKED process |"), out


TRAINER = """\
import os
import sys
import time
import jaxfeed

BLOCKED = sys.argv[1]


def block(x):
  open(os.path.join(BLOCKED, str(os.getpid())), "w").close()
  time.sleep(3600)
  return x


if __name__ == "__main__":  # a trainer as careful as can be
  ds = jaxfeed.Dataset.range(100).map(block, {map_args})
  {batch}
  print("READY", flush=True)
  next(iter(ds))
"""


@pytest.mark.parametrize(
  "pipeline",
  [
    # Fused with a batch: the chain's worker processes (2: one per core).
    ("backend='process'", "ds = ds.batch(4)", 2),
    ("num_parallel_calls=jaxfeed.AUTOTUNE, backend='process'", "ds = ds.batch(4)", 2),
    # Not fused: a worker process per executor thread (the first element
    # runs on one, timed by the consumer).
    ("num_parallel_calls=2, backend='process'", "", 1),
  ],
)
def test_no_worker_outlives_a_sigkilled_trainer(tmp_path, pipeline):
  map_args, batch, workers = pipeline
  path = tmp_path / "trainer.py"
  path.write_text(TRAINER.format(map_args=map_args, batch=batch))
  blocked = tmp_path / "blocked"  # a file per worker inside the function
  blocked.mkdir()
  trainer = subprocess.Popen(
    [sys.executable, str(path), str(blocked)], cwd=tmp_path, stdout=subprocess.PIPE, text=True
  )
  try:
    assert trainer.stdout.readline().strip() == "READY"
    parent = psutil.Process(trainer.pid)
    op_testing.wait_until(lambda: len(os.listdir(blocked)) >= workers, timeout_s=60)
    descendants = parent.children(recursive=True)
    assert {int(pid) for pid in os.listdir(blocked)} <= {p.pid for p in descendants}
    os.kill(trainer.pid, signal.SIGKILL)
    trainer.wait()
    deadline = time.monotonic() + 5
    while any(op_testing.process_alive(p.pid) for p in descendants):
      assert time.monotonic() < deadline, [
        p.pid for p in descendants if op_testing.process_alive(p.pid)
      ]
      time.sleep(0.05)
  finally:
    if trainer.poll() is None:
      trainer.kill()
      trainer.wait()
    trainer.stdout.close()


def test_functions_closures_and_large_arrays_travel_by_value():
  big = np.arange(1_000_000, dtype=np.int64)  # 8 MB: a memfd, not the pickle
  scale = 3
  shipment = shipping.dumps(lambda i: big[i] * scale)
  assert len(shipment.data) < 10_000 and len(shipment.fds) == 1
  fn = shipping.loads(shipment.data, [os.dup(fd) for fd in shipment.fds])
  assert fn(999_999) == 2_999_997
  array = fn.__closure__[0].cell_contents  # mapped read-only, not copied
  assert not array.flags.writeable and array.base is not None
  shipment.close()
  assert shipment.fds == []
  lock = threading.Lock()
  assert "lock" in shipping.why_not_shippable(lambda: lock)
  assert shipping.why_not_shippable(lambda: big) is None


def test_the_launcher_thread_ends_once_no_worker_lives(monkeypatch):
  monkeypatch.setattr(worker_processes, "LINGER_S", 0.2)
  dataset = jaxfeed.Dataset.range(20).map(np.square, backend="process").batch(4)
  assert [b.tolist() for b in dataset][0] == [0, 1, 4, 9]
  assert worker_processes.launcher_running()
  dataset.close()
  op_testing.wait_until(lambda: not worker_processes.launcher_running(), timeout_s=10)
  assert not any(t.name == worker_processes.LAUNCHER_THREAD for t in threading.enumerate())
