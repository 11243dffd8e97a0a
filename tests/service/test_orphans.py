"""A trainer SIGKILLed (say, by the OOM killer) leaves no process running.

The trainer runs a dispatcher with a local worker pool in its own process
and reads through it; its read blocks on a record on which its UDF spins in
C code holding the GIL (so no thread of that worker runs, its parent watch
included). It is then SIGKILLed: every process it started, directly or
not, must be gone within seconds.
"""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

pytestmark = pytest.mark.timeout(120)

TESTS_DIR = pathlib.Path(__file__).resolve().parent

_TRAINER = textwrap.dedent("""
    import time
    import jaxfeed
    import service_udfs
    from jaxfeed import service
    config = service.DispatcherConfig(
        udf_modules=("service_udfs",), autoscale=service.AutoscaleConfig(
            min_workers=2, max_workers=2, interval_s=60,
            worker_flags=("--heartbeat_interval_s=0.2",)))
    dispatcher = service.DispatchServer(config)
    while dispatcher.state.num_workers() < 2:
      time.sleep(0.05)
    dataset = jaxfeed.Dataset.range(64).map(service_udfs.spin_at_poison)
    print("reading", flush=True)
    for element in dataset.distribute(dispatcher.target, "distributed_epoch",
                                      visitation="exactly_once", timeout_s=600):
      pass  # blocks at the record the UDF spins on
""")


def test_a_sigkilled_trainer_leaves_no_process_behind():
  env = dict(
    os.environ,
    PYTHONPATH=os.pathsep.join(
      [str(TESTS_DIR.parents[1]), str(TESTS_DIR), os.environ.get("PYTHONPATH", "")]
    ),
  )
  trainer = subprocess.Popen(
    [sys.executable, "-c", _TRAINER], stdout=subprocess.PIPE, text=True, env=env
  )
  descendants: list[psutil.Process] = []
  try:
    assert trainer.stdout.readline().strip() == "reading"
    time.sleep(1.0)  # the read reaches the record and blocks there
    descendants = psutil.Process(trainer.pid).children(recursive=True)
    assert len(descendants) >= 2, descendants  # the pool's workers
    trainer.send_signal(signal.SIGKILL)
    trainer.wait(timeout=30)
    _, alive = psutil.wait_procs(descendants, timeout=5)
    assert not alive, (
      f"{len(alive)} of the trainer's {len(descendants)} processes "
      f"outlived it by 5 s: {[p.cmdline()[:4] for p in alive]}"
    )
  finally:
    trainer.kill()
    trainer.wait()
    for process in descendants:
      try:
        process.kill()
      except psutil.NoSuchProcess:
        pass
