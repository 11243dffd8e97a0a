"""Seeded chaos schedules: a read through the service while faults hit it.

`draw(seed)` picks a processing mode, a small pipeline, a cluster and a
sequence of faults, each fired once the consumer has taken a given number of
batches; `run(schedule, work_dir)` starts the cluster, reads, injects the
faults from a second thread (signals, proxies, `ss -K`, a torn journal) and
checks the guarantee of the mode (DESIGN.md, "Fault model and guarantees"):

* exactly-once: every record of the epoch once;
* at-most-once (distributed_epoch): nothing twice, nothing foreign, and a
  loss only if a worker was killed, at most what each killed worker held:
  the splits it had fetched plus its buffer, the batch it was building and
  the batch it was sending; over gRPC also the batches it had sent but the
  client had not acknowledged (a failed call discards the messages the
  client's gRPC library received but not yet handed on, while the data
  socket's reader still reads them from its socket buffer);
* parallel_epochs: every worker never killed delivers the whole epoch, a
  killed or restarted one at most one epoch per process it ran as;
* every read ends, or fails with a clear error, within a deadline; with the
  dispatcher back and a worker alive, any failure is itself a violation;
* a dispatcher stopped (SIGSTOP) for longer than its heartbeat timeout takes
  no healthy worker for dead: at-most-once loses nothing for it;
* a dispatcher restarted without its state (its work_dir emptied) under live
  workers never makes anyone read wrong data: the read of a job it does not
  know ends as its mode promises, or fails saying that the dispatcher
  restarted without its state, with nothing foreign or twice (parallel_epochs:
  no more than an epoch per worker process) in what it read; and a pipeline
  registered right after it (other values) is read whole, and only it.

The run's `RunRecord` says which faults were injected, how many elements
were checked, the violation (None if the guarantee held) and whether the
read hung.
"""

from __future__ import annotations

import collections
import dataclasses
import random
import threading
import time
from typing import Any, Callable

import numpy as np

import jaxfeed
import service_udfs
from jaxfeed.service import WorkerConfig
from jaxfeed.service.worker import delivery
from chaos_cluster import HEARTBEAT_TIMEOUT_S, ChaosCluster

MODES = ("parallel_epochs", "at_most_once", "exactly_once")
FAULT_KINDS = ("worker_kill", "worker_restart", "worker_stop", "worker_cut",
               "worker_stall", "dispatcher_restart", "dispatcher_torn_restart",
               "dispatcher_cut", "dispatcher_stall", "dispatcher_and_worker_restart",
               "dispatcher_stateless_restart", "dispatcher_pause")
SPLITS_PER_REQUEST = WorkerConfig.splits_per_request  # split ranges a worker holds
BASE_DEADLINE_S = 90.0
# A read that hands on no batch this long, beyond the fault being injected,
# hangs: a dead worker is noticed in HEARTBEAT_TIMEOUT_S.
NO_PROGRESS_S = 45.0
# A pipeline read right after a stateless restart has values above this.
PROBE_OFFSET = 1_000_000
PROBE_RECORDS = 40
# What a read of a job the dispatcher lost in a restart without state says.
STATELESS_RESTART_ERROR = "restarted without its state"
PAUSE_CHECK_S = 1.0  # after a dispatcher pause, its log is read this much later


@dataclasses.dataclass(frozen=True)
class Fault:
  """One fault: `kind` on worker slot `slot`, once `after_batches` were read."""

  after_batches: int
  kind: str
  slot: int = 0
  duration_s: float = 0.0  # a stop, stall, or the time a server stays down


@dataclasses.dataclass(frozen=True)
class Schedule:
  seed: int
  mode: str
  num_records: int
  batch_size: int
  split_size: int
  num_workers: int
  worker_buffer_size: int
  proxied_workers: bool  # gRPC reads through proxies; else raw data sockets
  slow_map: bool
  consumer_delay_s: float
  faults: tuple[Fault, ...]

  @property
  def expected_batches(self) -> int:
    per_epoch = -(-self.num_records // self.batch_size)
    return per_epoch * (self.num_workers if self.mode == "parallel_epochs" else 1)

  @property
  def deadline_s(self) -> float:
    """How long the read may take, faults included: generous, for loaded machines."""
    extra = 0.0
    for fault in self.faults:
      extra += fault.duration_s + 5.0
      if "kill" in fault.kind or "restart" in fault.kind:
        extra += 3 * HEARTBEAT_TIMEOUT_S
    return BASE_DEADLINE_S + extra


@dataclasses.dataclass
class RunRecord:
  seed: int
  mode: str
  faults_injected: list[str]
  elements_checked: int
  violation: str | None
  hang: bool
  elapsed_s: float

  @property
  def ok(self) -> bool:
    return self.violation is None and not self.hang


def draw(seed: int) -> Schedule:
  """The schedule of `seed`: the same seed always gives the same schedule."""
  rng = random.Random(seed)
  mode = rng.choice(MODES)
  num_workers = rng.choice((1, 2, 2, 3))
  proxied = rng.random() < 0.5
  schedule = dict(
      seed=seed, mode=mode, num_records=rng.choice((240, 400, 600)),
      batch_size=rng.choice((2, 4, 8)), split_size=rng.choice((8, 16)),
      num_workers=num_workers, worker_buffer_size=rng.choice((2, 8)),
      proxied_workers=proxied, slow_map=rng.random() < 0.8,
      consumer_delay_s=rng.choice((0.0, 0.002, 0.005)))
  kinds = [k for k in FAULT_KINDS
           if (k != "worker_kill" or num_workers > 1)  # one worker always lives
           and (k != "worker_stall" or proxied)]
  total = (-(-schedule["num_records"] // schedule["batch_size"])
           * (num_workers if mode == "parallel_epochs" else 1))
  points = sorted(rng.uniform(0.05, 0.75) for _ in range(rng.randint(1, 4)))
  faults = []
  for fraction in points:
    kind = rng.choice(kinds)
    slot = rng.randrange(1, num_workers) if kind == "worker_kill" else rng.randrange(num_workers)
    duration = 0.0
    if kind in ("worker_stop", "worker_stall", "dispatcher_stall"):
      duration = round(rng.uniform(0.2, 1.5), 2)
    elif kind == "dispatcher_pause":  # past the heartbeat timeout
      duration = round(rng.uniform(HEARTBEAT_TIMEOUT_S + 0.5, HEARTBEAT_TIMEOUT_S + 3), 2)
    elif "restart" in kind:
      duration = round(rng.uniform(0.0, 1.0), 2)
    faults.append(Fault(int(fraction * total), kind, slot, duration))
  return Schedule(faults=tuple(faults), **schedule)


def records(num_records: int, batch_size: int, slow_map: bool = True,
            seed: int = 0, offset: int = 0) -> Any:
  """Batches of {"x": offset + 1..num_records}, shuffled; 2 ms per record if slow_map."""
  source = jaxfeed.ArraySource(
      {"x": np.arange(offset, offset + num_records, dtype=np.int64)})
  sampler = jaxfeed.IndexSampler(num_records, shuffle=True, seed=seed)
  udf = service_udfs.slow_add_one_to_x if slow_map else service_udfs.add_one_to_x
  return jaxfeed.Dataset.from_source(source, sampler).map(udf).batch(batch_size)


def distribute(schedule: Schedule, cluster: ChaosCluster, dataset: Any = None,
               **options: Any) -> Any:
  if dataset is None:
    dataset = records(schedule.num_records, schedule.batch_size, schedule.slow_map,
                      schedule.seed)
  mode = "parallel_epochs" if schedule.mode == "parallel_epochs" else "distributed_epoch"
  visitation = "exactly_once" if schedule.mode == "exactly_once" else "at_most_once"
  return dataset.distribute(
      cluster.address, mode, visitation=visitation, max_outstanding_requests=4,
      data_transfer="grpc" if schedule.proxied_workers else "socket", **options)


class _Injector:
  """Fires a schedule's faults in order as the consumer's batch count passes
  each one's mark; each fault's duration is spent on this thread."""

  def __init__(self, schedule: Schedule, cluster: ChaosCluster):
    self.schedule = schedule
    self.cluster = cluster
    self.injected: list[str] = []
    self.killed_incarnations = 0  # worker processes killed (at-most-once may lose)
    self.killed_slots: set[int] = set()
    self.stateless_restarts = 0
    # What a fault's own check found: a healthy worker taken for dead after a
    # dispatcher pause, the read after a restart without state.
    self.fault_violation: str | None = None
    self.error: BaseException | None = None
    self._consumed = 0
    self._done = False
    self._cond = threading.Condition()
    self.thread = threading.Thread(target=self._run, daemon=True, name="chaos-injector")
    self.thread.start()

  def consumed(self, count: int) -> None:
    with self._cond:
      self._consumed = count
      self._cond.notify_all()

  def finish(self) -> None:
    with self._cond:
      self._done = True
      self._cond.notify_all()
    self.thread.join(timeout=120)

  def _run(self) -> None:
    try:
      for fault in self.schedule.faults:
        with self._cond:
          while self._consumed < fault.after_batches and not self._done:
            self._cond.wait(0.1)
          if self._done:
            return
        self._inject(fault)
        self.injected.append(fault.kind)
    except BaseException as e:  # pylint: disable=broad-except
      self.error = e

  def _kill_worker(self, slot: int) -> None:
    worker = self.cluster.workers[slot]
    if worker.alive:
      worker.kill()
      self.killed_incarnations += 1
      self.killed_slots.add(slot)

  def _inject(self, fault: Fault) -> None:
    cluster = self.cluster
    worker = cluster.workers[fault.slot]
    kind = fault.kind
    if kind == "worker_kill":
      self._kill_worker(fault.slot)
    elif kind == "worker_restart":
      self._kill_worker(fault.slot)
      time.sleep(fault.duration_s)
      worker.start()
    elif kind == "worker_stop":
      worker.pause()
      time.sleep(fault.duration_s)
      worker.resume()
    elif kind == "worker_cut":
      worker.cut()
    elif kind == "worker_stall":
      worker.proxy.stall()
      time.sleep(fault.duration_s)
      worker.proxy.resume()
    elif kind in ("dispatcher_restart", "dispatcher_torn_restart"):
      cluster.kill_dispatcher()
      time.sleep(fault.duration_s)
      if kind == "dispatcher_torn_restart":
        cluster.tear_journal()
      cluster.start_dispatcher()
    elif kind == "dispatcher_cut":
      cluster.cut_dispatcher(with_ss=not self.schedule.proxied_workers)
    elif kind == "dispatcher_stall":
      cluster.dispatcher_proxy.stall()
      time.sleep(fault.duration_s)
      cluster.dispatcher_proxy.resume()
    elif kind == "dispatcher_pause":
      logged = cluster.log_path.stat().st_size
      cluster.dispatcher.pause()
      time.sleep(fault.duration_s)
      cluster.dispatcher.resume()
      time.sleep(PAUSE_CHECK_S)  # its liveness loop runs at once
      self.fault_violation = self.fault_violation or self._healthy_declared_dead(logged)
    elif kind == "dispatcher_stateless_restart":
      cluster.kill_dispatcher()
      time.sleep(fault.duration_s)
      cluster.wipe_state()
      cluster.start_dispatcher()
      self.stateless_restarts += 1
      self.fault_violation = self.fault_violation or self._probe()
    elif kind == "dispatcher_and_worker_restart":
      cluster.kill_dispatcher()
      self._kill_worker(fault.slot)
      time.sleep(fault.duration_s)
      cluster.start_dispatcher()
      worker.start()
    else:
      raise ValueError(f"Unknown fault kind {kind!r}.")


  def _healthy_declared_dead(self, log_offset: int) -> str | None:
    """The violation if the dispatcher's log since `log_offset` declares a
    worker dead that is alive (nothing else ran during the pause)."""
    with open(self.cluster.log_path, "rb") as f:
      f.seek(log_offset)
      lines = f.read().decode(errors="replace").splitlines()
    alive = [w.address for w in self.cluster.workers if w.alive]
    wrong = [line for line in lines if "declared dead" in line
             and any(f"Worker {address} " in line for address in alive)]
    if wrong:
      return f"after a dispatcher pause, a healthy worker was declared dead: {wrong[0]}"
    return None

  def _probe(self) -> str | None:
    """Reads a new pipeline (other values) on the dispatcher just restarted
    without state, while the workers may still run the old read's tasks:
    the violation in what it read, or None."""
    schedule = self.schedule
    probe = dataclasses.replace(schedule, num_records=PROBE_RECORDS)
    dataset = records(PROBE_RECORDS, schedule.batch_size, slow_map=False,
                      seed=schedule.seed, offset=PROBE_OFFSET)
    result = read_until_end(distribute(probe, self.cluster, dataset=dataset,
                                       timeout_s=60.0).make_iterator(), BASE_DEADLINE_S)
    if result.hang or result.error is not None:
      return (f"the read after a restart without state "
              f"{'hung' if result.hang else f'failed: {result.error!r}'}")
    counts = result.counts
    expected = set(range(PROBE_OFFSET + 1, PROBE_OFFSET + PROBE_RECORDS + 1))
    if set(counts) != expected or len(set(counts.values())) != 1 or (
        schedule.mode != "parallel_epochs" and max(counts.values()) != 1):
      foreign = sorted(set(counts) - expected)[:10]
      return (f"the read after a restart without state got values {foreign} not its "
              f"own, or not each equally often ({collections.Counter(counts.values())})")
    return None


def check(schedule: Schedule, counts: collections.Counter, killed_incarnations: int,
          killed_slots: set[int], incarnations: list[int],
          complete: bool = True) -> str | None:
  """The violation of the mode's guarantee in `counts` (value -> times read),
  or None; of a read that failed (`complete` False), only nothing foreign
  and nothing read more often than the mode allows."""
  expected = range(1, schedule.num_records + 1)
  foreign = sorted(set(counts) - set(expected))
  if foreign:
    return f"values never in the dataset: {foreign[:10]}"
  if schedule.mode == "parallel_epochs":
    live = sum(1 for slot in range(schedule.num_workers) if slot not in killed_slots)
    most = live + sum(incarnations[slot] for slot in killed_slots)
    short = [v for v in expected if counts[v] < live] if complete else []
    extra = [v for v in expected if counts[v] > most]
    if short:
      return (f"{len(short)} values read fewer than {live} times (once per worker "
              f"never killed), e.g. {short[:10]} ({[counts[v] for v in short[:10]]} times)")
    if extra:
      return (f"{len(extra)} values read more than {most} times (once per worker "
              f"process), e.g. {extra[:10]}")
    return None
  twice = sorted(v for v, n in counts.items() if n > 1)
  missing = [v for v in expected if counts[v] == 0]
  if twice:
    return f"{len(twice)} values read more than once, e.g. {twice[:10]}"
  if not complete:
    return None
  if schedule.mode == "exactly_once":
    if missing:
      return f"{len(missing)} values never read, e.g. {missing[:10]}"
    return None
  held = (SPLITS_PER_REQUEST * schedule.split_size
          + (schedule.worker_buffer_size + 2) * schedule.batch_size)
  if schedule.proxied_workers:  # reads over gRPC: the unacknowledged window too
    held += delivery.DEFAULT_WINDOW * schedule.batch_size
  allowed = killed_incarnations * held
  if len(missing) > allowed:
    why = (f"{killed_incarnations} killed worker process(es) held at most {allowed}"
           if killed_incarnations else "no worker was killed")
    return f"{len(missing)} values lost but {why}, e.g. {missing[:10]}"
  return None


@dataclasses.dataclass
class ReadResult:
  counts: collections.Counter  # value of "x" -> times read
  batches: int
  error: BaseException | None  # what the read raised, if it failed
  hang: bool  # it neither ended nor failed in time


def read_until_end(iterator: Any, deadline_s: float, no_progress_s: float = NO_PROGRESS_S,
                   on_batch: Callable[[int], None] | None = None,
                   delay_s: float = 0.0, max_batches: int | None = None) -> ReadResult:
  """Reads `iterator` to its end (or `max_batches`) on a thread, counting the
  values of "x".

  A read hangs if it has not ended `deadline_s` after the start, or handed on
  no batch for `no_progress_s`; it is then closed (which ends its `next()`),
  as it is at its end. `on_batch(n)` is called after the n-th batch;
  `delay_s` is the consumer's time per batch.
  """
  counts: collections.Counter = collections.Counter()
  state = {"batches": 0, "error": None}

  def consume() -> None:
    try:
      while max_batches is None or state["batches"] < max_batches:
        batch = next(iterator, None)
        if batch is None:
          return
        counts.update(np.asarray(batch["x"]).reshape(-1).tolist())
        state["batches"] += 1
        if on_batch is not None:
          on_batch(state["batches"])
        if delay_s:
          time.sleep(delay_s)
    except BaseException as e:  # pylint: disable=broad-except
      state["error"] = e

  consumer = threading.Thread(target=consume, daemon=True, name="chaos-consumer")
  consumer.start()
  end = time.monotonic() + deadline_s
  last_count, last_change = -1, time.monotonic()
  hang = False
  while consumer.is_alive():
    now = time.monotonic()
    if state["batches"] != last_count:
      last_count, last_change = state["batches"], now
    if now > end or now - last_change > no_progress_s:
      hang = True
      break
    consumer.join(timeout=0.2)
  if hang or max_batches is None:
    iterator.close()  # ends a hung read: its next() sees the stop
  consumer.join(timeout=60)
  return ReadResult(counts, state["batches"], None if hang else state["error"], hang)


def run(schedule: Schedule, work_dir: str) -> RunRecord:
  """Runs `schedule` on a fresh cluster in `work_dir` and checks its guarantee."""
  start = time.monotonic()
  with ChaosCluster(work_dir, schedule.num_workers,
                    proxied_workers=schedule.proxied_workers,
                    split_size=schedule.split_size,
                    worker_buffer_size=schedule.worker_buffer_size) as cluster:
    iterator = distribute(schedule, cluster, timeout_s=60.0).make_iterator()
    injector = _Injector(schedule, cluster)
    longest = max((f.duration_s for f in schedule.faults), default=0.0)
    result = read_until_end(iterator, schedule.deadline_s, NO_PROGRESS_S + longest,
                            on_batch=injector.consumed, delay_s=schedule.consumer_delay_s)
    injector.finish()
    log = cluster.log_tail()
  counts, hang = result.counts, result.hang
  violation = None
  if hang:
    violation = (f"hang: the read did not end within {schedule.deadline_s:.0f}s or "
                 f"stopped making progress ({sum(counts.values())} elements read)")
  elif injector.error is not None:
    violation = f"fault injection failed: {type(injector.error).__name__}: {injector.error}"
  elif injector.fault_violation is not None:
    violation = injector.fault_violation
  elif result.error is not None:
    error = result.error
    violation = f"read failed: {type(error).__name__}: {error}"
    if injector.stateless_restarts and STATELESS_RESTART_ERROR in str(error):
      violation = check(schedule, counts, injector.killed_incarnations,
                        injector.killed_slots, [w.incarnations for w in cluster.workers],
                        complete=False)
  else:
    violation = check(schedule, counts, injector.killed_incarnations, injector.killed_slots,
                      [w.incarnations for w in cluster.workers])
  if violation is not None and log:
    violation += "\nserver log tail:\n" + log
  return RunRecord(seed=schedule.seed, mode=schedule.mode,
                   faults_injected=list(injector.injected),
                   elements_checked=sum(counts.values()), violation=violation,
                   hang=hang, elapsed_s=time.monotonic() - start)
