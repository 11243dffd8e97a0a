"""Per-op statistics of a running pipeline, and the bottleneck they point at.

`OpIterator.stats()` returns `{"ops": [row, ...]}`, one row per op of the
iterator tree in pipeline order (inputs before the ops reading them), each
row `{"op", "elements", "self_seconds", "wait_seconds", "buffer_fill",
"parallelism"}` plus what the op adds of its own (see `OpIterator.stats`).

Time is measured by sampling, not by timers around `next()`: a pipeline of
cheap element-wise ops spends a few hundred nanoseconds per element, less
than two clock reads cost, so any per-call timing would slow it down by more
than it measures. Instead one thread per process ("jaxfeed-op-stats",
running while a tracked pipeline is open and for `LINGER_S` after the last
one closed) looks at every thread's Python stack every `SAMPLE_INTERVAL_S`
(less often, down to every `MAX_INTERVAL_S`, when looks would cost the
pipeline more than `MAX_CPU_SHARE` of its time) and charges the time since
its last look to the
innermost op method on each stack: to the op's `wait_seconds` when the
stack is blocked in a wait for that op's producers (a `threading.Condition`
or `Event` wait, or a function marked with `waits_for_input`), else to its
`self_seconds`. A call into an op's parent shows the parent's frame
innermost, so the parent is charged: self time excludes the input's time.
A thread that runs no op (the training loop, an idle worker) is not
charged. Work an op does on its own threads or processes, outside any op
method (parallel map's workers), is added from the op's own clock.

Elements are counted where that is free or nearly: an op reports its count
when it keeps one anyway (a position, a sequence number, batches made, a
shuffle window's offset), a filter adds one to an integer per element it
keeps; an op that returns one element per input element reports its
input's count.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import sys
import threading
import time
import weakref
from typing import Any, Callable

__all__ = [
  "SAMPLE_INTERVAL_S",
  "LINGER_S",
  "THREAD_NAME",
  "OpCell",
  "register_op_class",
  "waits_for_input",
  "track",
  "release",
  "tracked_count",
  "sampler_running",
  "sampler_cpu_seconds",
  "samples_taken",
  "label_of",
  "fuse_labels",
  "label_iterators",
  "instrument",
  "rows_of",
]

SAMPLE_INTERVAL_S = 0.1
"""Seconds between two looks at the threads' stacks. A look costs little CPU
(about 0.1 ms) but makes a thread running Python hand over the GIL and
sleep until the look is done; waking it again costs microseconds on a quiet
machine and a scheduling round (milliseconds) on a loaded one, which is
most of what stats cost. 10 looks a second keep that small and still give
a minute-long run 600 samples.

Until it has the GIL, a waking sampler is a thread waiting for it, and a
pipeline thread that lets go of the GIL for a moment thousands of times a
second (C code that releases it around a short call: `np.arange` does on
every call, a ufunc or cast on more than about 500 elements) wakes it at
each release without it getting the GIL. Each release then costs the
pipeline a futex wake, until the sampler wins a race (tens of ms).
`range`'s element-wise reads keep the GIL for that reason, and the sampler
backs off (`_cost` counts its wait for the GIL as `late`) when a function
makes looks that dear."""

LINGER_S = 1.0
"""Seconds the sampling thread waits for a new pipeline once none is open
before it ends (a loop making one iterator per epoch keeps using it)."""

THREAD_NAME = "jaxfeed-op-stats"
"""The sampling thread's name (one per process, not owned by any op)."""

MAX_CPU_SHARE = 0.002
"""The most of the pipeline's time the looks may cost (see `_cost`): the
thread looks less often when a look costs more (many threads to look at, or
a machine so busy that a thread waits milliseconds for a core)."""

MAX_INTERVAL_S = 1.0
"""The longest wait between two looks, however dear they are, so that a
minute's run still gets 60 samples."""

_MAX_DEPTH = 64  # stack frames examined per thread, from the innermost

# Code objects of every OpIterator method, and of functions in which a
# thread waits for an op's producers (filled as classes are defined).
_OP_CODES: set = set()
_WAIT_CODES: set = {threading.Condition.wait.__code__, threading.Event.wait.__code__}


@dataclasses.dataclass
class OpCell:
  """What the sampler charged to one op iterator so far."""

  self_s: float = 0.0
  wait_s: float = 0.0
  fill_sum: float = 0.0
  fill_samples: int = 0


def register_op_class(cls: type) -> None:
  """Lets the sampler recognize `cls`'s methods on a stack (`self` is the op)."""
  for value in vars(cls).values():
    if isinstance(value, property):
      value = value.fget
    code = getattr(value, "__code__", None)
    if code is not None and code.co_varnames[:1] == ("self",):
      _OP_CODES.add(code)


def waits_for_input(fn: Callable) -> Callable:
  """Marks `fn` as a place where an op's consumer waits for its producers,
  so that time sampled in it counts as the op's `wait_seconds`."""
  _WAIT_CODES.add(fn.__code__)
  return fn


# -- tracking ----------------------------------------------------------------
class _Pipeline:
  """One tracked iterator tree: its root and its ops (for their buffers)."""

  __slots__ = ("root", "ops")

  def __init__(self, root: Any):
    self.root = weakref.ref(root)
    self.ops: list[tuple[weakref.ref, OpCell]] = []

  def alive(self) -> bool:
    root = self.root()
    return root is not None and not getattr(root, "_closed", False)


class _Sampler:
  """The process's one sampling thread, shared by every tracked pipeline.

  It starts with the first tracked pipeline and ends by itself once none has
  been open for `LINGER_S`: closing a pipeline neither stops nor joins it, so
  a loop that makes one iterator per epoch pays for one thread, not for a
  thread started and joined per epoch (which, on a busy machine, costs a
  scheduling round each way: more than a short epoch of W2 takes to run).
  """

  def __init__(self):
    self._lock = threading.Lock()
    self._pipelines: list[_Pipeline] = []
    self._thread: threading.Thread | None = None
    # A failure of the sampling thread, raised by `stats()` (the pipelines
    # themselves go on).
    self.error: Exception | None = None
    self.cpu_s = 0.0  # CPU seconds the sampling thread used, in total
    self.samples = 0  # looks at the stacks taken, in total

  def after_fork_in_child(self) -> None:
    """A forked child has no sampling thread and samples none of its
    parent's pipelines; the lock may have been held when it forked."""
    self._lock = threading.Lock()
    self._pipelines = []
    self._thread = None

  def track(self, pipeline: _Pipeline) -> None:
    with self._lock:
      self._pipelines.append(pipeline)
      if self._thread is None:
        self._thread = threading.Thread(target=self._run, name=THREAD_NAME, daemon=True)
        self._thread.start()

  def release(self, root: Any) -> None:
    """Forgets `root` (the thread ends `LINGER_S` after the last one)."""
    with self._lock:
      self._pipelines = [p for p in self._pipelines if p.alive() and p.root() is not root]

  def count(self) -> int:
    with self._lock:
      return sum(p.alive() for p in self._pipelines)

  def running(self) -> bool:
    with self._lock:
      return self._thread is not None

  def _live_pipelines(self, idle_since: float | None) -> list[_Pipeline] | None:
    """The pipelines still open; None (and the thread ends) when none has
    been since `idle_since` for `LINGER_S`."""
    with self._lock:
      self._pipelines = [p for p in self._pipelines if p.alive()]
      if (
        not self._pipelines and idle_since is not None and time.monotonic() - idle_since >= LINGER_S
      ):
        self._thread = None
        return None
      return list(self._pipelines)

  def _run(self) -> None:
    me = threading.get_ident()
    last = time.perf_counter()
    idle_since = None
    interval = SAMPLE_INTERVAL_S  # read here, so tests may change it
    cost = 0.0  # what a look costs, averaged over the last few (see _cost)
    while True:
      asleep = time.perf_counter()
      time.sleep(interval)
      now = time.perf_counter()
      late = now - asleep - interval
      pipelines = self._live_pipelines(idle_since)
      if pipelines is None:
        return
      cpu_start = time.thread_time()
      elapsed, last = now - last, now
      if not pipelines:
        idle_since = time.monotonic() if idle_since is None else idle_since
        interval = SAMPLE_INTERVAL_S
        continue
      idle_since = None
      try:
        _sample_stacks(me, elapsed)
        for pipeline in pipelines:
          _sample_buffers(pipeline)
      except Exception as e:  # noqa: BLE001 -- raised by the next stats()
        self.error = e
        with self._lock:
          self._thread = None
        return
      self.cpu_s += time.thread_time() - cpu_start
      self.samples += 1
      cost += 0.25 * (_cost(time.perf_counter() - now, late) - cost)
      interval = min(MAX_INTERVAL_S, max(SAMPLE_INTERVAL_S, cost / MAX_CPU_SHARE))


def _cost(held: float, late: float) -> float:
  """What one look cost the pipeline's threads, in seconds: the time it
  held the GIL (`held`; every thread that wanted it waited), plus one
  scheduling delay of this machine now. A thread running Python hands the
  GIL over and sleeps, and waking it takes about as long as this thread
  took to run after its own sleep ended (`late`), less the switch interval
  it waited for a busy thread to let go of the GIL."""
  switch = sys.getswitchinterval()
  if late > switch:
    late -= switch
  return held + max(0.0, late)


def _sample_stacks(me: int, elapsed: float) -> None:
  """Charges `elapsed` to the innermost op on each other thread's stack.

  The garbage collector is off meanwhile. Reading another thread's frames
  makes frame objects for them (`_current_frames`, `f_back`), and on
  CPython 3.11 an allocation that starts a collection there can run
  finalizers that let go of the GIL: the other thread may then leave the
  very frame the new object is being attached to, which then points at
  freed memory, and a later `f_code` or `f_back` segfaults the process
  (seen in benchmarks/client_churn_soak.py: 40 threads of short service
  reads, the crash in this function; sampling profilers such as
  sentry-sdk's and ddtrace's crashed the same way). A pass takes about
  0.1 ms; the collector runs at the next allocation after it.
  """
  enabled = gc.isenabled()
  gc.disable()
  try:
    _charge_stacks(me, elapsed)
  finally:
    if enabled:
      gc.enable()


def _charge_stacks(me: int, elapsed: float) -> None:
  for ident, frame in sys._current_frames().items():  # pylint: disable=protected-access
    if ident == me:
      continue
    waiting = False
    depth = 0
    while frame is not None and depth < _MAX_DEPTH:
      code = frame.f_code
      if code in _WAIT_CODES:
        waiting = True
      elif code in _OP_CODES:
        cell = getattr(frame.f_locals.get("self"), "_stats_cell", None)
        if cell is not None:
          if waiting:
            cell.wait_s += elapsed
          else:
            cell.self_s += elapsed
          break
      frame = frame.f_back
      depth += 1


def _sample_buffers(pipeline: _Pipeline) -> None:
  for op_ref, cell in pipeline.ops:
    op = op_ref()
    fill = None if op is None else op._stats_buffer_fill()  # pylint: disable=protected-access
    if fill is not None:
      cell.fill_sum += fill
      cell.fill_samples += 1


_SAMPLER = _Sampler()
os.register_at_fork(after_in_child=_SAMPLER.after_fork_in_child)


def ops_of(root: Any) -> list:
  """The op iterators under `root`, inputs first (post-order, each once)."""
  # Iterative: a recursive closure would be a reference cycle holding the
  # ops until the next garbage collection.
  ordered, seen = [], set()
  stack = [(root, False)]
  while stack:
    op, expanded = stack.pop()
    if expanded:
      ordered.append(op)
      continue
    if id(op) in seen:
      continue
    seen.add(id(op))
    stack.append((op, True))
    stack.extend((parent, False) for parent in reversed(op.parents))
  return ordered


def cell_of(op: Any) -> OpCell:
  """The op's cell (`OpIterator.__init__` makes it; an iterator that skipped
  that gets an empty one, which the sampler does not fill)."""
  cell = getattr(op, "_stats_cell", None)
  return cell if cell is not None else OpCell()


def track(root: Any) -> Any:
  """Samples the ops under `root` from now on, until it is closed or
  garbage-collected; returns `root`."""
  pipeline = _Pipeline(root)
  pipeline.ops = [(weakref.ref(op), cell_of(op)) for op in ops_of(root)]
  _SAMPLER.track(pipeline)
  return root


def label_of(node: Any) -> str:
  """A node's name in stats: its fused parts, or its op name."""
  return node.stats_label or node.op_name


def fuse_labels(*nodes: Any) -> str:
  """The label of one op fused from `nodes` (inputs first)."""
  return "+".join(label_of(n) for n in nodes)


def label_iterators(node: Any, iterator: Any) -> None:
  """Gives the iterators built from `node`'s graph the labels of fused
  nodes, walking both trees while they have the same shape."""
  iterator = getattr(iterator, "root", iterator)  # the autotuner's wrapper
  stack = [(node, iterator)]
  while stack:
    node, iterator = stack.pop()
    if node.op_name != iterator.op_name:
      continue
    if node.stats_label:
      iterator.stats_label = node.stats_label
    if len(node.parents) == len(iterator.parents):
      stack.extend(zip(node.parents, iterator.parents))


def instrument(node: Any, root: Any, options: Any) -> Any:
  """Readies the iterator `root` built from the optimized graph `node` for
  `stats()`: fused ops get their labels, and sampling starts unless
  `options.stats` is False. Returns `root`."""
  label_iterators(node, root)
  if options is None or options.stats:
    track(root)
  return root


def rows_of(iterator: Any) -> list[dict]:
  """The `stats()` rows of a jaxfeed iterator; none for other iterables."""
  stats = getattr(iterator, "stats", None)
  result = stats() if callable(stats) else None
  return list(result["ops"]) if isinstance(result, dict) and "ops" in result else []


def release(root: Any) -> None:
  """Called when `root` closes: stops sampling it (the thread ends by itself
  `LINGER_S` after the last sampled pipeline closed)."""
  _SAMPLER.release(root)


def sampler_cpu_seconds() -> float:
  """CPU seconds the sampling thread has spent looking at stacks in this
  process (its direct cost)."""
  return _SAMPLER.cpu_s


def samples_taken() -> int:
  """Looks at the stacks taken in this process so far."""
  return _SAMPLER.samples


def tracked_count() -> int:
  """Open pipelines being sampled now (for tests)."""
  return _SAMPLER.count()


def sampler_running() -> bool:
  """Whether the sampling thread runs (or lingers) now."""
  return _SAMPLER.running()


# -- rows --------------------------------------------------------------------
def op_rows(root: Any) -> list[dict]:
  """The stats rows of the ops under `root` (see the module docstring).

  Raises:
    RuntimeError: the sampling thread failed (with its exception as cause).
  """
  if _SAMPLER.error is not None:
    raise RuntimeError(
      f"Op statistics: the sampling thread failed: {_SAMPLER.error!r}"
    ) from _SAMPLER.error
  ops = ops_of(root)
  counts: dict[int, int | None] = {}
  rows = []
  for op in ops:
    cell = cell_of(op)
    fields = dict(op._stats_fields())  # pylint: disable=protected-access
    elements = fields.pop("elements", None)
    if elements is None and op.stats_one_to_one and len(op.parents) == 1:
      elements = counts.get(id(op.parents[0]))
    counts[id(op)] = elements
    row = {
      "op": op.stats_label,
      "elements": elements,
      "self_seconds": round(cell.self_s + fields.pop("busy_seconds", 0.0), 4),
      "wait_seconds": round(cell.wait_s, 4),
      "buffer_fill": (round(cell.fill_sum / cell.fill_samples, 3) if cell.fill_samples else None),
      "parallelism": fields.pop("parallelism", 1),
    }
    if op.tunables():
      row["autotune"] = True  # the autotuner sets its parallelism or buffer
    row.update(fields)
    rows.append(row)
  return rows
