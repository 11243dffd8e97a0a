"""Where an exactly-once service read stands, so that it can resume.

An exactly-once `distributed_epoch` read receives every split of the job
(a range [start, stop) of the positions of the pipeline's split input) whole
and once; the consumer then takes the split's elements one by one.
`SplitProgress` follows what the consumer took, per split, as of its last
`next()`. Its state (`SplitProgress.state()`, small and JSON-able):

  {"version": 1, "done": [[a, b], ...], "partial": [[start, stop, taken], ...]}

`done`: the positions of the splits of which the consumer took every element
(adjacent ranges merged, so a read in order keeps one range); `partial`: the
splits of which it took the first `taken` elements. Elements that arrived but
were not taken (the client's buffer, batches read ahead) are in neither.

A read restored from such a state starts a new job (`resume_job_name`) that
skips the `done` positions and issues each `partial` split again, whole and
first; the client drops the first `taken` elements of each. The rest of the
epoch is thus delivered once: the remaining positions, and the rest of each
partly taken split. This relies on a split's elements being a function of its
range, which holds for jaxfeed pipelines after the split input (per-record
seeds; see `jaxfeed.service.worker.task_pipeline`) but not for a UDF that draws its
own randomness or reads the clock.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import os
import threading
from typing import Any, Iterable, NamedTuple, Sequence

from jaxfeed.service.protocol import wire

STATE_VERSION = 1


class ResumeStateError(ValueError):
  """A service read's saved state is malformed or does not fit the job."""


class SplitTag(NamedTuple):
  """An element's place: element `index` of the `count` of split [start, stop)."""

  start: int
  stop: int
  index: int
  count: int


def merge_ranges(ranges: Iterable[Sequence[int]]) -> list[list[int]]:
  """Sorted, disjoint [start, stop) ranges covering `ranges` (adjacent ones
  joined; empty ones dropped)."""
  merged: list[list[int]] = []
  for start, stop in sorted((int(a), int(b)) for a, b in ranges if b > a):
    if merged and start <= merged[-1][1]:
      merged[-1][1] = max(merged[-1][1], stop)
    else:
      merged.append([start, stop])
  return merged


def skip_to(skip: Sequence[Sequence[int]], position: int) -> int:
  """The first position >= `position` outside the sorted, disjoint `skip`."""
  i = bisect.bisect_right([a for a, _ in skip], position) - 1
  if i >= 0 and position < skip[i][1]:
    return skip[i][1]
  return position


def clip(skip: Sequence[Sequence[int]], start: int, stop: int) -> int:
  """`stop`, cut at the first range of `skip` that starts after `start`."""
  i = bisect.bisect_right([a for a, _ in skip], start)
  return min(stop, skip[i][0]) if i < len(skip) else stop


_is_int = wire.is_int


def check_state(state: Any) -> tuple[list[list[int]], list[list[int]]]:
  """(done ranges, partial [start, stop, taken]) of a `SplitProgress.state()`.

  Raises:
    ResumeStateError: naming what is wrong.
  """
  if (
    not isinstance(state, dict)
    or state.get("version") != STATE_VERSION
    or set(state) != {"version", "done", "partial"}
  ):
    raise ResumeStateError(
      f"A service read's state must be a dict with version {STATE_VERSION}, "
      f"'done' and 'partial', got {str(state):.200}."
    )
  done, partial = state["done"], state["partial"]
  if not isinstance(done, list) or not all(
    isinstance(r, list) and len(r) == 2 and all(map(_is_int, r)) and 0 <= r[0] < r[1] for r in done
  ):
    raise ResumeStateError(
      f"A service read's 'done' must be a list of [start, stop) "
      f"ranges with 0 <= start < stop, got {str(done):.200}."
    )
  if not isinstance(partial, list) or not all(
    isinstance(p, list) and len(p) == 3 and all(map(_is_int, p)) and 0 <= p[0] < p[1] and p[2] > 0
    for p in partial
  ):
    raise ResumeStateError(
      f"A service read's 'partial' must be a list of [start, stop, taken] with "
      f"0 <= start < stop and taken > 0, got {str(partial):.200}."
    )
  ranges = [list(r) for r in done] + [p[:2] for p in partial]
  if sum(b - a for a, b in ranges) != sum(b - a for a, b in merge_ranges(ranges)):
    raise ResumeStateError(
      f"A service read's state has overlapping splits: "
      f"done {str(done):.200}, partial {str(partial):.200}."
    )
  return [list(r) for r in done], [list(p) for p in partial]


def check_resume_ranges(
  done: Sequence[Sequence[int]], partial: Sequence[Sequence[int]], num_positions: int
) -> None:
  """Raises ResumeStateError unless the ranges lie in [0, num_positions) and
  do not overlap (the dispatcher's check of a resumed job's request)."""
  ranges = [list(r) for r in done] + [list(r) for r in partial]
  bad = [
    r for r in ranges if not (0 <= r[0] < r[1] and (num_positions < 0 or r[1] <= num_positions))
  ]
  if bad:
    raise ResumeStateError(
      f"A resumed read names splits {bad[:4]} outside the dataset's "
      f"{num_positions} positions: it was saved from another dataset."
    )
  if sum(b - a for a, b in ranges) != sum(b - a for a, b in merge_ranges(ranges)):
    raise ResumeStateError("A resumed read names overlapping splits.")


def resume_job_name(job_name: str, state: dict, restore_id: str = "") -> str:
  """The shared job that every consumer resuming `state` of job `job_name`
  in restore `restore_id` reads: a new one, never the checkpointed job (it
  has gone on since), nor that of another restore of the same state (a job
  preempted twice, restored twice from one checkpoint)."""
  digest = hashlib.sha256(json.dumps([state, restore_id], sort_keys=True).encode())
  return f"{job_name}/resumed-{digest.hexdigest()[:16]}"


def new_restore_id() -> str:
  """A random id of one restore (see `resume_job_name`)."""
  return os.urandom(8).hex()


class SplitProgress:
  """What the consumer of an exactly-once read took, split by split.

  Args:
    state: a `state()` to go on from (a restored read), or None.
    restore_id: the restore's id (`resume_job_name`), for a restored read.
  """

  def __init__(self, state: dict | None = None, restore_id: str = ""):
    done, partial = check_state(state) if state is not None else ([], [])
    self.resumed_from = state  # the state the read's job was created from
    self.restore_id = restore_id  # the restore's, shared by its consumers
    self._lock = threading.Lock()
    self._done = merge_ranges(done)
    # start -> [stop, taken]: splits partly taken.
    self._partial = {start: [stop, taken] for start, stop, taken in partial}
    # Restored partial splits: start -> elements already taken before.
    self._drop = {start: taken for start, _, taken in partial}

  @property
  def resume_ranges(self) -> tuple[list[list[int]], list[list[int]]]:
    """(done, partial [start, stop]) ranges of the state the read resumed."""
    done, partial = check_state(self.resumed_from) if self.resumed_from else ([], [])
    return done, [p[:2] for p in partial]

  def arrived(self, start: int, stop: int, elements: list) -> list[tuple[Any, SplitTag]]:
    """A whole split arrived: its elements to hand on, each with its tag,
    less those a restored read had already taken."""
    with self._lock:
      drop = self._drop.pop(start, 0)
      count = len(elements)
      if drop >= count:
        self._add_done(start, stop)
        return []
    return [
      (element, SplitTag(start, stop, drop + i, count))
      for i, (element, _) in enumerate(elements[drop:])
    ]

  def took(self, tag: SplitTag) -> None:
    """The consumer took the element of `tag`."""
    with self._lock:
      if tag.index + 1 >= tag.count:
        self._add_done(tag.start, tag.stop)
      else:
        self._partial[tag.start] = [tag.stop, tag.index + 1]

  def _add_done(self, start: int, stop: int) -> None:
    self._partial.pop(start, None)
    if stop <= start:
      return  # a worker that does not say where its splits stop
    i = bisect.bisect_left(self._done, [start, stop])
    self._done.insert(i, [start, stop])
    lo = max(i - 1, 0)
    self._done[lo : i + 2] = merge_ranges(self._done[lo : i + 2])

  def state(self) -> dict:
    """The JSON-able state as of the consumer's last element."""
    with self._lock:
      return {
        "version": STATE_VERSION,
        "done": [list(r) for r in self._done],
        "partial": [[start, stop, taken] for start, (stop, taken) in sorted(self._partial.items())],
      }

  @property
  def started(self) -> bool:
    """Whether anything was taken (or restored)."""
    with self._lock:
      return bool(self._done or self._partial)


def merge_states(states: Sequence[dict]) -> dict:
  """One state of what the consumers of a shared job took together, from
  each consumer's `SplitProgress.state()`.

  Each split went to one consumer; consumers restored from one merged state
  all list its partly taken splits, and the one that took more of a split
  (or all of it) knows best.
  """
  checked = [check_state(state) for state in states]
  done = merge_ranges(r for d, _ in checked for r in d)
  taken: dict[tuple[int, int], int] = {}
  for _, partial in checked:
    for start, stop, count in partial:
      taken[(start, stop)] = max(count, taken.get((start, stop), 0))
  partial = [
    [start, stop, count]
    for (start, stop), count in sorted(taken.items())
    if skip_to(done, start) == start
  ]  # not taken whole by another
  merged = {"version": STATE_VERSION, "done": done, "partial": partial}
  check_state(merged)  # a split twice: states of different jobs or epochs
  return merged


def merge_process_states(
  pipeline_states: Sequence[Any], restore_id: str | None = None
) -> list[Any]:
  """The processes' pipeline states with each shared exactly-once read's
  state replaced by what all its consumers took (`merge_states`), and
  marked with `restore_id` (None: a new one), which every process of one
  restore must share (`resume_job_name`).

  `pipeline_states[h]` is process h's (an op state tree, see
  `jaxfeed.ops.base.OpIterator.get_state`). Reads of one job are those at
  the same place in the pipeline with the same `job_name`; reads without a
  job name (each process its own job) stay as they are. Restoring the result
  on every process resumes the shared job once, on one new job.
  """
  states = [json.loads(json.dumps(state)) for state in pipeline_states]
  restore_id = restore_id or new_restore_id()

  def visit(nodes: list) -> None:
    if not all(isinstance(n, dict) and "own" in n for n in nodes):
      return
    groups: dict[str, list[dict]] = {}
    for node in nodes:
      own = node.get("own")
      if (
        node.get("op") == "distribute"
        and isinstance(own, dict)
        and own.get("job_name")
        and "splits" in own
      ):
        groups.setdefault(own["job_name"], []).append(own)
    for name, owns in groups.items():
      identities = {json.dumps(own.get("identity"), sort_keys=True) for own in owns}
      if len(identities) > 1:
        raise ResumeStateError(
          f"The processes' reads of shared job {name!r} were saved from "
          f"different pipelines: {sorted(identities)!s:.400}."
        )
      merged = merge_states([own["splits"] for own in owns])
      for own in owns:
        own["splits"] = merged
        own["restore_id"] = restore_id
    parents = [n.get("parents") for n in nodes]
    if all(isinstance(p, list) and len(p) == len(parents[0]) for p in parents):
      for i in range(len(parents[0])):
        visit([p[i] for p in parents])

  visit(states)
  return states


def has_shared_read(pipeline_state: Any) -> bool:
  """Whether the state holds an exactly-once read of a named (shared) job."""
  if not isinstance(pipeline_state, dict):
    return False
  own = pipeline_state.get("own")
  if (
    pipeline_state.get("op") == "distribute"
    and isinstance(own, dict)
    and own.get("job_name")
    and "splits" in own
  ):
    return True
  return any(has_shared_read(p) for p in pipeline_state.get("parents") or ())
