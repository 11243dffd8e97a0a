"""The autocache policy: per autocache point, compute, write the cache, or
read it, from what each costs here.

For each point (an `autocache` op pointed at a folder; its entry names it)
the policy keeps what it measured:

- `compute_s`: seconds per element of its input, up to the point (the time
  spent waiting for the input, less the time other points spent writing
  their caches meanwhile);
- `read_s` and `write_s`: seconds per element to read the point's elements
  back from the folder and to write them there, measured on the point's own
  elements: first by a probe (the first elements of its first pass written
  into the folder and read back), then on every pass that reads or writes,
  and on a sample of the cache at the start of a pass that computes while
  the cache is complete;
- `bytes`: bytes per element in the cache;
- `elements`: elements per pass, once a pass has ended.

A point whose cache would be read faster than its input computes by more
than `TIE_MARGIN` (a near-tie computes: it costs no storage) is worth
caching. Among the points of one pipeline (an autocache whose input holds
another), only the one that saves the most seconds per pass caches (`read`
where its entry is complete, `write` where not); the others compute. A pass
without measurements (its point's first) computes and profiles its first
elements, then decides, writing those elements first where it chose
`write`. Every pass decides again from what the passes before it measured,
so a point whose reads turn out slower than its compute (a slower disk, a
cheaper input) goes back to computing, and one whose input grew slower
starts caching.

A store of preprocessed records (`jaxfeed.ops.shared_preprocessing`) is a
point too: its blocks are read or computed and written while its first
blocks are measured, then it keeps blocks (`read` where a block is there,
`write` where not) or computes them without keeping them (`compute`),
deciding again every `REDECIDE_LOOKUPS` records it looks up.

Each decision is counted (`decision_counts`: by job, point and decision) and
written, with its measurements and its reason, to
`.jaxfeed/policy/<entry>.json` in the folder, where `jaxfeed inspect DIR`
shows it. `policy="always"`
caches every point, as before this policy; `"never"` computes every point.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import tempfile
import threading
import time

__all__ = [
  "COMPUTE",
  "POLICIES",
  "READ",
  "WRITE",
  "Measurements",
  "Point",
  "decision_counts",
  "link",
  "point",
  "read_records",
]

COMPUTE, WRITE, READ = "compute", "write", "read"
PROFILE = "profile"
"""A pass without measurements: computes, profiles, then decides."""

POLICIES = ("auto", "always", "never")
"""`auto`: this policy; `always`: cache every point; `never`: compute."""

TIE_MARGIN = 0.1
"""A cache must be read this much faster than compute to be used."""

PROBE_MARGIN = 0.2
"""... and this much faster while its read cost is only the probe's
estimate (no pass has read it yet): a probe of a few elements reads them
back from the page cache, and a pass that writes and then finds reads
slower costs more than it can save."""

SAMPLE_ELEMENTS = 256
"""A computing pass whose point has a complete cache reads this many of its
elements (at most PROBE_MAX_BYTES) to measure reads again: the first
reads after a write compete with the write's flush to disk, and a point
must see its reads grow cheaper to go back to them."""

PROBE_MAX_BYTES = 8 << 20
"""The probe writes and reads back at most this many bytes of elements."""

WARMUP_ELEMENTS = 8
"""A profile's first elements (warming up the input) do not count."""

PROFILE_ELEMENTS = 128
PROFILE_MIN_S = 0.05
PROFILE_ENOUGH_BYTES = 4 << 20
PROFILE_MAX_S = 2.0
PROFILE_MAX_BYTES = 16 << 20
"""A first pass profiles at least PROFILE_ELEMENTS elements and either
PROFILE_MIN_S seconds or PROFILE_ENOUGH_BYTES bytes; at most PROFILE_MAX_S
seconds or PROFILE_MAX_BYTES bytes (or its whole pass, where shorter). It
keeps the elements it profiled, to write them where it decides to."""

PROFILE_BLOCKS = 2
REDECIDE_LOOKUPS = 4096
"""A record store decides after PROFILE_BLOCKS blocks, then every
REDECIDE_LOOKUPS records it looked up (those not in its memory)."""

_NEW_WEIGHT = 0.5  # of a pass's measurement against what came before

_POLICY_DIR = os.path.join(".jaxfeed", "policy")


@dataclasses.dataclass
class Measurements:
  """What a point costs; seconds and bytes per element (None: unmeasured)."""

  compute_s: float | None = None
  read_s: float | None = None
  write_s: float | None = None
  bytes: float | None = None
  elements: int | None = None
  read_passes: int = 0  # passes (or store blocks) whose reads were measured

  def update(self, **values: float | None) -> None:
    """Blends each given value into the one kept."""
    for name, value in values.items():
      if value is None:
        continue
      old = getattr(self, name)
      if name in ("elements", "read_passes") or old is None:
        setattr(self, name, value)
      else:
        setattr(self, name, (1 - _NEW_WEIGHT) * old + _NEW_WEIGHT * value)

  def margin(self) -> float:
    """How much faster reads must be: TIE_MARGIN once reads were measured,
    PROBE_MARGIN on the probe's estimate."""
    return TIE_MARGIN if self.read_passes else PROBE_MARGIN

  def cache_wins(self) -> bool:
    """Whether reading beats computing by more than the margin."""
    return (
      self.compute_s is not None
      and self.read_s is not None
      and self.read_s < self.compute_s * (1 - self.margin())
    )

  def saving_s(self) -> float:
    """Seconds a pass saves by reading instead of computing (per element
    where the elements per pass are unknown)."""
    if not self.cache_wins():
      return 0.0
    assert self.compute_s is not None and self.read_s is not None
    return (self.compute_s - self.read_s) * (self.elements or 1)


class _Group:
  """Points of one pipeline; `chosen` is the one that caches (None: none)."""

  def __init__(self, key: tuple[str, str]):
    self.keys = {key}
    self.chosen: tuple[str, str] | None = None
    self.overhead_s = 0.0  # seconds its points spent writing caches


class Point:
  """One autocache point: entry `entry` of folder `folder` (an absolute path).

  Shared by every pass over the point in this process (see `point`).
  """

  def __init__(self, folder: str, entry: str):
    self.folder, self.entry = folder, entry
    self.key = (folder, entry)
    self.measurements = Measurements()
    self.group = _Group(self.key)
    self.last: tuple[str, str] | None = None  # decision, reason
    self.blocks = 0  # records a store looked up since its last decision
    self._load()

  # -- decisions -------------------------------------------------------------
  def decide(self, complete: bool, policy: str, job: str) -> str:
    """How a pass starting now runs: READ, WRITE, COMPUTE, or PROFILE."""
    with _lock:
      if policy == "always" or policy == "never":
        decision = (READ if complete else WRITE) if policy == "always" else COMPUTE
        return self._record(decision, f"policy={policy!r}", job)
      if self.measurements.read_s is None or self.measurements.compute_s is None:
        return PROFILE
      return self._choose(complete, job)

  def profiled(self, complete: bool, job: str) -> str:
    """The decision at the end of a first pass's profile (not PROFILE)."""
    with _lock:
      return self._choose(complete, job)

  def _choose(self, complete: bool, job: str) -> str:
    group = self.group
    best, best_saving = None, 0.0
    for key in sorted(group.keys):
      member = _points.get(key)
      saving = member.measurements.saving_s() if member is not None else 0.0
      if saving > best_saving:
        best, best_saving = key, saving
    group.chosen = best
    for key in group.keys - {self.key, best}:
      member = _points.get(key)
      if member is not None and member.last is not None and member.last[0] != COMPUTE:
        why = (
          f"caching point {best[1][:16]} saves more"
          if best is not None
          else "no point of its pipeline is worth caching now"
        )
        member._record(COMPUTE, why, job)  # pylint: disable=protected-access
    m = self.measurements
    assert m.compute_s is not None and m.read_s is not None
    costs = f"read {m.read_s * 1e6:.1f} us/element, compute {m.compute_s * 1e6:.1f} us/element"
    if best == self.key:
      return self._record(READ if complete else WRITE, f"{costs}: reading saves most", job)
    if not m.cache_wins():
      reason = f"{costs}: reading is not {m.margin():.0%} faster"
    else:
      other = best[1] if best is not None else "?"
      reason = f"{costs}, but caching point {other[:16]} saves more"
    return self._record(COMPUTE, reason, job)

  def block_mode(self, policy: str, job: str, read_share: float) -> str:
    """How a record store's next block runs: PROFILE, READ (kept: read
    where the block is there, computed and written where not) or COMPUTE
    (computed, not kept). `read_share`: of the blocks since the last
    decision, the share that were read (the decision's name: read or write)."""
    with _lock:
      if policy in ("always", "never"):
        if self.last is None:
          self._record(READ if policy == "always" else COMPUTE, f"policy={policy!r}", job)
        assert self.last is not None
        return self.last[0]
      m = self.measurements
      if m.compute_s is None and m.read_s is not None:
        self._load()  # every block was there: another reader measured compute
        m = self.measurements
      if m.read_s is None or m.compute_s is None:
        return PROFILE
      if self.last is None or self.blocks >= REDECIDE_LOOKUPS:
        self.blocks = 0
        costs = f"read {m.read_s * 1e6:.1f} us/record, compute {m.compute_s * 1e6:.1f} us/record"
        if m.cache_wins():
          self._record(READ if read_share >= 0.5 else WRITE, f"{costs}: records kept", job)
        else:
          self._record(COMPUTE, f"{costs}: reading is not {m.margin():.0%} faster", job)
      self.blocks += 1
      assert self.last is not None
      return COMPUTE if self.last[0] == COMPUTE else READ

  def _record(self, decision: str, reason: str, job: str) -> str:
    _counts[(job or "local", self.label, decision)] += 1
    self.last = (decision, reason)
    self._save(job)
    return decision

  @property
  def label(self) -> str:
    """The point's short name in metrics."""
    return self.entry[:16]

  def chosen(self) -> bool:
    """Whether this point is still its pipeline's cached one."""
    return self.group.chosen in (None, self.key)

  # -- the folder's record ---------------------------------------------------
  def _path(self) -> str:
    return os.path.join(self.folder, _POLICY_DIR, self.entry + ".json")

  def _load(self) -> None:
    """Fills what this process has not measured from what another process
    sharing the folder measured, where one did."""
    try:
      with open(self._path(), encoding="utf-8") as f:
        saved = json.load(f).get("measurements", {})
    except (OSError, ValueError, AttributeError):
      return
    if not isinstance(saved, dict):
      return
    for field in dataclasses.fields(Measurements):
      value = saved.get(field.name)
      if getattr(self.measurements, field.name) is None and isinstance(value, (int, float)):
        setattr(self.measurements, field.name, value)

  def _save(self, job: str) -> None:
    assert self.last is not None
    record = {
      "entry": self.entry,
      "job": job or "local",
      "decision": self.last[0],
      "reason": self.last[1],
      "time": time.time(),
      "measurements": dataclasses.asdict(self.measurements),
    }
    directory = os.path.dirname(self._path())
    try:
      os.makedirs(directory, exist_ok=True)
      fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-")
      with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(record, f)
      os.replace(tmp, self._path())
    except OSError:
      pass  # a read-only folder: the decision stands, unrecorded


_lock = threading.RLock()
_points: dict[tuple[str, str], Point] = {}
_counts: collections.Counter = collections.Counter()


def point(folder: str, entry: str) -> Point:
  """The process's point for `entry` of `folder`."""
  key = (os.path.abspath(folder), entry)
  with _lock:
    found = _points.get(key)
    if found is None:
      found = _points[key] = Point(*key)
    return found


def link(points: list[Point]) -> None:
  """Puts `points` (the autocache points of one pipeline) in one group."""
  with _lock:
    groups = {id(p.group): p.group for p in points}
    if len(groups) < 2:
      return
    merged = _Group(points[0].key)
    for group in groups.values():
      merged.keys |= group.keys
      merged.overhead_s += group.overhead_s
    for key in merged.keys:
      member = _points.get(key)
      if member is not None:
        member.group = merged


def decision_counts() -> dict[tuple[str, str, str], int]:
  """(job, point, decision) -> decisions made in this process."""
  with _lock:
    return dict(_counts)


def read_records(folder: str) -> list[dict]:
  """The decisions recorded in autocache folder `folder`, newest first."""
  directory = os.path.join(folder, _POLICY_DIR)
  try:
    names = sorted(os.listdir(directory))
  except OSError:
    return []
  records = []
  for name in names:
    if not name.endswith(".json") or name.startswith("."):
      continue
    try:
      with open(os.path.join(directory, name), encoding="utf-8") as f:
        record = json.load(f)
    except (OSError, ValueError):
      continue
    if isinstance(record, dict):
      records.append(record)
  return sorted(records, key=lambda r: -float(r.get("time", 0)))
