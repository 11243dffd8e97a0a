"""Fixtures of the service tests."""

from __future__ import annotations

import threading
import time

import psutil
import pytest

from jaxfeed import _lifetime
from jaxfeed.service.protocol import import_paths
from service_cluster import ServiceProcess, TEST_UDF_MODULES


@pytest.fixture(autouse=True)
def allow_test_udfs(monkeypatch):
  """In-process dispatchers and workers may import the tests' UDF modules
  (server processes get --udf_modules from ServiceProcess)."""
  monkeypatch.setattr(
    import_paths, "DEFAULT_UDF_MODULES", (*import_paths.DEFAULT_UDF_MODULES, *TEST_UDF_MODULES)
  )


@pytest.fixture
def cluster():
  """Starts processes on demand; stops all of them after the test."""
  started: list[ServiceProcess] = []
  threads_before = set(threading.enumerate())
  # Earlier tests in this interpreter may have left multiprocessing's
  # resource tracker running: only processes started here must be gone.
  children_before = {p.pid for p in psutil.Process().children(recursive=True)}

  def start(role: str, *flags: str, wait_ready: bool = True, log_path=None) -> ServiceProcess:
    process = ServiceProcess(role, *flags, wait_ready=wait_ready, log_path=log_path)
    started.append(process)
    return process

  yield start
  for process in started:
    process.stop()
  assert not [p for p in psutil.Process().children(recursive=True) if p.pid not in children_before]
  deadline = time.monotonic() + 10
  while time.monotonic() < deadline:
    leaked = [
      t
      for t in set(threading.enumerate()) - threads_before
      if t.is_alive() and t.name.startswith("jaxfeed") and t.name != _lifetime.SPAWNER_THREAD_NAME
    ]  # lives as long as the process
    if not leaked:
      break
    time.sleep(0.05)
  assert not leaked, leaked
