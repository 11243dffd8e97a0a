"""`zip`: elements of several datasets side by side (tf.data's `Dataset.zip`).

The datasets come as a (nested) tuple or dict; each output element has that
structure with every dataset replaced by its next element. The output ends with
the shortest input: inputs are read in structure order (dict keys sorted) and
reading stops at the first one that ends, as in tf.data. Python lists are
refused, as tf.data refuses them (use a tuple).
"""

from __future__ import annotations

from typing import Any

from jaxfeed.ops import base
from jaxfeed.ops import index_ranges
from jaxfeed.ops import tree

__all__ = ["ZipNode", "ZipIterator"]

_OP = "zip"


def _is_dataset(value: Any) -> bool:
  return isinstance(value, base.Node) or isinstance(getattr(value, "node", None), base.Node)


def _split_structure(datasets: Any) -> tuple[Any, list[base.Node]]:
  """(skeleton with leaf indices in `tree.flatten` order, the leaf nodes)."""
  nodes: list[base.Node] = []

  def walk(value: Any) -> Any:
    if _is_dataset(value):
      nodes.append(base.to_node(value, _OP, "each input"))
      return len(nodes) - 1
    if isinstance(value, dict):
      built = {k: walk(value[k]) for k in sorted(value)}
      return {k: built[k] for k in value}
    if type(value) is tuple:
      return tuple(walk(v) for v in value)
    if isinstance(value, list):
      raise TypeError(
        f"{_OP}: inputs must be a (nested) tuple or dict of datasets; a "
        f"Python list is not supported (as in tf.data), use a tuple: "
        f"{value!r:.200}."
      )
    raise TypeError(
      f"{_OP}: inputs must be a (nested) tuple or dict of jaxfeed datasets, "
      f"found {type(value).__name__}: {value!r:.200}."
    )

  skeleton = walk(datasets)
  if not nodes:
    raise ValueError(f"{_OP}: needs at least one dataset, got {datasets!r}.")
  return skeleton, nodes


class ZipNode(base.Node):
  """Zips a (nested) tuple or dict of datasets.

  `ZipNode((a, b))`, `ZipNode({"x": a, "y": b})` or, tf.data style,
  `ZipNode(a, b)`. `spec_params` rebuilds it as
  `ZipNode(*parent_nodes, structure=skeleton)`, where the skeleton holds each
  parent's index in place of the dataset.
  """

  op_name = _OP

  def __init__(self, datasets: Any, *more_datasets: Any, structure: Any = None):
    if structure is None:
      if more_datasets:
        datasets = (datasets,) + more_datasets
      structure, nodes = _split_structure(datasets)
    else:
      nodes = [base.to_node(d, _OP, "each input") for d in (datasets,) + more_datasets]
      leaves = tree.flatten(structure)
      if sorted(leaves) != list(range(len(nodes))) or leaves != sorted(leaves):
        raise ValueError(
          f"{_OP}: structure must hold the parent indices 0..{len(nodes) - 1} "
          f"in order, got {structure!r:.200}."
        )
    super().__init__(nodes)
    self.structure = structure

  def spec_params(self) -> dict:
    return {"structure": self.structure}

  def cardinality(self) -> int | None:
    result = -1
    for parent in self.parents:
      n = parent.cardinality()
      if n is None:
        return None
      if n >= 0 and (result < 0 or n < result):
        result = n
    return result

  def make_iterator(self) -> "ZipIterator":
    return ZipIterator([p.make_iterator() for p in self.parents], self.structure)

  # Index addressing (see jaxfeed.ops.index_ranges): position p of every
  # input, up to the shortest input.
  def index_addressable(self) -> bool:
    return all(index_ranges.is_index_addressable(p) for p in self.parents)

  def num_positions(self) -> int | None:
    counts = [index_ranges.num_positions(p) for p in self.parents]
    bounded = [n for n in counts if n is not None]
    return min(bounded) if bounded else None

  def range_iterator(self, start: int, stop: int) -> "ZipIterator":
    return ZipIterator(
      [index_ranges.range_iterator(p, start, stop) for p in self.parents], self.structure
    )


class ZipIterator(base.OpIterator):
  """Reads one element of every input per `next()`."""

  op_name = _OP

  def __init__(self, parents: list[base.OpIterator], structure: Any):
    super().__init__(parents)
    self._structure = structure
    self._ended = False
    if type(structure) is tuple and all(isinstance(v, int) for v in structure):
      self._build = tuple  # Flat tuple: no tree walk per element.
    else:
      self._build = lambda values: tree.unflatten(structure, values)

  @property
  def last_seed(self) -> int:
    return base.mix_seed(*(p.last_seed for p in self.parents))

  def __next__(self) -> Any:
    if self._ended:
      raise StopIteration
    try:
      values = [next(p) for p in self.parents]
    except StopIteration:
      self._ended = True
      raise
    return self._build(values)

  def _get_own_state(self) -> dict:
    return {"ended": self._ended}

  def _set_own_state(self, state: dict) -> None:
    ended = state.get("ended") if isinstance(state, dict) else None
    if not isinstance(ended, bool):
      raise base.PipelineStateError(
        f"Cannot restore op {_OP!r}: own state needs a bool 'ended', got {state!r:.200}."
      )
    self._ended = ended
