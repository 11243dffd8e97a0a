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
* poison records (distributed_epoch only): one record on which the UDF
  segfaults its worker, in every worker ("always") or only in the first one
  that maps it ("once"). Exactly-once: "always" fails the read with
  `PoisonSplitError` naming the dataset, a split holding the record's
  position and max_split_attempts workers killed by SIGSEGV ("lost" here:
  the workers are not the dispatcher's children), after exactly that many
  deaths; "once" delivers every record once. At-most-once: the read ends
  without the record, its `lost_positions` hold the record's position, and
  the poisoned worker counts as a killed one for what may be lost;
* an exactly-once read may also fail with `PoisonSplitError` when the
  faults killed max_split_attempts workers while each made the same split:
  the dispatcher cannot tell that from a poison record, so the error must
  name only workers the schedule killed;
* every read ends, or fails with a clear error, within a deadline; with the
  dispatcher back and a worker alive, any failure is itself a violation;
* a bit flipped in the dispatcher's work_dir (it is killed, the bit flipped,
  and it is restarted): it refuses to start naming the file and the offset
  (the bit is then restored, as from a backup, and it starts), or it serves
  the right data (the read's guarantee holds);
* a full disk (its work_dir is a small tmpfs, filled for a while): the
  dispatcher process stays up and serves again once space returns, and the
  read's guarantee holds;
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
import pathlib
import random
import re
import threading
import time
from typing import Any, Callable, Sequence

import numpy as np

import jaxfeed
import service_udfs
from jaxfeed.service import WorkerConfig
from jaxfeed.service.protocol import split_failures
from jaxfeed.service.worker import delivery
from chaos_cluster import HEARTBEAT_TIMEOUT_S, ChaosCluster

MODES = ("parallel_epochs", "at_most_once", "exactly_once")
FAULT_KINDS = (
  "worker_kill",
  "worker_restart",
  "worker_stop",
  "worker_cut",
  "worker_stall",
  "dispatcher_restart",
  "dispatcher_torn_restart",
  "dispatcher_cut",
  "dispatcher_stall",
  "dispatcher_and_worker_restart",
  "poison_records",
  "work_dir_bit_flip",
  "full_disk",
  "dispatcher_stateless_restart",
  "dispatcher_pause",
)
# In the data rather than injected: drawn after the other faults (so that
# adding it left every seed's other draws as they were), see `Schedule.poison`.
POISON = "poison_records"
POISON_KINDS = ("always", "once")
MAX_SPLIT_ATTEMPTS = split_failures.DEFAULT_MAX_SPLIT_ATTEMPTS  # the dispatcher's
# Faults on the dispatcher's disk, drawn after poison for the same reason.
DISK_FAULTS = ("work_dir_bit_flip", "full_disk")
DISK_FAULT_CHANCE = 0.15  # of each, per schedule
# A dispatcher restarted without its state, and one stopped past its
# heartbeat timeout: drawn after the disk faults for the same reason.
DISPATCHER_LOSS_FAULTS = ("dispatcher_stateless_restart", "dispatcher_pause")
DISPATCHER_LOSS_CHANCE = 0.15  # of each, per schedule
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


class NotInjected(Exception):
  """This machine cannot inject the fault (it is left out of the run)."""


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
  # "", or how the record of value `poison_record` + 1 kills workers
  # (POISON_KINDS; see the module docstring).
  poison: str = ""
  poison_record: int = -1

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
      if "kill" in fault.kind or "restart" in fault.kind or fault.kind in DISK_FAULTS:
        extra += 3 * HEARTBEAT_TIMEOUT_S
    if self.poison:  # each death is noticed after a heartbeat timeout
      extra += MAX_SPLIT_ATTEMPTS * 3 * HEARTBEAT_TIMEOUT_S
    return BASE_DEADLINE_S + extra

  @property
  def poison_position(self) -> int:
    """The sampler position of the poison record (-1: none)."""
    if not self.poison:
      return -1
    sampler = jaxfeed.IndexSampler(self.num_records, shuffle=True, seed=self.seed)
    return next(p for p in range(self.num_records) if sampler[p].record_index == self.poison_record)


@dataclasses.dataclass
class RunRecord:
  seed: int
  mode: str
  faults_injected: list[str]
  elements_checked: int
  violation: str | None
  hang: bool
  elapsed_s: float
  # Per work_dir bit flip: "refused" (naming file and offset) or "served".
  flips: list[str] = dataclasses.field(default_factory=list)

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
    seed=seed,
    mode=mode,
    num_records=rng.choice((240, 400, 600)),
    batch_size=rng.choice((2, 4, 8)),
    split_size=rng.choice((8, 16)),
    num_workers=num_workers,
    worker_buffer_size=rng.choice((2, 8)),
    proxied_workers=proxied,
    slow_map=rng.random() < 0.8,
    consumer_delay_s=rng.choice((0.0, 0.002, 0.005)),
  )
  kinds = [
    k
    for k in FAULT_KINDS
    if k != POISON
    and k not in DISK_FAULTS
    and k not in DISPATCHER_LOSS_FAULTS
    and (k != "worker_kill" or num_workers > 1)  # one worker always lives
    and (k != "worker_stall" or proxied)
  ]
  total = -(-schedule["num_records"] // schedule["batch_size"]) * (
    num_workers if mode == "parallel_epochs" else 1
  )
  points = sorted(rng.uniform(0.05, 0.75) for _ in range(rng.randint(1, 4)))
  faults = []
  for fraction in points:
    kind = rng.choice(kinds)
    slot = rng.randrange(1, num_workers) if kind == "worker_kill" else rng.randrange(num_workers)
    duration = 0.0
    if kind in ("worker_stop", "worker_stall", "dispatcher_stall"):
      duration = round(rng.uniform(0.2, 1.5), 2)
    elif "restart" in kind:
      duration = round(rng.uniform(0.0, 1.0), 2)
    faults.append(Fault(int(fraction * total), kind, slot, duration))
  # Poison kills a worker, which worker_kill may have spared: one must live
  # besides (exactly-once "always" fails the read even with none left).
  spared = num_workers - 1 - any(f.kind == "worker_kill" for f in faults)
  if mode != "parallel_epochs" and spared >= 1 and rng.random() < 0.25:
    schedule["poison"] = rng.choice(POISON_KINDS)
    schedule["poison_record"] = rng.randrange(schedule["num_records"])
  for kind in DISK_FAULTS:
    if rng.random() < DISK_FAULT_CHANCE:
      duration = round(rng.uniform(0.5, 3.0), 2) if kind == "full_disk" else 0.0
      faults.append(Fault(int(rng.uniform(0.05, 0.75) * total), kind, 0, duration))
  for kind in DISPATCHER_LOSS_FAULTS:
    if rng.random() < DISPATCHER_LOSS_CHANCE:
      if kind == "dispatcher_pause":  # past the heartbeat timeout
        duration = round(rng.uniform(HEARTBEAT_TIMEOUT_S + 0.5, HEARTBEAT_TIMEOUT_S + 3), 2)
      else:
        duration = round(rng.uniform(0.0, 1.0), 2)
      faults.append(Fault(int(rng.uniform(0.05, 0.75) * total), kind, 0, duration))
  faults.sort(key=lambda f: f.after_batches)  # stable: the others keep their order
  return Schedule(faults=tuple(faults), **schedule)


def records(
  num_records: int,
  batch_size: int,
  slow_map: bool = True,
  seed: int = 0,
  poisoned: bool = False,
  offset: int = 0,
) -> Any:
  """Batches of {"x": offset + 1..num_records}, shuffled; 2 ms per record if
  slow_map; `poisoned`: the map kills workers as their POISON_ENV says."""
  source = jaxfeed.ArraySource({"x": np.arange(offset, offset + num_records, dtype=np.int64)})
  sampler = jaxfeed.IndexSampler(num_records, shuffle=True, seed=seed)
  udf = {
    (True, False): service_udfs.slow_add_one_to_x,
    (False, False): service_udfs.add_one_to_x,
    (True, True): service_udfs.poisoned_slow_add_one_to_x,
    (False, True): service_udfs.poisoned_add_one_to_x,
  }[(slow_map, poisoned)]
  return jaxfeed.Dataset.from_source(source, sampler).map(udf).batch(batch_size)


def distribute(
  schedule: Schedule, cluster: ChaosCluster, dataset: Any = None, **options: Any
) -> Any:
  if dataset is None:
    dataset = records(
      schedule.num_records,
      schedule.batch_size,
      schedule.slow_map,
      schedule.seed,
      bool(schedule.poison),
    )
  mode = "parallel_epochs" if schedule.mode == "parallel_epochs" else "distributed_epoch"
  visitation = "exactly_once" if schedule.mode == "exactly_once" else "at_most_once"
  return dataset.distribute(
    cluster.address,
    mode,
    visitation=visitation,
    max_outstanding_requests=4,
    data_transfer="grpc" if schedule.proxied_workers else "socket",
    **options,
  )


class _Injector:
  """Fires a schedule's faults in order as the consumer's batch count passes
  each one's mark; each fault's duration is spent on this thread."""

  def __init__(self, schedule: Schedule, cluster: ChaosCluster):
    self.schedule = schedule
    self.cluster = cluster
    self.injected: list[str] = []
    self.killed_incarnations = 0  # worker processes killed (at-most-once may lose)
    self.killed_slots: set[int] = set()
    self.flips: list[str] = []  # per bit flipped: "refused" or "served"
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
        try:
          self._inject(fault)
        except NotInjected:
          continue
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
    elif kind == "dispatcher_and_worker_restart":
      cluster.kill_dispatcher()
      self._kill_worker(fault.slot)
      time.sleep(fault.duration_s)
      cluster.start_dispatcher()
      worker.start()
    elif kind == "work_dir_bit_flip":
      index = self.schedule.faults.index(fault)
      self.flips.append(
        cluster.flip_bit_and_restart(random.Random(self.schedule.seed * 100 + index))
      )
    elif kind == "full_disk":
      if cluster.disk is None:
        raise NotInjected("no tmpfs to fill (mounting one needs root)")
      cluster.fill_disk(fault.duration_s)
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
    else:
      raise ValueError(f"Unknown fault kind {kind!r}.")

  def _healthy_declared_dead(self, log_offset: int) -> str | None:
    """The violation if the dispatcher's log since `log_offset` declares a
    worker dead that is alive (nothing else ran during the pause)."""
    with open(self.cluster.log_path, "rb") as f:
      f.seek(log_offset)
      lines = f.read().decode(errors="replace").splitlines()
    alive = [w.address for w in self.cluster.workers if w.alive]
    wrong = [
      line
      for line in lines
      if "declared dead" in line and any(f"Worker {address} " in line for address in alive)
    ]
    if wrong:
      return f"after a dispatcher pause, a healthy worker was declared dead: {wrong[0]}"
    return None

  def _probe(self) -> str | None:
    """Reads a new pipeline (other values) on the dispatcher just restarted
    without state, while the workers may still run the old read's tasks:
    the violation in what it read, or None."""
    schedule = self.schedule
    probe = dataclasses.replace(schedule, num_records=PROBE_RECORDS, poison="")
    dataset = records(
      PROBE_RECORDS, schedule.batch_size, slow_map=False, seed=schedule.seed, offset=PROBE_OFFSET
    )
    result = read_until_end(
      distribute(probe, self.cluster, dataset=dataset, timeout_s=60.0).make_iterator(),
      BASE_DEADLINE_S,
    )
    if result.hang or result.error is not None:
      return (
        f"the read after a restart without state "
        f"{'hung' if result.hang else f'failed: {result.error!r}'}"
      )
    counts = result.counts
    expected = set(range(PROBE_OFFSET + 1, PROBE_OFFSET + PROBE_RECORDS + 1))
    if (
      set(counts) != expected
      or len(set(counts.values())) != 1
      or (schedule.mode != "parallel_epochs" and max(counts.values()) != 1)
    ):
      foreign = sorted(set(counts) - expected)[:10]
      return (
        f"the read after a restart without state got values {foreign} not its "
        f"own, or not each equally often ({collections.Counter(counts.values())})"
      )
    return None


def check(
  schedule: Schedule,
  counts: collections.Counter,
  killed_incarnations: int,
  killed_slots: set[int],
  incarnations: list[int],
  poison_deaths: int = 0,
  lost_positions: Sequence[tuple[int, int]] = (),
  complete: bool = True,
) -> str | None:
  """The violation of the mode's guarantee in `counts` (value -> times read)
  by a read that ended without an error, or None; of a read that failed
  (`complete` False), only nothing foreign and nothing read more often than
  the mode allows."""
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
      return (
        f"{len(short)} values read fewer than {live} times (once per worker "
        f"never killed), e.g. {short[:10]} ({[counts[v] for v in short[:10]]} times)"
      )
    if extra:
      return (
        f"{len(extra)} values read more than {most} times (once per worker "
        f"process), e.g. {extra[:10]}"
      )
    return None
  twice = sorted(v for v, n in counts.items() if n > 1)
  missing = [v for v in expected if counts[v] == 0]
  if twice:
    return f"{len(twice)} values read more than once, e.g. {twice[:10]}"
  if not complete:
    return None
  if schedule.mode == "exactly_once":
    if schedule.poison == "always":
      return (
        f"the read ended although every worker that maps record "
        f"{schedule.poison_record} dies ({poison_deaths} died)"
      )
    if missing:
      return f"{len(missing)} values never read, e.g. {missing[:10]}"
    return None
  if schedule.poison and counts[schedule.poison_record + 1]:
    return f"the poison record {schedule.poison_record} was read, though it kills its worker"
  position = schedule.poison_position
  if poison_deaths and not any(a <= position < b for a, b in lost_positions):
    return (
      f"a worker died on the record at position {position}, but the read's "
      f"lost_positions {list(lost_positions)[:10]} leave it out"
    )
  killed_incarnations += poison_deaths
  held = (
    SPLITS_PER_REQUEST * schedule.split_size
    + (schedule.worker_buffer_size + 2) * schedule.batch_size
  )
  if schedule.proxied_workers:  # reads over gRPC: the unacknowledged window too
    held += delivery.DEFAULT_WINDOW * schedule.batch_size
  allowed = killed_incarnations * held
  if len(missing) > allowed:
    why = (
      f"{killed_incarnations} killed worker process(es) held at most {allowed}"
      if killed_incarnations
      else "no worker was killed"
    )
    return f"{len(missing)} values lost but {why}, e.g. {missing[:10]}"
  return None


@dataclasses.dataclass
class ReadResult:
  counts: collections.Counter  # value of "x" -> times read
  batches: int
  error: BaseException | None  # what the read raised, if it failed
  hang: bool  # it neither ended nor failed in time


def read_until_end(
  iterator: Any,
  deadline_s: float,
  no_progress_s: float = NO_PROGRESS_S,
  on_batch: Callable[[int], None] | None = None,
  delay_s: float = 0.0,
  max_batches: int | None = None,
) -> ReadResult:
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


def check_poison_error(
  schedule: Schedule, message: str, poison_deaths: int, killed_addresses: set[str]
) -> str | None:
  """The violation in an exactly-once read's PoisonSplitError, or None: it
  names the dataset and a split; each worker it names died on that split,
  killed by the schedule or by the poison record the split holds; and the
  poison killed no more than MAX_SPLIT_ATTEMPTS workers (the split was not
  handed out again)."""
  found = re.search(
    r"Dataset (\d+) \(job \d+\): the split of positions \[(\d+), (\d+)\) "
    r"ended (\d+) worker\(s\) while they made it: (.*?)\. It is not",
    message,
  )
  if found is None:
    return f"PoisonSplitError without the dataset, the positions or the workers: {message}"
  start, stop = int(found.group(2)), int(found.group(3))
  named = re.findall(r"([\w.\-]+:\d+): ", found.group(5))
  if len(named) != MAX_SPLIT_ATTEMPTS:
    return f"PoisonSplitError names {len(named)} workers, not {MAX_SPLIT_ATTEMPTS}: {message}"
  if poison_deaths > MAX_SPLIT_ATTEMPTS:
    return f"the poison record killed {poison_deaths} workers: its split was handed out again"
  poisoned = start <= schedule.poison_position < stop
  unexplained = [a for a in named if a not in killed_addresses]
  if len(unexplained) > (poison_deaths if poisoned else 0):
    return (
      f"PoisonSplitError names workers {unexplained} that neither the faults "
      f"nor a poison record of [{start}, {stop}) killed: {message}"
    )
  return None


def run(schedule: Schedule, work_dir: str) -> RunRecord:
  """Runs `schedule` on a fresh cluster in `work_dir` and checks its guarantee."""
  start = time.monotonic()
  worker_env, deaths_dir = None, pathlib.Path(work_dir) / "poison"
  if schedule.poison:
    deaths_dir.mkdir(parents=True, exist_ok=True)
    worker_env = {
      service_udfs.POISON_ENV: f"{schedule.poison_record},{schedule.poison},{deaths_dir}"
    }
  with ChaosCluster(
    work_dir,
    schedule.num_workers,
    proxied_workers=schedule.proxied_workers,
    split_size=schedule.split_size,
    worker_buffer_size=schedule.worker_buffer_size,
    worker_env=worker_env,
    small_disk=any(f.kind == "full_disk" for f in schedule.faults),
  ) as cluster:
    iterator = distribute(schedule, cluster, timeout_s=60.0).make_iterator()
    injector = _Injector(schedule, cluster)
    longest = max((f.duration_s for f in schedule.faults), default=0.0)
    result = read_until_end(
      iterator,
      schedule.deadline_s,
      NO_PROGRESS_S + longest,
      on_batch=injector.consumed,
      delay_s=schedule.consumer_delay_s,
    )
    injector.finish()
    log = cluster.log_tail()
    killed_addresses = {cluster.workers[slot].address for slot in injector.killed_slots}
  poison_deaths = len(list(deaths_dir.glob("died-*")))
  counts, hang = result.counts, result.hang
  violation = None
  if hang:
    violation = (
      f"hang: the read did not end within {schedule.deadline_s:.0f}s or "
      f"stopped making progress ({sum(counts.values())} elements read)"
    )
  elif injector.error is not None:
    violation = f"fault injection failed: {type(injector.error).__name__}: {injector.error}"
  elif injector.fault_violation is not None:
    violation = injector.fault_violation
  elif isinstance(result.error, split_failures.PoisonSplitError):
    violation = check_poison_error(schedule, str(result.error), poison_deaths, killed_addresses)
  elif result.error is not None:
    error = result.error
    violation = f"read failed: {type(error).__name__}: {error}"
    if injector.stateless_restarts and STATELESS_RESTART_ERROR in str(error):
      violation = check(
        schedule,
        counts,
        injector.killed_incarnations,
        injector.killed_slots,
        [w.incarnations for w in cluster.workers],
        poison_deaths,
        iterator.lost_positions,
        complete=False,
      )
  else:
    violation = check(
      schedule,
      counts,
      injector.killed_incarnations,
      injector.killed_slots,
      [w.incarnations for w in cluster.workers],
      poison_deaths,
      iterator.lost_positions,
    )
  if violation is not None and log:
    violation += "\nserver log tail:\n" + log
  return RunRecord(
    seed=schedule.seed,
    mode=schedule.mode,
    faults_injected=list(injector.injected) + ([POISON] if schedule.poison else []),
    elements_checked=sum(counts.values()),
    violation=violation,
    hang=hang,
    elapsed_s=time.monotonic() - start,
    flips=injector.flips,
  )
