"""The autotuner: parallelism and buffer sizes chosen from measurements.

Like tf.data's model, every AUTOTUNE parallel op and prefetch buffer is seen
as a queue between a producer and a consumer. Ops expose `Knob`s through
`OpIterator.tunables()`: the current value, a setter, and two cumulative
clocks — how long the consumer waited on this op (`wait_s`) and how long its
producers were busy (`busy_s`). Every `interval_s` the tuner compares the
clocks' deltas:

* the consumer waited a noticeable share of the interval on a knob -> that op
  is a bottleneck: grow it by one step, if the CPU budget (threads in total)
  or the RAM budget (buffered bytes in total) allows. A buffer grows only if
  its producer also had to wait for room in that interval: a buffer that
  never fills is behind a producer slower than its consumer, and more room
  would only hold memory;
* nobody waited for several intervals and the producers were mostly idle ->
  shrink it by one step (threads are given back to other ops).

The tuner re-decides for as long as the pipeline runs, so a change of load
(a slower UDF, a cache warming up) is followed.
"""

from __future__ import annotations

import dataclasses
import threading
import time
import weakref
from typing import Any, Callable

from jaxfeed.ops.base import OpIterator
from jaxfeed.ops.options import Options

_WAIT_SHARE_TO_GROW = 0.05
_IDLE_SHARE_TO_SHRINK = 0.5
_CALM_INTERVALS_TO_SHRINK = 3


@dataclasses.dataclass
class Knob:
  """One tunable value of a running op.

  Attributes:
    name: for stats and logs, e.g. "map/parallelism".
    kind: "threads" (counts against the CPU budget) or "buffer" (counts
      against the RAM budget through `unit_bytes`).
    get: returns the current value.
    set: applies a new value while running.
    minimum, maximum: the allowed range.
    wait_s: cumulative seconds the consumer waited on this op.
    busy_s: cumulative seconds the op's producers spent working (threads).
    producer_blocked_s: cumulative seconds the producer of a buffer waited
      for room (buffers only; None when the op cannot tell).
    unit_bytes: bytes one unit of a buffer holds (estimate; buffers only).
  """

  name: str
  kind: str
  get: Callable[[], int]
  set: Callable[[int], None]
  minimum: int
  maximum: int
  wait_s: Callable[[], float]
  busy_s: Callable[[], float] = lambda: 0.0
  producer_blocked_s: Callable[[], float] | None = None
  unit_bytes: Callable[[], int] = lambda: 0

  def __post_init__(self):
    if self.kind not in ("threads", "buffer"):
      raise ValueError(
        f"Knob {self.name!r}: kind must be 'threads' or 'buffer', got {self.kind!r}."
      )
    if not 1 <= self.minimum <= self.maximum:
      raise ValueError(
        f"Knob {self.name!r}: need 1 <= minimum <= maximum, got {self.minimum}..{self.maximum}."
      )


def collect_knobs(root: OpIterator) -> list[Knob]:
  """Knobs of every iterator in the tree under `root`."""
  knobs, stack, seen = [], [root], set()
  while stack:
    it = stack.pop()
    if id(it) in seen:
      continue
    seen.add(id(it))
    knobs.extend(it.tunables())
    stack.extend(it.parents)
  return knobs


class _KnobTrack:
  __slots__ = ("knob", "wait", "busy", "blocked", "calm")

  def __init__(self, knob: Knob):
    self.knob = knob
    self.wait = knob.wait_s()
    self.busy = knob.busy_s()
    self.blocked = self._blocked()
    self.calm = 0

  def _blocked(self) -> float | None:
    clock = self.knob.producer_blocked_s
    return None if clock is None else clock()

  def producer_filled_buffer(self) -> bool:
    """Whether the producer waited for room since the last call."""
    blocked, self.blocked = self.blocked, self._blocked()
    return blocked is None or self.blocked is None or self.blocked > blocked


class AutotunePolicy:
  """The decision rule, separate from the thread so it can be tested directly."""

  def __init__(self, knobs: list[Knob], cpu_budget: int, ram_budget_bytes: int):
    self.tracks = [_KnobTrack(k) for k in knobs]
    self.cpu_budget = cpu_budget
    self.ram_budget_bytes = ram_budget_bytes

  def _threads_used(self) -> int:
    return sum(t.knob.get() for t in self.tracks if t.knob.kind == "threads")

  def _bytes_used(self) -> int:
    return sum(t.knob.get() * t.knob.unit_bytes() for t in self.tracks if t.knob.kind == "buffer")

  def step(self, interval_s: float) -> dict[str, int]:
    """Applies one round of decisions; returns the knobs' new values."""
    # The knob whose consumer waited longest is served first.
    deltas = []
    for track in self.tracks:
      wait, busy = track.knob.wait_s(), track.knob.busy_s()
      filled = track.producer_filled_buffer()
      deltas.append((wait - track.wait, busy - track.busy, filled, track))
      track.wait, track.busy = wait, busy
    deltas.sort(key=lambda d: -d[0])
    for waited, busy, filled, track in deltas:
      knob = track.knob
      value = knob.get()
      useful = knob.kind == "threads" or filled
      if waited > _WAIT_SHARE_TO_GROW * interval_s and value < knob.maximum and useful:
        track.calm = 0
        if knob.kind == "threads" and self._threads_used() + 1 > self.cpu_budget:
          continue
        if knob.kind == "buffer" and self._bytes_used() + knob.unit_bytes() > self.ram_budget_bytes:
          continue
        knob.set(value + 1)
        continue
      track.calm = track.calm + 1 if waited <= 0.0 else 0
      idle = knob.kind == "buffer" or busy < _IDLE_SHARE_TO_SHRINK * value * interval_s
      if track.calm >= _CALM_INTERVALS_TO_SHRINK and idle and value > knob.minimum:
        knob.set(value - 1)
        track.calm = 0
    return {t.knob.name: t.knob.get() for t in self.tracks}


def _tune_loop(
  policy: AutotunePolicy, stop: threading.Event, interval_s: float, history: list
) -> None:
  while not stop.wait(interval_s):
    try:
      history.append(policy.step(interval_s))
    except Exception:  # noqa: BLE001 -- the iterator went away under us
      return
    del history[:-64]


class AutotunedIterator(OpIterator):
  """Runs `root` unchanged while a background thread tunes its knobs.

  State, seeds and iteration are the root's: saving a state from a tuned
  pipeline and restoring it into an untuned one (or back) works.
  """

  def __init__(self, root: OpIterator, options: Options, interval_s: float = 0.1):
    super().__init__(())
    self.root = root
    self.op_name = root.op_name
    self.history: list[dict[str, int]] = []
    knobs = collect_knobs(root)
    self._stop = threading.Event()
    self._thread = None
    if knobs:
      policy = AutotunePolicy(knobs, options.cpu_budget, options.ram_budget_bytes)
      self._thread = threading.Thread(
        target=_tune_loop,
        args=(policy, self._stop, interval_s, self.history),
        name="jaxfeed-autotune",
        daemon=True,
      )
      self._thread.start()
    self._finalizer = weakref.finalize(self, _stop_thread, self._stop, self._thread)

  @property
  def parents(self) -> list:  # type: ignore[override]
    return self.root.parents

  @parents.setter
  def parents(self, value: Any) -> None:
    del value  # The root keeps its own parents.

  def __next__(self) -> Any:
    return next(self.root)

  @property
  def last_seed(self) -> int:
    return self.root.last_seed

  def get_state(self) -> dict:
    return self.root.get_state()

  def set_state(self, state: dict) -> None:
    self.root.set_state(state)

  def tunables(self) -> list:
    return self.root.tunables()

  def stats(self) -> dict:
    return self.root.stats()

  def close(self) -> None:
    self._finalizer()
    self.root.close()


def _stop_thread(stop: threading.Event, thread: threading.Thread | None) -> None:
  stop.set()
  if thread is not None and thread is not threading.current_thread():
    thread.join()


def autotuned(root: OpIterator, options: Options | None) -> OpIterator:
  """Wraps `root` with a tuner when it has knobs and autotune is on."""
  options = options or Options()
  if not options.autotune or not collect_knobs(root):
    return root
  return AutotunedIterator(root, options)


def now() -> float:
  """The clock knobs use for their wait and busy times."""
  return time.perf_counter()
