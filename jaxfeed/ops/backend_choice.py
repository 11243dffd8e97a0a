"""AUTOTUNE's choice of who computes a fused chain: the consumer's thread
("inline"), worker threads ("thread") or worker processes ("process").

`BackendChooser` is the rule, apart from the iterator that follows it so that
it can be tested with injected measurements. The iterator runs the backend
`backend()` names and reports, window by window, the rate at which it turned
input elements into batches (`record`): wall-clock, end to end, so what the
consumer's own thread costs (its share of the cores, the GIL it holds) is in
every rate, and so are the cores this process may use.

* Measuring: the candidates take turns, a window each, in the order given
  (which may name one twice: one measured while worker processes start and
  again after); a backend's rate is the best of its windows (what else runs
  on the machine only ever slows a window down). A backend faster than all
  others by `CLEAR` runs at once; those closer are measured again first, up
  to `FIRST_ROUNDS` windows each. Then the fastest runs; rates within `TIE`
  of each other count as equal and go to the one that costs least CPU
  (inline, then threads, then processes).
* Keeping measuring: the running backend keeps being measured. After
  `explore_every` seconds of running (from `EXPLORE_FIRST_S`, doubling each
  time the others prove slower, up to `EXPLORE_MAX_S`), or at once when its
  rate falls below `DROP` of what it was when chosen (the machine got
  busier, the function dearer: its best window of the last `SETTLE_S`
  seconds of running, as a backend's rate is its best window), the
  others are measured again, then the running one once more, and the
  fastest runs; another backend takes over only when it is faster by
  `SWITCH_MARGIN`, so that noise does not make the choice flap.

The findings belong to the dataset (its fused node), not to one iterator: an
epoch loop measures once, and goes on measuring as it runs.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Sequence

__all__ = [
  "BackendChooser",
  "Window",
  "WINDOW_S",
  "WINDOW_CHUNKS",
  "PREFERENCE",
  "TIE",
  "CLEAR",
  "SWITCH_MARGIN",
  "DROP",
  "SETTLE_S",
  "FIRST_ROUNDS",
  "EXPLORE_FIRST_S",
  "EXPLORE_MAX_S",
]

PREFERENCE = ("inline", "thread", "process")
"""Backends from the least CPU used for the same work to the most."""

TIE = 0.03
"""Rates closer than this (relative) are a tie, won by the cheaper backend."""

SWITCH_MARGIN = 0.1
"""Another backend replaces the running one only when this much faster."""

DROP = 0.6
"""The running backend's best window of the last `SETTLE_S` seconds below
this share of its rate when chosen sends the chooser measuring the others
again, once it has run `SETTLE_S` since the last measurement: on a busy
machine the rate of every window is noisy (a mean of them falls below the
best window the pick was chosen by, with no change at all), and each
measurement runs slower backends."""

SETTLE_S = 2.0

CLEAR = 0.2
"""A backend this much faster than every other is picked without measuring
them again."""

FIRST_ROUNDS = 2
"""The most windows a backend is measured for in one measurement, when the
fastest is not clear."""

EXPLORE_FIRST_S = 10.0
EXPLORE_MAX_S = 160.0
"""Seconds of running between two measurements of the other backends."""


def _label(backend: str) -> str:
  return {"inline": "inline", "thread": "threads", "process": "processes"}.get(backend, backend)


class BackendChooser:
  """Which backend runs a fused chain now (see the module docstring).

  Thread-safe: iterators of one dataset may report from several threads.

  Args:
    candidates: the backends to choose from.
    excluded: backends ruled out and why (reported by `summary`).
    order: the windows of the first measurement, by backend (default: the
      candidates in turn).
  """

  def __init__(
    self,
    candidates: Sequence[str],
    excluded: dict[str, str] | None = None,
    order: Sequence[str] | None = None,
  ):
    self._lock = threading.Lock()
    self.excluded = dict(excluded or {})
    self.candidates = [c for c in candidates if c not in self.excluded]
    if not self.candidates:
      raise ValueError("BackendChooser: no candidate backend left.")
    self.rates: dict[str, float] = {}
    self._round: dict[str, float] = {}  # best rates of the measurement
    self._windows: collections.Counter = collections.Counter()  # per backend
    self._todo = (
      [c for c in (order or self.candidates) if c in self.candidates]
      if len(self.candidates) > 1
      else []
    )
    self._pick: str | None = None if self._todo else self.candidates[0]
    self._reason = "measuring" if self._todo else f"the only backend ({self._why_others()})"
    self._reference = 0.0  # the pick's rate when it was chosen
    # The pick's windows of the last SETTLE_S seconds: (seconds, rate).
    self._recent: collections.deque = collections.deque()
    self._run_s = 0.0  # seconds the pick ran since the last round
    self.explore_every = EXPLORE_FIRST_S
    self.rounds = 0  # measurements of every candidate so far

  def backend(self) -> str:
    """The backend to run now: the next to measure, or the pick."""
    with self._lock:
      return self._todo[0] if self._todo else self._pick

  @property
  def measuring(self) -> bool:
    with self._lock:
      return bool(self._todo)

  def record(self, backend: str, rate: float, seconds: float) -> None:
    """A window of `seconds` in which `backend` produced `rate` input
    elements per second."""
    with self._lock:
      if backend not in self.candidates:
        return
      if self._todo:
        self._round[backend] = max(rate, self._round.get(backend, 0.0))
        self._windows[backend] += 1
        if backend == self._todo[0]:
          self._todo.pop(0)
          if not self._todo:
            self._end_round()
        return
      if backend != self._pick:
        return
      self.rates[backend] = rate
      self._run_s += seconds
      recent = self._recent
      recent.append((seconds, rate))
      while sum(s for s, _ in recent) - recent[0][0] >= SETTLE_S:
        recent.popleft()
      # A noisy machine slows some windows down: a fall is when none of the
      # last SETTLE_S seconds came near the rate the pick was chosen at.
      best = max(r for _, r in recent)
      if best < DROP * self._reference and self._run_s >= SETTLE_S:
        self._explore(f"{_label(backend)} fell from {self._reference:,.0f}/s to {best:,.0f}/s")
      elif self._run_s >= self.explore_every:
        self._explore(f"{self._run_s:.0f} s since the last measurement")

  def exclude(self, backend: str, reason: str) -> None:
    """Rules `backend` out from now on (e.g. its processes failed to start)."""
    with self._lock:
      if backend not in self.candidates or len(self.candidates) == 1:
        return
      self.candidates.remove(backend)
      self.excluded[backend] = reason
      self.rates.pop(backend, None)
      self._round.pop(backend, None)
      if backend in self._todo:
        self._todo = [c for c in self._todo if c != backend]
        if not self._todo:
          self._end_round()
      elif backend == self._pick:
        self._pick = None
        self._decide()

  def _explore(self, why: str) -> None:
    assert self._pick is not None  # only the running pick explores
    self._todo = [c for c in self.candidates if c != self._pick] + [self._pick]
    self._round = {self._pick: self.rates[self._pick]}
    self._windows = collections.Counter({self._pick: 1})
    self._run_s = 0.0
    self._reason = f"measuring again: {why}"

  def _end_round(self) -> None:
    """Decides, or first measures again the backends whose rates are too
    close to tell (see `CLEAR`), and those not measured yet."""
    rates = self._round
    missing = [c for c in self.candidates if c not in rates]
    if not missing and rates:
      top = max(rates.values())
      missing = [
        c
        for c in self.candidates
        if (1 + CLEAR) * rates[c] >= top and self._windows[c] < FIRST_ROUNDS
      ]
      if len([c for c in self.candidates if (1 + CLEAR) * rates[c] >= top]) < 2:
        missing = []
    if missing:
      self._todo = missing
      return
    self._decide()

  def _decide(self) -> None:
    previous = self._pick
    self.rates.update(self._round)
    self._round = {}
    self._windows = collections.Counter()
    measured = [c for c in self.candidates if c in self.rates]
    if not measured:
      self._todo = list(self.candidates)
      return
    top = max(self.rates[c] for c in measured)
    tied = [c for c in measured if self.rates[c] >= (1 - TIE) * top]
    best = min(tied, key=lambda c: PREFERENCE.index(c) if c in PREFERENCE else 99)
    if (
      previous in measured
      and best != previous
      and self.rates[best] < (1 + SWITCH_MARGIN) * self.rates[previous]
    ):
      best = previous
    self._pick = best
    self._reference = self.rates[best]
    self._recent.clear()
    self._run_s = 0.0
    self.rounds += 1
    if best == previous:
      self.explore_every = min(2 * self.explore_every, EXPLORE_MAX_S)
    else:
      self.explore_every = EXPLORE_FIRST_S
    ranked = sorted(measured, key=lambda c: -self.rates[c])
    self._reason = " > ".join(f"{_label(c)} {self.rates[c]:,.0f}/s" for c in ranked)
    if best != ranked[0]:
      self._reason += (
        f"; {_label(best)} kept (within "
        f"{100 * (SWITCH_MARGIN if best == previous else TIE):.0f}%"
        f", {'no switch' if best == previous else 'less CPU'})"
      )
    others = self._why_others()
    if others:
      self._reason += f"; {others}"

  def _why_others(self) -> str:
    return "; ".join(f"no {_label(b)}: {why}" for b, why in self.excluded.items())

  def summary(self) -> dict:
    """The choice and why: {"picked" (None before the first choice),
    "reason", "rates" (elements/s by backend, as last measured),
    "measuring" (whether backends are being measured now)}."""
    with self._lock:
      return {
        "picked": self._pick,
        "reason": self._reason,
        "rates": {c: round(r, 1) for c, r in self.rates.items()},
        "measuring": bool(self._todo),
      }


WINDOW_S = 0.1
WINDOW_CHUNKS = 4
"""A measurement window lasts at least `WINDOW_S` and `WINDOW_CHUNKS` chunks
per worker: the work in flight at its start and at its end (up to a chunk
per worker, part done) then weighs little, and the two even out."""


class Window:
  """A measurement of one backend for `BackendChooser.record`: its seconds
  and input positions, summed over the stretches it ran in (an iterator that
  ends leaves the window to its dataset's next one).

  The iterator calls `chunk_received` for each chunk that comes back and
  `after_batch` after each batch it returns; a stretch starts after the
  `settle` chunks given to `resume` (they fill the pipeline).
  """

  __slots__ = ("backend", "settle", "chunks", "seconds", "positions", "since", "from_position")

  def __init__(self, backend: str):
    self.backend = backend
    self.settle = 0  # chunks to receive before the stretch starts
    self.chunks = 0  # chunks received while measuring
    self.seconds = 0.0
    self.positions = 0
    self.since: float | None = None  # the running stretch's start
    self.from_position = 0

  def resume(self, settle: int) -> None:
    """A new stretch, after `settle` chunks."""
    self.settle, self.since = settle, None

  def pause(self, now: float, position: int) -> None:
    """Ends the running stretch."""
    if self.since is not None:
      self.seconds += now - self.since
      self.positions += position - self.from_position
      self.since = None

  def chunk_received(self) -> None:
    if self.settle:
      self.settle -= 1
    elif self.since is not None:
      self.chunks += 1

  def after_batch(self, position: int, workers: int) -> float | None:
    """The window's rate (input positions per second) once it is long
    enough (it is then over), else None; `position` is the input position
    after the batch, `workers` those of the backend."""
    if self.settle:
      return None
    now = time.perf_counter()
    if self.since is None:
      self.since, self.from_position = now, position
      return None
    if self.seconds + now - self.since < WINDOW_S or self.chunks < WINDOW_CHUNKS * workers:
      return None
    self.pause(now, position)
    return self.positions / self.seconds
