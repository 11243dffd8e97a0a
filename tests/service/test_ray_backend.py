"""Elastic pools on a Ray cluster: actors spread over nodes, a lost node."""

from __future__ import annotations

import collections
import os
import time

import psutil
import pytest

import jaxfeed
from jaxfeed import service

# Not part of ray's public options: keeps a multi-node cluster on one machine allowed.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
cluster_utils = pytest.importorskip("ray.cluster_utils")
import ray  # pylint: disable=g-import-not-at-top,wrong-import-position

from service_cluster import REPO_ROOT, TESTS_DIR, ServiceProcess  # pylint: disable=wrong-import-position

pytestmark = pytest.mark.timeout(240)


def _worker_processes(dispatcher_address: str) -> list[psutil.Process]:
  """The jaxfeed worker processes that serve this dispatcher, on any node."""
  found = []
  for process in psutil.process_iter(["cmdline"]):
    cmdline = process.info["cmdline"] or []
    if (
      "jaxfeed.service.worker" in cmdline
      and f"--dispatcher_address={dispatcher_address}" in cmdline
    ):
      found.append(process)
  return found


@pytest.fixture(scope="module")
def ray_cluster():
  """Two Ray nodes of one CPU each on loopback, shared by this module's tests."""
  # Ray's processes (and so the actors' workers) inherit this environment.
  saved = os.environ.get("PYTHONPATH")
  os.environ["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), str(TESTS_DIR), saved or ""])
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  # Children this process had before (e.g. multiprocessing's resource
  # tracker, started by an earlier test in the same test process) are not Ray's.
  before = {p.pid for p in psutil.Process().children(recursive=True)}
  cluster = cluster_utils.Cluster(
    initialize_head=True,
    connect=True,
    head_node_args={"node_ip_address": "127.0.0.1", "num_cpus": 1, "include_dashboard": False},
  )
  cluster.add_node(num_cpus=1, node_ip_address="127.0.0.1")
  cluster.wait_for_nodes()
  try:
    yield cluster
  finally:
    ray.shutdown()
    cluster.shutdown()
    alive = [
      p
      for p in psutil.Process().children(recursive=True)
      if p.pid not in before and p.status() != "zombie"
    ]
    _, alive = psutil.wait_procs(alive, timeout=30)
    assert not alive, [p.cmdline()[:2] for p in alive]
    if saved is None:
      del os.environ["PYTHONPATH"]
    else:
      os.environ["PYTHONPATH"] = saved


def _ray_pool(min_workers: int, max_workers: int, **kwargs) -> service.DispatcherConfig:
  return service.DispatcherConfig(
    heartbeat_timeout_s=3,
    autoscale=service.AutoscaleConfig(
      min_workers=min_workers,
      max_workers=max_workers,
      interval_s=0.5,
      backend="ray",
      worker_flags=("--heartbeat_interval_s=0.2",),
    ),
    **kwargs,
  )


def _wait_for_workers(dispatcher: service.DispatchServer, count: int) -> None:
  deadline = time.monotonic() + 120
  while len(dispatcher.state.workers) < count:
    assert time.monotonic() < deadline, dispatcher.state.workers
    time.sleep(0.1)


def test_a_ray_pool_spreads_over_the_nodes_and_serves_a_read(ray_cluster):
  with service.DispatchServer(_ray_pool(2, 2)) as dispatcher:
    backend = dispatcher.autoscaler.backend
    workers = backend.workers()
    assert len(workers) == 2
    assert len({w["node_id"] for w in workers}) == 2  # one per node
    _wait_for_workers(dispatcher, 2)
    dataset = jaxfeed.Dataset.range(2000)
    got = [int(x) for x in dataset.distribute(dispatcher.target, "distributed_epoch")]
    assert sorted(got) == list(range(2000))
    assert len(_worker_processes(dispatcher.target)) == 2
  assert not _worker_processes(dispatcher.target)  # stopping the dispatcher stopped its pool
  assert backend.num_workers == 0


def test_a_command_line_dispatcher_runs_its_pool_on_ray(ray_cluster):
  dispatcher = ServiceProcess(
    "dispatcher",
    "--port=0",
    "--worker_backend=ray",
    f"--ray_address={ray_cluster.address}",
    "--autoscale_min_workers=2",
    "--autoscale_max_workers=2",
    "--worker_flag=--heartbeat_interval_s=0.2",
  )
  try:
    got = sorted(
      int(x) for x in jaxfeed.Dataset.range(300).distribute(dispatcher.address, "distributed_epoch")
    )
    assert got == list(range(300))
    # The read may end before the second actor got its node's CPU (an
    # earlier test's actor may still hold it): the pool comes up in time.
    deadline = time.monotonic() + 60
    while len(_worker_processes(dispatcher.address)) < 2:
      assert time.monotonic() < deadline, _worker_processes(dispatcher.address)
      time.sleep(0.1)
    dispatcher.proc.terminate()  # SIGTERM: the pool drains and its actors go
    assert dispatcher.proc.wait(timeout=90) == 0
  finally:
    dispatcher.stop()
  assert not _worker_processes(dispatcher.address)


def test_a_node_removed_mid_epoch_loses_nothing_exactly_once(ray_cluster):
  import service_udfs  # pylint: disable=g-import-not-at-top

  n = 3000
  dataset = jaxfeed.Dataset.range(n).map(service_udfs.sleepy)
  with service.DispatchServer(
    _ray_pool(2, 2, split_size=50, udf_modules=("service_udfs",))
  ) as dispatcher:
    backend = dispatcher.autoscaler.backend
    before = backend.workers()
    assert len({w["node_id"] for w in before}) == 2
    _wait_for_workers(dispatcher, 2)
    got = []
    with dataset.distribute(
      dispatcher.target, "distributed_epoch", visitation="exactly_once"
    ).make_iterator() as iterator:
      for _ in range(300):
        got.append(int(next(iterator)))
      doomed = ray_cluster.worker_nodes.copy().pop()
      ray_cluster.remove_node(doomed)  # its raylet and every process it started die
      ray_cluster.add_node(num_cpus=1, node_ip_address="127.0.0.1")
      got.extend(int(x) for x in iterator)
    assert collections.Counter(got) == collections.Counter(range(n))
    # The pool replaced the lost worker on the new node.
    deadline = time.monotonic() + 120
    while True:
      after = backend.workers()
      nodes = {w["node_id"] for w in after}
      if len(nodes) == 2 and not nodes <= {w["node_id"] for w in before}:
        break
      assert time.monotonic() < deadline, after
      time.sleep(0.2)
    assert any(change > 0 for _, change in dispatcher.autoscaler.decisions)
  assert not _worker_processes(dispatcher.target)


@pytest.mark.parametrize(
  "kwargs, message",
  [
    ({"backend": "slurm"}, "backend must be one of local, ray, kubernetes"),
    ({"ray_address": "127.0.0.1:6379"}, "ray_address applies to backend='ray' only"),
    ({"backend": "ray", "ray_address": ""}, "ray_address"),
  ],
)
def test_bad_backend_choice_names_the_field(kwargs, message):
  with pytest.raises(ValueError, match=message):
    service.AutoscaleConfig(**kwargs)


def test_the_service_imports_no_optional_cluster_package():
  import subprocess  # pylint: disable=g-import-not-at-top
  import sys  # pylint: disable=g-import-not-at-top

  code = (
    "import sys, jaxfeed, jaxfeed.service.dispatcher.server, jaxfeed.service.worker.server, "
    "jaxfeed.service.client.distribute, jaxfeed.service.dispatcher.autoscale, "
    "jaxfeed.service.metrics; "
    "print([m for m in ('ray', 'kubernetes', 'prometheus_client') if m in sys.modules])"
  )
  out = subprocess.run(
    [sys.executable, "-c", code],
    capture_output=True,
    text=True,
    check=True,
    env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
  )
  assert out.stdout.strip() == "[]"
