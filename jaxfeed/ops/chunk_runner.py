"""Computing chunks of a fused chain's input positions into batches.

`ChunkRunner` is what computes a `process_batch` chain (input -> element ops
-> batch) wherever it runs: in a worker process, on a worker thread, or in
the consumer's thread. `run(start, stop, slot)` reads the chunk's input
positions with the input's `range_iterator`, applies the element ops to each
element with the record seed the element-wise thread path gives it, and,
without a filter, writes the batches into `slot` (memory the consumer hands
out views of): each element's leaves go to their batch row as soon as the
element is computed (elements of `ROW_MIN_BYTES` or more, numeric leaves,
shaped like the batch's first element), and a function
with `writes_out=True` is handed that row as `out`; smaller elements are
stacked into the slot as soon as their batch is complete. A slot too small
is replaced by a bigger one (`slot.grow`). With a filter, elements are
returned one by one and the consumer batches them.
"""

from __future__ import annotations

import traceback
from typing import Any, Callable

import numpy as np

from jaxfeed.ops import batch_placement, parallel, random_map, stacking, tree
from jaxfeed.ops import map as map_op
from jaxfeed.ops.filter import predicate_result
from jaxfeed.ops.memfd import ArrayRef

__all__ = ["ChunkRunner", "drop_tracebacks"]


ROW_MIN_BYTES = 16 << 10
"""Elements this big or bigger go to their batch row in the slot as soon as
they are computed, while they are in the cache (the worker computes every
row of its batches, so the rows cost no hand-off, unlike
`batch_placement.MIN_ELEMENT_BYTES` on the element-wise thread path);
smaller ones are stacked with their batch."""


def _rebuild(cls: type, params: dict) -> Any:
  return cls(**params)


class ChunkRunner:
  """Computes the outputs of chunks of input positions (module docstring).

  Args:
    payload: `((input class, input params), stage specs, batch size,
      drop_remainder)`, what `process_batch` sends its workers.
    contiguous: each chunk starts where the last ended (the consumer's
      thread computes them all): one input iterator reads them all, looking
      records up in ever larger blocks, instead of one per chunk.
  """

  def __init__(self, payload: tuple, contiguous: bool = False):
    (input_cls, input_params), stages, self.batch_size, self.drop_remainder = payload
    self.input = _rebuild(input_cls, input_params)
    self._contiguous = contiguous
    self._reader: Any = None  # contiguous: the input iterator, at `_next`
    self._next = -1
    self._iteration = 0  # of the positions `_reader` reads
    self.stages = [_stage_fn(s) for s in stages]
    # Maps only, none writing into its row: each a plain work(element, seed).
    self._works = (
      None
      if any(s[0] not in ("map", "random_map") or s[-1] for s in stages)
      else [_work_fn(s) for s in stages]
    )
    self.filters = any(s[0] in ("filter", "map_and_filter") for s in stages)
    # The last op writes into its element's batch row (writes_out).
    self.hands_out_rows = stages[-1][-1] and not self.filters
    self.template: batch_placement.Template | None = None  # the last batch's

  def run(self, start: int, stop: int, slot: Any) -> list:
    """The outputs of input positions [start, stop).

    `slot` has `buf` (a writable memoryview) and `grow(needed, written) ->
    buf` (a bigger slot holding bytes [0, written) of this one). None: the
    batches are stacked into new arrays (the consumer's own thread computes
    them), or, with a filter, the elements are returned one by one.

    Items are ("batch", skeleton, first seed, next position) (in a slot the
    batch lies after the chunk's batches before it, and the skeleton has an
    `ArrayRef` for each array leaf; without a slot it is the batch),
    ("element", element, seed, next position), and at most one last
    ("error", exc, traceback, next position).
    """
    items = []
    batch, first_seed, end = [], 0, 0  # end: of the batches in the slot
    rows: _Rows | None = None  # the batch being written into the slot
    count = 0  # elements of the current batch
    iterator = self._input_at(start, stop)
    position = start
    last = len(self.stages) - 1
    works = self._works
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
          rows = self._open(slot, end, stop - position + 1)
        out = own = None
        if works is not None:
          for work in works:
            element = work(element, seed)
        else:
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
            # A function that writes into its row gets one at any size.
            self.template = batch_placement.template_for(
              element, 0 if self.hands_out_rows else ROW_MIN_BYTES
            )
            rows = None if self.template is None else self._open(slot, end, stop - position + 1)
        if rows is not None and not rows.put(count, element, own):
          batch = rows.elements(count)  # shapes changed: stacked instead
          rows = None
        if rows is None:
          batch.append(element)
        count += 1
        if count == self.batch_size:
          end = self._finish(
            slot, items, rows, batch, count, first_seed, position, end, stop - position
          )
          batch, rows, count = [], None, 0
      if count and not self.drop_remainder:
        end = self._finish(slot, items, rows, batch, count, first_seed, position, end, 0)
    except Exception as exc:  # noqa: BLE001 -- raised in the consumer
      text = traceback.format_exc()
      drop_tracebacks(exc)
      items.append(("error", exc, text, position))
    finally:
      if self._contiguous:
        self._next = position
      elif not hasattr(iterator, "reposition"):
        iterator.close()
        self._reader = None
    return items

  def _input_at(self, start: int, stop: int) -> Any:
    """An input iterator at position `start` that reads up to `stop` (when
    contiguous: on, for the next chunks). One iterator serves the chunks of
    an iteration in turn where it can be repositioned (`from_source`: its
    sampler lookups, made in blocks, serve the next chunks too).

    A reshuffling `from_source` gives iteration i the positions [i * n,
    (i + 1) * n) (see `index_ranges`): an iterator reads within one."""
    per_iteration = self.input.num_positions()
    iteration = start // per_iteration if per_iteration else 0
    if iteration != self._iteration:
      self.close()
      self._iteration = iteration
    if self._contiguous:
      if self._reader is None or self._next != start:
        self.close()
        end = None if per_iteration is None else (iteration + 1) * per_iteration
        self._reader = self.input.range_iterator(start, end)
      return self._reader
    reposition = getattr(self._reader, "reposition", None)
    if reposition is not None:
      offset = iteration * (per_iteration or 0)
      reposition(start - offset, stop - offset)
      return self._reader
    self._reader = self.input.range_iterator(start, stop)
    return self._reader

  def close(self) -> None:
    """Closes the input iterator kept for the next chunk."""
    if self._reader is not None:
      self._reader.close()
      self._reader = None

  def _open(self, slot: Any, start: int, left: int) -> "_Rows":
    """Rows for the next batch from byte `start`, in a bigger slot if this
    one is too small (then big enough for the `left` positions' batches)."""
    rows = _Rows.open(slot.buf, start, self.batch_size, self.template)
    if rows is None:
      batches = -(-left // self.batch_size)
      size = _Rows.layout(0, self.batch_size, self.template)[1]
      rows = _Rows.open(
        slot.grow(start + batches * _align(size), start), start, self.batch_size, self.template
      )
    return rows

  def _finish(
    self,
    slot: Any,
    items: list,
    rows: "_Rows | None",
    batch: list,
    count: int,
    first_seed: int,
    position: int,
    end: int,
    left: int,
  ) -> int:
    """Adds the batch to `items` (stacking its elements into the slot unless
    its rows are there); returns where it ends in the slot."""
    if rows is not None:
      items.append(("batch", rows.skeleton(count), first_seed, position))
      return rows.end
    if slot is None:
      items.append(("batch", stacking.stack(batch, "batch"), first_seed, position))
      return end
    skeleton, writes, batch_end = _plan_batch(batch, end)
    buf = slot.buf
    if batch_end > len(buf):  # room for this batch and the `left` ones
      batches = -(-left // self.batch_size)
      buf = slot.grow(batch_end + batches * (batch_end - end), end)
    for offset, shape, dtype, source in writes:
      view = np.ndarray(shape, dtype, buffer=buf, offset=offset)
      if type(source) is list:
        np.stack(source, out=view)
      else:
        view[...] = source
      del view
    items.append(("batch", skeleton, first_seed, position))
    return batch_end


def drop_tracebacks(exc: BaseException | None) -> None:
  """Drops the tracebacks of `exc` and its causes: their frames hold views
  of the slot, which would stay in use as long as the exception lives."""
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
  def open(cls, block: memoryview, start: int, batch_size: int, template) -> "_Rows | None":
    """The batch's rows, or None if the block is too small for them."""
    offsets, offset = cls.layout(start, batch_size, template)
    if offset > len(block):
      return None
    arrays = [
      np.ndarray((batch_size,) + shape, dtype, buffer=block, offset=o)
      for o, (shape, dtype) in zip(offsets, template.specs)
    ]
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
    return [
      tree.unflatten(self.template.structure, [array[row, ...].copy() for array in self.arrays])
      for row in range(count)
    ]

  def skeleton(self, count: int) -> Any:
    """The batch of the first `count` rows as `ArrayRef`s."""
    refs = [
      ArrayRef(offset, array.dtype.str, (count,) + array.shape[1:])
      for offset, array in zip(self.offsets, self.arrays)
    ]
    return tree.unflatten(self.template.structure, refs)


def _plan_batch(elements: list, start: int) -> tuple[Any, list, int]:
  """Where the leaves of `stacking.stack(elements)` go, from byte `start` on.

  Returns the batch with `ArrayRef`s for its array leaves (object leaves
  stay), the writes `(offset, shape, dtype, source)` that fill them (source:
  the equally shaped arrays of a column, stacked straight into shared
  memory, or an already stacked leaf) and the end of the last leaf.
  """
  # The column split and the stacking rules are the batch op's own.
  structure, columns = stacking._columns(elements, "batch")  # pylint: disable=protected-access
  markers, writes, offset = [], [], start
  for index, column in enumerate(columns):
    first = column[0]
    if (
      type(first) is np.ndarray
      and not first.dtype.hasobject
      and all(
        type(v) is np.ndarray and v.dtype == first.dtype and v.shape == first.shape for v in column
      )
    ):
      # What np.array(column) would give, without building it first.
      shape, dtype, source = (len(column),) + first.shape, first.dtype, column
    else:
      source = stacking._stack_column(column, index, structure, elements, "batch")  # pylint: disable=protected-access
      if source.dtype.hasobject:
        markers.append(source)
        continue
      shape, dtype = source.shape, source.dtype
    offset = _align(offset)
    markers.append(ArrayRef(offset, dtype.str, shape))
    writes.append((offset, shape, dtype, source))
    offset += int(np.prod(shape)) * dtype.itemsize
  return tree.unflatten(structure, markers), writes, offset


def _work_fn(spec: tuple) -> Callable[..., Any]:
  """A map's or random_map's work(element, seed[, out]): the thread path's
  own work functions, so the same calls, `out` included."""
  kind, writes_out = spec[0], spec[-1]
  if kind == "map":
    return map_op._map_work(spec[1], writes_out)  # pylint: disable=protected-access
  return random_map._random_map_work(  # pylint: disable=protected-access
    spec[1], random_map.ElementGenerators(spec[2]), writes_out
  )


def _stage_fn(spec: tuple) -> Callable[[Any, int, Any], tuple[bool, Any]]:
  """stage(element, seed, out) -> (keep, output); `out` is the element's
  batch row for an op with writes_out (else ignored; None: no row)."""
  kind, writes_out = spec[0], spec[-1]
  if kind in ("map", "random_map"):
    work = _work_fn(spec)
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
