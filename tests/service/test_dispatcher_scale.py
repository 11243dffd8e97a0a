"""The dispatcher at scale: heartbeat pacing, task lists sent once per change,
splits that grow with a job, and the load simulator (benchmarks.dispatcher_scale)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time

import grpc
import numpy as np
import psutil
import pytest

import jaxfeed
from jaxfeed import service
from jaxfeed.service.dispatcher import heartbeat_pacing
from jaxfeed.service.dispatcher import server as dispatcher_lib
from jaxfeed.service.protocol import spec
from jaxfeed.service.protocol.protos import service_pb2 as pb
from service_cluster import REPO_ROOT

RESULT_FIELDS = (
  "workers",
  "clients",
  "parties",
  "seconds",
  "rpcs_per_s",
  "rpcs",
  "latency_ms",
  "handler_ms",
  "failed_rpcs",
  "failed_by_kind",
  "dispatcher_cpu_share",
  "dispatcher_rss_mb",
  "journal_bytes_per_s",
  "simulator_cpu_share",
  "restart_replay_s",
  "dispatcher_gc",
  "simulator_loop_lag_ms",
  "simulator_burst_lag_ms",
  "joins_dispatcher_cpu_s",
  "release_all_s",
  "goodbyes",
  "release_job_client_calls",
)
RPC_KINDS = (
  "WorkerHeartbeat",
  "GetSplits",
  "GetOrCreateJob",
  "ClientHeartbeat",
  "ReleaseJobClient",
)


def _dataset_def(num_positions: int = 1 << 40) -> pb.DatasetDef:
  dataset = jaxfeed.Dataset.from_source(jaxfeed.ArraySource({"x": np.arange(4)}))
  result = spec.to_dataset_def(dataset.node)
  result.num_positions = num_positions
  return result


def _state(**pacing) -> dispatcher_lib.DispatcherState:
  return dispatcher_lib.DispatcherState(
    dispatcher_lib.DispatcherConfig(
      split_size=10, heartbeat_pacing=heartbeat_pacing.HeartbeatPacing(**pacing)
    )
  )


def _register_workers(state, count: int, first: int = 0) -> pb.WorkerHeartbeatResponse:
  response = None
  for i in range(first, first + count):
    response = state.worker_heartbeat(pb.WorkerHeartbeatRequest(worker_address=f"w{i}:1"))
  return response


@pytest.mark.parametrize(
  "parties, expected",
  [
    (10, 0.0),  # few: the parties keep their own interval
    (100, 1.0),  # 100 / 100 calls a second
    (10_000, 5.0),  # capped at the most allowed
  ],
)
def test_heartbeat_interval_keeps_the_rate_within_budget(parties, expected):
  assert heartbeat_pacing.heartbeat_interval(parties, 100.0, 0.5, 5.0) == expected


def test_heartbeat_pacing_rejects_bad_values():
  with pytest.raises(ValueError, match="worker_heartbeats_per_s must be > 0"):
    heartbeat_pacing.HeartbeatPacing(worker_heartbeats_per_s=0)
  with pytest.raises(ValueError, match=r"client_timeout_fraction must be in \(0, 1\]"):
    heartbeat_pacing.HeartbeatPacing(client_timeout_fraction=2)
  with pytest.raises(ValueError, match="heartbeat_pacing must be a HeartbeatPacing"):
    dispatcher_lib.DispatcherConfig(heartbeat_pacing=3)


def test_workers_are_told_a_longer_interval_as_they_grow():
  state = _state(worker_heartbeats_per_s=10.0)
  assert _register_workers(state, 4).heartbeat_interval_s == 0.0
  # 40 workers at 10 heartbeats a second: every 4 s; at most timeout / 3.
  assert _register_workers(state, 36, first=4).heartbeat_interval_s == pytest.approx(10 / 3)
  state.close()


def test_clients_are_told_a_longer_interval_as_they_grow_and_while_others_join():
  state = _state(client_heartbeats_per_s=100.0)
  _register_workers(state, 2)
  dataset_id = state.register_dataset(_dataset_def())
  joined = [
    state.get_or_create_job(
      pb.GetOrCreateJobRequest(dataset_id=dataset_id, sharding_policy="DYNAMIC", job_name="shared")
    )
    for _ in range(30)
  ]
  job_id, client_id = joined[0]
  # 30 joins within moments (counted over at least 0.1 s: 300 a second) leave
  # the heartbeats a quarter of the 100 a second: every 30 / 25 s.
  during = state.client_heartbeat(job_id, client_id).heartbeat_interval_s
  assert during == pytest.approx(1.2)
  time.sleep(heartbeat_pacing.JoinRate().window_s + 0.05)
  # The joins are past: the whole budget, every 30 / 100 s.
  assert state.client_heartbeat(job_id, client_id).heartbeat_interval_s == pytest.approx(0.3)
  state.close()


@pytest.mark.parametrize(
  "clients, joins_per_s, expected",
  [
    (100, 0.0, 1 / 3),  # no joins: 100 / 300 a second
    (100, 200.0, 1.0),  # joins take 200 of the 300: 100 / 100
    (150, 270.0, 2.0),  # a quarter stays with the heartbeats: 150 / 75
    (2048, 205.0, 6.0),  # a pod joining: capped at a tenth of the timeout
    (5, 200.0, 0.0),  # few: the clients keep their own interval
  ],
)
def test_joins_take_their_share_of_the_client_budget(clients, joins_per_s, expected):
  pacing = heartbeat_pacing.HeartbeatPacing(client_heartbeats_per_s=300.0)
  assert pacing.client_interval(clients, 60.0, joins_per_s) == pytest.approx(expected)


def test_join_rate_is_taken_over_the_recent_joins_span():
  rate = heartbeat_pacing.JoinRate(window_s=1.0, shortest_s=0.1)
  assert rate.per_s(5.0) == 0.0
  for i in range(50):  # 50 joins in 0.49 s, from t = 10
    rate.note(10.0 + i * 0.01)
  assert rate.per_s(10.5) == pytest.approx(50 / 0.5)  # right from the burst's start
  assert rate.per_s(11.2) == pytest.approx(30 / 1.0)  # the last 30 are within 1 s
  assert rate.per_s(11.6) == 0.0  # all older than the window
  rate.note(20.0)
  assert rate.per_s(20.0) == pytest.approx(1 / 0.1)  # at least 0.1 s of span


def test_client_gets_the_task_list_only_when_it_changed():
  state = _state()
  _register_workers(state, 3)
  dataset_id = state.register_dataset(_dataset_def())
  job_id, client_id = state.get_or_create_job(
    pb.GetOrCreateJobRequest(dataset_id=dataset_id, sharding_policy="DYNAMIC")
  )
  heartbeat = lambda version: state.client_heartbeat(
    job_id, client_id, report=pb.ClientHeartbeatRequest(known_tasks_version=version)
  )
  first = heartbeat(0)
  assert len(first.tasks) == 3 and first.tasks_version and not first.tasks_unchanged
  assert all(t.read_ticket == "" for t in first.tasks)
  again = heartbeat(first.tasks_version)
  assert again.tasks_unchanged and not again.tasks
  assert again.tasks_version == first.tasks_version
  _register_workers(state, 1, first=3)  # a new worker: a new task
  grown = heartbeat(first.tasks_version)
  assert not grown.tasks_unchanged and len(grown.tasks) == 4
  assert grown.tasks_version != first.tasks_version
  state.worker_heartbeat(pb.WorkerHeartbeatRequest(worker_address="w0:1", leaving=True))
  shrunk = heartbeat(grown.tasks_version)
  assert sorted(t.worker_address for t in shrunk.tasks) == ["w1:1", "w2:1", "w3:1"]
  # An unrelated change elsewhere keeps the version (no list is resent).
  other = state.register_dataset(_dataset_def(7))
  state.get_or_create_job(pb.GetOrCreateJobRequest(dataset_id=other, sharding_policy="DYNAMIC"))
  assert heartbeat(shrunk.tasks_version).tasks_unchanged
  state.close()


def test_task_list_reports_finished_tasks():
  state = _state()
  _register_workers(state, 1)
  dataset_id = state.register_dataset(_dataset_def(5))
  job_id, client_id = state.get_or_create_job(
    pb.GetOrCreateJobRequest(dataset_id=dataset_id, sharding_policy="OFF")
  )
  task_id = next(iter(state.jobs[job_id].tasks))
  before = state.client_heartbeat(job_id, client_id)
  assert not before.job_finished
  state.worker_heartbeat(pb.WorkerHeartbeatRequest(worker_address="w0:1", finished_tasks=[task_id]))
  after = state.client_heartbeat(
    job_id, client_id, report=pb.ClientHeartbeatRequest(known_tasks_version=before.tasks_version)
  )
  assert after.job_finished and after.tasks_version != before.tasks_version
  state.close()


def test_splits_grow_with_the_tasks_of_a_job():
  state = _state(tasks_per_split_step=4)
  _register_workers(state, 10)
  dataset_id = state.register_dataset(_dataset_def())
  job_id, _ = state.get_or_create_job(
    pb.GetOrCreateJobRequest(dataset_id=dataset_id, sharding_policy="DYNAMIC")
  )
  task_id = next(iter(state.jobs[job_id].tasks))
  response = state.get_splits(pb.GetSplitsRequest(job_id=job_id, task_id=task_id, max_ranges=2))
  # 10 tasks, 4 a step: 3 x split_size.
  assert [(r.start, r.stop) for r in response.ranges] == [(0, 30), (30, 60)]
  state.close()


def _simulate(*flags: str) -> dict:
  """The load simulator's result for 20 workers and 40 clients."""
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")])
  output = subprocess.run(
    [
      sys.executable,
      "-m",
      "benchmarks.dispatcher_scale",
      "--workers=20",
      "--clients=40",
      "--seconds=3",
      "--warmup_s=0.5",
      "--join_spread_s=0.5",
      "--processes=1",
      "--round_robin_clients=4",
      "--json",
      *flags,
    ],
    cwd=REPO_ROOT,
    env=env,
    capture_output=True,
    text=True,
    timeout=240,
    check=True,
  )
  return json.loads(output.stdout.strip().splitlines()[-1])


def test_load_simulator_reports_every_field_without_failures():
  children_before = {p.pid for p in psutil.Process().children(recursive=True)}
  result = _simulate()
  assert not set(RESULT_FIELDS) - set(result)
  assert result["failed_rpcs"] == 0, result["errors"]
  assert result["parties"] == 60
  assert set(result["latency_ms"]) == set(RPC_KINDS)
  for kind in RPC_KINDS:
    assert result["rpcs"][kind] > 0, kind
  assert result["rpcs"]["GetOrCreateJob"] == 40
  # 40 clients, below the dispatcher's goodbye_via_worker_clients: each called.
  assert result["goodbyes"]["call"] == result["release_job_client_calls"] == 40
  assert result["goodbyes"]["worker"] == 0 and result["release_all_s"] is not None
  assert result["restart_replay_s"] > 0 and result["dispatcher_rss_mb"] > 0
  assert result["journal_bytes_per_s"] > 0  # splits and acknowledgments are journaled
  assert result["dispatcher_gc"]["collections"] > 0  # a 3 s window of calls collects
  assert result["simulator_loop_lag_ms"]["max"] >= result["simulator_loop_lag_ms"]["p50"] >= 0
  assert not [p for p in psutil.Process().children(recursive=True) if p.pid not in children_before]


def test_every_goodbye_of_a_pod_sized_burst_is_answered():
  # 3,000 clients of one job say goodbye at once, as a pod's hosts do at the
  # end of a job. gRPC by default holds 1,000 calls for the Python server and
  # answers the rest of such a burst CANCELLED.
  server = dispatcher_lib.DispatchServer(dispatcher_lib.DispatcherConfig())
  try:
    dataset_id = server.state.register_dataset(_dataset_def())
    joined = [
      server.state.get_or_create_job(
        pb.GetOrCreateJobRequest(dataset_id=dataset_id, sharding_policy="DYNAMIC", job_name="pod")
      )
      for _ in range(3000)
    ]

    async def say_goodbyes() -> list[str]:
      async with grpc.aio.insecure_channel(server.target) as channel:
        release = channel.unary_unary(
          f"/{dispatcher_lib.SERVICE_NAME}/ReleaseJobClient",
          request_serializer=pb.ReleaseJobClientRequest.SerializeToString,
          response_deserializer=pb.ReleaseJobClientResponse.FromString,
        )

        async def goodbye(job_id: int, client_id: int) -> str:
          try:
            await release(
              pb.ReleaseJobClientRequest(job_id=job_id, client_id=client_id),
              timeout=60,
              wait_for_ready=True,
            )
            return "OK"
          except grpc.aio.AioRpcError as e:
            return e.code().name

        return await asyncio.gather(*(goodbye(*ids) for ids in joined))

    outcomes = asyncio.run(say_goodbyes())
    assert {o: outcomes.count(o) for o in set(outcomes)} == {"OK": 3000}
    assert not server.state.jobs[joined[0][0]].clients
  finally:
    server.stop()


def test_worker_gets_its_tasks_clients_only_when_they_changed():
  state = _state()
  _register_workers(state, 1)
  dataset_id = state.register_dataset(_dataset_def())
  join = lambda: state.get_or_create_job(
    pb.GetOrCreateJobRequest(dataset_id=dataset_id, sharding_policy="DYNAMIC", job_name="shared")
  )
  job_id, first = join()
  task_id = next(iter(state.jobs[job_id].tasks))
  heartbeat = lambda version: state.worker_heartbeat(
    pb.WorkerHeartbeatRequest(
      worker_address="w0:1", current_tasks=[task_id], known_clients_version=version
    )
  )
  listed = heartbeat(0)
  assert [(t.task_id, list(t.client_ids)) for t in listed.task_clients] == [(task_id, [first])]
  assert listed.clients_version and not listed.clients_unchanged
  again = heartbeat(listed.clients_version)
  assert again.clients_unchanged and not again.task_clients
  assert again.clients_version == listed.clients_version
  _, second = join()  # a client joins: every list again
  grown = heartbeat(listed.clients_version)
  assert not grown.clients_unchanged
  assert [list(t.client_ids) for t in grown.task_clients] == [sorted([first, second])]
  state.release_client(job_id, first)
  shrunk = heartbeat(grown.clients_version)
  assert [list(t.client_ids) for t in shrunk.task_clients] == [[second]]
  # A version of another dispatcher process never matches.
  other = _state()
  assert other.clients_version != state.clients_version
  state.close()
  other.close()


def _wait_for(condition, timeout_s: float = 30.0) -> None:
  deadline = time.monotonic() + timeout_s
  while not condition():
    assert time.monotonic() < deadline, "timed out"
    time.sleep(0.05)


_KILLED_READER = """
import sys, time
import jaxfeed
reader = jaxfeed.Dataset.range(1 << 20).batch(4).distribute(
    sys.argv[1], "distributed_epoch", job_name="shared").make_iterator()
next(reader)
print("read", flush=True)
time.sleep(600)
"""


def test_worker_drops_the_stream_of_a_client_that_died_without_goodbye():
  # The worker learns that a client is gone only from the dispatcher's
  # task_clients: a killed client sends no goodbye to anyone.
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")])
  with service.DispatchServer(service.DispatcherConfig(client_timeout_s=1.0)) as dispatcher:
    with service.WorkerServer(
      service.WorkerConfig(dispatcher_address=dispatcher.target, heartbeat_interval_s=0.05)
    ) as worker:
      streams = worker._worker.streams._streams  # pylint: disable=protected-access
      reader = (
        jaxfeed.Dataset.range(1 << 20)
        .batch(4)
        .distribute(dispatcher.target, "distributed_epoch", job_name="shared")
        .make_iterator()
      )
      next(reader)
      other = subprocess.Popen(
        [sys.executable, "-c", _KILLED_READER, dispatcher.target],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
      )
      try:
        assert other.stdout.readline().strip() == "read"
        _wait_for(lambda: len(streams) == 2)
        other.kill()
        other.wait(timeout=30)
        job = next(iter(dispatcher.state.jobs.values()))
        _wait_for(lambda: len(job.clients) == 1)  # released after client_timeout_s
        _wait_for(lambda: len(streams) == 1)
        assert {client for _, client in streams} == set(job.clients)
        # Later heartbeats are answered "unchanged": the live client's stream stays.
        _wait_for(lambda: worker._worker._listed[0] == dispatcher.state.clients_version)  # pylint: disable=protected-access
        time.sleep(0.5)
        assert {client for _, client in streams} == set(job.clients)
        next(reader)
      finally:
        other.kill()
        other.wait(timeout=30)
        other.stdout.close()
        reader.close()


def _dispatcher_call(channel, method: str, response_cls):
  return channel.unary_unary(
    f"/{dispatcher_lib.SERVICE_NAME}/{method}",
    request_serializer=lambda m: m.SerializeToString(),
    response_deserializer=response_cls.FromString,
  )


def test_join_answers_the_first_heartbeat():
  # A pod's hosts join at once and each heartbeats right after: the join
  # answers that heartbeat, one call instead of two a host.
  with dispatcher_lib.DispatchServer(dispatcher_lib.DispatcherConfig()) as server:
    _register_workers(server.state, 3)
    dataset_id = server.state.register_dataset(_dataset_def())
    with grpc.insecure_channel(server.target) as channel:
      join = _dispatcher_call(channel, "GetOrCreateJob", pb.GetOrCreateJobResponse)
      heartbeat = _dispatcher_call(channel, "ClientHeartbeat", pb.ClientHeartbeatResponse)
      request = pb.GetOrCreateJobRequest(
        dataset_id=dataset_id, sharding_policy="DYNAMIC", job_name="pod", first_heartbeat=True
      )
      joined = join(request, timeout=30)
      first = joined.heartbeat
      assert joined.HasField("heartbeat") and first.tasks_version
      assert sorted(t.worker_address for t in first.tasks) == ["w0:1", "w1:1", "w2:1"]
      assert {t.job_id for t in first.tasks} == {joined.job_id}
      assert not first.job_finished and not first.tasks_unchanged
      # The version is the one the next heartbeat compares.
      again = heartbeat(
        pb.ClientHeartbeatRequest(
          job_id=joined.job_id, client_id=joined.client_id, known_tasks_version=first.tasks_version
        ),
        timeout=30,
      )
      assert again.tasks_unchanged and again.tasks_version == first.tasks_version
      request.first_heartbeat = False  # as clients from before it ask
      plain = join(request, timeout=30)
      assert not plain.HasField("heartbeat") and plain.client_id != joined.client_id


def test_client_makes_no_heartbeat_call_right_after_its_join():
  # The dispatcher asks for a heartbeat every 5 s; the client reads from the
  # tasks its join listed, and its first heartbeat call (with its report)
  # comes 5 s later.
  pacing = heartbeat_pacing.HeartbeatPacing(client_heartbeats_per_s=0.2)
  config = service.DispatcherConfig(heartbeat_pacing=pacing, client_timeout_s=100.0)
  with service.DispatchServer(config) as dispatcher:
    with service.WorkerServer(service.WorkerConfig(dispatcher_address=dispatcher.target)):
      reader = (
        jaxfeed.Dataset.range(1 << 20)
        .batch(4)
        .distribute(dispatcher.target, "distributed_epoch")
        .make_iterator()
      )
      try:
        started = time.monotonic()
        next(reader)  # read from the tasks its join listed
        # The client's first report to the dispatcher is in its first
        # heartbeat call: one interval after the join, not right after it.
        _wait_for(lambda: dispatcher.state.sample_clients() is not None, 30.0)
        assert time.monotonic() - started > 4.0
      finally:
        reader.close()


def test_goodbyes_go_through_workers_from_the_threshold_of_live_clients_on():
  pacing = heartbeat_pacing.HeartbeatPacing(goodbye_via_worker_clients=256)
  assert not pacing.goodbye_via_worker(255) and pacing.goodbye_via_worker(256)
  no_goodbyes = heartbeat_pacing.HeartbeatPacing(goodbye_via_worker_clients=0)
  assert not no_goodbyes.goodbye_via_worker(1 << 20)
  with pytest.raises(
    ValueError,
    match=r"goodbye_via_worker_clients must be an integer >= 0 "
    r"\(0: never\), got -1",
  ):
    heartbeat_pacing.HeartbeatPacing(goodbye_via_worker_clients=-1)


def test_load_simulator_says_goodbye_through_workers_as_jaxfeed_does():
  result = _simulate("--dispatcher_flag=--goodbye_via_worker_clients=1")
  assert result["failed_rpcs"] == 0, result["errors"]
  assert result["release_job_client_calls"] == 0
  assert result["goodbyes"] == {"call": 0, "worker": 40, "timeout": 0, "refused": 0, "stale": 0}
  assert result["release_all_s"] is not None
