"""Control-plane load on one dispatcher: simulated workers and clients over gRPC.

  python -m benchmarks.dispatcher_scale --workers=1024 --clients=2048 \
      --seconds=60 --json

Starts a real dispatcher process (`python -m jaxfeed.service.dispatcher` with a
`--work_dir`, journal fsync on, worker and client tokens) and `--processes`
simulator processes. Each simulator process runs its share of the workers and
clients as asyncio tasks over `grpc.aio`, one channel (TCP connection) per
party, speaking the real protocol at the intervals the dispatcher asks for:

- workers register and heartbeat (`WorkerHeartbeat`), take the tasks they are
  given and, for each DYNAMIC task, fetch split ranges (numbered `GetSplits`;
  the first ones come with the task, as jaxfeed's worker takes them) at the
  pace of a worker that produces `--elements_per_s` elements a second for
  the task (one element per sampler position);
- clients join one of `--jobs` shared, named, exactly-once DYNAMIC jobs
  (`GetOrCreateJob`, which answers their first heartbeat, as jaxfeed's
  client asks) and heartbeat (`ClientHeartbeat`), acknowledging the
  splits the workers of their process were issued for that job; with
  `--round_robin_clients=K` another K clients read one round-robin job.

Nobody serves or fetches data. After `--seconds` of steady load (timed from
when every party has joined) the simulators stop, the dispatcher is killed
(SIGKILL) and restarted on the same work_dir, and the time until it answers
again is the restart replay time. Prints one JSON line (`--json`) or a
readable summary: parties, RPCs/s, p50/p99/max latency per RPC kind (as the
callers saw it, `latency_ms`, and inside the dispatcher's handlers,
`handler_ms`: lock, work and fsync, without gRPC's queues; GetOrCreateJob
and ReleaseJobClient from the joins before and the goodbyes after the
window), failed RPCs, dispatcher CPU (share of one core) and RSS,
journal bytes written per second, the dispatcher's garbage-collection pauses
(`dispatcher_gc`), the simulators' own CPU and how late their event loops woke
a 10 ms sleep (`simulator_loop_lag_ms`: their own share of the latencies;
`simulator_burst_lag_ms`: the same while the clients join and say goodbye),
how the clients said goodbye and how long until the dispatcher had released
them all (`goodbyes`, `release_all_s`: from its metrics; from
`--goodbye_via_worker_clients` live clients on, the dispatcher's default
256, a client hands its goodbye to a simulated worker of its job in its
process, which forwards it in its next heartbeat, as jaxfeed's client and
worker do; `release_job_client_calls` counts the calls made instead),
the dispatcher's CPU seconds while the clients join (`joins_dispatcher_cpu_s`,
over `joins_s`) and the other calls made meanwhile (`joins_rpcs`,
`joins_latency_ms`), and the restart.

Latencies include the simulators' own scheduling delay: on a machine with few
cores the simulators and the dispatcher compete for them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import queue
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

from benchmarks import record
from jaxfeed import _lifetime

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
CLIENT_TOKEN = "dispatcher-scale-client-token"
WORKER_TOKEN = "dispatcher-scale-worker-token"
SERVICE = "/jaxfeed.service.Dispatcher/"
RPC_KINDS = (
  "WorkerHeartbeat",
  "GetSplits",
  "GetOrCreateJob",
  "ClientHeartbeat",
  "ReleaseJobClient",
)
START_TIMEOUT_S = 120.0
# A simulated RPC's deadline: one that takes longer counts as failed.
RPC_DEADLINE_S = 30.0
# Positions of the simulated dataset: more than any run hands out.
NUM_POSITIONS = 1 << 50


# -- the dispatcher process -------------------------------------------------------
class DispatcherProcess:
  """`python -m jaxfeed.service.dispatcher` on loopback; `kill()` ends it."""

  def __init__(
    self,
    work_dir: str,
    extra_flags: tuple[str, ...] = (),
    nice: int = 0,
    timing_file: str = "",
    metrics: bool = False,
  ):
    """timing_file: run it under benchmarks.dispatcher_scale_server, which
    writes its handlers' times there; metrics: serve its metrics
    (`metrics_url`)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")])
    env["GRPC_VERBOSITY"] = "ERROR"
    env.setdefault("JAX_PLATFORMS", "cpu")
    self.started_at = time.monotonic()
    self.proc = _lifetime.popen(
      [
        sys.executable,
        "-m",
        "benchmarks.dispatcher_scale_server" if timing_file else "jaxfeed.service.dispatcher",
        *([f"--timing_file={timing_file}"] if timing_file else []),
        "--port=0",
        f"--work_dir={work_dir}",
        f"--auth_token={CLIENT_TOKEN}",
        f"--worker_token={WORKER_TOKEN}",
        "--max_jobs_per_host=100000",
        "--heartbeat_timeout_s=10",
        *(["--metrics_port=0"] if metrics else []),
        *extra_flags,
      ],
      stdout=subprocess.PIPE,
      stderr=subprocess.DEVNULL,
      env=env,
      text=True,
      preexec_fn=(lambda: os.nice(nice)) if nice else None,
    )
    self._lines: queue.Queue = queue.Queue()
    threading.Thread(target=self._read, daemon=True).start()
    try:
      line = self._lines.get(timeout=START_TIMEOUT_S)
    except queue.Empty:
      self.kill()
      raise TimeoutError("The dispatcher did not report its address.") from None
    words = line.split()
    self.address = words[words.index("on") + 1]
    self.ready_at = time.monotonic()
    self.metrics_url = ""
    if metrics:
      line = self._lines.get(timeout=START_TIMEOUT_S)
      assert " metrics on " in line, line
      self.metrics_url = line.split()[-1]

  def _read(self) -> None:
    for line in self.proc.stdout:
      self._lines.put(line)

  def kill(self) -> None:
    if self.proc.poll() is None:
      self.proc.send_signal(signal.SIGKILL)
    self.proc.wait(timeout=30)


def _scrape(url: str) -> list:
  """The samples of the dispatcher's /metrics page."""
  import urllib.request  # pylint: disable=g-import-not-at-top
  from prometheus_client import parser  # pylint: disable=g-import-not-at-top

  with urllib.request.urlopen(url, timeout=10) as response:
    text = response.read().decode()
  return [s for family in parser.text_string_to_metric_families(text) for s in family.samples]


def _wait_released(url: str, timeout_s: float) -> float | None:
  """Seconds until the dispatcher has no live client left (its
  jaxfeed_job_clients gauge), or None after timeout_s."""
  started = time.monotonic()
  while time.monotonic() - started < timeout_s:
    if not sum(s.value for s in _scrape(url) if s.name == "jaxfeed_job_clients"):
      return time.monotonic() - started
    time.sleep(0.05)
  return None


def _goodbye_counts(url: str) -> dict[str, int]:
  """How the dispatcher's clients left (jaxfeed_dispatcher_client_goodbyes_total)."""
  return {
    s.labels["via"]: int(s.value)
    for s in _scrape(url)
    if s.name == "jaxfeed_dispatcher_client_goodbyes_total"
  }


def _channel_options() -> list[tuple[str, object]]:
  # One TCP connection per simulated party, as separate hosts would have.
  return [
    ("grpc.use_local_subchannel_pool", 1),
    ("grpc.so_reuseport", 0),
    ("grpc.max_receive_message_length", 64 << 20),
  ]


def _wait_serving(address: str, timeout_s: float) -> None:
  """Blocks until the dispatcher answers an RPC (any answer but UNAVAILABLE)."""
  import grpc  # pylint: disable=g-import-not-at-top
  from jaxfeed.service.protocol.protos import service_pb2 as pb  # pylint: disable=g-import-not-at-top

  deadline = time.monotonic() + timeout_s
  with grpc.insecure_channel(address, options=_channel_options()) as channel:
    call = channel.unary_unary(
      SERVICE + "GetDatasetDef",
      request_serializer=lambda m: m.SerializeToString(),
      response_deserializer=pb.GetDatasetDefResponse.FromString,
    )
    while True:
      try:
        call(
          pb.GetDatasetDefRequest(dataset_id="0"),
          timeout=5,
          metadata=(("x-jaxfeed-token", WORKER_TOKEN),),
          wait_for_ready=True,
        )
        return
      except grpc.RpcError as e:
        if e.code() != grpc.StatusCode.UNAVAILABLE and (
          e.code() != grpc.StatusCode.DEADLINE_EXCEEDED
        ):
          return  # it answered (NOT_FOUND for the made-up id)
        if time.monotonic() > deadline:
          raise TimeoutError(f"The dispatcher at {address} does not answer.") from e


def _register_dataset(address: str) -> str:
  import grpc  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import jaxfeed  # pylint: disable=g-import-not-at-top
  from jaxfeed.service.protocol import spec  # pylint: disable=g-import-not-at-top
  from jaxfeed.service.protocol.protos import service_pb2 as pb  # pylint: disable=g-import-not-at-top

  dataset = jaxfeed.Dataset.from_source(jaxfeed.ArraySource({"x": np.arange(4)}))
  dataset_def = spec.to_dataset_def(dataset.node)
  dataset_def.num_positions = NUM_POSITIONS
  with grpc.insecure_channel(address) as channel:
    call = channel.unary_unary(
      SERVICE + "RegisterDataset",
      request_serializer=lambda m: m.SerializeToString(),
      response_deserializer=pb.RegisterDatasetResponse.FromString,
    )
    response = call(
      pb.RegisterDatasetRequest(dataset=dataset_def),
      timeout=60,
      metadata=(("x-jaxfeed-token", CLIENT_TOKEN),),
      wait_for_ready=True,
    )
  return response.dataset_id


# -- a simulator process ------------------------------------------------------------
class _Stats:
  """Latencies (seconds) and failures per RPC kind."""

  def __init__(self):
    self.latencies: dict[str, list[float]] = {kind: [] for kind in RPC_KINDS}
    self.failed: dict[str, int] = {kind: 0 for kind in RPC_KINDS}
    self.errors: dict[str, int] = {}
    self.measuring = False
    # The other calls made while the clients join (the join storm).
    self.joining = False
    self.joins: dict[str, list[float]] = {kind: [] for kind in RPC_KINDS}
    # How late the simulator's event loop woke a task in the window: the part
    # of the callers' latencies that is the simulator's own delay.
    self.loop_lags: list[float] = []
    self.burst_lags: dict[str, list[float]] = {"joins": [], "goodbyes": []}

  def add(self, kind: str, seconds: float) -> None:
    # Joining and leaving happen outside the measured window: always kept.
    if self.measuring or kind in ("GetOrCreateJob", "ReleaseJobClient"):
      self.latencies[kind].append(seconds)
    elif self.joining:
      self.joins[kind].append(seconds)

  def fail(self, kind: str, error: str) -> None:
    self.failed[kind] += 1
    key = f"{kind}: {error}"[:200]
    self.errors[key] = self.errors.get(key, 0) + 1


class _Party:
  """One simulated host: its own channel and the dispatcher's methods on it."""

  def __init__(self, address: str, token: str, stats: _Stats, stop: asyncio.Event):
    import grpc  # pylint: disable=g-import-not-at-top
    from jaxfeed.service.protocol.protos import service_pb2 as pb  # pylint: disable=g-import-not-at-top

    self.channel = grpc.aio.insecure_channel(address, options=_channel_options())
    self.metadata = (("x-jaxfeed-token", token),)
    self.stats = stats
    self.stop = stop
    responses = {
      "WorkerHeartbeat": pb.WorkerHeartbeatResponse,
      "GetSplits": pb.GetSplitsResponse,
      "GetOrCreateJob": pb.GetOrCreateJobResponse,
      "ClientHeartbeat": pb.ClientHeartbeatResponse,
      "ReleaseJobClient": pb.ReleaseJobClientResponse,
    }
    self.calls = {
      kind: self.channel.unary_unary(
        SERVICE + kind,
        request_serializer=lambda m: m.SerializeToString(),
        response_deserializer=cls.FromString,
      )
      for kind, cls in responses.items()
    }

  async def call(self, kind: str, request):
    """The response, or None when the RPC failed (counted)."""
    import grpc  # pylint: disable=g-import-not-at-top

    start = time.perf_counter()
    try:
      response = await self.calls[kind](
        request, timeout=RPC_DEADLINE_S, metadata=self.metadata, wait_for_ready=True
      )
    except grpc.aio.AioRpcError as e:
      if (
        self.stop.is_set()
        and e.code() == grpc.StatusCode.CANCELLED
        and (kind != "ReleaseJobClient")
      ):
        return None  # the simulation ends: its calls in flight are cancelled
      self.stats.fail(kind, f"{e.code().name}: {e.details()}")
      return None
    self.stats.add(kind, time.perf_counter() - start)
    return response


async def _sleep_until(stop: asyncio.Event, seconds: float) -> None:
  try:
    await asyncio.wait_for(stop.wait(), timeout=seconds)
  except asyncio.TimeoutError:
    pass


class _Simulator:
  """The workers and clients of one simulator process."""

  def __init__(self, args: argparse.Namespace, index: int):
    self.args = args
    self.index = index
    self.stats = _Stats()
    self.stop = asyncio.Event()
    # Exactly-once jobs: split starts the workers of this process were issued
    # (job id -> starts), acknowledged by this process's clients of the job.
    self.issued: dict[int, list[int]] = {}
    self.clients_joined = 0
    self.phase = "workers"  # then joins, window, goodbyes, done
    # Goodbyes through workers, as jaxfeed's client and worker say them: the
    # simulated workers of this process by job (number -> its goodbyes not
    # yet forwarded), and whether every client of the process has left.
    self.job_workers: dict[int, set[int]] = {}
    self.goodbyes: dict[int, list] = {}
    self.clients_gone = asyncio.Event()

  async def worker(self, number: int, ready: asyncio.Event) -> None:
    from jaxfeed.service.protocol.protos import service_pb2 as pb  # pylint: disable=g-import-not-at-top

    party = _Party(self.args.address, WORKER_TOKEN, self.stats, self.stop)
    address = f"sim-worker-{number}.local:5051"
    current: set[int] = set()
    fetchers: dict[int, asyncio.Task] = {}
    interval = 0.5
    first = True
    # As jaxfeed's worker: the clients_version of the last task_clients and
    # the tasks they were listed for.
    listed_version, listed_tasks = 0, frozenset()
    incarnation = f"{random.getrandbits(64):016x}"
    goodbyes = self.goodbyes.setdefault(number, [])
    try:
      # After the window: until the clients have left and this worker
      # forwarded their goodbyes, at its own pace.
      while not (self.clients_gone.is_set() and not goodbyes):
        running = frozenset(current)
        forwarded, goodbyes[:] = list(goodbyes), []
        response = await party.call(
          "WorkerHeartbeat",
          pb.WorkerHeartbeatRequest(
            worker_address=address,
            data_address=f"sim-worker-{number}.local:5052",
            current_tasks=sorted(current),
            incarnation=incarnation,
            splits_per_request=self.args.splits_per_request,
            known_clients_version=listed_version if listed_tasks == running else 0,
            client_goodbyes=forwarded,
          ),
        )
        if response is None:
          goodbyes.extend(forwarded)  # with the next heartbeat
        else:
          if not response.clients_unchanged:
            listed_version, listed_tasks = response.clients_version, running
          if first:
            first = False
            ready.set()
          interval = response.heartbeat_interval_s or 0.5
          for task in response.new_tasks:
            current.add(task.task_id)
            self.job_workers.setdefault(task.job_id, set()).add(number)
            if task.sharding_policy == "DYNAMIC":
              fetchers[task.task_id] = asyncio.ensure_future(
                self.fetch_splits(
                  party,
                  task.job_id,
                  task.task_id,
                  task.exactly_once,
                  task.first_splits if task.HasField("first_splits") else None,
                )
              )
          for task_id in response.tasks_to_delete:
            current.discard(task_id)
            fetcher = fetchers.pop(task_id, None)
            if fetcher is not None:
              fetcher.cancel()
        if self.clients_gone.is_set() and not goodbyes:
          break
        # Not woken by the window's end: goodbyes wait for the next heartbeat.
        await asyncio.sleep(interval * random.uniform(0.9, 1.1))
      if self.args.leave:
        await party.call(
          "WorkerHeartbeat", pb.WorkerHeartbeatRequest(worker_address=address, leaving=True)
        )
    finally:
      for fetcher in fetchers.values():
        fetcher.cancel()
      await party.channel.close()

  async def fetch_splits(
    self, party: _Party, job_id: int, task_id: int, exactly_once: bool, first_splits=None
  ) -> None:
    from jaxfeed.service.protocol.protos import service_pb2 as pb  # pylint: disable=g-import-not-at-top

    per_request = self.args.splits_per_request
    # The first request comes once the (simulated) pipeline is built; as
    # jaxfeed's worker, it takes the first splits that came with the task
    # instead, and numbers its requests.
    await _sleep_until(self.stop, random.uniform(0, 2.0))
    request_seq = 1
    while not self.stop.is_set():
      if request_seq == 1 and first_splits is not None:
        response = first_splits
      else:
        response = await party.call(
          "GetSplits",
          pb.GetSplitsRequest(
            job_id=job_id, task_id=task_id, max_ranges=per_request, request_seq=request_seq
          ),
        )
      if response is not None:
        request_seq += 1
      positions = 0
      if response is not None:
        if exactly_once:
          self.issued.setdefault(job_id, []).extend(r.start for r in response.ranges)
        if response.end_of_splits:
          return
        positions = sum(r.stop - r.start for r in response.ranges)
      # Working through the splits takes this long; then the next request.
      period = max(positions / self.args.elements_per_s, 0.5)
      await _sleep_until(self.stop, period * random.uniform(0.8, 1.2))

  async def client(self, number: int) -> None:
    from jaxfeed.service.protocol.protos import service_pb2 as pb  # pylint: disable=g-import-not-at-top

    party = _Party(self.args.address, CLIENT_TOKEN, self.stats, self.stop)
    args = self.args
    try:
      await _sleep_until(self.stop, random.uniform(0, args.join_spread_s))
      if number < args.round_robin_clients:
        request = pb.GetOrCreateJobRequest(
          dataset_id=args.dataset_id,
          sharding_policy="OFF",
          job_name="scale-rr",
          num_consumers=args.round_robin_clients,
          consumer_index=number,
        )
      else:
        request = pb.GetOrCreateJobRequest(
          dataset_id=args.dataset_id,
          sharding_policy="DYNAMIC",
          job_name=f"scale-{number % args.jobs}",
          exactly_once=True,
        )
      request.first_heartbeat = True  # as jaxfeed's client
      job = await party.call("GetOrCreateJob", request)
      if job is None:
        return
      self.clients_joined += 1
      # The join answered the first heartbeat.
      version, started = job.heartbeat.tasks_version, time.monotonic()
      interval = job.heartbeat.heartbeat_interval_s or 0.1
      goodbye = job.heartbeat  # the last answer: whether and how to say goodbye
      consumed = 0
      await _sleep_until(self.stop, interval * random.uniform(0.9, 1.1))
      while not self.stop.is_set():
        pending = self.issued.get(job.job_id, [])
        acks = pending[: args.max_acks]
        del pending[: len(acks)]
        consumed += 256 * len(acks)
        response = await party.call(
          "ClientHeartbeat",
          pb.ClientHeartbeatRequest(
            job_id=job.job_id,
            client_id=job.client_id,
            acked_splits=acks,
            elements_consumed=consumed,
            consumer_wait_s=0.0,
            read_elapsed_s=time.monotonic() - started,
            buffer_fill=0.5,
            known_tasks_version=version,
          ),
        )
        if response is not None:
          goodbye = response
          interval = response.heartbeat_interval_s or 0.1
          if not response.tasks_unchanged:
            version = response.tasks_version
        await _sleep_until(self.stop, interval * random.uniform(0.9, 1.1))
      # As jaxfeed's client: through one worker of its job when the
      # dispatcher asks for it (here one of this process, in process: the
      # worker's side of a goodbye costs the dispatcher nothing), else a call.
      workers = sorted(self.job_workers.get(job.job_id, ()))
      if goodbye.goodbye_via_worker and workers:
        self.goodbyes[workers[job.client_id % len(workers)]].append(
          pb.ClientGoodbye(
            job_id=job.job_id, client_id=job.client_id, ticket=goodbye.goodbye_ticket
          )
        )
      else:
        await party.call(
          "ReleaseJobClient", pb.ReleaseJobClientRequest(job_id=job.job_id, client_id=job.client_id)
        )
    finally:
      await party.channel.close()

  async def watch_loop(self) -> None:
    """Notes how late a 10 ms sleep wakes: in the window (`loop_lags`), and
    while the clients join and say goodbye (`burst_lags`)."""
    while self.phase != "done":
      start = time.perf_counter()
      await asyncio.sleep(0.01)
      lag = time.perf_counter() - start - 0.01
      if self.stats.measuring:
        self.stats.loop_lags.append(lag)
      elif self.phase in self.stats.burst_lags:
        self.stats.burst_lags[self.phase].append(lag)

  async def run(self, commands: "asyncio.Queue[str]") -> dict:
    args = self.args
    worker_numbers = range(self.index, args.workers, args.processes)
    client_numbers = range(self.index, args.clients, args.processes)
    readies = [asyncio.Event() for _ in worker_numbers]
    tasks = []
    for number, ready in zip(worker_numbers, readies):
      tasks.append(asyncio.ensure_future(self.worker(number, ready)))
      await asyncio.sleep(0.002)  # spread the registrations a little
    await asyncio.gather(*(ready.wait() for ready in readies))
    _say({"event": "workers_ready"})
    assert await commands.get() == "clients"
    self.phase = "joins"
    self.stats.joining = True
    watch = asyncio.ensure_future(self.watch_loop())
    tasks += [asyncio.ensure_future(self.client(n)) for n in client_numbers]
    while self.clients_joined < len(client_numbers):
      if any(t.done() for t in tasks):  # a party gave up: report, do not hang
        break
      await asyncio.sleep(0.05)
    self.stats.joining = False
    _say({"event": "clients_ready"})
    assert await commands.get() == "measure"
    self.phase = "window"
    self.stats.measuring = True
    assert await commands.get() == "stop"
    self.stats.measuring = False
    self.phase = "goodbyes"
    self.stop.set()
    clients = tasks[len(worker_numbers) :]
    await asyncio.gather(*clients, return_exceptions=True)
    self.clients_gone.set()
    outcomes = await asyncio.gather(*tasks, return_exceptions=True)
    self.phase = "done"
    await watch
    for outcome in outcomes:
      if isinstance(outcome, BaseException):  # a bug of the simulator: report it
        key = f"simulator: {type(outcome).__name__}: {outcome}"[:200]
        self.stats.errors[key] = self.stats.errors.get(key, 0) + 1
    return {
      "latencies": self.stats.latencies,
      "failed": self.stats.failed,
      "errors": self.stats.errors,
      "loop_lags": self.stats.loop_lags,
      "burst_lags": self.stats.burst_lags,
      "joins": self.stats.joins,
    }


def _say(message: dict) -> None:
  sys.stdout.write(json.dumps(message) + "\n")
  sys.stdout.flush()


async def _simulate(args: argparse.Namespace) -> None:
  commands: asyncio.Queue = asyncio.Queue()
  loop = asyncio.get_running_loop()

  def read_commands():
    for line in sys.stdin:
      loop.call_soon_threadsafe(commands.put_nowait, line.strip())

  threading.Thread(target=read_commands, daemon=True).start()
  result = await _Simulator(args, args.index).run(commands)
  _say({"event": "result", **result})


# -- the driver ---------------------------------------------------------------------
class _SimulatorProcess:
  """A child running `_simulate` for its share of the parties."""

  def __init__(self, args: argparse.Namespace, index: int, dataset_id: str):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")])
    env["GRPC_VERBOSITY"] = "ERROR"
    env.setdefault("JAX_PLATFORMS", "cpu")
    flags = [
      f"--{name}={getattr(args, name)}"
      for name in (
        "workers",
        "clients",
        "jobs",
        "round_robin_clients",
        "processes",
        "elements_per_s",
        "splits_per_request",
        "max_acks",
        "join_spread_s",
      )
    ]
    self.proc = _lifetime.popen(
      [
        sys.executable,
        "-m",
        "benchmarks.dispatcher_scale",
        "--simulator",
        f"--index={index}",
        f"--address={args.address}",
        f"--dataset_id={dataset_id}",
        *flags,
        *(["--leave"] if args.leave else []),
      ],
      stdin=subprocess.PIPE,
      stdout=subprocess.PIPE,
      env=env,
      text=True,
    )
    self._lines: queue.Queue = queue.Queue()
    threading.Thread(target=self._read, daemon=True).start()

  def _read(self) -> None:
    for line in self.proc.stdout:
      self._lines.put(line)
    self._lines.put(None)

  def expect(self, event: str, timeout_s: float) -> dict:
    try:
      line = self._lines.get(timeout=timeout_s)
    except queue.Empty:
      raise TimeoutError(f"A simulator did not report {event!r} in {timeout_s:g} s.") from None
    if line is None:
      raise RuntimeError(f"A simulator exited (code {self.proc.wait()}) before {event!r}.")
    message = json.loads(line)
    if message.get("event") != event:
      raise RuntimeError(f"A simulator reported {message.get('event')!r}, expected {event!r}.")
    return message

  def send(self, command: str) -> None:
    self.proc.stdin.write(command + "\n")
    self.proc.stdin.flush()

  def kill(self) -> None:
    if self.proc.poll() is None:
      self.proc.kill()
    self.proc.wait(timeout=30)


def _percentile(sorted_values: list[float], q: float) -> float:
  if not sorted_values:
    return 0.0
  return sorted_values[min(len(sorted_values) - 1, int(q * len(sorted_values)))]


def _summary_ms(sorted_values: list[float]) -> dict[str, float]:
  """p50, p99 and max of seconds, in ms."""
  return {
    "p50": round(_percentile(sorted_values, 0.5) * 1e3, 2),
    "p99": round(_percentile(sorted_values, 0.99) * 1e3, 2),
    "max": round((sorted_values[-1] if sorted_values else 0.0) * 1e3, 2),
  }


def _read_timing(path: str, timeout_s: float) -> dict[str, list[float]]:
  """The dispatcher's handler times of the window (see dispatcher_scale_server)."""
  deadline = time.monotonic() + timeout_s
  while not os.path.exists(path):
    if time.monotonic() > deadline:
      raise TimeoutError(f"The dispatcher wrote no handler times to {path}.")
    time.sleep(0.1)
  with open(path) as f:
    return json.load(f)


def _cpu_seconds(process) -> float:
  times = process.cpu_times()
  return times.user + times.system


def _tree_cpu_seconds(pids: list[int]) -> float:
  import psutil  # pylint: disable=g-import-not-at-top

  total = 0.0
  for pid in pids:
    try:
      total += _cpu_seconds(psutil.Process(pid))
    except psutil.NoSuchProcess:
      pass
  return total


def run(args: argparse.Namespace) -> dict:
  """Runs the whole measurement; returns the result dict."""
  import psutil  # pylint: disable=g-import-not-at-top

  work_dir = args.work_dir or tempfile.mkdtemp(prefix="jaxfeed-dispatcher-scale-")
  os.makedirs(work_dir, exist_ok=True)
  dispatcher_flags = tuple(args.dispatcher_flag or ())
  timing_dir = tempfile.mkdtemp(prefix="jaxfeed-dispatcher-timing-")
  timing_file = os.path.join(timing_dir, "handlers.json")
  dispatcher = DispatcherProcess(
    work_dir, dispatcher_flags, args.dispatcher_nice, timing_file, metrics=True
  )
  simulators: list[_SimulatorProcess] = []
  try:
    args.address = dispatcher.address
    start_s = dispatcher.ready_at - dispatcher.started_at
    dataset_id = _register_dataset(dispatcher.address)
    setup_started = time.monotonic()
    simulators = [_SimulatorProcess(args, i, dataset_id) for i in range(args.processes)]
    join_timeout = START_TIMEOUT_S + args.workers * 0.05 + args.clients * 0.05
    for simulator in simulators:
      simulator.expect("workers_ready", join_timeout)
    server = psutil.Process(dispatcher.proc.pid)
    joins_cpu0, joins_started = _cpu_seconds(server), time.monotonic()
    for simulator in simulators:
      simulator.send("clients")
    for simulator in simulators:
      simulator.expect("clients_ready", join_timeout)
    joins_cpu_s = _cpu_seconds(server) - joins_cpu0
    joins_s = time.monotonic() - joins_started
    setup_s = time.monotonic() - setup_started
    # Let the heartbeats spread out to their steady rhythm before measuring.
    time.sleep(args.warmup_s)
    sim_pids = [s.proc.pid for s in simulators]
    cpu0, io0 = _cpu_seconds(server), server.io_counters().write_chars
    sim_cpu0 = _tree_cpu_seconds(sim_pids)
    machine0 = psutil.cpu_times()
    started = time.monotonic()
    for simulator in simulators:
      simulator.send("measure")
    time.sleep(args.seconds)
    for simulator in simulators:
      simulator.send("stop")
    stopped = time.monotonic()
    elapsed = stopped - started
    with open(f"{timing_file}.window", "w") as f:
      f.write(f"{started} {stopped}")
    cpu1, io1 = _cpu_seconds(server), server.io_counters().write_chars
    sim_cpu1 = _tree_cpu_seconds(sim_pids)
    machine1 = psutil.cpu_times()
    rss = server.memory_info().rss
    # Every client says goodbye now: until the dispatcher has released them all.
    release_all_s = _wait_released(dispatcher.metrics_url, 120.0)
    goodbye_cpu_s = _cpu_seconds(server) - cpu1
    goodbye_counts = _goodbye_counts(dispatcher.metrics_url)
    results = [s.expect("result", 120 + args.seconds) for s in simulators]
    with open(f"{timing_file}.done", "w"):
      pass  # every goodbye was answered
    handler_times = _read_timing(timing_file, 60.0)
    for simulator in simulators:
      simulator.proc.wait(timeout=60)
    journal_bytes = sum(f.stat().st_size for f in pathlib.Path(work_dir).rglob("*") if f.is_file())
    dispatcher.kill()
    restarted = DispatcherProcess(work_dir, dispatcher_flags, args.dispatcher_nice)
    _wait_serving(restarted.address, START_TIMEOUT_S)
    restart_s = time.monotonic() - restarted.started_at
    restarted.kill()
  finally:
    for simulator in simulators:
      simulator.kill()
    dispatcher.kill()
    if not args.work_dir:
      shutil.rmtree(work_dir, ignore_errors=True)
    shutil.rmtree(timing_dir, ignore_errors=True)

  latencies = {kind: sorted(x for r in results for x in r["latencies"][kind]) for kind in RPC_KINDS}
  failed = {kind: sum(r["failed"][kind] for r in results) for kind in RPC_KINDS}
  errors: dict[str, int] = {}
  for r in results:
    for key, count in r["errors"].items():
      errors[key] = errors.get(key, 0) + count
  loop_lags = sorted(x for r in results for x in r["loop_lags"])
  joins = {
    kind: sorted(x for r in results for x in r["joins"][kind])
    for kind in RPC_KINDS
    if kind != "GetOrCreateJob"
  }
  burst_lags = {
    phase: sorted(x for r in results for x in r["burst_lags"][phase])
    for phase in ("joins", "goodbyes")
  }
  collections = handler_times.get("gc", [])
  busy = lambda t: t.user + t.system + getattr(t, "irq", 0) + getattr(t, "softirq", 0)
  machine_busy = (
    (busy(machine1) - busy(machine0))
    / max(1e-9, sum(machine1) - sum(machine0))
    * psutil.cpu_count()
  )
  # Joins and goodbyes fall outside the window: the rate counts the others.
  measured = sum(
    len(v) for kind, v in latencies.items() if kind not in ("GetOrCreateJob", "ReleaseJobClient")
  )
  return {
    "workers": args.workers,
    "clients": args.clients,
    "jobs": args.jobs,
    "round_robin_clients": args.round_robin_clients,
    "dispatcher_flags": list(dispatcher_flags),
    "dispatcher_nice": args.dispatcher_nice,
    "parties": args.workers + args.clients,
    "seconds": round(elapsed, 2),
    "simulator_processes": args.processes,
    "rpcs_per_s": round(measured / elapsed, 1),
    "rpcs": {kind: len(v) for kind, v in latencies.items()},
    "latency_ms": {kind: _summary_ms(v) for kind, v in latencies.items()},
    "handler_ms": {kind: _summary_ms(v) for kind, v in handler_times.items() if kind in RPC_KINDS},
    "simulator_burst_lag_ms": {phase: _summary_ms(v) for phase, v in burst_lags.items()},
    # From the window's end until the dispatcher had released every client
    # (its jaxfeed_job_clients gauge; None: not within 120 s), its CPU
    # seconds meanwhile, and how the clients left (dispatcher metrics:
    # call = ReleaseJobClient calls, worker = goodbyes forwarded by workers).
    "release_all_s": None if release_all_s is None else round(release_all_s, 2),
    "release_dispatcher_cpu_s": round(goodbye_cpu_s, 2),
    "goodbyes": goodbye_counts,
    "release_job_client_calls": len(latencies["ReleaseJobClient"]),
    "failed_rpcs": sum(failed.values()),
    "failed_by_kind": failed,
    "simulator_errors": sum(n for k, n in errors.items() if k.startswith("simulator:")),
    "errors": dict(sorted(errors.items(), key=lambda kv: -kv[1])[:5]),
    "dispatcher_cpu_share": round((cpu1 - cpu0) / elapsed, 3),
    "dispatcher_rss_mb": round(rss / (1 << 20), 1),
    "journal_bytes_per_s": round((io1 - io0) / elapsed, 1),
    "journal_dir_bytes": journal_bytes,
    "simulator_cpu_share": round((sim_cpu1 - sim_cpu0) / elapsed, 3),
    "simulator_loop_lag_ms": _summary_ms(loop_lags),
    "dispatcher_gc": {
      "collections": len(collections),
      "seconds": round(sum(collections), 3),
      "max_ms": round((collections[-1] if collections else 0.0) * 1e3, 2),
      "full_collections": len(handler_times.get("gc2", [])),
      "full_max_ms": round(max(handler_times.get("gc2", [0.0])) * 1e3, 2),
    },
    "machine_cores": psutil.cpu_count(),
    "machine_busy_cores": round(machine_busy, 2),
    "load_average_1m": round(os.getloadavg()[0], 2),
    "setup_s": round(setup_s, 2),
    # From the first join until every client joined (--join_spread_s).
    "joins_s": round(joins_s, 2),
    "joins_dispatcher_cpu_s": round(joins_cpu_s, 2),
    # The other calls in those seconds, and what their callers saw.
    "joins_rpcs": {kind: len(v) for kind, v in joins.items()},
    "joins_latency_ms": {kind: _summary_ms(v) for kind, v in joins.items()},
    "dispatcher_start_s": round(start_s, 2),
    "restart_replay_s": round(restart_s, 2),
  }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--workers", type=int, default=64)
  parser.add_argument("--clients", type=int, default=128)
  parser.add_argument("--seconds", type=float, default=20.0, help="Length of the measured window.")
  parser.add_argument("--json", action="store_true", help="Print one JSON line.")
  parser.add_argument(
    "--jobs", type=int, default=2, help="Shared exactly-once DYNAMIC jobs the clients read."
  )
  parser.add_argument(
    "--round_robin_clients",
    type=int,
    default=8,
    help="Clients that read one round-robin job instead (at most half the clients).",
  )
  parser.add_argument("--processes", type=int, default=2, help="Simulator processes.")
  parser.add_argument(
    "--elements_per_s",
    type=float,
    default=1000.0,
    help="Elements (sampler positions) a second one worker produces for one task.",
  )
  parser.add_argument(
    "--splits_per_request",
    type=int,
    default=2,
    help="Split ranges per GetSplits (the workers' default).",
  )
  parser.add_argument(
    "--max_acks", type=int, default=1024, help="Most acknowledgments in one client heartbeat."
  )
  parser.add_argument(
    "--join_spread_s",
    type=float,
    default=10.0,
    help="Clients join at random times within this many seconds.",
  )
  parser.add_argument(
    "--warmup_s", type=float, default=5.0, help="Seconds of load before the measured window."
  )
  parser.add_argument("--leave", action="store_true", help="Workers say goodbye when they stop.")
  parser.add_argument("--work_dir", default="", help="Dispatcher work_dir (kept).")
  parser.add_argument(
    "--dispatcher_flag",
    action="append",
    help="A flag for the dispatcher, e.g. --dispatcher_flag=--nojournal_fsync (repeat for more).",
  )
  parser.add_argument(
    "--dispatcher_nice",
    type=int,
    default=0,
    help="Niceness change of the dispatcher process (e.g. -10 to "
    "favour it on a machine that runs other work).",
  )
  # A simulator process (started by the driver).
  parser.add_argument("--simulator", action="store_true", help=argparse.SUPPRESS)
  parser.add_argument("--index", type=int, default=0, help=argparse.SUPPRESS)
  parser.add_argument("--address", default="", help=argparse.SUPPRESS)
  parser.add_argument("--dataset_id", default="", help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  for name in ("workers", "clients", "jobs", "processes", "splits_per_request", "max_acks"):
    if getattr(args, name) < 1:
      parser.error(f"--{name} must be >= 1, got {getattr(args, name)}.")
  if args.round_robin_clients < 0:
    parser.error(f"--round_robin_clients must be >= 0, got {args.round_robin_clients}.")
  args.round_robin_clients = min(args.round_robin_clients, args.clients // 2)
  if args.seconds <= 0 or args.elements_per_s <= 0:
    parser.error("--seconds and --elements_per_s must be > 0.")
  return args


def main(argv: list[str] | None = None) -> None:
  args = parse_args(argv)
  if args.simulator:
    _lifetime.die_with_parent_from_env()
    asyncio.run(_simulate(args))
    return
  result = run(args)
  record.row(
    {
      "workload": "dispatcher scale",
      "system": f"{args.workers} workers, {args.clients} clients",
      **result,
    },
    echo=False,
  )
  if args.json:
    print(json.dumps(result))
    return
  for key, value in result.items():
    print(f"{key}: {value}")


if __name__ == "__main__":
  with record.run("dispatcher_scale"):
    main()
