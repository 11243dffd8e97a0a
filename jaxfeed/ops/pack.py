"""`pack`: packs variable-length sequences into fixed-length rows.

Input elements are dicts (nested dicts allowed) of sequences: arrays whose
first dimension is the sequence length (scalars count as length 1). Features
not named in `length_struct` are dropped. `length_struct` has the same dict
structure with each feature's row length.

Packing works like Grain's `FirstFitPackIterDataset` (without bin shuffling):
`num_packing_bins` rows are filled together. Each element goes, whole, into a
row where every feature still has room (and which holds fewer than
`max_sequences_per_bin` elements, if set):

- `first_fit`: the first such row;
- `best_fit`: the fullest such row (the least room left, summed over the
  features); ties go to the first.

When an element fits in no row, all non-empty rows are emitted, one output
element per row in row order, and a new set of rows starts with that element.
At the end of the input the last rows are emitted. Every output row holds, for
each feature `key`, the packed values (padded with 0 to the row length),
`key_segment_ids` (int32: 1, 2, ... for the row's elements in arrival order,
0 for padding) and `key_positions` (int32: 0, 1, ... within each element, 0
for padding).

An element longer than its row length is handled by `overflow`:

- `"error"` (the default): a ValueError naming the feature and the lengths;
- `"truncate"`: every feature is cut to its row length (the rest is dropped);
- `"split"`: the element is cut into pieces of at most the row length, each
  packed as an element of its own, in order (the usual pretraining recipe for
  documents longer than a row). Piece `k` of a feature holds its values
  `[k * row_length, (k + 1) * row_length)`; an element has as many pieces as
  its longest feature needs (a shorter feature's later pieces are empty).
  Each piece is a segment of its own: its positions start at 0. No value is
  lost or repeated.

State: the input's position through `InputReplay`, the read index of the first
element of the rows being emitted (or being filled) and the number of rows
already emitted from them. Restoring reads the input again from that element
and repeats the packing, which is deterministic.

Elastic resume (`jaxfeed.reshard_loader_states`): the state also names, by
their per-record seeds, the input elements whose values have not all been
emitted yet (`unemitted`: whole elements, and for `overflow="split"` the
pieces still to come of partly emitted ones). Resharding folds them back into
the global order as unread sampler positions (see
`jaxfeed.resharded_sampler.ReshardedSampler`), and the resumed `pack_split` cuts a partly
emitted element to exactly its missing pieces (`keep`). Every value the
uninterrupted run would still have emitted is emitted once over all new
processes; rows differ from the uninterrupted run's, since each process packs
what it reads.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from jaxfeed.ops import base
from jaxfeed.ops.pack_split import (
  SPLIT_OP,
  SplitIterator,
  element_leaves,
  keep_map,
  lookup,
  resumed_split_state,
)

__all__ = [
  "PackNode",
  "PackIterator",
  "ALGORITHMS",
  "OVERFLOWS",
  "SPLIT_OP",
  "ELASTIC_INPUT_OPS",
  "unemitted_elements",
  "resumed_pack_state",
  "resumed_split_state",
]

_OP = "pack"
ALGORITHMS = ("first_fit", "best_fit")
OVERFLOWS = ("error", "truncate", "split")
# Element-wise ops that may stand between a sampler's records and `pack` in a
# pipeline resumed on another number of processes.
ELASTIC_INPUT_OPS = ("map", "random_map", "filter", "map_and_filter")


def _feature_paths(length_struct: Any, prefix: tuple = ()) -> list[tuple]:
  """Key paths of the features of `length_struct`, dict keys sorted."""
  if not isinstance(length_struct, dict) or not length_struct:
    raise TypeError(
      f"{_OP}: length_struct must be a non-empty dict (of dicts) mapping "
      f"feature names to row lengths, got {length_struct!r:.200}."
    )
  paths = []
  for key in sorted(length_struct):
    if not isinstance(key, str):
      raise TypeError(
        f"{_OP}: length_struct keys must be str (output features are named "
        f"'<key>_segment_ids'), got {key!r}."
      )
    value = length_struct[key]
    if isinstance(value, dict):
      paths.extend(_feature_paths(value, prefix + (key,)))
    else:
      base.check_positive_int(
        value, _OP, f"the row length of feature {'/'.join(prefix + (key,))!r}"
      )
      paths.append(prefix + (key,))
  return paths


class PackNode(base.Node):
  """Packs sequences into rows with `*_segment_ids` and `*_positions`.

  Args:
    parent: the input node (dict elements of sequences).
    length_struct: dict of row lengths, one per packed feature.
    num_packing_bins: rows filled together (more rows, less padding).
    algorithm: "first_fit" or "best_fit".
    max_sequences_per_bin: None, or the most elements one row may hold.
    overflow: what to do with an element longer than its row: "error",
      "truncate" or "split" (see the module docstring).
  """

  op_name = _OP

  def __init__(
    self,
    parent: base.Node,
    length_struct: Any,
    *,
    num_packing_bins: int,
    algorithm: str = "first_fit",
    max_sequences_per_bin: int | None = None,
    overflow: str = "error",
  ):
    super().__init__([base.to_node(parent, _OP, "input")])
    self.paths = _feature_paths(length_struct)
    self.length_struct = length_struct
    self.num_packing_bins = base.check_positive_int(num_packing_bins, _OP, "num_packing_bins")
    if algorithm not in ALGORITHMS:
      raise ValueError(
        f"{_OP}: algorithm must be one of {', '.join(map(repr, ALGORITHMS))}, got {algorithm!r}."
      )
    self.algorithm = algorithm
    self.max_sequences_per_bin = (
      None
      if max_sequences_per_bin is None
      else base.check_positive_int(max_sequences_per_bin, _OP, "max_sequences_per_bin")
    )
    if overflow not in OVERFLOWS:
      raise ValueError(
        f"{_OP}: overflow must be one of {', '.join(map(repr, OVERFLOWS))}, got {overflow!r}."
      )
    self.overflow = overflow

  def spec_params(self) -> dict:
    return {
      "length_struct": self.length_struct,
      "num_packing_bins": self.num_packing_bins,
      "algorithm": self.algorithm,
      "max_sequences_per_bin": self.max_sequences_per_bin,
      "overflow": self.overflow,
    }

  def cardinality(self) -> int | None:
    return 0 if self.parents[0].cardinality() == 0 else None

  def capacities(self) -> list[int]:
    """The row length of each feature, in `paths` order."""
    return [int(lookup(self.length_struct, p)) for p in self.paths]

  def make_iterator(self) -> "PackIterator":
    parent = self.parents[0].make_iterator()
    if self.overflow == "split":
      parent = SplitIterator(parent, self)
    return PackIterator(parent, self)


class _Rows:
  """One set of `num_packing_bins` rows being filled.

  Elements are only placed here (row bookkeeping in plain Python lists, which
  beats numpy at these sizes); the values are copied once, when the rows are
  emitted (`PackIterator._assemble`), with one scatter per feature for all
  rows.
  """

  __slots__ = ("free", "counts", "items", "lengths", "rows_of", "seeds", "idents", "num_rows")

  def __init__(self, capacities: list[int], num_bins: int):
    self.free = [[c] * num_bins for c in capacities]  # per feature, per row
    self.counts = [0] * num_bins  # elements per row
    self.items: list[list] = []  # per element: its leaves (arrival order)
    self.lengths: list[list[int]] = []  # per element: its feature lengths
    self.rows_of: list[int] = []  # per element: its row
    self.seeds: list[int] = []  # per element: its seed
    # Per element, what elastic resume names it by: its seed, or for a piece
    # (doc seed, piece index, piece count).
    self.idents: list = []
    self.num_rows = 0  # rows holding an element (always a prefix)


class PackIterator(base.OpIterator):
  """Fills rows from the input and returns them one at a time."""

  op_name = _OP

  def __init__(self, parent: base.OpIterator, node: PackNode):
    super().__init__([parent])
    self._paths = node.paths
    self._flat = all(len(p) == 1 for p in self._paths)
    self._capacities = np.array([lookup(node.length_struct, p) for p in self._paths], np.int64)
    self._capacity_list = self._capacities.tolist()
    self._num_bins = node.num_packing_bins
    self._best_fit = node.algorithm == "best_fit"
    self._max_sequences = node.max_sequences_per_bin
    self._truncate = node.overflow == "truncate"
    self._split = parent if isinstance(parent, SplitIterator) else None
    self._elastic = _reads_a_sampler(parent)
    self._filling = _Rows(self._capacity_list, self._num_bins)
    self._filling_start = 0  # read index of its first element
    self._emitted: list | None = None  # rows being returned
    self._emitted_seeds: list = []
    self._emitted_elements: _Rows | None = None  # what they were made of
    self._emitted_start = 0  # read index of their first element
    self._next_row = 0
    self._end_of_input = False
    self._last_seed = 0
    self._input = base.InputReplay(parent, _OP, oldest_needed=self._oldest_needed)

  @property
  def last_seed(self) -> int:
    """The seed of the first element of the row returned last."""
    return self._last_seed

  def _oldest_needed(self) -> int:
    if self._emitted is not None:
      return self._emitted_start
    if self._filling.items:
      return self._filling_start
    return self._input.num_read

  # -- placing ---------------------------------------------------------------
  def _leaves(self, element: Any) -> list[np.ndarray]:
    leaves = element_leaves(element, self._paths, self._flat)
    if self._truncate:
      for i, capacity in enumerate(self._capacity_list):
        if len(leaves[i]) > capacity:
          leaves[i] = leaves[i][:capacity]
    return leaves

  def _too_long(self, leaves: list) -> None:
    for path, leaf, capacity in zip(self._paths, leaves, self._capacity_list):
      if len(leaf) > capacity:
        raise ValueError(
          f"{_OP}: feature {'/'.join(path)!r} of an element has length "
          f"{len(leaf)}, longer than its row length {capacity}; pass "
          f"overflow='truncate' or overflow='split' to cut it."
        )

  def _place(self, rows: _Rows, leaves: list, seed: int, ident: Any) -> bool:
    """Puts an element into a row of `rows`; False if it fits in none."""
    lengths = [len(leaf) for leaf in leaves]
    for length, capacity in zip(lengths, self._capacity_list):
      if length > capacity:
        self._too_long(leaves)
    # Rows in use are a prefix, so only they and the first empty row compete.
    candidates = range(min(rows.num_rows + 1, self._num_bins))
    counts, limit = rows.counts, self._max_sequences
    chosen = -1
    if len(lengths) == 1:
      length, free = lengths[0], rows.free[0]
      if self._best_fit:
        least = None
        for r in candidates:
          if (
            free[r] >= length
            and (limit is None or counts[r] < limit)
            and (least is None or free[r] < least)
          ):
            chosen, least = r, free[r]
      else:
        for r in candidates:
          if free[r] >= length and (limit is None or counts[r] < limit):
            chosen = r
            break
      if chosen < 0:
        return False
      free[chosen] -= length
    else:
      pairs = list(zip(rows.free, lengths))
      least = None
      for r in candidates:
        if (limit is None or counts[r] < limit) and all(
          free[r] >= length for free, length in pairs
        ):
          if not self._best_fit:
            chosen = r
            break
          room = sum(free[r] for free in rows.free)
          if least is None or room < least:
            chosen, least = r, room
      if chosen < 0:
        return False
      for free, length in pairs:
        free[chosen] -= length
    counts[chosen] += 1
    rows.items.append(leaves)
    rows.lengths.append(lengths)
    rows.rows_of.append(chosen)
    rows.seeds.append(seed)
    rows.idents.append(ident)
    if chosen >= rows.num_rows:
      rows.num_rows = chosen + 1
    return True

  def _absorb(self, index: int, element: Any, seed: int) -> None:
    """Adds an input element; emits the rows when it fits in none of them."""
    leaves = self._leaves(element)
    ident = seed if self._split is None else self._split.last_piece
    if not self._filling.items:
      self._filling_start = index
    if self._place(self._filling, leaves, seed, ident):
      return
    if self._emitted is not None:
      raise base.PipelineStateError(
        f"Cannot restore op {_OP!r}: re-reading the input filled more rows "
        f"than the state describes; it belongs to other data."
      )
    self._emit_filling()
    self._filling_start = index
    self._place(self._filling, leaves, seed, ident)

  def _emit_filling(self) -> None:
    rows = self._filling
    self._filling = _Rows(self._capacity_list, self._num_bins)
    self._emitted, self._emitted_seeds = self._assemble(rows)
    self._emitted_elements = rows
    self._emitted_start = self._filling_start
    self._next_row = 0

  # -- assembling ------------------------------------------------------------
  def _assemble(self, rows: _Rows) -> tuple[list, list]:
    """The output elements of filled rows (one vectorized fill per feature)."""
    num_rows = rows.num_rows
    rows_of = np.asarray(rows.rows_of, np.int64)
    order = np.argsort(rows_of, kind="stable")  # by row, then arrival
    sorted_rows = rows_of[order]
    # Position (in `order`) of each row's first element, for segment ids.
    row_first = np.searchsorted(sorted_rows, np.arange(num_rows))
    segment_of = np.arange(len(order)) - row_first[sorted_rows] + 1
    order_list = order.tolist()
    outputs = []
    all_lengths = np.asarray(rows.lengths, np.int64)[order]
    for f, path in enumerate(self._paths):
      parts = [rows.items[i][f] for i in order_list]
      lengths = all_lengths[:, f]
      ends = np.cumsum(lengths)
      starts = ends - lengths
      total = int(ends[-1]) if len(ends) else 0
      # Offset of each element inside its row: its start minus the start of
      # its row's first element.
      within = starts - starts[row_first][sorted_rows]
      capacity = self._capacity_list[f]
      first = parts[0]
      values = np.zeros((num_rows, capacity) + first.shape[1:], first.dtype)
      segment_ids = np.zeros((num_rows, capacity), np.int32)
      positions = np.zeros((num_rows, capacity), np.int32)
      if total:
        try:
          flat_values = np.concatenate(parts)
        except ValueError as e:
          raise ValueError(
            f"{_OP}: the elements of feature {'/'.join(path)!r} have "
            f"different shapes beyond the sequence dimension: "
            f"{sorted({p.shape[1:] for p in parts})}."
          ) from e
        token_offsets = np.repeat(sorted_rows * capacity + within - starts, lengths)
        destination = token_offsets + np.arange(total)
        values.reshape((num_rows * capacity,) + first.shape[1:])[destination] = flat_values
        segment_ids.reshape(-1)[destination] = np.repeat(segment_of, lengths)
        positions.reshape(-1)[destination] = np.arange(total) - np.repeat(starts, lengths)
      outputs.append((values, segment_ids, positions))
    first_item = order[row_first]
    seeds = [rows.seeds[i] for i in first_item.tolist()]
    return [self._row(outputs, r) for r in range(num_rows)], seeds

  def _row(self, outputs: list, r: int) -> dict:
    row: dict = {}
    for path, (values, segment_ids, positions) in zip(self._paths, outputs):
      target = row
      for key in path[:-1]:
        target = target.setdefault(key, {})
      key = path[-1]
      target[key] = values[r]
      target[f"{key}_segment_ids"] = segment_ids[r]
      target[f"{key}_positions"] = positions[r]
    return row

  # -- iteration ---------------------------------------------------------------
  def __next__(self) -> Any:
    while self._emitted is None:
      if self._end_of_input:
        raise StopIteration
      try:
        element = self._input.read()
      except StopIteration:
        self._end_of_input = True
        if self._filling.items:
          self._emit_filling()
        continue
      self._absorb(self._input.num_read - 1, element, self.parents[0].last_seed)
    row = self._emitted[self._next_row]
    self._last_seed = self._emitted_seeds[self._next_row]
    self._emitted[self._next_row] = None  # Returned: do not keep it alive.
    self._next_row += 1
    if self._next_row == len(self._emitted):
      self._emitted = self._emitted_elements = None
      self._next_row = 0
    return row

  # -- state -------------------------------------------------------------------
  def _get_own_state(self) -> dict:
    first = self._oldest_needed()
    state = {
      "input": self._input.get_state(first),
      "first": first,
      "emitting": self._emitted is not None,
      "next_row": self._next_row,
      "end_of_input": self._end_of_input,
    }
    if self._elastic:
      state["unemitted"] = self._unemitted()
    return state

  def _unemitted(self) -> dict:
    """The input elements not all emitted yet (see the module docstring):
    `{"elements": [seed, ...], "pieces": [[seed, [piece, ...]], ...]}`."""
    idents = list(self._filling.idents)
    emitted = self._emitted_elements
    if emitted is not None:
      next_row = self._next_row
      idents.extend(ident for ident, row in zip(emitted.idents, emitted.rows_of) if row >= next_row)
    if self._split is None:
      return {"elements": idents, "pieces": []}
    pieces: dict[int, tuple[int, list[int]]] = {}
    seed, to_come, count = self._split.pieces_to_come()
    if to_come:
      pieces[seed] = (count, list(to_come))
    for seed, index, count in idents:
      pieces.setdefault(seed, (count, []))[1].append(index)
    whole = [seed for seed, (count, indices) in pieces.items() if len(indices) == count]
    return {
      "elements": whole,
      "pieces": [
        [seed, sorted(indices)]
        for seed, (count, indices) in pieces.items()
        if len(indices) != count
      ],
    }

  def _set_own_state(self, state: dict) -> None:
    first = base.state_int(state, "first", _OP)
    next_row = base.state_int(state, "next_row", _OP, high=self._num_bins - 1)
    emitting = state.get("emitting")
    end_of_input = state.get("end_of_input")
    if not isinstance(emitting, bool) or not isinstance(end_of_input, bool):
      raise base.PipelineStateError(
        f"Cannot restore op {_OP!r}: own state needs bools 'emitting' and "
        f"'end_of_input', got {state!r:.200}."
      )
    self._filling = _Rows(self._capacity_list, self._num_bins)
    self._emitted, self._emitted_seeds, self._next_row = None, [], 0
    self._emitted_elements = None
    self._end_of_input = end_of_input
    self._input.set_state(state.get("input"), first, self._absorb)
    if emitting and self._emitted is None and end_of_input and self._filling.items:
      self._emit_filling()
    if emitting != (self._emitted is not None) or (emitting and next_row >= len(self._emitted)):
      raise base.PipelineStateError(
        f"Cannot restore op {_OP!r}: re-reading the input from element "
        f"{first} does not rebuild the rows the state describes; it "
        f"belongs to other data."
      )
    for r in range(next_row):
      self._emitted[r] = None
    self._next_row = next_row


def _reads_a_sampler(iterator: base.OpIterator) -> bool:
  """Whether `iterator` is `from_source` under a chain of element-wise ops:
  only then can the pipeline be resumed on another number of processes, so
  only then does the state name the elements `pack` holds."""
  while iterator.op_name in ELASTIC_INPUT_OPS + (SPLIT_OP,):
    if len(iterator.parents) != 1:
      return False
    iterator = iterator.parents[0]
  return iterator.op_name == "from_source"


def unemitted_elements(own_state: Any) -> tuple[list[int], list[list]]:
  """From a `pack` op's own state: the seeds of the input elements it had read
  but not all emitted, and `[seed, [piece, ...]]` for those of them partly
  emitted (the pieces still to come).

  Raises:
    ValueError: the state does not list them (saved before they were kept).
  """
  unemitted = own_state.get("unemitted") if isinstance(own_state, dict) else None
  if (
    not isinstance(unemitted, dict)
    or not isinstance(unemitted.get("elements"), list)
    or not isinstance(unemitted.get("pieces"), list)
  ):
    raise ValueError(
      f"reshard: op {_OP!r}'s state does not list the elements it holds "
      f"('unemitted'), so it can only be resumed on the same number of "
      f"processes; got {str(own_state):.200}."
    )
  partial = unemitted["pieces"]
  keep_map(partial)
  return unemitted["elements"] + [seed for seed, _ in partial], partial


def resumed_pack_state() -> dict:
  """The own state of a `pack` that holds nothing (after a reshard)."""
  return {
    "input": {"num_read": 0},
    "first": 0,
    "emitting": False,
    "next_row": 0,
    "end_of_input": False,
    "unemitted": {"elements": [], "pieces": []},
  }
