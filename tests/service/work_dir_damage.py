"""A dispatcher's work_dir with every kind of journal record, and bits flipped in it.

`make_busy_work_dir` drives a real dispatcher process through fake workers
and clients (their RPCs, deterministic) until its work_dir holds a snapshot
and journal lines of every record kind, then SIGKILLs it. `Truth` is what a
restart on that work_dir must give: the same dataset ids for the same
pipelines, and an exactly-once job whose remaining splits, issued to a
worker that comes back and acknowledged by its client, deliver every
position exactly once with the positions acknowledged before the kill.
`flip_positions` picks seeded bits to flip, spread over the files and over
every record kind.
"""

from __future__ import annotations

import base64
import collections
import dataclasses
import pathlib
import random
import re
import time
from typing import Any, Callable

import dispatcher_parties
from jaxfeed.service.protocol.protos import service_pb2 as pb

FLAGS = dispatcher_parties.FLAGS
EXACTLY_ONCE_POSITIONS = 1000
WAIT_S = dispatcher_parties.WAIT_S
_KIND = re.compile(rb'"kind":"(\w+)"')
Parties = dispatcher_parties.Parties


@dataclasses.dataclass
class Truth:
  """What a restarted dispatcher must give (see the module docstring)."""

  dataset_ids: dict[int, str]  # pipeline size -> dataset id
  job_id: int
  client_id: int
  acked: list[tuple[int, int]]  # ranges acknowledged before the kill

  def check(self, address: str) -> None:
    """Raises AssertionError unless the dispatcher at `address` gives it."""
    parties = Parties(address)
    try:
      for size, dataset_id in sorted(self.dataset_ids.items()):
        got = parties.register(size)
        assert got == dataset_id, (
          f"the pipeline of {size} records registered again got dataset id {got}, "
          f"not its id {dataset_id}"
        )
      # Worker 1 comes back as a new process: its splits are issued again.
      task = next(
        t for t in parties.worker("127.0.0.1:1", "again").new_tasks if t.job_id == self.job_id
      )
      delivered = collections.Counter()
      for start, stop in self.acked:
        delivered.update(range(start, stop))
      for seq in range(1, 200):
        ranges, end = parties.splits(task, seq)
        for start, stop in ranges:
          delivered.update(range(start, stop))
        if ranges:
          parties.ack(self.job_id, self.client_id, [start for start, _ in ranges])
        if end:
          break
      twice = sorted(p for p, n in delivered.items() if n > 1)
      missing = sorted(set(range(EXACTLY_ONCE_POSITIONS)) - set(delivered))
      assert not twice and not missing and end, (
        f"exactly-once after the restart: {len(twice)} positions twice (e.g. "
        f"{twice[:5]}), {len(missing)} never (e.g. {missing[:5]}), ended: {end}"
      )
    finally:
      parties.close()


def make_busy_work_dir(start: Callable[..., Any]) -> Truth:
  """Drives dispatcher processes through every kind of record; returns
  what a restart must give.

  `start(*flags)` starts a dispatcher process (a ServiceProcess) with FLAGS
  and `flags` on the work_dir. A first one snapshots after every change, so
  that its snapshot holds every kind of live state; it is SIGKILLed, and a
  second one that never snapshots adds journal lines of every kind; it is
  SIGKILLed too.
  """
  dispatcher = start("--snapshot_every_records=1")
  parties = Parties(dispatcher.address)
  eo = _ExactlyOnce(parties)
  try:
    ids = {size: parties.register(size) for size in (EXACTLY_ONCE_POSITIONS, 30)}
    eo.start(ids[EXACTLY_ONCE_POSITIONS], ("127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"))
    parties.job(ids[30], "off", job_name="rr", num_consumers=2)  # fixes its workers
    eo.rounds(3)
    eo.leave("127.0.0.1:3")  # its splits wait to be issued again
    _snapshot_everything(parties, ids[30], work_dir_of(dispatcher))
    _kill_when_idle(dispatcher)
    dispatcher = start("--snapshot_every_records=0")
    parties.close()
    parties = eo.parties = Parties(dispatcher.address)
    ids.update({size: parties.register(size) for size in (40, 50)})
    shared, shared_client = parties.job(ids[40], "parallel_epochs", job_name="kept")
    parties.release(*parties.job(ids[40], "parallel_epochs"))  # its job is deleted
    parties.job(ids[50], "off", job_name="rr2", num_consumers=2)
    eo.rounds(6)
    eo.leave("127.0.0.1:2")
    eo.rounds(3)
    eo.finish_others("127.0.0.1:1")
    parties.ack(shared, shared_client, [])
    _kill_when_idle(dispatcher)
  finally:
    parties.close()
    dispatcher.kill()
  return Truth(ids, eo.job_id, eo.client_id, eo.acked)


class _ExactlyOnce:
  """An exactly-once job read by fake workers (one task each) and a client."""

  def __init__(self, parties: Parties):
    self.parties = parties
    self.tasks: dict[str, pb.TaskInfo] = {}
    self.known: dict[str, set[int]] = collections.defaultdict(set)  # each worker's tasks
    self.seqs: collections.Counter = collections.Counter()
    self.acked: list[tuple[int, int]] = []
    self.job_id = self.client_id = 0
    self.round = 0

  def start(self, dataset_id: str, workers: tuple[str, ...]) -> None:
    for address in workers:
      self.parties.worker(address, address)
    self.job_id, self.client_id = self.parties.job(
      dataset_id, "distributed_epoch", exactly_once=True
    )
    for address in workers:
      self.tasks[address] = next(
        t for t in self.parties.worker(address, address).new_tasks if t.job_id == self.job_id
      )
      self.known[address].add(self.tasks[address].task_id)

  def heartbeat(self, address: str, **options: Any) -> None:
    """A heartbeat of the worker at `address`, which runs the tasks it got."""
    response = self.parties.worker(address, address, current=sorted(self.known[address]), **options)
    self.known[address].update(t.task_id for t in response.new_tasks)

  def rounds(self, count: int) -> None:
    """Each worker gets splits and says its client holds them; the client
    acknowledges two rounds of three."""
    for address in self.tasks:
      self.heartbeat(address)  # back after a restart of the dispatcher, or new tasks
    for _ in range(count):
      self.round += 1
      for address, task in self.tasks.items():
        self.seqs[address] += 1
        ranges, _ = self.parties.splits(task, self.seqs[address])
        self.heartbeat(address, held=[(task.task_id, self.client_id, [s for s, _ in ranges])])
        if self.round % 3:
          self.parties.ack(self.job_id, self.client_id, [s for s, _ in ranges])
          self.acked += ranges

  def leave(self, address: str) -> None:
    self.parties.worker(address, address, leaving=True)  # its task is lost
    del self.tasks[address]

  def finish_others(self, address: str) -> None:
    """The worker's tasks of other jobs finish."""
    self.heartbeat(address)
    self.heartbeat(address, finished=sorted(self.known[address] - {self.tasks[address].task_id}))


def work_dir_of(dispatcher) -> pathlib.Path:
  return pathlib.Path(
    next(f.split("=", 1)[1] for f in dispatcher.proc.args if f.startswith("--work_dir="))
  )


def _snapshot_everything(parties: Parties, dataset_id: str, work_dir: pathlib.Path) -> None:
  """Changes the state (a client joins a job) until a snapshot holds the
  last changes: one that starts while another is written is skipped."""
  deadline = time.monotonic() + WAIT_S
  while time.monotonic() < deadline:
    parties.job(dataset_id, "parallel_epochs", job_name="probe")
    time.sleep(0.3)
    snapshot = (work_dir / "snapshot.json").read_bytes()
    if all(f'"kind":"{k}"'.encode() in snapshot for k in ("splits_lost", "splits_held")):
      return
  raise TimeoutError(f"No snapshot in {work_dir} holds the last changes.")


def _kill_when_idle(dispatcher) -> None:
  """SIGKILL, once a snapshot under way is written."""
  work_dir = work_dir_of(dispatcher)
  deadline = time.monotonic() + WAIT_S
  while (work_dir / "snapshot.json.tmp").exists() and time.monotonic() < deadline:
    time.sleep(0.05)
  dispatcher.kill()


@dataclasses.dataclass(frozen=True)
class Flip:
  """One bit to flip: in file `name` at byte `offset`, in a line (starting
  at `line_start`) whose records are of `kinds`."""

  name: str
  offset: int
  bit: int
  line_start: int
  kinds: tuple[str, ...]

  def apply(self, work_dir: pathlib.Path) -> None:
    path = work_dir / self.name
    data = bytearray(path.read_bytes())
    data[self.offset] ^= 1 << self.bit
    path.write_bytes(bytes(data))


def record_lines(work_dir: pathlib.Path) -> list[tuple[str, int, int, tuple[str, ...]]]:
  """(file, line start, line end, record kinds) of every line of the
  journal and snapshot files ("header" for a line without records)."""
  found = []
  for path in sorted(work_dir.iterdir()):
    if not (path.name.startswith("journal") or path.name == "snapshot.json"):
      continue
    offset = 0
    for line in path.read_bytes().splitlines(keepends=True):
      kinds = tuple(sorted({k.decode() for k in _KIND.findall(line)})) or ("header",)
      found.append((path.name, offset, offset + len(line), kinds))
      offset += len(line)
  return found


def flip_positions(work_dir: pathlib.Path, seeds) -> list[Flip]:
  """One bit per seed: seed i takes a record kind in turn (every kind the
  files hold, in the snapshot and in the journal), a line of that kind and
  a byte and bit in it, from `random.Random(i)`."""
  lines = record_lines(work_dir)
  groups = collections.defaultdict(list)
  for name, start, end, kinds in lines:
    where = "snapshot" if name == "snapshot.json" else "journal"
    for kind in kinds:
      groups[(where, kind)].append((name, start, end, kinds))
  keys = sorted(groups)
  flips = []
  for seed in seeds:
    rng = random.Random(seed)
    name, start, end, kinds = rng.choice(groups[keys[seed % len(keys)]])
    flips.append(Flip(name, rng.randrange(start, end), rng.randrange(8), start, kinds))
  return flips


def targeted_flips(work_dir: pathlib.Path) -> list[Flip]:
  """Bits whose flip leaves a journal line valid JSON with other values:
  a digit of the last `next_position` (splits issued again, or never), and
  a character of the base64 of a dataset's fingerprint in its record (the
  pipeline, registered again, would get a new id)."""
  flips = []
  for name, start, end, kinds in reversed(record_lines(work_dir)):
    if name == "snapshot.json":
      continue
    line = (work_dir / name).read_bytes()[start:end]
    if "splits" in kinds and len(flips) == 0:
      at = line.index(b'"next_position":') + len(b'"next_position":')
      flips.append(Flip(name, start + at, 0, start, kinds))
    elif kinds == ("dataset",) and len(flips) == 1:
      encoded = re.search(rb'"def":"([^"]+)"', line)
      dataset_def = pb.DatasetDef.FromString(base64.b64decode(encoded.group(1)))
      at = dataset_def.SerializeToString().index(dataset_def.fingerprint.encode())
      index = encoded.start(1) + (at + 4) * 4 // 3  # a character inside the fingerprint
      while line[index : index + 1] not in _FLIPS_TO_BASE64:
        index += 1
      flips.append(Flip(name, start + index, 0, start, kinds))
      return flips
  raise ValueError(f"{work_dir} lacks a splits or dataset record in its journal.")


# Characters whose lowest bit flipped is base64 still.
_FLIPS_TO_BASE64 = {
  bytes([c]) for c in b"ABCDEFGHIJKLMNOPQRSTUVWXYabcdefghijklmnopqrstuvwxy0123456789"
}


def kinds_present(work_dir: pathlib.Path) -> set[tuple[str, str]]:
  """(snapshot | journal, record kind) of every line."""
  return {
    ("snapshot" if name == "snapshot.json" else "journal", kind)
    for name, _, _, kinds in record_lines(work_dir)
    for kind in kinds
  }
