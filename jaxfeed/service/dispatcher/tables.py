"""The dispatcher's tables (datasets, jobs and their tasks, workers) and the
journal records that change them: a restart replays the records into them."""

from __future__ import annotations

import base64
import dataclasses
import itertools
import random
import time

from jaxfeed.service.dispatcher import task_lists
from jaxfeed.service.protocol import read_state
from jaxfeed.service.protocol import spec as spec_lib
from jaxfeed.service.protocol import target_workers
from jaxfeed.service.protocol.protos import service_pb2 as pb
from jaxfeed.service.protocol.sharding import ShardingPolicy
from jaxfeed.service.storage import journal_lock
from jaxfeed.service.storage import journal_records
from jaxfeed.service.storage import state_snapshot


@dataclasses.dataclass
class Task:
  task_id: int
  job_id: int
  worker_address: str
  worker_index: int
  num_workers: int
  finished: bool = False


@dataclasses.dataclass
class Job:
  job_id: int
  dataset_id: str
  policy: ShardingPolicy
  job_name: str
  num_consumers: int
  num_positions: int
  round_timeout_s: float = 0.0
  tasks: dict[int, Task] = dataclasses.field(default_factory=dict)
  clients: dict[int, float] = dataclasses.field(default_factory=dict)
  # Round-robin jobs: client id -> its consumer_index.
  consumers: dict[int, int] = dataclasses.field(default_factory=dict)
  # Static and round-robin jobs fix their workers (address -> index) once.
  fixed_workers: dict[str, int] | None = None
  next_position: int = 0
  # When the last client left a named job (kept for job_gc_timeout_s).
  idle_since: float | None = None
  # Exactly-once DYNAMIC jobs: issued splits not yet acknowledged by a client
  # (start -> (stop, task id)), and splits of lost tasks to issue again.
  exactly_once: bool = False
  ephemeral_sharing: bool = False
  unacked: dict[int, tuple[int, int]] = dataclasses.field(default_factory=dict)
  reissue: dict[int, int] = dataclasses.field(default_factory=dict)
  # Exactly-once: the client a worker is sending each unacknowledged split
  # to (start -> client id); a released client's splits are issued again.
  holders: dict[int, int] = dataclasses.field(default_factory=dict)
  # Task id -> (request_seq, ranges) of its last GetSplits that handed out
  # ranges: a request repeated after a lost reply gets the same ones.
  last_splits: dict[int, tuple[int, list]] = dataclasses.field(default_factory=dict)
  # A resumed exactly-once read's job: positions no split is carved from (sorted
  # disjoint [start, stop) ranges; see jaxfeed.service.protocol.read_state).
  skip: list = dataclasses.field(default_factory=list)
  # Exactly-once: split start -> (its stop, "worker: how it ended" for each
  # worker lost while it made the split; see jaxfeed.service.protocol.split_failures).
  split_losses: dict[int, tuple[int, list[str]]] = dataclasses.field(default_factory=dict)
  # Exactly-once: unacknowledged splits their worker reported made (not
  # journaled: after a restart, a worker lost counts against them again).
  made: set[int] = dataclasses.field(default_factory=set)
  # Why the job failed ("": it did not), and the splits it handed out no more.
  error: str = ""
  failed_splits: dict[int, int] = dataclasses.field(default_factory=dict)
  # At-most-once: sorted disjoint [start, stop) positions lost workers were reading.
  lost: list = dataclasses.field(default_factory=list)
  # Which workers its clients read (jaxfeed.service.protocol.target_workers),
  # and each client's process.
  target_workers: str = target_workers.AUTO
  client_processes: dict[int, str] = dataclasses.field(default_factory=dict)
  # parallel_epochs: every task streams the pipeline's own order (True), or
  # each its own (see jaxfeed.service.worker.worker_orders); a resumed read's
  # worker indices, handed to its first tasks in turn.
  identical_worker_streams: bool = False
  resume_orders: list[int] = dataclasses.field(default_factory=list)

  def next_worker_index(self, taken: set[int]) -> int:
    """A new parallel_epochs task's worker index (its order): the next of
    `resume_orders` no task holds, else the smallest index none holds."""
    if self.policy != ShardingPolicy.OFF or self.identical_worker_streams:
      return 0
    index = next((i for i in self.resume_orders if i not in taken), 0)
    while index in taken:
      index += 1
    return index

  def return_split(self, start: int) -> None:
    """An unacknowledged split goes back to the pool, to be issued again."""
    stop, _ = self.unacked.pop(start)
    self.holders.pop(start, None)
    self.made.discard(start)
    self.reissue[start] = stop

  @property
  def splits_exhausted(self) -> bool:
    return 0 <= self.num_positions <= self.next_position

  @property
  def all_splits_delivered(self) -> bool:
    """No split is left to issue, or (exactly-once) to be acknowledged."""
    return self.splits_exhausted and not self.unacked and not self.reissue

  @property
  def fixes_workers(self) -> bool:
    return self.policy.is_static or self.num_consumers > 0


@dataclasses.dataclass
class Worker:
  address: str
  data_address: str
  last_heartbeat: float
  tasks: set[int] = dataclasses.field(default_factory=set)
  incarnation: str = ""  # of the worker's process ("": it sends none)
  pid: int = 0  # its process and that process's parent (0: it sends none)
  parent_pid: int = 0
  process_id: str = ""  # jaxfeed.service.protocol.target_workers.process_id
  tags: tuple[str, ...] = ()


class WorkerTable(dict):
  """Address -> Worker; a worker that comes or goes changes the clients'
  task lists (they list the tasks of live workers only)."""

  def __init__(self, task_lists_cache: task_lists.TaskListCache):
    super().__init__()
    self._task_lists = task_lists_cache

  def __setitem__(self, key, value):
    super().__setitem__(key, value)
    self._task_lists.changed()

  def __delitem__(self, key):
    super().__delitem__(key)
    self._task_lists.changed()

  def pop(self, *args):
    self._task_lists.changed()
    return super().pop(*args)


# A dispatcher process hands out ids (of datasets, jobs, clients and tasks)
# from its start time in microseconds times 2**ID_BITS_PER_US on, or after the
# highest id its journal holds. One that restarted without its state never
# gives an id its predecessor gave (workers and clients still hold those): that
# would take the predecessor more than 2**10 ids per microsecond it ran, or a
# clock set back by more than ids / 2**10 microseconds. Ids stay below 2**63
# (protobuf int64) until the year 2255.
ID_BITS_PER_US = 10


def first_id_now() -> int:
  """The first id a dispatcher process starting now may hand out."""
  return (time.time_ns() // 1000) << ID_BITS_PER_US


# Journal records that change a job's task list as clients see it.
TASK_LIST_RECORDS = frozenset({"task", "task_finished", "task_lost", "fix_workers"})
# Records that change which clients read a job (workers' task_clients).
CLIENT_RECORDS = frozenset({"client", "client_released", "job_deleted"})


class DispatcherTables:
  """The journaled state: every change is a record, applied by `_apply` as it
  happens and again when the journal is replayed after a restart."""

  # Set by the subclass, once the journal is open.
  lock: journal_lock.JournalLock

  def __init__(self):
    self.datasets: dict[str, pb.DatasetDef] = {}
    self.dataset_by_fingerprint: dict[str, str] = {}
    self.jobs: dict[int, Job] = {}
    self.job_by_name: dict[str, int] = {}
    # Clients' task lists, built once per change (see jaxfeed.service.dispatcher.task_lists).
    self._task_lists = task_lists.TaskListCache()
    self.workers: dict[str, Worker] = WorkerTable(self._task_lists)
    # Task id -> its job's id (entries of lost tasks and deleted jobs stay
    # until their worker's next heartbeat finds them gone).
    self._task_jobs: dict[int, int] = {}
    # This process's first id: ids below it were given by earlier processes.
    self.first_process_id = first_id_now()
    self._ids = itertools.count(self.first_process_id)
    # The id of the first process of this state (the "incarnation" record):
    # the same across restarts that replay the work_dir, new without one.
    # Ids below it belong to dispatchers that ran before with other state.
    self.incarnation = 0
    # Workers derive their read-ticket keys from it; journaled (and kept in
    # snapshots), so that the tickets clients hold stay valid across a restart.
    self._ticket_master: bytes | None = None
    # Datasets no job reads: id -> since when (not journaled: a restart
    # only extends their life).
    self._unread_since: dict[str, float] = {}
    # Version of every job's clients as workers see them; random at start,
    # so that no version a worker got from an earlier process matches.
    self.clients_version = random.getrandbits(62) + 1
    # Records come from the journal's files, not from a change being made.
    self.replaying = False

  # -- journaled changes --------------------------------------------------
  def _record(self, record: dict) -> None:
    """Applies a change; it is journaled when the lock is released."""
    self._apply(record)
    self.lock.add(record)
    if record["kind"] in TASK_LIST_RECORDS:
      self._task_lists.changed()
    elif record["kind"] == "job_deleted":
      self._task_lists.forget(record["job_id"])
    if record["kind"] in CLIENT_RECORDS:
      self.clients_version += 1

  def _live_records(self) -> list[dict]:
    next_id = next(self._ids)
    self._ids = itertools.count(next_id)
    records = state_snapshot.state_records(self.datasets, self.jobs, next_id)
    if self._ticket_master is not None:  # the tickets clients hold stay valid
      records.append({"kind": "ticket_master", "key": self._ticket_master.hex()})
    if self.incarnation:
      records.append({"kind": "incarnation", "id": self.incarnation})
    return records

  def _next_id(self) -> int:
    return next(self._ids)

  def unknown_id(self, what: str, value: int | str, otherwise: str) -> str:
    """Why `what` `value` is unknown, for a NOT_FOUND answer: made by a
    dispatcher that ran here before with other state (it restarted without
    its work_dir), or `otherwise`."""
    number = value if isinstance(value, int) else int(value) if str(value).isdigit() else -1
    shown = repr(value) if isinstance(value, str) else value
    if 0 < number < self.incarnation:
      return (
        f"Unknown {what} {shown}: it was made by an earlier dispatcher at this "
        "address, which restarted without its state (give the dispatcher a "
        "--work_dir to keep datasets and jobs across restarts); "
        f"{'register it' if what == 'dataset id' else 'start the read'} again."
      )
    return f"Unknown {what} {shown}: {otherwise}"

  def _apply(self, r: dict) -> None:
    journal_records.check_record(r, self.jobs)
    kind = r["kind"]
    if "id" in r:  # keep ids unique across restarts
      n = int(r["id"])
      current = next(self._ids)
      self._ids = itertools.count(max(current, n + 1))
    if kind == "ids":
      pass  # a snapshot's highest id: handled above
    elif kind == "incarnation":
      self.incarnation = int(r["id"])
    elif kind == "dataset":
      dataset_def = pb.DatasetDef.FromString(base64.b64decode(r["def"]))
      if self.replaying:  # computed from the definition, never trusted from the file
        dataset_def.fingerprint = spec_lib.fingerprint(dataset_def)
      self.datasets[r["dataset_id"]] = dataset_def
      self.dataset_by_fingerprint[dataset_def.fingerprint] = r["dataset_id"]
    elif kind == "dataset_deleted":
      dataset_def = self.datasets.pop(r["dataset_id"], None)
      if (
        dataset_def is not None
        and self.dataset_by_fingerprint.get(dataset_def.fingerprint) == r["dataset_id"]
      ):
        del self.dataset_by_fingerprint[dataset_def.fingerprint]
      self._unread_since.pop(r["dataset_id"], None)
    elif kind == "job":
      job = Job(
        int(r["id"]),
        r["dataset_id"],
        ShardingPolicy(r["policy"]),
        r["job_name"],
        r["num_consumers"],
        r["num_positions"],
        r.get("round_timeout_s", 0.0),
        exactly_once=r.get("exactly_once", False),
        ephemeral_sharing=r.get("ephemeral_sharing", False),
        target_workers=r.get("target_workers", target_workers.AUTO),
        skip=read_state.merge_ranges(r.get("skip", [])),
        identical_worker_streams=r.get("identical_worker_streams", False),
        resume_orders=list(r.get("resume_orders", [])),
      )
      job.next_position = read_state.skip_to(job.skip, 0)
      self.jobs[job.job_id] = job
      if job.job_name:
        self.job_by_name[job.job_name] = job.job_id
    elif kind == "fix_workers":
      self.jobs[r["job_id"]].fixed_workers = dict(r["workers"])
    elif kind == "task":
      job = self.jobs[r["job_id"]]
      job.tasks[int(r["id"])] = Task(
        int(r["id"]), job.job_id, r["worker_address"], r["worker_index"], r["num_workers"]
      )
      self._task_jobs[int(r["id"])] = job.job_id
      worker = self.workers.get(r["worker_address"])
      if worker is not None:
        worker.tasks.add(int(r["id"]))
    elif kind == "task_finished":
      task = self.jobs[r["job_id"]].tasks.get(r["task_id"])
      if task is not None:
        task.finished = True
    elif kind == "task_lost":
      job = self.jobs[r["job_id"]]
      job.tasks.pop(r["task_id"], None)
      job.last_splits.pop(r["task_id"], None)
      for start, (_, task_id) in list(job.unacked.items()):
        if task_id == r["task_id"]:  # its elements may never have arrived
          job.return_split(start)
    elif kind == "splits_held":
      job = self.jobs[r["job_id"]]
      for start in r["starts"]:
        if start not in job.unacked:
          continue
        if r["client_id"] in job.clients:
          job.holders[start] = r["client_id"]
        else:  # its client left before the worker told
          job.return_split(start)
    elif kind == "client":
      job = self.jobs[r["job_id"]]
      job.clients[int(r["id"])] = time.monotonic()
      if r.get("process"):
        job.client_processes[int(r["id"])] = r["process"]
      if job.num_consumers:
        job.consumers[int(r["id"])] = r.get("consumer_index", 0)
    elif kind == "client_released":
      job = self.jobs[r["job_id"]]
      job.clients.pop(r["client_id"], None)
      job.consumers.pop(r["client_id"], None)
      job.client_processes.pop(r["client_id"], None)
      for start, client_id in list(job.holders.items()):
        if client_id == r["client_id"]:  # it may never have had all of them
          job.return_split(start)
    elif kind == "job_deleted":
      job = self.jobs.pop(r["job_id"], None)
      if job is not None and self.job_by_name.get(job.job_name) == job.job_id:
        del self.job_by_name[job.job_name]
    elif kind == "splits":
      job = self.jobs[r["job_id"]]
      job.next_position = r["next_position"]
      if "request_seq" in r:
        job.last_splits[r["task_id"]] = (r["request_seq"], r["ranges"])
    elif kind == "splits_reply":  # from a compacted journal
      self.jobs[r["job_id"]].last_splits[r["task_id"]] = (r["request_seq"], r["ranges"])
    elif kind == "splits_issued":
      job = self.jobs[r["job_id"]]
      if "request_seq" in r:
        job.last_splits[r["task_id"]] = (r["request_seq"], r["ranges"])
      for start, stop in r["ranges"]:
        job.reissue.pop(start, None)
        job.holders.pop(start, None)
        job.unacked[start] = (stop, r["task_id"])
    elif kind == "ticket_master":
      self._ticket_master = bytes.fromhex(r["key"])
    elif kind == "splits_acked":
      job = self.jobs[r["job_id"]]
      for start in r["starts"]:
        job.unacked.pop(start, None)
        job.holders.pop(start, None)
        job.made.discard(start)
        job.reissue.pop(start, None)  # acknowledged just after its worker was lost
    elif kind == "splits_lost":
      self.jobs[r["job_id"]].reissue.update((start, stop) for start, stop in r["ranges"])
    elif kind == "splits_failed":  # a worker was lost while it made (or read) them
      job = self.jobs[r["job_id"]]
      if job.exactly_once:
        for start, stop in r["ranges"]:
          job.split_losses.setdefault(start, (stop, []))[1].append(f"{r['worker']}: {r['how']}")
      else:
        job.lost = read_state.merge_ranges(job.lost + r["ranges"])
    elif kind == "split_poisoned":  # handed out no more; the job fails
      job = self.jobs[r["job_id"]]
      job.reissue.pop(r["start"], None)
      job.failed_splits[r["start"]] = r["stop"]
      job.error = job.error or r["error"]
    else:
      raise ValueError(f"Unknown journal record kind {kind!r}.")
