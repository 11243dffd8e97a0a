"""Batch assembly shared by the batching ops.

`batch`, `padded_batch`, `unbatch`, `rebatch`, `bucket_by_sequence_length`,
`pack` and the coordinated readers all turn lists of elements into batches (and
back). They use these helpers so every op produces the same batch layout and
the same errors:

- `stack(elements)`: a batch from equally shaped elements.
- `pad_and_stack(elements, padded_shapes, padding_values)`: a batch from
  elements padded to common shapes, with tf.data `padded_batch` semantics.
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
    "pad_and_stack",
    "slice_batch",
    "stack",
    "to_batch_leaf",
    "unstack",
]

# Above this padded length the per-row copy beats the boolean-mask scatter.
_MASK_PAD_MAX_LENGTH = 64
_MASK_PAD_MIN_ROWS = 16
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
  leaves = [_stack_column(col, i, structure, elements, op_name)
            for i, col in enumerate(columns)]
  return tree.unflatten(structure, leaves)


def pad_and_stack(elements: Sequence[Any], padded_shapes: Any = None,
                  padding_values: Any = None,
                  op_name: str = "padded_batch") -> Any:
  """Pads elements to common shapes and stacks them (tf.data `padded_batch`).

  Args:
    elements: A non-empty sequence of equally structured pytrees whose leaves
      have equal ranks per leaf.
    padded_shapes: None (pad every dimension to the batch maximum), or the
      element's structure with one shape per leaf: a list / tuple / 1-D array
      of ints (pad to exactly that size) and None or -1 (pad to the batch
      maximum); a leaf's shape may itself be None (all dimensions to the
      maximum). Objects with `as_list()` (TensorShape) are accepted.
    padding_values: None (0 / False for numbers, b'' or '' for strings), one
      scalar used for every leaf, or the element's structure with one scalar
      (or None for the default) per leaf.
    op_name: The op named in error messages.

  Returns:
    The padded batch, laid out as `stack` lays it out.

  Raises:
    ValueError: Structures, ranks or dtypes differ, an element is larger than
      its explicit padded size, or `padded_shapes` / `padding_values` do not
      fit the elements.
  """
  structure, columns = _columns(elements, op_name)
  shapes = _per_leaf(structure, padded_shapes, "padded_shapes", op_name)
  values = _per_leaf(structure, padding_values, "padding_values", op_name)
  leaves = []
  for i, col in enumerate(columns):
    leaves.append(_pad_column(col, i, shapes[i], values[i], structure,
                              elements, op_name))
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
          f"differ beyond the batch dimension.") from e
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


def _raise_structure_mismatch(elements: list, op_name: str) -> None:
  first = elements[0]
  for pos, element in enumerate(elements):
    if not tree.same_structure(first, element):
      raise ValueError(
          f"{op_name}: elements of one batch must have the same structure, "
          f"but element 0 is {_describe(first)} and element {pos} is "
          f"{_describe(element)}.")
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


def _stack_column(col: list, leaf_index: int, structure: Any,
                  elements: list, op_name: str) -> np.ndarray:
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


def _stack_objects(col: list, leaf_index: int, structure: Any, elements: list,
                   op_name: str) -> np.ndarray:
  """Stacks a string column into an object array of the original values."""
  shape = np.shape(col[0])
  out = np.empty((len(col),) + shape, dtype=object)
  try:
    if not shape:
      if any(isinstance(v, (np.ndarray, np.generic)) for v in col):
        # 0-d arrays would be stored as array objects and numpy string
        # scalars as such; store their Python values.
        col = [v.item() if isinstance(v, (np.ndarray, np.generic)) else v
               for v in col]
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


def _diagnose_column(col: list, leaf_index: int, structure: Any,
                     elements: list, op_name: str,
                     cause: BaseException | None,
                     padded: bool = False) -> None:
  """Raises the most specific error for a column that would not stack."""
  path = _path(structure, leaf_index)
  if not all(map(tree.is_leaf, col)):
    _raise_structure_mismatch(elements, op_name)
  shapes = [np.shape(v) for v in col]
  if len(set(shapes)) > 1 and not padded:
    raise ValueError(
        f"{op_name}: cannot batch elements whose leaf {path!r} has different "
        f"shapes: {_groups(shapes)}. Batching needs equal shapes; use "
        f"padded_batch to pad them to a common shape.") from cause
  kinds = [_kind(v) for v in col]
  if len(set(kinds)) > 1:
    raise ValueError(
        f"{op_name}: cannot batch elements whose leaf {path!r} has different "
        f"dtypes: {_groups(kinds)}. All elements must have one dtype per "
        f"leaf; cast them in a map first.") from cause
  raise ValueError(
      f"{op_name}: cannot batch leaf {path!r} with values of shape "
      f"{shapes[0]} and dtype {kinds[0]}.") from cause


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
def _is_shape_spec(value: Any) -> bool:
  if value is None or hasattr(value, "as_list"):
    return True
  if isinstance(value, np.ndarray):
    return value.ndim == 1
  return isinstance(value, (tuple, list)) and all(
      d is None or isinstance(d, (int, np.integer)) for d in value)


def _is_scalar_spec(value: Any) -> bool:
  return tree.is_leaf(value)


_SPEC_LEAVES = {
    # name: (is a per-leaf entry, what one is, one entry may serve all leaves)
    "padded_shapes": (_is_shape_spec, "a shape (a list of ints / None)", False),
    "padding_values": (_is_scalar_spec, "a scalar or None", True),
}


def _per_leaf(structure: Any, spec: Any, name: str, op_name: str) -> list:
  """One entry of `spec` per leaf of `structure` (None where spec is None)."""
  is_spec_leaf, what, broadcasts = _SPEC_LEAVES[name]
  num_leaves = len(tree.flatten(structure))
  if spec is None:
    return [None] * num_leaves
  if is_spec_leaf(spec) and (broadcasts or tree.is_leaf(structure)):
    return [spec] * num_leaves
  out: list = []

  def walk(s: Any, p: Any, where: str) -> None:
    if tree.is_leaf(s):
      if not is_spec_leaf(p):
        raise ValueError(
            f"{op_name}: {name} at {where or '<element>'!r} must be {what} "
            f"for a leaf, got {p!r}.")
      out.append(p)
      return
    if p is None:
      out.extend([None] * len(tree.flatten(s)))
      return
    if isinstance(s, dict):
      if not isinstance(p, dict) or set(p) != set(s):
        _spec_mismatch(name, op_name, s, p)
      for k in sorted(s):
        walk(s[k], p[k], f"{where}/{k}" if where else str(k))
      return
    if not isinstance(p, (tuple, list)) or len(p) != len(s):
      _spec_mismatch(name, op_name, s, p)
    for i, (sv, pv) in enumerate(zip(s, p)):
      walk(sv, pv, f"{where}/{i}" if where else str(i))

  walk(structure, spec, "")
  return out


def _spec_mismatch(name: str, op_name: str, structure: Any, spec: Any) -> None:
  raise ValueError(
      f"{op_name}: {name} must have the structure of the elements "
      f"{_describe(structure)}, got {spec!r}.")


def _shape_spec(spec: Any, rank: int, path: str, op_name: str) -> list:
  """Normalizes one leaf's padded shape to a list of int | None of `rank`."""
  if spec is None:
    return [None] * rank
  dims = spec.as_list() if hasattr(spec, "as_list") else list(spec)
  if len(dims) != rank:
    raise ValueError(
        f"{op_name}: padded_shapes for leaf {path!r} is {list(dims)} (rank "
        f"{len(dims)}), but the elements have rank {rank}. The padded shape "
        f"needs one entry (an int or None) per dimension.")
  out = []
  for d in dims:
    if d is None or int(d) == -1:
      out.append(None)
    elif int(d) < 0:
      raise ValueError(
          f"{op_name}: padded_shapes for leaf {path!r} has size {int(d)}; "
          f"allowed are sizes >= 0, or None / -1 for the batch maximum.")
    else:
      out.append(int(d))
  return out


def _padding_value(value: Any, is_string: bool, first: Any, dtype: np.dtype,
                   path: str, op_name: str) -> Any:
  if is_string:
    if value is None:
      return "" if _holds_str(first) else b""
    if not isinstance(value, (bytes, str)):
      raise ValueError(
          f"{op_name}: padding value {value!r} for string leaf {path!r} must "
          f"be bytes or str.")
    return value
  if value is None:
    return np.zeros((), dtype)
  arr = np.asarray(value)
  if arr.ndim != 0 or arr.dtype.kind not in "biufc":
    raise ValueError(
        f"{op_name}: padding value {value!r} for leaf {path!r} must be a "
        f"numeric scalar (the leaf has dtype {dtype}).")
  converted = arr.astype(dtype)
  same_nan = arr != arr and converted != converted
  if converted != arr and not same_nan:
    raise ValueError(
        f"{op_name}: padding value {value!r} for leaf {path!r} is not "
        f"representable in its dtype {dtype}.")
  return converted


def _holds_str(value: Any) -> bool:
  if isinstance(value, str):
    return True
  if isinstance(value, np.ndarray):
    if value.dtype.kind == "U":
      return True
    if value.dtype.kind == "O" and value.size:
      return isinstance(value.flat[0], str)
  return False


def _pad_column(col: list, leaf_index: int, shape_spec: Any, pad_value: Any,
                structure: Any, elements: list, op_name: str) -> np.ndarray:
  first = col[0]
  path = _path(structure, leaf_index)
  shapes = [np.shape(v) for v in col]
  rank = len(shapes[0])
  if any(len(s) != rank for s in shapes):
    if not all(map(tree.is_leaf, col)):
      _raise_structure_mismatch(elements, op_name)
    raise ValueError(
        f"{op_name}: leaf {path!r} has different ranks in one batch: "
        f"{_groups(shapes)}. Padding needs equal ranks.")
  dims = _shape_spec(shape_spec, rank, path, op_name)
  target = []
  for d, size in enumerate(dims):
    longest = max(s[d] for s in shapes)
    if size is None:
      target.append(longest)
      continue
    if longest > size:
      pos = next(i for i, s in enumerate(shapes) if s[d] > size)
      raise ValueError(
          f"{op_name}: element {pos} of the batch has size {shapes[pos][d]} "
          f"in dimension {d} of leaf {path!r}, larger than its padded size "
          f"{size} from padded_shapes. Allowed: padded sizes >= every "
          f"element's size, or None to pad to the batch maximum.")
    target.append(size)
  target_shape = tuple(target)
  is_string = _is_string(first)
  dtype = np.dtype(object) if is_string else _dtype_of(first)
  fill = _padding_value(pad_value, is_string, first, dtype, path, op_name)
  if all(s == target_shape for s in shapes):
    return _stack_column(col, leaf_index, structure, elements, op_name)
  if not is_string and any(v.dtype != dtype for v in col):
    _diagnose_column(col, leaf_index, structure, elements, op_name, None,
                     padded=True)
  n = len(col)
  out = np.full((n,) + target_shape, fill, dtype=dtype)
  if (rank == 1 and n >= _MASK_PAD_MIN_ROWS
      and target_shape[0] <= _MASK_PAD_MAX_LENGTH):
    lengths = np.fromiter((s[0] for s in shapes), np.int64, n)
    flat = np.concatenate(col)
    out[np.arange(target_shape[0]) < lengths[:, None]] = flat
  elif rank == 1:
    for i, (value, s) in enumerate(zip(col, shapes)):
      out[i, :s[0]] = value
  else:
    for i, (value, s) in enumerate(zip(col, shapes)):
      out[(i,) + tuple(slice(0, d) for d in s)] = value
  return out
