"""`process_batch`: element ops and their batching run by worker processes.

The optimizer replaces a chain `input -> (map | random_map | filter |
map_and_filter)* -> batch`, whose input is `range`, `from_tensor_slices` or
`from_source`, by a `ProcessBatchNode` wrapping it when an element op asks for
`backend="process"`, or for `num_parallel_calls=AUTOTUNE` with the default
backend and functions that can be pickled (see `fuse`).

Worker processes each rebuild the input node and the element functions once
(pickled; numpy arrays of `SHARED_ARRAY_BYTES` or more go through shared
memory instead of the pipe, so an in-memory source is not copied per worker).
The parent hands them chunks of input positions `[start, stop)`, each to
the worker with the fewest chunks left to compute, and waits on all of them
(answering requests, refilling a worker as soon as it is done), up to
`AHEAD_CHUNKS` per worker sent and not yet consumed. A worker reads the
chunk's elements with the input's `range_iterator`, applies the element ops
to each with the record seed the thread path gives it, and

  * without a filter, where a chunk is whole batches, writes the batches
    into a slot: memory owned by the parent (a memfd, sent to a worker over
    its pipe the first time it gets that slot, mapped with all its pages at
    once). Each element's leaves go to their batch row as soon as the
    element is computed (elements of 64 KiB or more, numeric leaves, shaped
    like the batch's first element: `batch_placement.Template`), and a
    function with `writes_out=True` is handed that row as `out`; a slot too
    small is replaced by a bigger one there and then (the size is kept on
    the node for its next iterators); a batch whose elements change shape
    is stacked into the slot instead (as on threads). The parent returns
    arrays that are views of the slot, and reuses a slot only once no view
    of its earlier batches is alive; otherwise the slot is retired (the
    memory goes with its last view) and a new one made. A closed iterator's
    free slots serve the next iterator of the same dataset (up to
    `SPARE_SLOTS`, freed when the dataset is): an epoch's batches go to
    memory that is already there;
Outputs, per-record seeds and errors are those of the chain run by threads:
a function's exception is raised by the `next()` that would return the
batch holding its element, with the worker's traceback as its cause; the
elements read into that batch before it are lost and the next batch starts
after it (as `batch` over a failing input does). The state is the chain's own
state, in the layout its thread iterator saves, so a checkpoint restores
into either backend.

With AUTOTUNE the iterator starts on threads. Once they have run a while, if
the process uses less than `THREADS_USE_CORES` cores (the functions hold the
GIL), it runs the same stretch on processes and keeps whichever produced
batches faster (threads unless processes win by `PROCESS_MARGIN`);
`stats()` and `repr` say what was picked and why.
"""

from __future__ import annotations

import collections
import copy
import io
import itertools
import mmap
import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import tempfile
import threading
import time
import traceback
import weakref
from multiprocessing import reduction, shared_memory
from typing import Any, Callable

import numpy as np

from jaxfeed.ops import (base, batch_placement, index_ranges, op_stats,
                         parallel, random_map, stacking, tree)
from jaxfeed.ops import map as map_op
from jaxfeed.ops.filter import predicate_result
from jaxfeed.ops.process_pool import (WorkerProcessError, _ArrayRef, _attach,
                                      _picklable, _RemoteTraceback)

__all__ = ["ProcessBatchNode", "ProcessBatchIterator", "fuse"]

_OP = "process_batch"
INPUT_OPS = ("range", "from_tensor_slices", "from_source")
ELEMENT_OPS = ("map", "random_map", "filter", "map_and_filter")

SHARED_ARRAY_BYTES = 1 << 20
"""Arrays in the pickled pipeline at least this big go through shared memory."""

CHUNK_WORK_S = 0.02
"""Worker time one chunk aims at: long enough to hide a round trip."""

CHUNKS_PER_WORKER = 2
"""Chunks queued at each worker (one computing, one waiting)."""

AHEAD_CHUNKS = 3
"""Chunks per worker sent and not yet consumed (each holds a slot)."""

THREADS_USE_CORES = 1.5
"""AUTOTUNE keeps threads when they keep this many cores busy."""

PROCESS_MARGIN = 1.1
"""AUTOTUNE keeps processes only when they are this much faster."""

MIN_BATCHES_LEFT = 64
"""AUTOTUNE tries processes only with at least this many batches of input left."""

TRIAL_S = 0.3
TRIAL_BATCHES = 8
"""Each backend is timed over at least this long and this many batches."""

_MAX_CHUNK_BATCHES = 16
_MIN_CHUNK_ELEMENTS, _MAX_CHUNK_ELEMENTS = 16, 4096
_RECV_POLL_S = 0.2


# ---------------------------------------------------------------------------
# the chain
# ---------------------------------------------------------------------------
class _Chain:
  """The parts of a fusable chain: input node, element ops, batch params."""

  def __init__(self, batch_node: base.Node):
    if batch_node.op_name != "batch":
      raise ValueError(f"{_OP}: expects a batch node, got {batch_node.op_name!r}.")
    params = batch_node.spec_params()
    self.batch_size = params["batch_size"]
    self.drop_remainder = params["drop_remainder"]
    stages = []
    node = batch_node.parents[0]
    while node.op_name in ELEMENT_OPS:
      stages.append(node)
      node = node.parents[0]
    if node.op_name not in INPUT_OPS or not stages:
      raise ValueError(
          f"{_OP}: fuses {' | '.join(INPUT_OPS)} -> "
          f"({' | '.join(ELEMENT_OPS)})+ -> batch, got a chain from "
          f"{node.op_name!r}.")
    self.input = node
    self.stage_nodes = stages[::-1]
    self.stages = [_stage_spec(n) for n in self.stage_nodes]
    self.filters = any(s[0] in ("filter", "map_and_filter") for s in self.stages)
    self.batch_node = batch_node

  def sequential(self) -> base.Node:
    """The chain with every element op in the consumer thread."""
    node = self.input
    for stage in self.stage_nodes:
      params = dict(stage.spec_params())
      if "num_parallel_calls" in params:
        params["num_parallel_calls"] = None
      if "backend" in params:
        params["backend"] = "thread"
      node = type(stage)(node, **params)
    return type(self.batch_node)(node, **self.batch_node.spec_params())

  def worker_payload(self) -> tuple:
    """What workers rebuild: the input as (type, params), the stages, batch."""
    return ((type(self.input), self.input.spec_params()), self.stages,
            self.batch_size, self.drop_remainder)


def _stage_spec(node: base.Node) -> tuple:
  """(kind, functions..., writes_out): what a worker rebuilds an op from."""
  params = node.spec_params()
  writes_out = bool(params.get("writes_out"))
  if node.op_name == "map":
    return ("map", params["fn"], writes_out)
  if node.op_name == "random_map":
    return ("random_map", params["fn"], params["seed"] or 0, writes_out)
  if node.op_name == "filter":
    return ("filter", params["predicate"], False)
  return ("map_and_filter", params["fn"], params["predicate"], False)


def fuse(batch_node: base.Node) -> "ProcessBatchNode | None":
  """The fused node for a fusable chain ending at `batch_node`, else None.

  A chain is fused when an element op asks for backend="process" (mode
  "process"), or when none asks for threads, one asks for AUTOTUNE
  parallelism and the functions can be pickled (mode "auto"). Batched maps
  are left to the map-and-batch vectorization.
  """
  try:
    chain = _Chain(batch_node)
  except ValueError:
    return None
  params = [n.spec_params() for n in chain.stage_nodes]
  if any(p.get("batched") for p in params):
    return None
  backends = {p.get("backend", "auto") for p in params}
  if "process" in backends:
    return ProcessBatchNode(batch_node, backend="process")
  if "thread" in backends or not any(
      p.get("num_parallel_calls") == base.AUTOTUNE for p in params):
    return None
  try:
    pickle.dumps(chain.stages)
  except Exception:  # noqa: BLE001 -- lambdas and closures stay on threads
    return None
  return ProcessBatchNode(batch_node, backend="auto")


class ProcessBatchNode(base.Node):
  """A batch of per-element ops computed by worker processes (module doc).

  Args:
    chain: the `batch` node of `input -> element ops -> batch`.
    backend: "process" always uses processes; "auto" measures (AUTOTUNE).
    num_workers: worker processes; None: one per core.
    chunk: positions per chunk, a multiple of the batch size without a
      filter; None: chosen from the measured cost per element.
    copy: return copies of the batches instead of views of shared memory.
  """

  op_name = _OP

  def __init__(self, chain: base.Node, backend: str = "process",
               num_workers: int | None = None, chunk: int | None = None,
               copy: bool = False):
    super().__init__([chain])
    self.chain = _Chain(chain)
    if backend not in ("auto", "process"):
      raise ValueError(f"{_OP}: backend must be 'auto' or 'process', got {backend!r}.")
    self.backend = backend
    self.num_workers = (None if num_workers is None else
                        base.check_positive_int(num_workers, _OP, "num_workers"))
    self.chunk = None if chunk is None else base.check_positive_int(chunk, _OP, "chunk")
    if (self.chunk is not None and not self.chain.filters
        and self.chunk % self.chain.batch_size):
      raise ValueError(
          f"{_OP}: chunk must be a multiple of the batch size "
          f"{self.chain.batch_size} when no filter runs, got {self.chunk}.")
    self.copy = bool(copy)
    # What iterators measured (slot bytes, chunk size): the next iterator (the
    # next epoch) starts from it instead of growing its slots again.
    self.learned: dict[str, int] = {}

  def spec_params(self) -> dict:
    return {"backend": self.backend, "num_workers": self.num_workers,
            "chunk": self.chunk, "copy": self.copy}

  def cardinality(self) -> int | None:
    return self.parents[0].cardinality()

  def make_iterator(self) -> "ProcessBatchIterator":
    return ProcessBatchIterator(self)


# ---------------------------------------------------------------------------
# worker side
# ---------------------------------------------------------------------------
_INPUT_BLOCKS: list = []  # a worker's attached blocks of shared input arrays


def _shared_array(name: str, dtype: str, shape: tuple) -> np.ndarray:
  block = _attach(name)
  _INPUT_BLOCKS.append(block)
  array = np.ndarray(shape, np.dtype(dtype), buffer=block.buf)
  array.flags.writeable = False
  return array


def _bottom(state: dict) -> dict:
  """The state of the chain's input inside a chain state."""
  while state["parents"]:
    state = state["parents"][0]
  return state


def _rebuild(cls: type, params: dict) -> base.Node:
  return cls(**params)


class _ChunkRunner:
  """Computes the outputs of chunks of input positions (in a worker)."""

  def __init__(self, payload: tuple):
    (input_cls, input_params), stages, self.batch_size, self.drop_remainder = payload
    self.input = _rebuild(input_cls, input_params)
    self.stages = [_stage_fn(s) for s in stages]
    self.filters = any(s[0] in ("filter", "map_and_filter") for s in stages)
    # The last op writes into its element's batch row (writes_out).
    self.hands_out_rows = stages[-1][-1] and not self.filters
    self.template: batch_placement.Template | None = None  # the last batch's

  def run(self, start: int, stop: int, slot: "_WorkerSlot | None"
          ) -> tuple[list, int, int]:
    """The outputs of input positions [start, stop), the bytes they need and
    the end of the batches already written into the slot (None: a chain
    with a filter, whose elements go back through the pipe).

    Items are ("batch", skeleton, writes, first seed, next position) (the
    batches of a chunk lie one after the other from byte 0; a batch whose
    rows were written into the slot as they came has no writes, others are
    planned by `_plan_batch`), ("element", element, seed, next position),
    and at most one last ("error", exc, traceback, next position).
    """
    items = []
    batch, first_seed, needed, written = [], 0, 0, 0
    rows: _Rows | None = None  # the batch being written into the slot
    count = 0  # elements of the current batch
    iterator = self.input.range_iterator(start, stop)
    position = start
    last = len(self.stages) - 1
    try:
      while position < stop:
        try:
          element = next(iterator)
        except StopIteration:
          break
        except Exception:
          position += 1  # a failing read counts as an element, as on threads
          raise
        position += 1
        seed = iterator.last_seed
        if count == 0 and slot is not None and self.template is not None:
          rows = self._open(slot, needed, written, stop - position + 1)
        out = own = None
        if rows is not None and self.hands_out_rows:
          out, own = rows.row(count)
        keep = True
        for index, stage in enumerate(self.stages):
          keep, element = stage(element, seed, out if index == last else None)
          if not keep:
            break
        if not keep:
          continue
        if self.filters:
          items.append(("element", element, seed, position))
          continue
        if count == 0:
          first_seed = seed
          if slot is not None and (rows is None or not rows.fits(element)):
            # A first batch, or new shapes: rows like this element's.
            self.template = batch_placement.template_for(element)
            rows = (None if self.template is None else
                    self._open(slot, needed, written, stop - position + 1))
        if rows is not None and not rows.put(count, element, own):
          batch = rows.elements(count)  # shapes changed: stacked instead
          rows = None
        if rows is None:
          batch.append(element)
        count += 1
        if count == self.batch_size:
          needed, written = self._finish(items, rows, batch, count,
                                         first_seed, position, needed, written)
          batch, rows, count = [], None, 0
      if count and not self.drop_remainder:
        needed, written = self._finish(items, rows, batch, count, first_seed,
                                       position, needed, written)
    except Exception as exc:  # noqa: BLE001 -- raised in the consumer
      text = traceback.format_exc()
      _drop_tracebacks(exc)  # their frames hold views of the slot
      items.append(("error", _picklable(exc), text, position))
    finally:
      iterator.close()
    return items, needed, written

  def _open(self, slot: "_WorkerSlot", start: int, written: int,
            left: int) -> "_Rows":
    """Rows for the next batch from byte `start`, in a bigger slot if this
    one is too small (then big enough for the `left` positions' batches)."""
    rows = _Rows.open(slot.buf, start, self.batch_size, self.template)
    if rows is None:
      batches = -(-left // self.batch_size)
      size = _Rows.layout(0, self.batch_size, self.template)[1]
      rows = _Rows.open(slot.grow(start + batches * _align(size), written),
                        start, self.batch_size, self.template)
    return rows

  @staticmethod
  def _finish(items: list, rows: "_Rows | None", batch: list, count: int,
              first_seed: int, position: int, needed: int, written: int
              ) -> tuple[int, int]:
    if rows is not None:
      items.append(("batch", rows.skeleton(count), [], first_seed, position))
      return rows.end, rows.end
    skeleton, writes, needed = _plan_batch(batch, needed)
    items.append(("batch", skeleton, writes, first_seed, position))
    return needed, written


def _drop_tracebacks(exc: BaseException | None) -> None:
  seen = set()
  while exc is not None and id(exc) not in seen:
    seen.add(id(exc))
    exc.__traceback__ = None
    exc = exc.__cause__ or exc.__context__


def _align(offset: int) -> int:
  return (offset + 63) // 64 * 64  # keep every array 64-byte aligned


class _Rows:
  """A batch written into a slot an element at a time, from byte `start`.

  Arrays of `batch_size` rows per leaf of the template; each element's
  leaves go to their row as soon as the element is computed (while it is
  still in the cache), so no list of elements is stacked afterwards.
  """

  __slots__ = ("template", "offsets", "arrays", "end")

  def __init__(self, template, offsets: list, arrays: list, end: int):
    self.template, self.offsets, self.arrays = template, offsets, arrays
    self.end = end

  @staticmethod
  def layout(start: int, batch_size: int, template) -> tuple[list, int]:
    """Where a batch's arrays go from byte `start` on, and where they end."""
    offsets, offset = [], start
    for shape, dtype in template.specs:
      offset = _align(offset)
      offsets.append(offset)
      offset += batch_size * int(np.prod(shape)) * dtype.itemsize
    return offsets, offset

  @classmethod
  def open(cls, block: memoryview, start: int, batch_size: int,
           template) -> "_Rows | None":
    """The batch's rows, or None if the block is too small for them."""
    offsets, offset = cls.layout(start, batch_size, template)
    if offset > len(block):
      return None
    arrays = [np.ndarray((batch_size,) + shape, dtype, buffer=block, offset=o)
              for o, (shape, dtype) in zip(offsets, template.specs)]
    return cls(template, offsets, arrays, offset)

  def row(self, row: int) -> tuple[Any, list]:
    """Row `row` as `out` (the element's structure) and as a leaf list."""
    return batch_placement.row_views(self.arrays, row, self.template)

  def fits(self, element: Any) -> bool:
    return self.template.leaves_of(element) is not None

  def put(self, row: int, element: Any, own: list | None) -> bool:
    """Writes `element` into row `row`; False if it does not fit. A leaf
    that is the row's own array (`own`, handed to fn as `out`) is there."""
    leaves = self.template.leaves_of(element)
    if leaves is None:
      return False
    batch_placement.write_row(self.arrays, row, leaves, own)
    return True

  def elements(self, count: int) -> list:
    """Copies of the first `count` elements (to stack with later ones)."""
    return [tree.unflatten(self.template.structure,
                           [array[row, ...].copy() for array in self.arrays])
            for row in range(count)]

  def skeleton(self, count: int) -> Any:
    """The batch of the first `count` rows as `_ArrayRef`s."""
    refs = [_ArrayRef(offset, array.dtype.str, (count,) + array.shape[1:])
            for offset, array in zip(self.offsets, self.arrays)]
    return tree.unflatten(self.template.structure, refs)


def _plan_batch(elements: list, start: int) -> tuple[Any, list, int]:
  """Where the leaves of `stacking.stack(elements)` go, from byte `start` on.

  Returns the batch with `_ArrayRef`s for its array leaves (object leaves
  stay), the writes `(offset, shape, dtype, source)` that fill them (source:
  the equally shaped arrays of a column, stacked straight into shared
  memory, or an already stacked leaf) and the end of the last leaf.
  """
  # The column split and the stacking rules are the batch op's own.
  structure, columns = stacking._columns(elements, "batch")  # pylint: disable=protected-access
  markers, writes, offset = [], [], start
  for index, column in enumerate(columns):
    first = column[0]
    if (type(first) is np.ndarray and not first.dtype.hasobject
        and all(type(v) is np.ndarray and v.dtype == first.dtype
                and v.shape == first.shape for v in column)):
      # What np.array(column) would give, without building it first.
      shape, dtype, source = (len(column),) + first.shape, first.dtype, column
    else:
      source = stacking._stack_column(column, index, structure, elements, "batch")  # pylint: disable=protected-access
      if source.dtype.hasobject:
        markers.append(source)
        continue
      shape, dtype = source.shape, source.dtype
    offset = _align(offset)
    markers.append(_ArrayRef(offset, dtype.str, shape))
    writes.append((offset, shape, dtype, source))
    offset += int(np.prod(shape)) * dtype.itemsize
  return tree.unflatten(structure, markers), writes, offset


def _stage_fn(spec: tuple) -> Callable[[Any, int, Any], tuple[bool, Any]]:
  """stage(element, seed, out) -> (keep, output); `out` is the element's
  batch row for an op with writes_out (else ignored; None: no row)."""
  kind, writes_out = spec[0], spec[-1]
  if kind in ("map", "random_map"):
    # The thread path's own work functions: the same calls, `out` included.
    work = (map_op._map_work(spec[1], writes_out) if kind == "map"  # pylint: disable=protected-access
            else random_map._random_map_work(  # pylint: disable=protected-access
                spec[1], random_map.ElementGenerators(spec[2]), writes_out))
    if writes_out:
      return lambda element, seed, out: (True, work(element, seed, out=out))
    return lambda element, seed, out: (True, work(element, seed))
  if kind == "filter":
    predicate = spec[1]

    def keep(element, seed, out):
      result = parallel.call_unpacked(predicate, element)
      return predicate_result(predicate, result, "filter"), element
    return keep
  fn, predicate = spec[1], spec[2]

  def map_and_keep(element, seed, out):
    mapped = parallel.call_unpacked(fn, element)
    result = parallel.call_unpacked(predicate, mapped)
    return predicate_result(predicate, result, "filter"), mapped
  return map_and_keep


class _ParentGone(BaseException):
  """The parent closed the pipe mid-chunk (not a function's error)."""


# Mapping a slot maps all its pages in one call: touching them one by one
# costs a page fault each (a 77 MB batch: 19k faults, ~15x slower).
_POPULATE = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)


class _Mapped:
  """A slot mapped by a worker (from the descriptor the parent sent)."""

  def __init__(self, fd: int, size: int):
    try:
      self.map = mmap.mmap(fd, size, flags=_POPULATE)
    finally:
      os.close(fd)
    self.size = size
    self.buf = memoryview(self.map)

  def close(self) -> None:
    self.buf.release()
    self.map.close()


class _WorkerSlot:
  """The slot a worker writes a chunk's batches into (worker side); `grow`
  asks the parent for a bigger one and moves what was written there."""

  def __init__(self, conn, slots: dict, queued: collections.deque,
               slot_id: int):
    # `slots`: the worker's mapped slots by id (mapped once each).
    self.conn, self.slots, self.queued = conn, slots, queued
    self.block = slots[slot_id]

  @property
  def buf(self) -> memoryview:
    return self.block.buf

  def grow(self, needed: int, written: int) -> memoryview:
    """A slot of `needed` bytes or more holding bytes [0, written) of this
    one (the batches already written)."""
    self.conn.send(("grow", needed))
    try:
      reply = _receive(self.conn, self.slots)
      while reply[0] == "chunk":
        self.queued.append(reply)
        reply = _receive(self.conn, self.slots)
    except (EOFError, OSError) as exc:
      raise _ParentGone from exc
    if reply[0] != "slot":
      raise _ParentGone
    old = self.block
    self.block = self.slots[reply[1][0]]
    self.block.buf[:written] = old.buf[:written]
    return self.block.buf


def _receive(conn, slots: dict) -> tuple:
  """The parent's next message; maps the slot it names when its descriptor
  follows (the first time this worker gets that slot)."""
  message = conn.recv()
  if message[0] in ("chunk", "slot") and message[-1] is not None:
    slot_id, size, new = message[-1]
    if new:
      slots[slot_id] = _Mapped(reduction.recv_handle(conn), size)
  return message


def _worker_main(payload: bytes, conn) -> None:
  signal.signal(signal.SIGINT, signal.SIG_IGN)
  try:
    runner = _ChunkRunner(pickle.loads(payload))
  except BaseException as exc:  # noqa: BLE001 -- reported to the parent
    conn.send(("error", _picklable(exc), traceback.format_exc()))
    return
  conn.send(("ready",))
  slots: dict[int, _Mapped] = {}
  queued: collections.deque = collections.deque()  # chunks sent meanwhile
  try:
    while True:
      try:
        message = queued.popleft() if queued else _receive(conn, slots)
      except (EOFError, OSError):
        return  # The parent went away.
      if message[0] == "stop":
        return
      _, start, stop, retired, slot_spec = message
      for slot_id in retired:
        block = slots.pop(slot_id, None)
        if block is not None:
          _close(block)
      begin = time.perf_counter()
      slot = (None if slot_spec is None
              else _WorkerSlot(conn, slots, queued, slot_spec[0]))
      items, needed, written = runner.run(start, stop, slot)
      if slot is not None:
        if needed > slot.block.size:
          slot.grow(needed, written)
        _write_planned(items, slot.buf)
        del slot
      conn.send(("done", items, time.perf_counter() - begin))
      del items
  except _ParentGone:
    return


def _write_planned(items: list, buf: memoryview) -> None:
  """Writes the batches planned by `_plan_batch` (stacking them into `buf`)
  and leaves only their skeletons in `items`."""
  for i, item in enumerate(items):
    if item[0] == "batch":
      for offset, shape, dtype, source in item[2]:
        view = np.ndarray(shape, dtype, buffer=buf, offset=offset)
        if type(source) is list:
          np.stack(source, out=view)
        else:
          view[...] = source
        del view
      items[i] = ("batch", item[1]) + item[3:]


def _close(block: _Mapped) -> None:
  try:
    block.close()
  except BufferError:
    pass  # a view of it lives on (kept by fn): unmapped when the worker exits


# ---------------------------------------------------------------------------
# parent side
# ---------------------------------------------------------------------------
class _SharedArrayPickler(pickle.Pickler):
  """Pickles large numpy arrays as names of shared-memory copies."""

  def __init__(self, file, blocks: list):
    super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
    self._blocks = blocks

  def reducer_override(self, obj):
    if (isinstance(obj, np.ndarray) and obj.nbytes >= SHARED_ARRAY_BYTES
        and not obj.dtype.hasobject):
      block = shared_memory.SharedMemory(create=True, size=obj.nbytes)
      self._blocks.append(block)
      np.ndarray(obj.shape, obj.dtype, buffer=block.buf)[...] = obj
      return _shared_array, (block.name, obj.dtype.str, obj.shape)
    return NotImplemented


class _Slot:
  """Memory batches are written to: a memfd (no name that could outlive the
  process), mapped by the workers it is sent to and by the parent."""

  __slots__ = ("fd", "id", "map", "size", "guard", "taken", "mapped_by")
  _ids = itertools.count()

  def __init__(self, size: int):
    self.fd = _anonymous_file()
    try:
      os.ftruncate(self.fd, size)
    except BaseException:
      os.close(self.fd)
      raise
    self.id = next(self._ids)
    self.map: mmap.mmap | None = None  # see `mapping`
    self.size = size
    self.guard: weakref.ref | None = None  # the views' buffer
    self.taken = True  # by a chunk in flight or not yet returned
    self.mapped_by: set[int] = set()  # the workers that mapped it

  def spec(self, worker: int) -> tuple[int, int, bool]:
    """(id, size, whether its descriptor follows) for `worker`."""
    return self.id, self.size, worker not in self.mapped_by

  def mapping(self) -> mmap.mmap:
    """The parent's mapping of the slot, made when its first batches are
    back: the worker that wrote them made the pages, which are then mapped
    at once instead of a fault each as the consumer reads them. The views
    handed out hold it, so after the slot is retired its memory lives
    exactly as long as they do."""
    if self.map is None:
      self.map = mmap.mmap(self.fd, self.size, flags=_POPULATE)
    return self.map

  def in_use(self) -> bool:
    """Whether a chunk or a view handed out uses the slot."""
    return self.taken or (self.guard is not None and self.guard() is not None)

  def retire(self) -> None:
    if self.fd >= 0:
      os.close(self.fd)
      self.fd = -1
    if self.map is not None and not self.in_use():
      self.map.close()
    self.map = None


def _anonymous_file() -> int:
  """A descriptor of a new file in memory that no name leads to."""
  if hasattr(os, "memfd_create"):
    return os.memfd_create(f"jaxfeed-{_OP}", os.MFD_CLOEXEC)
  fd, path = tempfile.mkstemp(  # no memfd (macOS): a file unlinked at once
      prefix=f"jaxfeed-{_OP}-",
      dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
  os.unlink(path)
  return fd


class _SpareSlots:
  """Free slots of a node's closed iterators, for its next iterator: a new
  slot costs its pages (a 77 MB batch: ~30 ms of zeroing, in the worker).

  Kept for a node (held by its dataset), outside it so that the node stays
  a plain picklable value: at most `SPARE_SLOTS`, the smallest let go
  first, and all of them closed when the node is collected.
  """

  def __init__(self):
    self._slots: list[_Slot] = []
    self._lock = threading.Lock()

  def keep(self, slots: list[_Slot]) -> None:
    with self._lock:
      self._slots.extend(slots)
      self._slots.sort(key=lambda slot: slot.size)
      while len(self._slots) > SPARE_SLOTS:
        self._slots.pop(0).retire()

  def take(self, size: int) -> _Slot | None:
    with self._lock:
      for i, slot in enumerate(self._slots):
        if slot.size >= size:
          return self._slots.pop(i)
    return None

  def close(self) -> None:
    with self._lock:
      for slot in self._slots:
        slot.retire()
      self._slots.clear()


SPARE_SLOTS = 8
_SPARES: dict[int, _SpareSlots] = {}  # id(node) -> its spare slots
_spares_lock = threading.Lock()


def _spares_of(node: object) -> _SpareSlots:
  with _spares_lock:
    spares = _SPARES.get(id(node))
    if spares is None:
      spares = _SPARES[id(node)] = _SpareSlots()
      weakref.finalize(node, _drop_spares, id(node))
    return spares


def _drop_spares(node_id: int) -> None:
  with _spares_lock:
    spares = _SPARES.pop(node_id, None)
  if spares is not None:
    spares.close()


class _Workers:
  """The worker processes, their pipes, slots and shared input (parent side)."""

  def __init__(self, payload: tuple, num_workers: int, spares: _SpareSlots):
    self.spares = spares
    self.blocks: list[shared_memory.SharedMemory] = []
    self.workers: list = []
    self.slots: list[_Slot] = []
    self.retired: list[list[str]] = []
    buffer = io.BytesIO()
    try:
      _SharedArrayPickler(buffer, self.blocks).dump(payload)
    except Exception as exc:
      self.close()
      raise ValueError(
          f"{_OP}: the pipeline cannot be sent to worker processes ({exc}). "
          f"Define its functions at module level (or make them picklable "
          f"callable objects), or use backend='thread'.") from exc
    ctx = _context()
    try:
      for index in range(num_workers):
        conn, child = ctx.Pipe()
        process = ctx.Process(target=_worker_main, args=(buffer.getvalue(), child),
                              name=f"jaxfeed-{_OP}-{index}", daemon=True)
        process.start()
        child.close()
        self.workers.append((process, conn))
        self.retired.append([])
      for index in range(num_workers):
        reply = self.recv(index, "starting")
        if reply[0] == "error":
          raise WorkerProcessError(
              f"{_OP}: a worker process could not rebuild the pipeline: "
              f"{reply[1]!r}") from _RemoteTraceback(reply[2])
    except BaseException:
      self.close()
      raise

  def __len__(self) -> int:
    return len(self.workers)

  def pids(self) -> list[int]:
    return [process.pid for process, _ in self.workers]

  def shared_memory_names(self) -> list[str]:
    return [b.name for b in self.blocks]

  def send_chunk(self, index: int, start: int, stop: int,
                 slot: _Slot | None) -> None:
    """Sends a chunk, and the slot's descriptor if the worker lacks it."""
    spec = None if slot is None else slot.spec(index)
    self.send(index, ("chunk", start, stop, self.take_retired(index), spec))
    self._send_fd(index, slot)

  def send_slot(self, index: int, slot: _Slot) -> None:
    """Answers a worker's "grow" with `slot`."""
    self.send(index, ("slot", slot.spec(index)))
    self._send_fd(index, slot)

  def _send_fd(self, index: int, slot: _Slot | None) -> None:
    if slot is None or index in slot.mapped_by:
      return
    process, conn = self.workers[index]
    try:
      reduction.send_handle(conn, slot.fd, process.pid)
    except OSError as exc:
      raise self._died(index, "receiving work") from exc
    slot.mapped_by.add(index)

  def send(self, index: int, message: tuple) -> None:
    conn = self.workers[index][1]
    try:
      conn.send(message)
    except (OSError, ValueError) as exc:
      raise self._died(index, "receiving work") from exc

  def wait(self, doing: dict[int, str]) -> list[tuple[int, tuple]]:
    """(index, message) of the workers in `doing` (index -> what it does)
    that sent one, within `_RECV_POLL_S`; WorkerProcessError if one died."""
    conns = {self.workers[i][1]: i for i in doing}
    ready = multiprocessing.connection.wait(list(conns), _RECV_POLL_S)
    if not ready:
      for index in doing:
        if not self.workers[index][0].is_alive():
          raise self._died(index, doing[index])
    messages = []
    for conn in ready:
      index = conns[conn]
      try:
        messages.append((index, conn.recv()))
      except (EOFError, OSError) as exc:
        raise self._died(index, doing[index]) from exc
    return messages

  def recv(self, index: int, doing: str) -> tuple:
    """The worker's next message; WorkerProcessError if it died."""
    process, conn = self.workers[index]
    try:
      while not conn.poll(_RECV_POLL_S):
        if not process.is_alive():
          raise self._died(index, doing)
      return conn.recv()
    except (EOFError, OSError) as exc:
      raise self._died(index, doing) from exc

  def _died(self, index: int, doing: str) -> WorkerProcessError:
    process = self.workers[index][0]
    process.join(timeout=1)
    return WorkerProcessError(
        f"{_OP}: worker process {process.name} (pid {process.pid}) died "
        f"(exit code {process.exitcode}) while {doing}; the iterator cannot "
        f"go on. Restore its last state into a new iterator to resume.")

  def slot(self, size: int, worker: int) -> _Slot:
    """A slot of `size` bytes or more that no chunk or live view uses, for
    `worker`: one it mapped already if there is one."""
    free = []
    for slot in list(self.slots):
      if not slot.in_use():
        if slot.size >= size:
          free.append(slot)
        else:
          self.retire(slot)  # outgrown
    if free:
      slot = next((s for s in free if worker in s.mapped_by), free[0])
      slot.taken, slot.guard = True, None
      return slot
    slot = self.spares.take(size)
    if slot is None:
      slot = _Slot(size)
    else:
      slot.taken, slot.guard, slot.mapped_by = True, None, set()
    self.slots.append(slot)
    return slot

  def release(self, slot: _Slot) -> None:
    """The chunk using `slot` is done (its views may live on)."""
    slot.taken = False
    # Slots whose batches users still hold are not reused; past a few, the
    # oldest are unlinked, so that memory is bounded by what users hold.
    held = [s for s in self.slots if s.in_use() and not s.taken]
    for old in held[:max(0, len(held) - 2 * len(self.workers))]:
      self.retire(old)

  def retire(self, slot: _Slot) -> None:
    slot.retire()
    self.slots.remove(slot)
    for ids in self.retired:
      ids.append(slot.id)

  def take_retired(self, index: int) -> list[int]:
    ids, self.retired[index] = self.retired[index], []
    return ids

  def close(self) -> None:
    for _, conn in self.workers:
      try:
        conn.send(("stop",))
      except (OSError, ValueError):
        pass
    for process, conn in self.workers:
      process.join(timeout=5)
      if process.is_alive():
        process.kill()
        process.join()
      conn.close()
    self.workers = []
    spares = []
    for slot in self.slots:
      slot.taken = False
      if slot.in_use():
        slot.retire()  # its memory goes with the last view
      else:
        spares.append(slot)
    self.slots = []
    self.spares.keep(spares)
    for block in self.blocks:
      block.close()
      try:
        block.unlink()
      except FileNotFoundError:
        pass
    self.blocks = []


def _context():
  # A fork server forks workers from a clean single-threaded process (safe
  # beside JAX and gRPC threads, unlike fork) that has this module imported
  # already, so a worker starts in milliseconds instead of a spawn's second.
  # The image and Example modules (with the JPEG decoders, when installed)
  # are preloaded too: a worker that imported them itself would pay ~0.1 s
  # per iterator (per epoch) on image pipelines.
  ctx = multiprocessing.get_context("forkserver")
  ctx.set_forkserver_preload(["__main__", "jaxfeed.sources", "jaxfeed.sampler",
                              "jaxfeed.example", "jaxfeed.image", __name__])
  return ctx


class _Chunk:
  __slots__ = ("worker", "start", "stop", "slot", "reply")

  def __init__(self, worker: int, start: int, stop: int, slot: _Slot | None):
    self.worker, self.start, self.stop, self.slot = worker, start, stop, slot
    self.reply: tuple[list, float] | None = None  # (headers, busy s) once done

  def doing(self) -> str:
    return f"computing input positions [{self.start}, {self.stop})"


class ProcessBatchIterator(base.OpIterator):
  """Iterator of `ProcessBatchNode` (see the module docstring)."""

  op_name = _OP

  def __init__(self, node: ProcessBatchNode):
    super().__init__()
    self._node = node
    self._chain = node.chain
    self._sequential = self._chain.sequential()
    with self._sequential.make_iterator() as iterator:
      self._template = iterator.get_state()
    # The input positions of this iteration (see index_ranges.iteration_span);
    # None when the input's state is more than a position (a mixture's).
    span = index_ranges.iteration_span(self._chain.input,
                                       _bottom(self._template)["own"])
    self._position, self._end = span or (0, None)  # end None: endless
    self._last_seed = 0
    self._error: BaseException | None = None
    self._workers: _Workers | None = None
    self._thread_iterator: base.OpIterator | None = None
    self._finalizer = None
    num = node.num_workers or os.cpu_count() or 1
    self._stats: dict[str, Any] = {
        "backend": None, "reason": None, "num_workers": num,
        "chunk": node.chunk, "copy": node.copy}
    self._trial: dict[str, float] | None = None
    if span is None:  # Workers could not save where they are.
      self._use_threads(None)
      self._decide("thread", "the input's state is more than a position")
    elif node.backend == "process":
      self._use_processes(self._position)
      self._decide("process", "backend='process'")
    elif (os.cpu_count() or 1) < 2:
      self._use_threads(None)
      self._decide("thread", "one core")
    else:
      self._use_threads(None)
      self._stats["backend"] = "thread (measuring)"
      self._trial = {"phase": "thread", "batches": 0, "start": None}

  # -- backends ------------------------------------------------------------
  def _use_threads(self, state: dict | None) -> None:
    self._stop_workers()
    iterator = self._chain.batch_node.make_iterator()
    if state is not None:
      iterator.set_state(state)
    self._thread_iterator = iterator
    self.parents = [iterator]  # the autotuner tunes its knobs

  def _use_processes(self, position: int) -> None:
    if self._thread_iterator is not None:
      self._thread_iterator.close()
      self._thread_iterator = None
      self.parents = []
    self._workers = _Workers(self._chain.worker_payload(), self._stats["num_workers"],
                             _spares_of(self._node))
    self._finalizer = weakref.finalize(self, self._workers.close)
    self._inflight: collections.deque = collections.deque()
    # Per worker, its chunks not done yet, in the order it computes them.
    self._pending = [collections.deque() for _ in range(len(self._workers))]
    self._items: collections.deque = collections.deque()
    self._next_start = position
    self._position = position
    self._chunks_sent = self._chunks_received = 0
    self._slot_bytes = self._node.learned.get("slot_bytes", 1 << 20)
    self._chunk_size = self._node.chunk or self._node.learned.get("chunk") or (
        _MIN_CHUNK_ELEMENTS if self._chain.filters else self._chain.batch_size)
    self._tuned_chunk = self._node.chunk is None

  def _stop_workers(self) -> None:
    if self._finalizer is not None:
      self._finalizer()
      self._finalizer = None
    self._workers = None

  def _decide(self, backend: str, reason: str) -> None:
    self._trial = None
    self._stats["backend"] = backend
    self._stats["reason"] = reason

  # -- iteration -----------------------------------------------------------
  def __next__(self) -> Any:
    if self._closed:
      raise RuntimeError(f"{_OP}: the iterator is closed.")
    if self._error is not None:
      raise self._error
    if self._workers is None:
      batch = next(self._thread_iterator)
      self._last_seed = self._thread_iterator.last_seed
    else:
      try:
        batch = self._next_from_workers()
      except WorkerProcessError as exc:
        self._error = exc
        self._stop_workers()
        raise
    if self._trial is not None:
      self._observe()
    return batch

  next = __next__

  def _observe(self) -> None:
    """AUTOTUNE: times the backend on trial; switches or decides."""
    trial = self._trial
    now = time.perf_counter()
    if trial["start"] is None:
      # The first batches fill the pipeline (processes: the chunks in flight).
      if trial["phase"] == "thread" or self._chunks_received > (
          CHUNKS_PER_WORKER * len(self._workers)):
        trial.update(start=now, cpu=time.process_time(), batches=0)
      return
    trial["batches"] += 1
    elapsed = now - trial["start"]
    if elapsed < TRIAL_S or trial["batches"] < TRIAL_BATCHES:
      return
    rate = trial["batches"] / elapsed
    if trial["phase"] == "thread":
      cores = (time.process_time() - trial["cpu"]) / elapsed
      self._stats["thread_batches_per_s"] = round(rate, 2)
      self._stats["thread_cores"] = round(cores, 2)
      if cores >= THREADS_USE_CORES:
        self._decide("thread", f"threads use {cores:.1f} cores")
        return
      position = self._position_of(self._thread_iterator.get_state())
      if position is None:
        self._decide("thread", "the input's state is more than a position")
        return
      left = None if self._end is None else self._end - position
      if left is not None and left < MIN_BATCHES_LEFT * self._chain.batch_size:
        self._decide("thread", f"only {left} input elements left")
        return
      try:
        self._use_processes(position)
      except (ValueError, WorkerProcessError) as exc:
        self._use_threads(self._state_at(position))
        self._decide("thread", f"processes unavailable: {exc}")
        return
      self._trial = {"phase": "process", "batches": 0, "start": None,
                     "thread_rate": rate}
      self._stats["backend"] = "process (measuring)"
      return
    self._stats["process_batches_per_s"] = round(rate, 2)
    if rate >= PROCESS_MARGIN * trial["thread_rate"]:
      self._decide("process", f"processes {rate / trial['thread_rate']:.2f}x threads")
      return
    state = self.get_state()
    self._drain()
    self._use_threads(state)
    self._decide("thread", f"processes only {rate / trial['thread_rate']:.2f}x threads")

  def _next_from_workers(self) -> Any:
    chain = self._chain
    elements, seeds = [], []
    last = self._position
    items = self._items
    while True:
      if not items:
        if not self._receive_chunk():
          break
        continue
      item = items.popleft()
      kind = item[0]
      if kind == "release":
        self._workers.release(item[1])
        continue
      if kind == "batch":
        _, batch, seed, self._position = item
        self._last_seed = seed
        return batch
      if kind == "element":
        _, element, seed, last = item
        elements.append(element)
        seeds.append(seed)
        if len(elements) == chain.batch_size:
          break
        continue
      # An error: the elements read into this batch are lost, the next
      # batch starts after the failing element.
      _, exc, text, position = item
      while items:
        rest = items.popleft()
        if rest[0] == "release":
          self._workers.release(rest[1])
      self._restart(position)
      raise exc from _RemoteTraceback(text)
    if not elements or (len(elements) < chain.batch_size and chain.drop_remainder):
      raise StopIteration
    self._position = last
    self._last_seed = seeds[0]
    return stacking.stack(elements, "batch")

  def _submit(self) -> None:
    """Sends chunks to the workers with the fewest to compute (at most
    `CHUNKS_PER_WORKER` each), up to `AHEAD_CHUNKS` per worker not yet
    consumed: a worker that is ahead goes on while the consumer waits for
    a slower one's chunk."""
    workers = self._workers
    depth = AHEAD_CHUNKS * len(workers)
    pending = self._pending
    while len(self._inflight) < depth and (self._end is None
                                           or self._next_start < self._end):
      index = min(range(len(workers)), key=lambda i: len(pending[i]))
      if len(pending[index]) >= CHUNKS_PER_WORKER:
        return
      start = self._next_start
      stop = start + self._chunk_size
      if self._end is not None:
        stop = min(stop, self._end)
      slot = None
      if not self._chain.filters:
        slot = workers.slot(self._slot_bytes, index)
      workers.send_chunk(index, start, stop, slot)
      chunk = _Chunk(index, start, stop, slot)
      self._inflight.append(chunk)
      pending[index].append(chunk)
      self._chunks_sent += 1
      self._next_start = stop

  def _receive_chunk(self) -> bool:
    """Moves the oldest chunk's outputs to `_items`; False at the end."""
    self._submit()
    if not self._inflight:
      return False
    chunk = self._inflight.popleft()
    headers, busy_s = self._result(chunk)
    self._chunks_received += 1
    self._tune_chunk(chunk, busy_s)
    if chunk.slot is None:
      self._items.extend(headers)
      return True
    # Every array is a view of `whole`, whose buffer (the memoryview numpy
    # made of the mapping) lives exactly as long as some view does.
    whole = np.frombuffer(chunk.slot.mapping(), np.uint8)
    copy_out = self._node.copy

    def restore(leaf):
      if type(leaf) is _ArrayRef:
        dtype = np.dtype(leaf.dtype)
        size = int(np.prod(leaf.shape)) * dtype.itemsize
        array = whole[leaf.offset:leaf.offset + size].view(dtype).reshape(leaf.shape)
        return array.copy() if copy_out else array
      return leaf

    for header in headers:
      if header[0] == "batch":
        header = ("batch", tree.map_structure(restore, header[1])) + header[2:]
      self._items.append(header)
    if not copy_out:
      chunk.slot.guard = weakref.ref(whole.base)
    self._items.append(("release", chunk.slot))
    return True

  def _result(self, chunk: _Chunk, refill: bool = True) -> tuple[list, float]:
    """The chunk's (headers, busy seconds). Meanwhile answers every worker
    (a slot to grow) and, with `refill`, gives a worker that finished its
    chunks new ones."""
    workers, pending = self._workers, self._pending
    while chunk.reply is None:
      busy = {i: queue[0].doing() for i, queue in enumerate(pending) if queue}
      for index, reply in workers.wait(busy):
        oldest = pending[index][0]  # a worker computes its chunks in order
        if reply[0] == "done":
          oldest.reply = reply[1], reply[2]
          pending[index].popleft()
          if refill:
            self._submit()
          continue
        # "grow": the chunk's batches need a bigger slot.
        self._slot_bytes = max(2 * oldest.slot.size, reply[1])
        self._node.learned["slot_bytes"] = self._slot_bytes
        oldest.slot.taken = False
        workers.retire(oldest.slot)
        oldest.slot = workers.slot(self._slot_bytes, index)
        workers.send_slot(index, oldest.slot)
    return chunk.reply

  def _tune_chunk(self, chunk: _Chunk, busy_s: float) -> None:
    if not self._tuned_chunk or chunk.stop <= chunk.start:
      return
    per_position = busy_s / (chunk.stop - chunk.start)
    target = CHUNK_WORK_S / max(per_position, 1e-9)
    if self._chain.filters:
      size = int(min(max(target, _MIN_CHUNK_ELEMENTS), _MAX_CHUNK_ELEMENTS))
    else:
      batch = self._chain.batch_size
      size = batch * int(min(max(target // batch, 1), _MAX_CHUNK_BATCHES))
    self._chunk_size = self._node.learned["chunk"] = size
    self._stats["chunk"] = size

  def _drain(self) -> None:
    """Waits for the chunks in flight and drops their outputs."""
    while self._inflight:
      chunk = self._inflight.popleft()
      self._result(chunk, refill=False)
      if chunk.slot is not None:
        self._workers.release(chunk.slot)
    while self._items:
      item = self._items.popleft()
      if item[0] == "release":
        self._workers.release(item[1])

  def _restart(self, position: int) -> None:
    self._drain()
    self._next_start = self._position = position

  # -- state ---------------------------------------------------------------
  @property
  def last_seed(self) -> int:
    """The seed of the first element of the batch returned last."""
    return self._last_seed

  def _state_at(self, position: int) -> dict:
    """The chain's state with every op caught up and the input at `position`."""
    state = copy.deepcopy(self._template)
    bottom = _bottom(state)
    bottom["own"] = index_ranges.own_state_at(self._chain.input, bottom["own"],
                                              position)
    return state

  def _position_of(self, state: dict) -> int | None:
    """The input position a chain state resumes from (checks the state), and
    its iteration taken on (the template and end of the positions).

    None when the input's state holds more than a position (workers, which
    read positions of the node they rebuilt, cannot resume it).
    """
    with self._sequential.make_iterator() as iterator:
      iterator.set_state(state)
      state = iterator.get_state()
    span = index_ranges.iteration_span(self._chain.input, _bottom(state)["own"])
    if span is None:
      return None
    self._template = state
    position, self._end = span
    return position

  def get_state(self) -> dict:
    if self._workers is None:
      return self._thread_iterator.get_state()
    return self._state_at(self._position)

  def set_state(self, state: dict) -> None:
    base.check_state(state, "batch", 1)
    position = self._position_of(state)
    self._last_seed = 0
    self._error = None
    if position is None:
      if self._workers is not None:
        self._drain()
      self._use_threads(state)
      self._decide("thread", "restored a state that is more than a position")
    elif self._workers is not None:
      self._restart(position)
    elif self._thread_iterator is not None:
      self._thread_iterator.set_state(state)
    else:  # the workers failed: start new ones
      self._use_processes(position)

  # -- reporting and lifetime ----------------------------------------------
  def _stats_fields(self) -> dict:
    """What runs the chain (backend, why, workers, chunk, trial rates), in
    its `stats()` row."""
    fields = dict(self._stats)
    fields["parallelism"] = fields["num_workers"] if self._workers is not None else 1
    return fields

  @property
  def backend(self) -> str | None:
    """"thread" or "process" ("... (measuring)" while AUTOTUNE times them)."""
    return self._stats["backend"]

  def pids(self) -> list[int]:
    """The worker processes' ids (none on threads)."""
    return [] if self._workers is None else self._workers.pids()

  def shared_memory_names(self) -> list[str]:
    """The shared-memory blocks this iterator owns now."""
    return [] if self._workers is None else self._workers.shared_memory_names()

  def __repr__(self) -> str:
    details = ", ".join(f"{k}={v}" for k, v in self._stats.items() if v is not None)
    return f"ProcessBatchIterator({details})"

  def close(self) -> None:
    if self._closed:
      return
    self._closed = True
    self._stop_workers()
    if self._thread_iterator is not None:
      self._thread_iterator.close()
    op_stats.release(self)

