"""Writing a parallel map's outputs straight into the batch they will join.

A `map` / `random_map` on threads followed by `batch` would hand each output
to the consumer thread, which keeps it until the batch is complete and then
copies it into a new batch array: the outputs of a batch pile up in fresh
memory (page faults), and all the copying happens in one thread. When `batch`
reads through the batched-read protocol (`jaxfeed.ops.stacking`), the
parallel map instead tells each task where its output goes, a row of a batch
array, and the worker thread that computed the output copies it there. The
batch is then complete when its last row is written, and the consumer hands
the arrays out as they are.

A function that can write its output itself (`map` / `random_map` with
`writes_out=True`) is handed the row as `out`: the leaves it returns that
are the row's own arrays are then not copied again (`Placement.slot`).

Outputs are identical to stacking's: rows are only placed when an output has
the structure, shapes and dtypes of the `Template` (numeric numpy leaves
only), and a batch is handed out as placed only when each of its rows holds
the element stacking would have put there. Anything else (an output of
another shape, an error that moves later batches' boundaries, work run in the
consumer thread) falls back to `stacking.stack` for that batch.

Batch arrays are views of one block per batch. A block is reused for a later
batch only once no array that views it is alive (the user dropped the batch),
so a reused block never changes under a batch the user still holds, and a
pipeline whose batches are dropped after use writes into memory that is
already mapped.
"""

from __future__ import annotations

import sys
import threading
import weakref
from typing import Any

import numpy as np

from jaxfeed.ops import tree

__all__ = [
  "Template",
  "Placed",
  "Placement",
  "place",
  "POOL_BLOCKS",
  "MIN_ELEMENT_BYTES",
  "template_for",
  "row_views",
  "write_row",
]

MIN_ELEMENT_BYTES = 64 << 10
"""Elements smaller than this are stacked, not placed: stacking copies a
small element in C for less than the Python that places it costs, and
batches of them come from memory the allocator already has."""

POOL_BLOCKS = 4
"""Blocks kept for reuse: the batch being filled, the next, and those the
consumer still holds (Python keeps the previous batch while it asks for the
next)."""

_ALIGN = 64
_KINDS = "biufc"  # numeric: bool, signed, unsigned, float, complex


class _Unfit(Exception):
  """Containers stacking rebuilds differently (subclasses): not placed."""


def _describe(value: Any, leaves: list) -> Any:
  """The containers' types and keys (a hashable signature); appends the
  leaves to `leaves` in `tree.flatten` order (dict keys sorted)."""
  kind = type(value)
  if kind is dict:
    return (dict, tuple(value), tuple(_describe(value[k], leaves) for k in sorted(value)))
  if kind is tuple or kind is list:
    return (kind, tuple(_describe(v, leaves) for v in value))
  if isinstance(value, (dict, tuple, list)):
    raise _Unfit
  leaves.append(value)
  return None


class Template:
  """The structure, shapes and dtypes every placed element must have."""

  __slots__ = ("structure", "signature", "specs", "nbytes")

  def __init__(self, structure: Any, signature: Any, specs: list):
    self.structure = structure
    self.signature = signature
    self.specs = specs  # [(shape, dtype)] in `tree.flatten` order
    self.nbytes = sum(int(np.prod(shape)) * dtype.itemsize for shape, dtype in specs)

  @classmethod
  def of(cls, element: Any) -> "Template | None":
    """The template of `element`, or None if its rows cannot be placed."""
    leaves: list = []
    try:
      signature = _describe(element, leaves)
    except _Unfit:
      return None
    specs = [_leaf_spec(leaf) for leaf in leaves]
    if not leaves or not all(specs):
      return None
    # The containers only: the template does not keep the element alive.
    return cls(tree.unflatten(element, [None] * len(leaves)), signature, specs)

  def leaves_of(self, value: Any) -> list | None:
    """`value`'s leaves (flatten order) if it fits the template, else None."""
    leaves: list = []
    try:
      if _describe(value, leaves) != self.signature:
        return None
    except _Unfit:
      return None
    for leaf, spec in zip(leaves, self.specs):
      if _leaf_spec(leaf) != spec:
        return None
    return leaves


def _leaf_spec(leaf: Any) -> tuple | None:
  if type(leaf) is np.ndarray or isinstance(leaf, np.generic):
    if leaf.dtype.kind in _KINDS:
      return leaf.shape, leaf.dtype
  return None


class Placed:
  """What a worker returns for an output it wrote into row `row`."""

  __slots__ = ("index", "arrays", "row", "template")

  def __init__(self, index: int, arrays: list, row: int, template: Template):
    self.index, self.arrays, self.row = index, arrays, row
    self.template = template

  def element(self, copy: bool) -> Any:
    """The output itself: views of its row (copies with `copy`)."""
    rows = [a[self.row, ...] for a in self.arrays]  # 0-d rows stay arrays
    if copy:
      rows = [r.copy() for r in rows]
    return tree.unflatten(self.template.structure, rows)


def place(value: Any, slot: tuple) -> Any:
  """Writes `value` into its slot; returns a `Placed`, or `value` if unfit.

  A leaf that is the slot's own row array (written there by the function
  handed the row as `out`) is already in place.
  """
  index, arrays, row, template, _, rows = slot
  leaves = template.leaves_of(value)
  if leaves is None:
    return value
  write_row(arrays, row, leaves, rows)
  return Placed(index, arrays, row, template)


def template_for(element: Any, min_bytes: int | None = None) -> Template | None:
  """The template to place elements like `element` by; None when it has no
  layout or is smaller than `min_bytes` (default `MIN_ELEMENT_BYTES`), too
  small to be worth placing."""
  template = Template.of(element)
  if template is None or template.nbytes < (MIN_ELEMENT_BYTES if min_bytes is None else min_bytes):
    return None
  return template


def row_views(arrays: list, row: int, template: Template) -> tuple[Any, list]:
  """Row `row` of each array, in the element's structure (a function's
  `out`) and as a list (0-d rows stay arrays)."""
  rows = [array[row, ...] for array in arrays]
  return tree.unflatten(template.structure, rows), rows


def write_row(arrays: list, row: int, leaves: list, own: list | None) -> None:
  """Writes `leaves` into row `row` of `arrays`. A leaf that is the row's own
  array (`own`, from `row_views`: the function handed it as `out` wrote
  there) is in place already."""
  if own is None:
    for array, leaf in zip(arrays, leaves):
      array[row] = leaf
  else:
    for array, leaf, mine in zip(arrays, leaves, own):
      if leaf is not mine:
        array[row] = leaf


def _unreferenced_count() -> int:
  probe = [np.empty(1)]
  return _refs(probe, 0)


def _refs(blocks: list, i: int) -> int:
  return sys.getrefcount(blocks[i])


class Placement:
  """Where the elements of a parallel map go: batch `index`, row `row`.

  Element `seq` (the executor's pull counter) goes to row `p % batch_size` of
  batch `p // batch_size`, `p = seq - origin`: the batches `batch` reads, as
  long as no element fails. `realign(seq)` starts a new batch at `seq` (a
  failed element ended the one before).
  """

  _UNREFERENCED = _unreferenced_count()

  def __init__(
    self, batch_size: int, template: Template, origin: int, hands_out_rows: bool = False
  ):
    self.batch_size = batch_size
    self.hands_out_rows = hands_out_rows
    self.template = template
    self.origin = origin
    self._open: dict[int, list] = {}  # batch index -> its arrays
    self._blocks: list[np.ndarray] = []
    self._offsets = []
    size = 0
    for shape, dtype in template.specs:
      self._offsets.append(size)
      size += -(-batch_size * int(np.prod(shape)) * dtype.itemsize // _ALIGN) * _ALIGN
    self._block_bytes = max(size, 1)
    weakref.finalize(self, _keep_spares, self._blocks)

  def slot(self, seq: int) -> tuple | None:
    """The task's slot for element `seq` (None before the origin):
    (batch index, arrays, row, template, out, rows). With `hands_out_rows`,
    `rows` are views of the element's row of each array and `out` is them
    in the element's structure, for the function to write into; else both
    are None."""
    p = seq - self.origin
    if p < 0:
      return None
    index, row = divmod(p, self.batch_size)
    arrays = self._open.get(index)
    if arrays is None:
      arrays = self._open[index] = self._arrays()
    if not self.hands_out_rows:
      return index, arrays, row, self.template, None, None
    return (index, arrays, row, self.template, *row_views(arrays, row, self.template))

  def index_of(self, seq: int) -> int:
    return (seq - self.origin) // self.batch_size

  def realign(self, seq: int) -> None:
    """The next batch starts with element `seq`."""
    self.origin = seq
    self._open.clear()

  def close_before(self, seq: int) -> None:
    """Forgets the batches before the one element `seq` belongs to."""
    first = self.index_of(seq)
    for index in [i for i in self._open if i < first]:
      del self._open[index]

  def batch(self, outputs: list) -> Any | None:
    """The batch as placed, if `outputs` are its rows in order, else None."""
    first = outputs[0]
    if len(outputs) != self.batch_size or type(first) is not Placed:
      return None
    arrays = first.arrays
    for row, output in enumerate(outputs):
      if type(output) is not Placed or output.arrays is not arrays or (output.row != row):
        return None
    self._open.pop(first.index, None)
    return tree.unflatten(self.template.structure, arrays)

  def assemble(self, elements: list) -> Any | None:
    """A whole batch of `elements` copied into a block, if all of them fit
    the template (else None: `stacking.stack` knows what to do)."""
    if len(elements) != self.batch_size:
      return None
    rows = [self.template.leaves_of(element) for element in elements]
    if not all(rows):
      return None
    arrays = self._arrays()
    for row, leaves in enumerate(rows):
      for array, leaf in zip(arrays, leaves):
        array[row] = leaf
    return tree.unflatten(self.template.structure, arrays)

  def _arrays(self) -> list:
    block = self._free_block()
    arrays = []
    for offset, (shape, dtype) in zip(self._offsets, self.template.specs):
      count = self.batch_size * int(np.prod(shape))
      arrays.append(
        block[offset : offset + count * dtype.itemsize]
        .view(dtype)
        .reshape((self.batch_size,) + shape)
      )
    return arrays

  def _free_block(self) -> np.ndarray:
    blocks = self._blocks
    for i in range(len(blocks)):
      if _refs(blocks, i) == self._UNREFERENCED:
        return blocks[i]
    block = _take_spare(self._block_bytes)
    if len(blocks) >= POOL_BLOCKS:
      del blocks[0]  # still in use; it lives as long as its views
    blocks.append(block)
    return block


# Blocks of placements that ended (an epoch's iterator), by size: the next
# epoch's batches go to memory that is already mapped instead of fresh pages
# (a 77 MB float32 image batch costs ~20k page faults on fresh memory).
_SPARES: dict[int, list[np.ndarray]] = {}
_SPARE_SIZES = 2
_spares_lock = threading.Lock()


def _keep_spares(blocks: list) -> None:
  """Keeps an ended placement's blocks for the next one of the same size."""
  if not blocks:
    return
  size = blocks[0].size
  with _spares_lock:
    spares = _SPARES.pop(size, [])  # re-inserted: most recent size last
    spares = (spares + blocks)[-POOL_BLOCKS:]
    _SPARES[size] = spares
    while len(_SPARES) > _SPARE_SIZES:
      del _SPARES[next(iter(_SPARES))]


def _take_spare(size: int) -> np.ndarray:
  """A kept block of `size` bytes no array views any more, or a new one."""
  with _spares_lock:
    spares = _SPARES.get(size, [])
    for i in range(len(spares)):
      if _refs(spares, i) == Placement._UNREFERENCED:
        return spares.pop(i)
  return np.empty(size, np.uint8)
