"""Batch assembly shared by the batching ops.

`batch`, `padded_batch`, `unbatch`, `rebatch`, `bucket_by_sequence_length`,
`pack` and the coordinated readers all turn lists of elements into batches (and
back). They use these helpers so every op produces the same batch layout and
the same errors:

- `stack(elements)`: a batch from equally shaped elements.
- `pad_and_stack(elements, padded_shapes, padding_values)` (in
  `jaxfeed.ops.padding`): a batch from elements padded to common shapes,
  with tf.data `padded_batch` semantics.
- `concatenate(batches)`, `slice_batch(batch, start, stop)`,
  `batch_length(batch)`, `unstack(batch)`: joining and splitting batches along
  the leading dimension.
- `to_batch_leaf(array)`: the batch layout of one already stacked leaf.
- `as_batch(gathered)`: the batch layout of a whole pytree of already stacked
  leaves (what iterators implementing `next_batch` below return).

Batch layout (as tf.data's `as_numpy_iterator` gives it): every leaf gains a
leading batch dimension and keeps its dtype; numpy and Python scalars become
1-D arrays (Python ints become int64, floats float64, bools bool); string
leaves (`bytes`, `str`, numpy `S`/`U` arrays) become `object` arrays holding
the Python `bytes` / `str` values. Unlike TensorFlow, `str` values stay `str`
(TensorFlow encodes them to UTF-8 `bytes`).

Optional batched-read protocol
------------------------------
An op iterator that can produce several consecutive elements at once faster
than one `next()` each (e.g. `from_source` over an in-memory `ArraySource`,
which gathers rows with one fancy-indexing call) may implement

    next_batch(max_count: int) -> tuple[batch, seeds]

- `batch`: the stacked pytree of the next `k` elements, exactly the batch
  `stack([next(it) for _ in range(k)])` would return (string leaves as object
  arrays, namedtuples as tuples, fresh writable arrays; `as_batch` converts a
  pytree of gathered leaves, `to_batch_leaf` one leaf), with
  `1 <= k <= max_count`; `k < max_count` only when the input ends after them.
- `seeds`: a uint64 numpy array of length `k`, the per-element rng seeds (what
  `last_seed` would have been after each of the `k` elements).
- Raises `StopIteration` when no element is left.
- Afterwards the iterator is in the state it would be in after `k` calls to
  `next()`: `get_state()`, `last_seed` (`seeds[-1]`) and later reads agree.

`batch` uses it when its parent iterator has it (`hasattr(parent,
"next_batch")`) and does not say `batched_reads_declined`; iterators whose
elements come from user code or buffers should not implement it, except
ordered parallel `map` / `random_map`, whose worker threads write each
output into its row of the batch (`jaxfeed.ops.batch_placement`), and which
decline when the outputs are too small for that to pay.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from jaxfeed.ops import tree

__all__ = [
  "as_batch",
  "batch_length",
  "concatenate",
  "slice_batch",
  "stack",
  "to_batch_leaf",
  "unstack",
]

_MAX_LISTED_POSITIONS = 8


# ---------------------------------------------------------------------------
# public helpers
# ---------------------------------------------------------------------------
def stack(elements: Sequence[Any], op_name: str = "batch") -> Any:
  """Stacks equally structured, equally shaped elements into one batch.

  Args:
    elements: A non-empty sequence of pytrees (dicts / tuples / lists of numpy
      arrays, numpy or Python scalars, bytes or str).
    op_name: The op named in error messages.

  Returns:
    A pytree of the first element's structure whose leaves are arrays with a
    leading dimension of `len(elements)` (see the module's batch layout).

  Raises:
    ValueError: The elements differ in structure, in the shape of a leaf (the
      message suggests `padded_batch`) or in the dtype of a leaf.
  """
  structure, columns = _columns(elements, op_name)
  leaves = [_stack_column(col, i, structure, elements, op_name) for i, col in enumerate(columns)]
  return tree.unflatten(structure, leaves)


def batch_length(batch: Any) -> int:
  """The size of a batch's leading dimension (of its first leaf)."""
  leaves = tree.flatten(batch)
  if not leaves:
    raise ValueError("Cannot take the length of a batch without leaves.")
  return int(np.shape(leaves[0])[0])


def slice_batch(batch: Any, start: int, stop: int) -> Any:
  """Rows `start:stop` of every leaf of a batch (views, no copy)."""
  return tree.map_structure(lambda leaf: leaf[start:stop], batch)


def unstack(batch: Any) -> list[Any]:
  """The elements of a batch: row `i` of every leaf, as a list of pytrees.

  Numeric rows are numpy arrays (0-d rows become numpy scalars); rows of
  object (string) leaves are their Python objects.
  """
  structure = batch
  leaves = tree.flatten(batch)
  if not leaves:
    return []
  n = int(np.shape(leaves[0])[0])
  rows = [list(leaf) for leaf in leaves]  # one C-level split per leaf
  return [tree.unflatten(structure, [r[i] for r in rows]) for i in range(n)]


def concatenate(batches: Sequence[Any], op_name: str = "rebatch") -> Any:
  """Joins batches of one structure along the leading dimension."""
  structure, columns = _columns(batches, op_name)
  leaves = []
  for i, col in enumerate(columns):
    try:
      leaf = np.concatenate(col, axis=0)
    except ValueError as e:
      raise ValueError(
        f"{op_name}: cannot join batches at leaf "
        f"{_path(structure, i)!r}: shapes {[np.shape(c) for c in col]} "
        f"differ beyond the batch dimension."
      ) from e
    leaves.append(leaf)
  return tree.unflatten(structure, leaves)


def to_batch_leaf(array: np.ndarray) -> np.ndarray:
  """A stacked leaf in the batch layout: numpy string arrays become object."""
  if array.dtype.kind in "SU":
    return array.astype(object)
  return array


def as_batch(gathered: Any, copy: bool = False) -> Any | None:
  """The batch `stack` builds from the rows of already stacked leaves.

  Args:
    gathered: A pytree (dicts, tuples, namedtuples, lists) of numpy arrays
      whose leading dimension holds the rows, e.g. leaves fancy-indexed from
      a source's arrays.
    copy: Whether to copy leaves that would otherwise be returned as they are
      (needed when they are views of data that other batches also see).

  Returns:
    The pytree in the batch layout (string arrays as object arrays of
    `bytes` / `str`, namedtuples as plain tuples, dict key order kept), or
    None when a leaf is not a numpy array or is an object array holding
    anything but strings: only `stack` knows how such rows combine.
  """
  if isinstance(gathered, dict):
    out = {}
    for key, value in gathered.items():
      out[key] = as_batch(value, copy)
      if out[key] is None:
        return None
    return out
  if isinstance(gathered, (tuple, list)):
    children = [as_batch(value, copy) for value in gathered]
    if any(child is None for child in children):
      return None
    return children if isinstance(gathered, list) else tuple(children)
  if not isinstance(gathered, np.ndarray) or gathered.ndim == 0:
    return None
  kind = gathered.dtype.kind
  if kind in "SU":
    return gathered.astype(object)
  if kind == "O":
    if not all(isinstance(v, (bytes, str)) for v in gathered.flat):
      return None
  elif kind == "V":
    return None  # Structured rows: stack decides.
  return gathered.copy() if copy else gathered


# ---------------------------------------------------------------------------
# columns: elements -> one list of values per leaf, checking structure
# ---------------------------------------------------------------------------
class _StructureMismatch(Exception):
  pass


def _columns(elements: Sequence[Any], op_name: str) -> tuple[Any, list[list]]:
  """The first element's structure and, per leaf, the values of all elements."""
  if not len(elements):
    raise ValueError(f"{op_name}: cannot assemble a batch from no elements.")
  elements = list(elements)
  structure = elements[0]
  out: list[list] = []
  try:
    _gather(structure, elements, out)
  except _StructureMismatch:
    _raise_structure_mismatch(elements, op_name)
  return structure, out


def _gather(structure: Any, values: list, out: list[list]) -> None:
  if isinstance(structure, dict):
    keys = structure.keys()
    if not all(isinstance(v, dict) and v.keys() == keys for v in values):
      raise _StructureMismatch
    for k in sorted(structure):
      _gather(structure[k], [v[k] for v in values], out)
  elif isinstance(structure, (tuple, list)):
    kind, size = type(structure), len(structure)
    if not all(type(v) is kind and len(v) == size for v in values):
      raise _StructureMismatch
    for i in range(size):
      _gather(structure[i], [v[i] for v in values], out)
  else:
    # Leaf-versus-subtree mismatches here surface when the column is stacked.
    out.append(values)


def _raise_structure_mismatch(elements: Sequence[Any], op_name: str) -> None:
  first = elements[0]
  for pos, element in enumerate(elements):
    if not tree.same_structure(first, element):
      raise ValueError(
        f"{op_name}: elements of one batch must have the same structure, "
        f"but element 0 is {_describe(first)} and element {pos} is "
        f"{_describe(element)}."
      )
  raise AssertionError("structure mismatch without a differing element")


def _describe(element: Any) -> str:
  try:
    return tree.structure_str(element)
  except Exception:  # pylint: disable=broad-except
    return repr(element)[:200]


def _path(structure: Any, leaf_index: int) -> str:
  path = tree.paths(structure)[leaf_index]
  return path or "<element>"


# ---------------------------------------------------------------------------
# stacking one column
# ---------------------------------------------------------------------------
def _is_string(value: Any) -> bool:
  if isinstance(value, (bytes, str)):
    return True
  dtype = getattr(value, "dtype", None)
  return dtype is not None and getattr(dtype, "kind", "") in "SUO"


def _dtype_of(value: Any) -> np.dtype:
  dtype = getattr(value, "dtype", None)
  if isinstance(dtype, np.dtype):
    return dtype
  return np.asarray(value).dtype


def _stack_column(
  col: list, leaf_index: int, structure: Any, elements: Sequence[Any], op_name: str
) -> np.ndarray:
  first = col[0]
  if _is_string(first):
    return _stack_objects(col, leaf_index, structure, elements, op_name)
  expected = _dtype_of(first)
  try:
    # np.array on a list of equally shaped arrays stacks them in C; it is
    # faster than np.stack or filling a preallocated array (no per-element
    # Python work), and it refuses ragged input.
    out = np.array(col)
  except (ValueError, TypeError) as e:
    _diagnose_column(col, leaf_index, structure, elements, op_name, e)
    raise
  if out.dtype != expected or out.shape[1:] != np.shape(first):
    _diagnose_column(col, leaf_index, structure, elements, op_name, None)
  return out


def _stack_objects(
  col: list, leaf_index: int, structure: Any, elements: Sequence[Any], op_name: str
) -> np.ndarray:
  """Stacks a string column into an object array of the original values."""
  shape = np.shape(col[0])
  out = np.empty((len(col),) + shape, dtype=object)
  try:
    if not shape:
      if any(isinstance(v, (np.ndarray, np.generic)) for v in col):
        # 0-d arrays would be stored as array objects and numpy string
        # scalars as such; store their Python values.
        col = [v.item() if isinstance(v, (np.ndarray, np.generic)) else v for v in col]
      out[:] = col
    else:
      for i, value in enumerate(col):
        if np.shape(value) != shape:
          raise ValueError("ragged")
        out[i] = value
  except (ValueError, TypeError) as e:
    _diagnose_column(col, leaf_index, structure, elements, op_name, e)
    raise
  if not all(map(_is_string, col)):
    _diagnose_column(col, leaf_index, structure, elements, op_name, None)
  return out


def _diagnose_column(
  col: list,
  leaf_index: int,
  structure: Any,
  elements: Sequence[Any],
  op_name: str,
  cause: BaseException | None,
  padded: bool = False,
) -> None:
  """Raises the most specific error for a column that would not stack."""
  path = _path(structure, leaf_index)
  if not all(map(tree.is_leaf, col)):
    _raise_structure_mismatch(elements, op_name)
  shapes = [np.shape(v) for v in col]
  if len(set(shapes)) > 1 and not padded:
    raise ValueError(
      f"{op_name}: cannot batch elements whose leaf {path!r} has different "
      f"shapes: {_groups(shapes)}. Batching needs equal shapes; use "
      f"padded_batch to pad them to a common shape."
    ) from cause
  kinds = [_kind(v) for v in col]
  if len(set(kinds)) > 1:
    raise ValueError(
      f"{op_name}: cannot batch elements whose leaf {path!r} has different "
      f"dtypes: {_groups(kinds)}. All elements must have one dtype per "
      f"leaf; cast them in a map first."
    ) from cause
  raise ValueError(
    f"{op_name}: cannot batch leaf {path!r} with values of shape {shapes[0]} and dtype {kinds[0]}."
  ) from cause


def _kind(value: Any) -> str:
  if isinstance(value, (bytes, str)):
    return type(value).__name__
  return str(_dtype_of(value))


def _groups(keys: list) -> str:
  """'shape (3,) at element positions [0, 1] vs shape (4,) at [2]'."""
  positions: dict[Any, list[int]] = {}
  for pos, key in enumerate(keys):
    positions.setdefault(key, []).append(pos)
  parts = []
  for key, where in positions.items():
    listed = where[:_MAX_LISTED_POSITIONS]
    hidden = len(where) - len(listed)
    more = f" and {hidden} more" if hidden else ""
    parts.append(f"{key} at element positions {listed}{more}")
  return " vs ".join(parts)


# ---------------------------------------------------------------------------
# padding one column
# ---------------------------------------------------------------------------
