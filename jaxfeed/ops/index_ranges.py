"""Index-addressable datasets: the elements at a range of positions, read directly.

Some datasets can produce the elements at positions [start, stop) of their
output without producing the ones before: `range`, `from_tensor_slices`,
`from_source` (the positions of its sampler) and a `concatenate` or `zip` of
such datasets. The service's DYNAMIC sharding splits that position space into
ranges and runs the rest of the pipeline over the elements of the ranges each
worker is handed (`RangesNode`).

A node takes part by implementing three methods:

- `index_addressable() -> bool`: whether it (with its inputs) is addressable;
- `num_positions() -> int | None`: the size of its position space, None when
  endless;
- `range_iterator(start, stop) -> OpIterator`: the elements at positions
  [start, stop), in order, each with the `last_seed` the node's own iterator
  gives it (so a record is augmented alike on every worker).

A node whose positions are files (`from_tfrecord`) also says so with
`positions_are_files() -> True`; so does a pipeline whose split input feeds
an `interleave` or `flat_map` (`from_tensor_slices(files).interleave(read)`)
(`reads_files`). The service hands such positions out one by one (a file per
DYNAMIC split) and FILE sharding gives each worker its share of them
(`over_positions`).

Readers of positions that save states (the worker processes of
`process_batch`) also need the position an iterator's own state stands at:
`iteration_span` and `own_state_at` below. A node whose iterations read
different data (`from_source` with a reshuffling sampler) gives iteration
`i` the positions `[i * n, (i + 1) * n)` of its position space, `n =
num_positions()`, and implements both; for the others an own state is a
single position.

`concatenate` maps position p < n of its input (n positions) to that input's
position p and the others to position p - n of `other`; `zip` maps p to
position p of every input and has as many positions as its shortest input.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from jaxfeed.ops import base
from jaxfeed.ops import stacking

__all__ = [
  "ALLOWED",
  "NotIndexAddressableError",
  "RangesNode",
  "RangesIterator",
  "is_index_addressable",
  "iteration_span",
  "num_positions",
  "over_positions",
  "over_ranges",
  "own_state_at",
  "range_iterator",
  "reads_files",
  "split_input",
]

_OP = "ranges"
ALLOWED = (
  "range, from_tensor_slices, from_source, from_tfrecord (its "
  "files), or a concatenate / zip of such datasets with no other op "
  "in between"
)
# Ops that open a dataset per input element: their input's positions are
# typically files (`from_tensor_slices(files).interleave(read)`).
_PER_ELEMENT_DATASET_OPS = frozenset({"interleave", "flat_map"})

# Inputs listed in an error at most (a graph's paths can be many).
_MAX_LISTED = 8

FetchRanges = Callable[[], "tuple[list[tuple[int, int]], bool]"]
"""Returns the next position ranges to read and whether none will follow."""


class NotIndexAddressableError(ValueError):
  """A pipeline has no single input whose positions can be split."""


def is_index_addressable(node: base.Node) -> bool:
  """Whether `node` can read the elements of any range of its positions."""
  check = getattr(node, "index_addressable", None)
  return callable(check) and bool(check())


def num_positions(node: base.Node) -> int | None:
  """The size of an addressable node's position space; None when endless."""
  return node.num_positions()


def range_iterator(node: base.Node, start: int, stop: int) -> base.OpIterator:
  """The elements of an addressable node at positions [start, stop)."""
  return node.range_iterator(start, stop)


def iteration_span(node: base.Node, own_state: Any) -> tuple[int, int | None] | None:
  """The position an own state of `node`'s iterator reads next and the end
  of its iteration's positions (None: endless); None when the state holds
  more than a position."""
  span = getattr(node, "iteration_span", None)
  if callable(span):
    return span(own_state)
  if not isinstance(own_state, dict) or len(own_state) != 1:
    return None
  (position,) = own_state.values()
  return position, node.num_positions()


def own_state_at(node: base.Node, own_state: dict, position: int) -> dict:
  """`own_state` (one `iteration_span` accepts) moved to `position`."""
  move = getattr(node, "own_state_at", None)
  if callable(move):
    return move(own_state, position)
  (key,) = own_state
  return {key: position}


def _find_inputs(node: base.Node, path: tuple[str, ...], found: list, refused: list) -> None:
  """Collects every addressable input on every path from `node` (a node read
  along two paths counts twice: each path would read it by itself)."""
  if len(found) + len(refused) > _MAX_LISTED:
    return  # enough to refuse the pipeline; shared subgraphs could explode
  if is_index_addressable(node):
    found.append((node, path))
    return
  if not node.parents:
    refused.append((node, path))
    return
  for parent in node.parents:
    _find_inputs(parent, path + (node.op_name,), found, refused)


def _describe(node: base.Node, path: tuple[str, ...]) -> str:
  """The ops from an input to the pipeline's end, e.g. 'range -> map -> zip'."""
  return repr(" -> ".join((node.op_name,) + tuple(reversed(path))))


def split_input(root: base.Node) -> base.Node:
  """The one addressable input of a pipeline that DYNAMIC sharding splits.

  Args:
    root: the pipeline's last node.

  Returns:
    The node whose positions are split; every other op of the pipeline reads
    its elements.

  Raises:
    NotIndexAddressableError: the pipeline reads a source that cannot be
      split, or more than one addressable input.
  """
  found: list = []
  refused: list = []
  _find_inputs(root, (), found, refused)
  if len(found) == 1 and not refused:
    return found[0][0]
  problems = []
  if refused:
    problems.append(
      "it reads " + ", ".join(_describe(n, p) for n, p in refused) + ", which cannot be split"
    )
  if len(found) > 1:
    count = (
      f"more than {_MAX_LISTED}" if len(found) + len(refused) > _MAX_LISTED else str(len(found))
    )
    problems.append(
      f"it reads {count} inputs separately ("
      + ", ".join(_describe(n, p) for n, p in found)
      + "): combine them with concatenate / zip before any other op"
    )
  raise NotIndexAddressableError(
    "DYNAMIC sharding (processing_mode='distributed_epoch') splits the "
    "positions of one index-addressable input of the pipeline, but "
    + "; ".join(problems)
    + f". Index-addressable are: {ALLOWED}. Files "
    "split as from_tfrecord([files]) or from_tensor_slices(files)"
    ".interleave(read_one_file); otherwise use "
    "processing_mode='parallel_epochs'."
  )


def _ops_between(root: base.Node, target: base.Node) -> set[str]:
  """The names of the ops on the paths from `target` up to `root`."""
  names: set[str] = set()
  seen: dict[int, bool] = {}

  def walk(node: base.Node) -> bool:  # whether `target` is below `node`
    if node is target:
      return True
    if id(node) not in seen:
      below = [walk(p) for p in node.parents]
      seen[id(node)] = any(below)
      if seen[id(node)]:
        names.add(node.op_name)
    return seen[id(node)]

  walk(root)
  return names


def reads_files(root: base.Node) -> bool:
  """Whether a pipeline's split input positions are files: the input reads
  files itself (`from_tfrecord`), or an `interleave` / `flat_map` opens a
  dataset for each of its elements. False when it has no split input."""
  try:
    target = split_input(root)
  except NotIndexAddressableError:
    return False
  files = getattr(target, "positions_are_files", None)
  if callable(files) and files():
    return True
  return bool(_ops_between(root, target) & _PER_ELEMENT_DATASET_OPS)


def over_positions(root: base.Node, index: int, count: int) -> base.Node:
  """`root`'s pipeline with its split input reading positions `index, index +
  count, index + 2 count, ...` only (static sharding of files, as tf.data's
  FILE sharding: a worker with no position reads nothing)."""
  total = num_positions(split_input(root))
  if total is None:
    raise NotIndexAddressableError(
      "FILE sharding gives each worker its share of the pipeline's files, "
      "but its split input is endless; use processing_mode='parallel_epochs'."
    )

  def fetch() -> tuple[list[tuple[int, int]], bool]:
    return [(p, p + 1) for p in range(index, total, count)], True

  return over_ranges(root, fetch)


def over_ranges(root: base.Node, fetch_ranges: FetchRanges) -> base.Node:
  """`root`'s pipeline with its split input reading only fetched ranges.

  The ops between the split input and `root` are rebuilt through their
  `spec_params` (see `base.Node`); `root` itself is not changed.
  """
  target = split_input(root)
  memo: dict[int, base.Node] = {}

  def rebuild(node: base.Node) -> base.Node:
    if node is target:
      return RangesNode(node, fetch_ranges)
    if id(node) not in memo:
      parents = tuple(rebuild(p) for p in node.parents)
      memo[id(node)] = (
        node
        if all(a is b for a, b in zip(parents, node.parents))
        else type(node)(*parents, **node.spec_params())
      )
    return memo[id(node)]

  return rebuild(root)


class RangesNode(base.Node):
  """The elements of an addressable input at the positions of fetched ranges.

  Args:
    parent: an index-addressable node.
    fetch_ranges: called whenever the ranges fetched so far are read; returns
      the next `(start, stop)` ranges and whether none will follow (no ranges
      also ends the iteration).
  """

  op_name = _OP

  def __init__(self, parent: base.Node, fetch_ranges: FetchRanges):
    super().__init__([base.to_node(parent, _OP, "input")])
    if not is_index_addressable(self.parents[0]):
      raise NotIndexAddressableError(
        f"{_OP}: the input {self.parents[0]!r} is not index-addressable; allowed: {ALLOWED}."
      )
    self.fetch_ranges = fetch_ranges

  def spec_params(self) -> dict:
    return {"fetch_ranges": self.fetch_ranges}

  def make_iterator(self) -> "RangesIterator":
    parent = self.parents[0]
    probe = range_iterator(parent, 0, 0)
    probe.close()
    # The batched-read protocol only where every range iterator has it.
    cls = BatchedRangesIterator if hasattr(probe, "next_batch") else RangesIterator
    return cls(parent, self.fetch_ranges)


class RangesIterator(base.OpIterator):
  """Reads range after range; ends when `fetch_ranges` has no more."""

  op_name = _OP

  def __init__(self, input_node: base.Node, fetch_ranges: FetchRanges):
    super().__init__()
    self._input = input_node
    self._fetch_ranges = fetch_ranges
    self._ranges: list[tuple[int, int]] = []
    self._exhausted = False
    self._current: base.OpIterator | None = None
    self._last: base.OpIterator | None = None  # gave the latest element
    self._elements_read = 0

  def _open_next(self) -> base.OpIterator:
    """The iterator of the next range (StopIteration when none is left)."""
    while not self._ranges:
      if self._exhausted:
        raise StopIteration
      ranges, end = self._fetch_ranges()
      self._ranges = [(int(a), int(b)) for a, b in ranges if b > a]
      self._exhausted = end or not ranges
    start, stop = self._ranges.pop(0)
    self._current = range_iterator(self._input, start, stop)
    return self._current

  def _close_current(self) -> None:
    if self._current is not None:
      self._current.close()
      self._current = None

  def __next__(self) -> Any:
    while True:
      current = self._current or self._open_next()
      try:
        element = next(current)
      except StopIteration:
        self._close_current()
        continue
      self._last = current
      self._elements_read += 1
      return element

  @property
  def last_seed(self) -> int:
    return 0 if self._last is None else self._last.last_seed

  def _get_own_state(self) -> dict:
    return {"elements_read": self._elements_read}

  def _set_own_state(self, state: dict) -> None:
    if state.get("elements_read") != self._elements_read:
      raise base.PipelineStateError(
        "A DYNAMIC service task cannot be restored to another position: its "
        f"ranges come from the dispatcher (state {state})."
      )

  def _close_own(self) -> None:
    self._close_current()


class BatchedRangesIterator(RangesIterator):
  """A `RangesIterator` with the batched-read protocol of its range iterators
  (see `jaxfeed.ops.stacking`): a batch may join the ends of two ranges."""

  def next_batch(self, max_count: int) -> tuple[Any, np.ndarray]:
    batches, seeds = [], []
    count = 0
    while count < max_count:
      try:
        current = self._current or self._open_next()
      except StopIteration:
        break
      try:
        batch, batch_seeds = current.next_batch(max_count - count)
      except StopIteration:
        self._close_current()
        continue
      self._last = current
      batches.append(batch)
      seeds.append(batch_seeds)
      count += len(batch_seeds)
    if not batches:
      raise StopIteration
    self._elements_read += count
    if len(batches) == 1:
      return batches[0], seeds[0]
    return stacking.concatenate(batches, _OP), np.concatenate(seeds)
