"""`process_batch`: a chain of element ops and its batching, computed by
chunks of input positions, inline, on threads or in worker processes.

The optimizer replaces a chain `input -> (map | random_map | filter |
map_and_filter)* -> batch`, whose input is `range`, `from_tensor_slices` or
`from_source`, by a `ProcessBatchNode` wrapping it when an element op asks
for `backend="process"`, or for `num_parallel_calls=jaxfeed.AUTOTUNE` with
the default backend (see `fuse`). Its iterator
(`jaxfeed.ops.process_batch_iterator`) hands chunks of input positions to
the consumer's thread, to worker threads or to worker processes
(`jaxfeed.ops.chunk_workers`), which write the batches into shared memory
(`jaxfeed.ops.batch_slots`) and hand out views of it. Outputs, per-record
seeds and errors are those of the chain run element by element on threads,
and the state is that chain's, so a checkpoint restores into either.

* `backend="process"`: worker processes (`num_workers`, by default
  `num_parallel_calls` or one per core the process may use). The functions
  travel by value (`jaxfeed.ops.shipping`: lambdas, closures and functions
  of `__main__` included), and the workers never run the user's main
  module (`jaxfeed.ops.worker_processes`). Functions that cannot be shipped
  run on threads, with one log line saying why.
* AUTOTUNE: inline, threads and processes are measured and the fastest
  runs, measured again as it runs (`jaxfeed.ops.backend_choice`); the
  op's `stats()` row says what was picked, the rates measured and why.

The node keeps what its iterators learn and start, so an epoch loop (`for
epoch ...: for batch in ds:`) reuses them: the backend chosen, the worker
processes (warm, like PyTorch's `persistent_workers`), the slots and their
sizes. They go with `Dataset.close()` (or the node's `close()`), when the
dataset is garbage-collected, or when the worker processes have been idle
for `IDLE_TIMEOUT_S`.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
import weakref
from typing import Any

from jaxfeed.ops import base, parallel, shipping, worker_processes
from jaxfeed.ops.backend_choice import BackendChooser
from jaxfeed.ops.batch_slots import SlotPool
from jaxfeed.ops.chunk_workers import ProcessWorkers, ship
from jaxfeed.ops.fused_chain import FusedChain
from jaxfeed.ops.process_batch_iterator import ProcessBatchIterator
from jaxfeed.ops.worker_processes import WorkerProcessError

__all__ = ["ProcessBatchNode", "ProcessBatchIterator", "fuse", "IDLE_TIMEOUT_S"]

_OP = "process_batch"
_LOG = logging.getLogger("jaxfeed")

IDLE_TIMEOUT_S = 120.0
"""Worker processes no iterator has used for this long are stopped (the
dataset's next iterator starts new ones)."""

BACKENDS = ("auto", "thread", "process")


def fuse(batch_node: base.Node) -> "ProcessBatchNode | None":
  """The fused node for a fusable chain ending at `batch_node`, else None.

  A chain is fused when an element op asks for backend="process", or when
  none asks for threads and one asks for AUTOTUNE parallelism. Batched maps
  are left to the map-and-batch vectorization.
  """
  try:
    chain = FusedChain(batch_node)
  except ValueError:
    return None
  params = chain.element_params()
  if any(p.get("batched") for p in params):
    return None
  backends = {p.get("backend", "auto") for p in params}
  calls = [p.get("num_parallel_calls") for p in params]
  if "process" in backends:
    counts = [c for c in calls if c is not None and c > 1]
    return ProcessBatchNode(
      batch_node, backend="process", num_workers=max(counts) if counts else None
    )
  if "thread" in backends or base.AUTOTUNE not in calls:
    return None
  return ProcessBatchNode(batch_node, backend="auto")


class ProcessBatchNode(base.Node):
  """A chain's element ops and batching computed by chunks (module doc).

  Args:
    chain: the `batch` node of `input -> element ops -> batch`.
    backend: "process" uses worker processes; "thread" worker threads;
      "auto" measures and picks (AUTOTUNE).
    num_workers: worker processes; None: one per core the process may use.
    chunk: positions per chunk, a multiple of the batch size without a
      filter; None: chosen from the measured cost per element.
    copy: return copies of the batches instead of views of shared memory.
  """

  op_name = _OP

  def __init__(
    self,
    chain: base.Node,
    backend: str = "process",
    num_workers: int | None = None,
    chunk: int | None = None,
    copy: bool = False,
  ):
    super().__init__([chain])
    self.chain = FusedChain(chain)
    if backend not in BACKENDS:
      raise ValueError(
        f"{_OP}: backend must be one of {', '.join(map(repr, BACKENDS))}, got {backend!r}."
      )
    self.backend = backend
    self.num_workers = (
      None if num_workers is None else base.check_positive_int(num_workers, _OP, "num_workers")
    )
    self.chunk = None if chunk is None else base.check_positive_int(chunk, _OP, "chunk")
    if self.chunk is not None and not self.chain.filters and self.chunk % self.chain.batch_size:
      raise ValueError(
        f"{_OP}: chunk must be a multiple of the batch size "
        f"{self.chain.batch_size} when no filter runs, got {self.chunk}."
      )
    self.copy = bool(copy)

  def spec_params(self) -> dict:
    return {
      "backend": self.backend,
      "num_workers": self.num_workers,
      "chunk": self.chunk,
      "copy": self.copy,
    }

  def cardinality(self) -> int | None:
    return self.parents[0].cardinality()

  def make_iterator(self) -> ProcessBatchIterator:
    return ProcessBatchIterator(self, _runtime_of(self))

  def close(self) -> None:
    """Stops the worker processes kept for the next iterator and frees the
    slots; iterating again starts afresh."""
    _drop_runtime(id(self))


# ---------------------------------------------------------------------------
# what a node keeps across its iterators
# ---------------------------------------------------------------------------
class _Kit:
  """Slots and worker processes, lent to one iterator at a time."""

  def __init__(self, runtime: "_Runtime"):
    self._runtime = runtime
    self.processes: ProcessWorkers | None = None
    self.slots = SlotPool(on_retire=self._on_retire)

  def _on_retire(self, slot_id: int) -> None:
    if self.processes is not None:
      self.processes.on_retire(slot_id)

  def start_processes(self) -> None:
    """Starts the worker processes (in the background) unless they run."""
    if self.processes is None:
      self.processes = ProcessWorkers(self._runtime.shipment, self._runtime.num_workers, _OP)
      self.slots.held_limit = 2 * self._runtime.num_workers
      for slot in self.slots.slots:
        slot.mapped_by.clear()

  def processes_starting(self) -> bool:
    """Whether worker processes are starting now (loading the chain)."""
    if self.processes is None:
      return False
    try:
      return not self.processes.ready()
    except WorkerProcessError:
      return False

  def stop_processes(self) -> None:
    if self.processes is not None:
      processes, self.processes = self.processes, None
      processes.close()
      for slot in self.slots.slots:
        slot.mapped_by.clear()

  def close(self) -> None:
    self.stop_processes()
    self.slots.close()


class Lease:
  """What an iterator borrowed from its node (`kit`) and started (`transport`,
  worker threads, and the chunks it sent, `inflight`); given back by
  `close`, which holds no reference to the iterator and so also runs when
  the iterator is garbage-collected."""

  def __init__(self, runtime: "_Runtime", kit: _Kit):
    self.runtime, self.kit = runtime, kit
    self.transport: Any = None
    self.inflight: collections.deque = collections.deque()
    self.given_back = False

  def close(self) -> None:
    if self.given_back:
      return
    self.given_back = True
    transport, self.transport = self.transport, None
    if transport is not None and transport.name != "process":
      transport.close()
    if self.inflight and transport is not None and transport.name == "process":
      # Chunks no one will read: the processes' pipes are out of step.
      self.kit.stop_processes()
    self.inflight.clear()
    self.runtime.give_back(self.kit)


class _Runtime:
  """What a node keeps across its iterators (see the module docstring).

  Holds no reference to the node, which stays a plain value: it is kept in
  `_RUNTIMES` by the node's id and closed when the node is collected.
  """

  def __init__(self, node: ProcessBatchNode):
    self._lock = threading.Lock()
    self._chain = node.chain
    cores = parallel.usable_cores()
    self.num_workers = node.num_workers or cores
    self.num_threads = cores
    self.learned: dict[str, int] = {}  # slot bytes, chunk size per backend
    self._kit: _Kit | None = None
    self._lent = False
    self._idle_since: float | None = None
    self._shipment: shipping.Shipment | None = None
    self._note: str | None = None
    self.window: Any = None  # AUTOTUNE's measurement, across iterators
    self.closed = False
    excluded = {}
    if node.backend in ("auto", "process"):
      why = shipping.why_not_shippable(self._chain.payload())
      if why is not None:
        excluded["process"] = f"its functions cannot be sent to worker processes ({why})"
        _LOG.warning(
          "%s: running %s on threads: %s.",
          _OP,
          node.chain.batch_node.stats_label or "the chain",
          excluded["process"],
        )
    if node.backend == "auto":
      if cores < 2:
        excluded.setdefault("process", "this process may use one core only")
      # Threads and inline are measured while the processes start (which
      # takes their cores for a while), inline once more after; processes
      # twice (their first chunks also make their slots).
      self.chooser: BackendChooser | None = BackendChooser(
        ["process", "inline", "thread"],
        excluded,
        order=["thread", "inline", "process", "inline", "process"],
      )
      self._fixed = None
      self._reason = None
    else:
      self.chooser = None
      self._fixed = node.backend
      self._reason = f"backend={node.backend!r}"
      if node.backend in excluded:
        self._fixed, self._reason = "thread", excluded[node.backend]
    worker_processes.every_tick(self._expire)

  def backend(self) -> str:
    """The backend iterators run now."""
    return self.chooser.backend() if self.chooser is not None else self._fixed

  def interim_backend(self) -> str:
    """What runs while worker processes start."""
    if self.chooser is None:
      return "thread"
    return "inline" if "inline" in self.chooser.candidates else "thread"

  def no_processes(self, reason: str) -> None:
    """Worker processes cannot run (they failed to start): rules them out."""
    _LOG.warning("%s: no worker processes: %s", _OP, reason)
    if self.chooser is not None:
      self.chooser.exclude("process", reason)
    else:
      self._fixed, self._reason = "thread", f"worker processes failed: {reason}"

  def note(self, text: str) -> None:
    self._note = text

  def summary(self) -> dict:
    """The `stats()` fields: picked (AUTOTUNE's choice, None while it
    measures the first time; else the backend asked for), reason, rates
    (elements/s by backend, AUTOTUNE only), num_workers."""
    if self.chooser is not None:
      fields = self.chooser.summary()
    else:
      fields = {"picked": self._fixed, "reason": self._reason}
    if self._note:
      fields["reason"] = f"{fields['reason']}; {self._note}"
    fields["num_workers"] = self.num_workers
    return fields

  def shipment(self) -> shipping.Shipment:
    """The chain shipped to worker processes (made once while processes
    run: its large arrays are copied into shared memory, which goes with
    the last holder of the shipment)."""
    with self._lock:
      if self._shipment is None:
        self._shipment = ship(self._chain.payload())
      return self._shipment

  def idle_processes(self, kit: _Kit) -> None:
    """AUTOTUNE picked another backend: the worker processes and their
    shared input would only hold memory until the next measurement, which
    starts them again."""
    kit.stop_processes()
    with self._lock:
      self._shipment = None

  def kit(self) -> _Kit | None:
    """The node's own kit (lent out or not), if it has one."""
    return self._kit

  def lease(self) -> Lease:
    """What an iterator borrows: the node's kit, or a kit of its own while
    another iterator has the node's (see `Lease`)."""
    return Lease(self, self.lend())

  def lend(self) -> _Kit:
    """The node's kit for an iterator, or a kit of its own while another
    iterator has the node's."""
    with self._lock:
      if self.closed or self._lent:
        return _Kit(self)
      if self._kit is None:
        self._kit = _Kit(self)
      self._lent, self._idle_since = True, None
      return self._kit

  def give_back(self, kit: _Kit) -> None:
    with self._lock:
      done = kit is not self._kit or self.closed
      if not done:
        self._lent, self._idle_since = False, time.monotonic()
        kit.slots.free_all()
      elif kit is self._kit:
        self._kit = None
        self._shipment = None
    if done:
      kit.close()  # not under the lock: see `close`

  def _expire(self) -> None:
    """Stops worker processes idle for `IDLE_TIMEOUT_S` (a launcher tick).

    A tick never waits for the lock: its holder may be waiting for the
    launcher to start a worker (`close`), which this thread would then never
    do. The next tick looks again."""
    if not self._lock.acquire(blocking=False):
      return
    try:
      if (
        self._kit is not None
        and not self._lent
        and self._idle_since is not None
        and time.monotonic() - self._idle_since >= IDLE_TIMEOUT_S
      ):
        self._kit.stop_processes()
    finally:
      self._lock.release()

  def close(self) -> None:
    """Stops the kit's workers. Not under the lock: closing waits for
    workers still starting, and the launcher thread starting them takes the
    lock to make their shipment (`shipment`)."""
    with self._lock:
      self.closed = True
      kit = None
      if self._kit is not None and not self._lent:
        kit, self._kit, self._shipment = self._kit, None, None
    if kit is not None:
      kit.close()


_RUNTIMES: dict[int, _Runtime] = {}
_runtimes_lock = threading.Lock()


def _runtime_of(node: ProcessBatchNode) -> _Runtime:
  with _runtimes_lock:
    runtime = _RUNTIMES.get(id(node))
    if runtime is None:
      runtime = _RUNTIMES[id(node)] = _Runtime(node)
      weakref.finalize(node, _drop_runtime, id(node))
    return runtime


def _drop_runtime(node_id: int) -> None:
  with _runtimes_lock:
    runtime = _RUNTIMES.pop(node_id, None)
  if runtime is not None:
    runtime.close()
