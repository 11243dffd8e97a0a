"""`element_spec`: the structure, shapes and dtypes of a dataset's elements.

Like tf.data's `Dataset.element_spec`, the spec is the elements' structure
(dicts, tuples, lists) with a `TensorSpec(shape, dtype)` per leaf, None in
`shape` for a size that varies between elements (a last partial batch, a
padded dimension). It is derived without reading the dataset where the op
graph says it: a source's leaves (`range`, `counter`, `random`,
`from_tensor_slices`, `from_tensors`, `list_files`, `from_tfrecord`) and the
effect of each op above them on shapes (`batch` and the other batching ops,
`unbatch`, `enumerate`, `zip`, `concatenate`, ...; ops that keep elements as
they are pass their input's spec on).

What the graph cannot say, tf.data learns by tracing the user's functions;
jaxfeed does not trace them. Below a `map` (and any other op not listed
above, `from_source` included) the spec is that of the op's first element:
that op's part of the graph is run for one element (without its `shuffle`
and `prefetch` ops, which change neither shapes nor dtypes, so that no
iteration or thread of the dataset is used up) and each leaf's shape is
taken as it is. A function whose outputs vary in shape gives the first
output's sizes where tf.data would give None (a `padded_batch` above it,
which pads to each batch's longest element, gives None for them). A dataset that is empty there
has no spec: that is an error naming the op.

Strings (tf.string) are `bytes` leaves, and their spec's dtype is numpy's
`object`, the dtype of a batch of them.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import numpy as np

from jaxfeed.ops import padding
from jaxfeed.ops import tree
from jaxfeed.ops.base import Node
from jaxfeed.ops.batch_rows import SAME_ELEMENT_OPS

__all__ = ["TensorSpec", "element_spec", "spec_of_value"]


@dataclasses.dataclass(frozen=True)
class TensorSpec:
  """The shape and dtype of one leaf of a dataset's elements (tf.TensorSpec).

  Attributes:
    shape: one size per dimension, None where it varies between elements.
    dtype: the numpy dtype; `object` for strings (`bytes`).
  """

  shape: tuple[int | None, ...]
  dtype: np.dtype

  def __post_init__(self):
    shape = tuple(self.shape)
    if any(
      not (d is None or (isinstance(d, (int, np.integer)) and not isinstance(d, bool) and d >= 0))
      for d in shape
    ):
      raise ValueError(f"TensorSpec: shape must hold sizes >= 0 or None, got {self.shape!r}.")
    object.__setattr__(self, "shape", tuple(None if d is None else int(d) for d in shape))
    object.__setattr__(self, "dtype", np.dtype(self.dtype))

  def is_compatible_with(self, value: Any) -> bool:
    """Whether `value` (an array or scalar) fits this spec."""
    other = spec_of_value(value)
    return (
      other.dtype == self.dtype
      and len(other.shape) == len(self.shape)
      and all(d is None or d == n for d, n in zip(self.shape, other.shape))
    )

  def most_specific_compatible(self, other: "TensorSpec") -> "TensorSpec":
    """The spec of both: sizes that differ become None (tf.data's rule for
    `concatenate` and the mixtures). A dtype or rank that differs is an error."""
    if other.dtype != self.dtype or len(other.shape) != len(self.shape):
      raise ValueError(
        f"element_spec: {self} and {other} have no common spec (the dtypes or ranks differ)."
      )
    return TensorSpec(
      tuple(a if a == b else None for a, b in zip(self.shape, other.shape)), self.dtype
    )

  def with_batch(self, size: int | None) -> "TensorSpec":
    """This spec with a leading batch dimension of `size`."""
    return TensorSpec((size,) + self.shape, self.dtype)


def spec_of_value(value: Any) -> TensorSpec:
  """The spec of one leaf value (bytes and str are `object`)."""
  if isinstance(value, (bytes, str)):
    return TensorSpec((), np.dtype(object))
  array = np.asarray(value)
  dtype = np.dtype(object) if array.dtype.kind in "SUO" else array.dtype
  return TensorSpec(array.shape, dtype)


def element_spec(node: Node) -> Any:
  """The element spec of `node`'s dataset (see the module docstring).

  Raises:
    ValueError: an op whose spec is read from its first element has none.
  """
  rule = _RULES.get(node.op_name)
  # A saved dataset (`Dataset.load`) records the spec of all its elements.
  recorded = getattr(getattr(node, "source", None), "element_spec", None)
  if node.op_name == "from_source" and recorded is not None:
    return recorded
  if rule is None:
    return _peek(node)
  return rule(node)


def _parent(node: Node, index: int = 0) -> Any:
  return element_spec(node.parents[index])


def _leaves(spec: Any, fn: Callable[[TensorSpec], TensorSpec]) -> Any:
  return tree.map_structure(fn, spec)


def _common(specs: list) -> Any:
  first = specs[0]
  for spec in specs[1:]:
    if not tree.same_structure(first, spec):
      raise ValueError(f"element_spec: the inputs' structures differ: {first} and {spec}.")
    first = tree.map_structure(TensorSpec.most_specific_compatible, first, spec)
  return first


# -- sources -------------------------------------------------------------------
def _scalar(dtype: Any) -> Callable[[Node], TensorSpec]:
  return lambda node: TensorSpec((), getattr(node, "dtype", dtype))


def _slices(node: Any) -> Any:
  # Every component's rows, of which one element is a slice.
  return _leaves(node.columns(), lambda column: _drop_first(spec_of_value(column)))


def _drop_first(spec: TensorSpec) -> TensorSpec:
  return TensorSpec(spec.shape[1:], spec.dtype)


# -- batching ------------------------------------------------------------------
def _batch(node: Any) -> Any:
  size = node.batch_size if node.drop_remainder else None
  return _leaves(_parent(node), lambda spec: spec.with_batch(size))


def _padded_batch(node: Any) -> Any:
  parent = _parent(node)
  size = node.batch_size if node.drop_remainder else None
  if node.padded_shapes is None:
    # Padded to the longest element of each batch: a size every element
    # has stays; a size read from a first element may vary.
    exact = _derived(node.parents[0])
    return _leaves(
      parent,
      lambda spec: TensorSpec(
        (size,) + (spec.shape if exact else (None,) * len(spec.shape)), spec.dtype
      ),
    )
  # One padded shape per leaf, read as padded_batch reads them; None and -1
  # pad to the longest element of each batch.
  padded = padding._per_leaf(
    parent,
    node.padded_shapes,
    "padded_shapes",  # pylint: disable=protected-access
    node.op_name,
  )
  specs = [
    TensorSpec(
      (size,)
      + tuple(
        padding._shape_spec(  # pylint: disable=protected-access
          shape, len(spec.shape), path, node.op_name
        )
      ),
      spec.dtype,
    )
    for spec, shape, path in zip(tree.flatten(parent), padded, tree.paths(parent))
  ]
  return tree.unflatten(parent, specs)


def _rebatch(node: Any) -> Any:
  sizes = node.batch_sizes
  size = sizes[0] if node.drop_remainder and len(set(sizes)) == 1 else None
  return _leaves(_parent(node), lambda spec: TensorSpec((size,) + spec.shape[1:], spec.dtype))


def _unbatch(node: Node) -> Any:
  def unbatched(spec: TensorSpec) -> TensorSpec:
    if not spec.shape:
      raise ValueError("element_spec: unbatch of scalar elements.")
    return _drop_first(spec)

  return _leaves(_parent(node), unbatched)


def _sparse_batch(node: Any) -> dict:
  rank = len(node.row_shape) + 1
  return {
    "indices": TensorSpec((None, rank), np.int64),
    "values": TensorSpec((None,), _parent(node).dtype),
    "dense_shape": TensorSpec((rank,), np.int64),
  }


# -- structure -------------------------------------------------------------------
def _zip(node: Any) -> Any:
  return tree.map_structure(lambda i: _parent(node, i), node.structure)


def _enumerate(node: Node) -> tuple:
  return TensorSpec((), np.int64), _parent(node)


def _all_parents(node: Node) -> Any:
  return _common([element_spec(p) for p in node.parents])


def _data_parents(node: Node) -> Any:
  # choose_from_datasets: the last parent is the choice dataset.
  return _common([element_spec(p) for p in node.parents[:-1]])


def _distributed(node: Any) -> Any:
  # A service read: the pipeline it runs; reading an element would start a job.
  pipeline = getattr(node, "dataset", None)
  if not isinstance(pipeline, Node):
    raise ValueError(
      "element_spec: a read of a dataset registered by id has no pipeline "
      "here to derive the spec from; read an element and use "
      "jaxfeed.ops.element_spec.spec_of_value on its leaves."
    )
  return element_spec(pipeline)


# `unique` hands on its elements too; they are scalars, never a batch.
_PASS_THROUGH = (*SAME_ELEMENT_OPS, "unique")

_RULES: dict[str, Callable[[Any], Any]] = {
  "range": _scalar(np.int64),
  "counter": _scalar(np.int64),
  "random": _scalar(np.int64),
  "from_tfrecord": _scalar(object),
  "from_tensor_slices": _slices,
  "from_tensors": _slices,
  "batch": _batch,
  "padded_batch": _padded_batch,
  "rebatch": _rebatch,
  "unbatch": _unbatch,
  "sparse_batch": _sparse_batch,
  "zip": _zip,
  "enumerate": _enumerate,
  "concatenate": _all_parents,
  "sample_from_datasets": _all_parents,
  "choose_from_datasets": _data_parents,
  "distribute": _distributed,
  **{op: _parent for op in _PASS_THROUGH},
}


def _derived(node: Node) -> bool:
  """Whether `node`'s spec is derived from the graph alone (no first element
  read below it)."""
  if node.op_name == "distribute":
    pipeline = getattr(node, "dataset", None)
    return isinstance(pipeline, Node) and _derived(pipeline)
  return node.op_name in _RULES and all(_derived(p) for p in node.parents)


# -- the first element -----------------------------------------------------------
_NOT_RUN = ("shuffle", "prefetch")  # change neither shapes nor dtypes


def _without(node: Node, memo: dict) -> Node:
  """`node`'s graph without its `_NOT_RUN` ops (nodes rebuilt as the
  optimizer rebuilds them, from `spec_params`)."""
  if id(node) in memo:
    return memo[id(node)]
  if node.op_name in _NOT_RUN and len(node.parents) == 1:
    rebuilt = _without(node.parents[0], memo)
  else:
    parents = tuple(_without(p, memo) for p in node.parents)
    rebuilt = node
    if any(new is not old for new, old in zip(parents, node.parents)):
      rebuilt = type(node)(*parents, **node.spec_params())
  memo[id(node)] = rebuilt
  return rebuilt


def _peek(node: Node) -> Any:
  with _without(node, {}).make_iterator() as iterator:
    try:
      element = next(iterator)
    except StopIteration:
      raise ValueError(
        f"element_spec: the spec of op {node.op_name!r} is read from its "
        f"first element (see jaxfeed.ops.element_spec), but it has none: "
        f"{node!r} is empty."
      ) from None
  return tree.map_structure(spec_of_value, element)
