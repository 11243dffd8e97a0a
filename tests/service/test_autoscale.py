"""Elastic worker pools: the policy, the local backend and a resizing pool."""

from __future__ import annotations

import os
import pathlib
import signal
import stat
import time

import psutil
import pytest

import jaxfeed
import service_udfs
from jaxfeed import service
from jaxfeed.service.dispatcher import autoscale
from jaxfeed.service.pools import local_backend

pytestmark = pytest.mark.timeout(120)

TESTS_DIR = pathlib.Path(__file__).resolve().parent


def sample(rate=100.0, wait=0.0, fill=0.0, clients=1):
  return autoscale.Sample(
    elements_per_s=rate, wait_fraction=wait, buffer_fill=fill, num_clients=clients
  )


def test_policy_grows_while_workers_help_and_stops_when_one_does_not():
  policy = autoscale.ScalingPolicy(autoscale.AutoscaleConfig(min_workers=1, max_workers=5))
  assert policy.decide(1, sample(100, wait=0.5)) == 1
  assert policy.decide(2, sample(150, wait=0.5)) == 0  # settling after the change
  assert policy.decide(2, sample(190, wait=0.4)) == 1  # 190 >= 1.1 * 100: it helped
  assert policy.decide(3, sample(195, wait=0.4)) == 0  # settling
  # 200 < 1.1 * 190: the third worker did not help, so it goes again and the
  # pool stays at 2 although consumers still wait.
  assert policy.decide(3, sample(200, wait=0.4)) == -1
  assert policy.decide(2, sample(190, wait=0.4)) == 0  # settling
  assert [policy.decide(2, sample(190, wait=0.4)) for _ in range(3)] == [0, 0, 0]


def test_policy_shrinks_after_well_fed_intervals_and_respects_its_bounds():
  config = autoscale.AutoscaleConfig(min_workers=2, max_workers=4, scale_down_intervals=3)
  policy = autoscale.ScalingPolicy(config)
  fed = sample(100, wait=0.001, fill=0.95)
  assert [policy.decide(4, fed) for _ in range(3)] == [0, 0, -1]
  assert policy.decide(3, fed) == 0  # settling
  assert [policy.decide(3, fed) for _ in range(3)] == [0, 0, -1]
  assert [policy.decide(2, fed) for _ in range(5)] == [0] * 5  # at min_workers
  assert policy.decide(4, sample(10, wait=0.9)) == 0  # at max_workers
  assert policy.decide(1, None) == 1 and policy.decide(5, None) == -1
  half_fed = sample(100, wait=0.001, fill=0.5)
  assert [policy.decide(3, half_fed) for _ in range(5)] == [0] * 5
  assert policy.decide(3, sample(0, clients=0)) == 0


@pytest.mark.parametrize(
  "kwargs, message",
  [
    ({"min_workers": -1}, "min_workers"),
    ({"max_workers": 0}, "max_workers"),
    ({"min_workers": 3, "max_workers": 2}, "max_workers"),
    ({"interval_s": 0}, "interval_s"),
    ({"scale_down_intervals": 0}, "scale_down_intervals"),
    ({"worker_flags": "--buffer_size=2"}, "worker_flags"),
  ],
)
def test_bad_autoscale_config_names_the_field(kwargs, message):
  with pytest.raises(ValueError, match=message):
    autoscale.AutoscaleConfig(**kwargs)


def test_local_backend_keeps_secrets_off_the_command_line(tmp_path):
  backend = local_backend.LocalWorkerBackend(
    "127.0.0.1:1", ["--heartbeat_interval_s=0.2"], {"worker_token": "hush"}
  )
  try:
    backend.start_worker()
    backend.start_worker()
    assert backend.num_workers == 2
    cmdline = " ".join(psutil.Process(backend.pids()[0]).cmdline())
    assert "hush" not in cmdline and "--flagfile=" in cmdline
    flagfile = cmdline.split("--flagfile=")[1].split()[0]
    assert stat.S_IMODE(os.stat(flagfile).st_mode) == 0o600
    assert backend.stop_worker() and backend.num_workers == 1
  finally:
    pids = backend.pids()
    backend.close()
  assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != "zombie" for p in pids)
  assert not os.path.exists(flagfile) and backend.num_workers == 0


def test_the_pool_grows_for_a_starved_consumer_and_shrinks_for_a_slow_one(monkeypatch):
  monkeypatch.setenv(
    "PYTHONPATH",
    os.pathsep.join([str(TESTS_DIR.parents[1]), str(TESTS_DIR), os.environ.get("PYTHONPATH", "")]),
  )
  config = service.DispatcherConfig(
    heartbeat_timeout_s=2,
    udf_modules=("service_udfs",),
    autoscale=service.AutoscaleConfig(
      min_workers=1,
      max_workers=3,
      interval_s=0.6,
      scale_down_intervals=2,
      worker_flags=("--heartbeat_interval_s=0.2", "--buffer_size=4"),
    ),
  )
  dataset = jaxfeed.Dataset.range(10**6).map(service_udfs.sleepy)
  with service.DispatchServer(config) as dispatcher:
    backend = dispatcher.autoscaler.backend
    assert backend.num_workers == 1
    with dataset.distribute(dispatcher.target, max_outstanding_requests=4).make_iterator() as it:
      # Starved: 5 ms per element on one worker, and a consumer that waits for each.
      deadline = time.monotonic() + 30
      while backend.num_workers < 3 and time.monotonic() < deadline:
        next(it)
      grown = backend.num_workers
      for _ in range(200):
        next(it)
      by_worker = it.elements_by_worker
      # Well fed: the consumer now takes 20 elements/s.
      deadline = time.monotonic() + 40
      while backend.num_workers > 1 and time.monotonic() < deadline:
        next(it)
        time.sleep(0.05)
      shrunk = backend.num_workers
    changes = [change for _, change in dispatcher.autoscaler.decisions if change]
  assert grown == 3 and shrunk == 1, dispatcher.autoscaler.decisions
  assert changes[0] == 1 and changes[-1] == -1
  assert len(by_worker) >= 2  # the added workers served the job
  assert backend.num_workers == 0  # stopping the dispatcher stopped its pool


def test_a_worker_slow_to_start_is_judged_once_it_serves(monkeypatch):
  # The worker the pool adds is stopped (SIGSTOP) before it registers, for
  # many intervals, as a pod or a loaded machine may take: the pool waits
  # for it instead of finding that it did not help and removing it.
  monkeypatch.setenv(
    "PYTHONPATH",
    os.pathsep.join([str(TESTS_DIR.parents[1]), str(TESTS_DIR), os.environ.get("PYTHONPATH", "")]),
  )
  interval_s = 0.5
  config = service.DispatcherConfig(
    heartbeat_timeout_s=2,
    udf_modules=("service_udfs",),
    autoscale=service.AutoscaleConfig(
      min_workers=1,
      max_workers=2,
      interval_s=interval_s,
      worker_flags=("--heartbeat_interval_s=0.2", "--buffer_size=4"),
    ),
  )
  dataset = jaxfeed.Dataset.range(10**6).map(service_udfs.sleepy)
  with service.DispatchServer(config) as dispatcher:
    backend = dispatcher.autoscaler.backend
    first = backend.pids()
    with dataset.distribute(dispatcher.target, max_outstanding_requests=4).make_iterator() as it:
      deadline = time.monotonic() + 30
      while len(backend.pids()) < 2 and time.monotonic() < deadline:
        next(it)  # starved: the pool adds a worker
      added = [pid for pid in backend.pids() if pid not in first]
      assert added, dispatcher.autoscaler.decisions
      os.kill(added[0], signal.SIGSTOP)
      try:
        assert dispatcher.state.num_workers() == 1, "caught after it registered"
        until = time.monotonic() + 8 * interval_s
        while time.monotonic() < until:
          next(it)
      finally:
        os.kill(added[0], signal.SIGCONT)
      deadline = time.monotonic() + 30
      while dispatcher.state.num_workers() < 2 and time.monotonic() < deadline:
        next(it)
      until = time.monotonic() + 6 * interval_s  # registered: settles, then is measured
      while time.monotonic() < until:
        next(it)
      by_worker = it.elements_by_worker
      decisions = list(dispatcher.autoscaler.decisions)
      assert backend.num_workers == 2, decisions
  assert -1 not in [change for _, change in decisions], decisions
  assert len(by_worker) == 2  # the late worker served


@pytest.mark.parametrize("how", ["terminate", "kill"])
def test_a_command_line_pool_goes_with_its_dispatcher(cluster, how):
  dispatcher = cluster(
    "dispatcher",
    "--port=0",
    "--autoscale_max_workers=3",
    "--autoscale_min_workers=2",
    "--worker_flag=--buffer_size=4",
  )
  parent = psutil.Process(dispatcher.proc.pid)
  deadline = time.monotonic() + 30
  while len(parent.children()) < 2 and time.monotonic() < deadline:
    time.sleep(0.1)
  workers = parent.children()
  assert len(workers) == 2
  getattr(dispatcher.proc, how)()  # SIGTERM stops the pool; SIGKILL orphans it
  assert dispatcher.proc.wait(timeout=30) == (0 if how == "terminate" else -9)
  gone, alive = psutil.wait_procs(workers, timeout=20)
  assert not alive and len(gone) == 2  # orphans notice their parent is gone


def test_sigterm_while_the_pool_starts_stops_the_dispatcher_and_its_pool(cluster):
  # The signal comes as soon as the first worker process exists, while the
  # dispatcher is still starting its pool: it still exits cleanly (0) and
  # takes every worker it started with it.
  dispatcher = cluster(
    "dispatcher",
    "--port=0",
    "--autoscale_max_workers=3",
    "--autoscale_min_workers=2",
    "--worker_flag=--buffer_size=4",
    wait_ready=False,
  )
  parent = psutil.Process(dispatcher.proc.pid)
  deadline = time.monotonic() + 30
  while not parent.children() and time.monotonic() < deadline:
    pass  # no sleep: the signal should come as early as it can
  seen = set(parent.children())
  assert seen, "the dispatcher started no worker within 30 s"
  dispatcher.proc.terminate()
  while dispatcher.proc.poll() is None and time.monotonic() < deadline:
    try:
      seen.update(parent.children())
    except psutil.NoSuchProcess:
      break
    time.sleep(0.005)
  assert dispatcher.proc.wait(timeout=30) == 0
  gone, alive = psutil.wait_procs(list(seen), timeout=20)
  assert not alive and len(gone) == len(seen)


class _CountingBackend:
  """A pool that only counts: starting or stopping a worker changes a number."""

  def __init__(self, workers: int):
    self.num_workers = workers

  def start_worker(self) -> None:
    self.num_workers += 1

  def stop_worker(self) -> None:
    self.num_workers -= 1

  def close(self) -> None:
    pass


def test_a_long_running_autoscaler_keeps_its_latest_decisions_and_counts_all():
  config = autoscale.AutoscaleConfig(min_workers=1, max_workers=2, interval_s=0.0005)
  scaler = autoscale.Autoscaler(config, _CountingBackend(1), sample=lambda: None)
  scaler.start()
  try:
    deadline = time.monotonic() + 60
    while sum(scaler.decision_counts.values()) < 3 * autoscale._DECISIONS_KEPT:  # pylint: disable=protected-access
      assert time.monotonic() < deadline, scaler.decision_counts
      time.sleep(0.05)
  finally:
    scaler.close()
  assert len(scaler.decisions) == autoscale._DECISIONS_KEPT  # pylint: disable=protected-access
  assert sum(scaler.decision_counts.values()) >= 3 * len(scaler.decisions)
