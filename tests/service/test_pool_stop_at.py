"""The pools stop the very worker the per_job policy drains: local ones by
its process, Ray ones by its address (against a stand-in for Ray: no
cluster needed)."""

from __future__ import annotations

import importlib
import sys
import types

import psutil
import pytest

from jaxfeed.service.pools import local_backend


class _Ref:
  def __init__(self, value):
    self.value = value


class _Actor:
  """An actor whose worker registered as `address`."""

  def __init__(self, address: str, stopped: list):
    self.running = True
    self.info = types.SimpleNamespace(
      remote=lambda: _Ref({"address": address, "running": self.running})
    )
    self.stop = types.SimpleNamespace(remote=lambda: _Ref(self._stop(stopped, address)))

  def _stop(self, stopped: list, address: str) -> None:
    self.running = False
    stopped.append(address)


def _fake_ray(stopped: list, killed: list) -> types.ModuleType:
  ray = types.ModuleType("ray")
  addresses = iter(f"10.0.0.{i}:5000" for i in range(1, 100))

  class _ActorClass:
    def remote(self, *args):
      del args
      return _Actor(next(addresses), stopped)

  ray.remote = lambda cls: types.SimpleNamespace(options=lambda **kwargs: _ActorClass())
  ray.is_initialized = lambda: True  # the pool does not start or end Ray
  ray.wait = lambda refs, num_returns, timeout: (list(refs), [])
  ray.get = lambda ref: ref.value
  ray.kill = killed.append
  ray.exceptions = types.SimpleNamespace(RayError=RuntimeError)
  return ray


@pytest.fixture
def ray_pool(monkeypatch):
  stopped, killed = [], []
  monkeypatch.setitem(sys.modules, "ray", _fake_ray(stopped, killed))
  monkeypatch.delitem(sys.modules, "jaxfeed.service.pools.ray_backend", raising=False)
  pools = importlib.import_module("jaxfeed.service.pools")
  real = pools.__dict__.get("ray_backend")
  ray_backend = importlib.import_module("jaxfeed.service.pools.ray_backend")
  try:
    yield ray_backend.RayWorkerBackend("127.0.0.1:1"), stopped, killed
  finally:
    # The package keeps its real module: importing the stand-in-bound one
    # set it as an attribute, which later tests would import instead.
    sys.modules.pop("jaxfeed.service.pools.ray_backend", None)
    if real is None:
      pools.__dict__.pop("ray_backend", None)
    else:
      pools.ray_backend = real


def test_the_worker_asked_for_is_stopped_and_no_other(ray_pool):
  pool, stopped, killed = ray_pool
  for _ in range(3):
    pool.start_worker()
  assert pool.stop_worker_at("10.0.0.2:5000")
  assert stopped == ["10.0.0.2:5000"] and len(killed) == 1 and pool.num_workers == 2
  assert not pool.stop_worker_at("10.0.0.2:5000")  # gone already
  assert not pool.stop_worker_at("10.0.0.9:5000")  # never the pool's
  assert stopped == ["10.0.0.2:5000"] and pool.num_workers == 2


def test_a_local_pool_stops_the_process_asked_for():
  pool = local_backend.LocalWorkerBackend("127.0.0.1:1", ["--heartbeat_interval_s=0.2"])
  try:
    pool.start_worker()
    pool.start_worker()
    first, second = pool.pids()
    assert pool.stop_worker_at("ignored:1", first)
    assert pool.pids() == [second] and pool.exit_status(first) is not None
    assert psutil.Process(second).is_running()
    assert not pool.stop_worker_at("ignored:1", first)  # not the pool's any more
    assert pool.pids() == [second]
  finally:
    pool.close()
