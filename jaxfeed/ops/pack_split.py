"""`pack`'s `overflow="split"`: elements longer than a row cut into row-length
pieces before they are packed (the `pack_split` op under `pack`).

Each piece is packed like an element of its own, with positions from 0;
nothing is lost. A resumed `pack_split` cuts the elements of its `keep`
state to exactly their missing pieces (see `jaxfeed.ops.pack` and
`jaxfeed.ops.reshard`).
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from jaxfeed.ops import base

_OP = "pack"
SPLIT_OP = "pack_split"


class PackLayout(Protocol):
  """What `SplitIterator` reads of its `PackNode`."""

  paths: list[tuple]

  def capacities(self) -> list[int]: ...


def lookup(tree: Any, path: tuple) -> Any:
  """The leaf of `tree` at `path` (its keys, outermost first)."""
  for key in path:
    tree = tree[key]
  return tree


class _Leaves(list):
  """An element already reduced to its packed features' leaves (a piece)."""


def element_leaves(element: Any, paths: list[tuple], flat: bool) -> _Leaves:
  """The leaves of `element` at `paths` (`flat`: all of length 1), each 1-D+."""
  if isinstance(element, _Leaves):
    return element
  try:
    if flat:
      leaves = _Leaves(element[p[0]] for p in paths)
    else:
      leaves = _Leaves(lookup(element, p) for p in paths)
  except (KeyError, TypeError, IndexError) as e:
    raise ValueError(
      f"{_OP}: input elements must be dicts holding the features "
      f"{['/'.join(p) for p in paths]} of length_struct; an element "
      f"lacks {e} ({type(element).__name__}: {element!r:.200})."
    ) from None
  for i, leaf in enumerate(leaves):
    if type(leaf) is not np.ndarray or leaf.ndim == 0:
      leaf = np.asarray(leaf)
      if leaf.ndim == 0:
        leaf = leaf.reshape(1)
      leaves[i] = leaf
  return leaves


class SplitIterator(base.OpIterator):
  """`overflow="split"`: the input's elements cut into row-length pieces.

  Its state is the input's position before the element being cut plus the
  number of its pieces returned; restoring reads that element again. After
  an elastic resume it also holds `keep`: for elements (by seed) that the old
  processes had partly emitted, the only pieces still to return.
  """

  op_name = SPLIT_OP

  def __init__(self, parent: base.OpIterator, node: PackLayout):
    super().__init__([parent])
    self._paths = node.paths
    self._flat = all(len(p) == 1 for p in self._paths)
    self._capacities = node.capacities()
    self._pieces: list[_Leaves] = []
    self._indices: list[int] = []  # Each piece's index among all pieces.
    self._count = 0  # The pieces of the element being cut.
    self._pos = 0
    self._seed = 0
    self._keep: dict[int, list[int]] = {}
    self._input = base.InputReplay(parent, _OP, oldest_needed=self._oldest_needed)

  @property
  def last_seed(self) -> int:
    index = self._indices[self._pos - 1] if self._pos else 0
    return self._seed if index == 0 else base.mix_seed(self._seed, index)

  @property
  def last_piece(self) -> tuple[int, int, int]:
    """(element seed, piece index, piece count) of the piece returned last."""
    return self._seed, self._indices[self._pos - 1], self._count

  def pieces_to_come(self) -> tuple[int, list[int], int]:
    """(element seed, indices of its pieces not returned yet, piece count)."""
    return self._seed, self._indices[self._pos :], self._count

  def _partial(self) -> bool:
    return 0 < self._pos < len(self._pieces)

  def _oldest_needed(self) -> int:
    return self._input.num_read - (1 if self._partial() else 0)

  def _cut(self, element: Any, seed: int) -> None:
    leaves = element_leaves(element, self._paths, self._flat)
    count = max([1] + [-(-len(leaf) // c) for leaf, c in zip(leaves, self._capacities)])
    indices = range(count)
    if self._keep and seed in self._keep:
      indices = self._keep[seed]
      if indices[-1] >= count:
        raise base.PipelineStateError(
          f"Cannot restore op {_OP!r}: the state keeps piece {indices[-1]} "
          f"of an element cut into {count}; it belongs to other data."
        )
    if count == 1:
      self._pieces = [leaves]
    else:
      self._pieces = [
        _Leaves(leaf[k * c : (k + 1) * c] for leaf, c in zip(leaves, self._capacities))
        for k in indices
      ]
    self._indices = list(indices)
    self._count = count
    self._pos = 0
    self._seed = seed

  def __next__(self) -> Any:
    while self._pos >= len(self._pieces):
      self._pieces = []
      element = self._input.read()
      self._cut(element, self.parents[0].last_seed)
    piece = self._pieces[self._pos]
    self._pieces[self._pos] = None
    self._pos += 1
    return piece

  def _get_own_state(self) -> dict:
    partial = self._partial()
    state = {
      "input": self._input.get_state(self._oldest_needed()),
      "pos": self._pos if partial else 0,
    }
    if self._keep:
      state["keep"] = [[seed, pieces] for seed, pieces in self._keep.items()]
    return state

  def _set_own_state(self, state: dict) -> None:
    pos = base.state_int(state, "pos", _OP)
    input_state = state.get("input") if isinstance(state, dict) else None
    num_read = base.state_int(input_state, "num_read", _OP)
    self._keep = keep_map(state.get("keep", []))
    self._pieces, self._pos = [], 0
    self._input.set_state(
      input_state,
      num_read - 1 if pos else num_read,
      lambda index, element, seed: self._cut(element, seed),
    )
    if pos:
      if pos >= len(self._pieces):
        raise base.PipelineStateError(
          f"Cannot restore op {_OP!r}: the state is at piece {pos} of an "
          f"element cut into {len(self._pieces)}; it belongs to other data."
        )
      for k in range(pos):
        self._pieces[k] = None
      self._pos = pos


def keep_map(keep: Any) -> dict[int, list[int]]:
  """`pack_split`'s `keep` state as {element seed: sorted piece indices}."""
  ok = isinstance(keep, list)
  result: dict[int, list[int]] = {}
  for entry in keep if ok else ():
    if not (
      isinstance(entry, list)
      and len(entry) == 2
      and isinstance(entry[0], int)
      and isinstance(entry[1], list)
      and entry[1]
      and all(isinstance(k, int) and k >= 0 for k in entry[1])
    ):
      ok = False
      break
    result[entry[0]] = sorted(set(entry[1]))
  if not ok:
    raise base.PipelineStateError(
      f"Cannot restore op {SPLIT_OP!r}: 'keep' must be a list of [seed, "
      f"[piece index, ...]] pairs, got {str(keep):.200}."
    )
  return result


def resumed_split_state(keep: list[list]) -> dict:
  """The own state of a `pack_split` that holds nothing and cuts the
  elements of `keep` (`[[seed, [piece, ...]], ...]`) to those pieces."""
  state: dict = {"input": {"num_read": 0}, "pos": 0}
  if keep:
    state["keep"] = keep
  return state
