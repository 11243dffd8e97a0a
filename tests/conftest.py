"""Shared test setup.

* 8 CPU devices, set before anything imports jax.
* Benchmarks that tests run record their rows in a temporary directory,
  never over the recorded runs in benchmarks/results/.
* A leak check around every test module: jaxfeed's threads (all named
  "jaxfeed-...") and child processes started by the module must be gone once
  its tests and fixtures are done (after a garbage collection).
"""

import gc
import os
import threading
import time

import psutil
import pytest

_DEVICE_FLAG = "--xla_force_host_platform_device_count=8"
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _DEVICE_FLAG).strip()

from jaxfeed import _lifetime  # pylint: disable=wrong-import-position  # after XLA_FLAGS


@pytest.fixture(autouse=True, scope="session")
def benchmark_results_elsewhere(tmp_path_factory):
  """Points `benchmarks.record` (and the benchmark processes tests start) at
  a temporary directory."""
  os.environ["JAXFEED_BENCHMARK_RESULTS"] = str(tmp_path_factory.mktemp("benchmark_results"))
  yield
  os.environ.pop("JAXFEED_BENCHMARK_RESULTS", None)


def _jaxfeed_threads() -> set:
  # jaxfeed._lifetime's spawner lives as long as the process: the children it
  # started would get their parent-death signal when it ended.
  return {
    t
    for t in threading.enumerate()
    if t.name.startswith("jaxfeed") and t.name != _lifetime.SPAWNER_THREAD_NAME
  }


def _children() -> set:
  procs = set()
  for child in psutil.Process().children(recursive=True):
    try:
      if child.status() == psutil.STATUS_ZOMBIE:
        continue
      # multiprocessing's resource tracker and fork server (process_batch
      # forks its workers from it) live as long as the interpreter.
      if any("resource_tracker" in part or "forkserver" in part for part in child.cmdline()):
        continue
      procs.add((child.pid, child.create_time()))
    except psutil.NoSuchProcess:
      pass
  return procs


@pytest.fixture(autouse=True, scope="module")
def no_leaked_threads_or_processes(request):
  threads_before, children_before = _jaxfeed_threads(), _children()
  yield
  deadline = time.monotonic() + 10
  while True:
    gc.collect()
    threads = _jaxfeed_threads() - threads_before
    children = _children() - children_before
    if not threads and not children:
      return
    if time.monotonic() > deadline:
      break
    time.sleep(0.05)
  pytest.fail(
    f"{request.module.__name__} leaked threads {sorted(t.name for t in threads)} "
    f"and child processes {sorted(children)}",
    pytrace=False,
  )
