"""`pad_and_stack`: a batch from elements padded to common shapes, with
tf.data `padded_batch` semantics, laid out as `jaxfeed.ops.stacking` lays out
batches (`padded_batch`, `bucket_by_sequence_length` and the coordinated
readers use it).
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from jaxfeed.ops import tree
from jaxfeed.ops.stacking import (
  _columns,
  _describe,
  _diagnose_column,
  _dtype_of,
  _groups,
  _is_string,
  _path,
  _raise_structure_mismatch,
  _stack_column,
)

__all__ = ["pad_and_stack"]

# Above this padded length the per-row copy beats the boolean-mask scatter.
_MASK_PAD_MAX_LENGTH = 64
_MASK_PAD_MIN_ROWS = 16


def pad_and_stack(
  elements: Sequence[Any],
  padded_shapes: Any = None,
  padding_values: Any = None,
  op_name: str = "padded_batch",
) -> Any:
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
    leaves.append(_pad_column(col, i, shapes[i], values[i], structure, elements, op_name))
  return tree.unflatten(structure, leaves)


def _is_shape_spec(value: Any) -> bool:
  if value is None or hasattr(value, "as_list"):
    return True
  if isinstance(value, np.ndarray):
    return value.ndim == 1
  return isinstance(value, (tuple, list)) and all(
    d is None or isinstance(d, (int, np.integer)) for d in value
  )


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
          f"{op_name}: {name} at {where or '<element>'!r} must be {what} for a leaf, got {p!r}."
        )
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
    f"{_describe(structure)}, got {spec!r}."
  )


def _shape_spec(spec: Any, rank: int, path: str, op_name: str) -> list:
  """Normalizes one leaf's padded shape to a list of int | None of `rank`."""
  if spec is None:
    return [None] * rank
  dims = spec.as_list() if hasattr(spec, "as_list") else list(spec)
  if len(dims) != rank:
    raise ValueError(
      f"{op_name}: padded_shapes for leaf {path!r} is {list(dims)} (rank "
      f"{len(dims)}), but the elements have rank {rank}. The padded shape "
      f"needs one entry (an int or None) per dimension."
    )
  out: list[int | None] = []
  for d in dims:
    if d is None or int(d) == -1:
      out.append(None)
    elif int(d) < 0:
      raise ValueError(
        f"{op_name}: padded_shapes for leaf {path!r} has size {int(d)}; "
        f"allowed are sizes >= 0, or None / -1 for the batch maximum."
      )
    else:
      out.append(int(d))
  return out


def _padding_value(
  value: Any, is_string: bool, first: Any, dtype: np.dtype, path: str, op_name: str
) -> Any:
  if is_string:
    if value is None:
      return "" if _holds_str(first) else b""
    if not isinstance(value, (bytes, str)):
      raise ValueError(
        f"{op_name}: padding value {value!r} for string leaf {path!r} must be bytes or str."
      )
    return value
  if value is None:
    return np.zeros((), dtype)
  arr = np.asarray(value)
  if arr.ndim != 0 or arr.dtype.kind not in "biufc":
    raise ValueError(
      f"{op_name}: padding value {value!r} for leaf {path!r} must be a "
      f"numeric scalar (the leaf has dtype {dtype})."
    )
  converted = arr.astype(dtype)
  same_nan = arr != arr and converted != converted
  if converted != arr and not same_nan:
    raise ValueError(
      f"{op_name}: padding value {value!r} for leaf {path!r} is not "
      f"representable in its dtype {dtype}."
    )
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


def _pad_column(
  col: list,
  leaf_index: int,
  shape_spec: Any,
  pad_value: Any,
  structure: Any,
  elements: Sequence[Any],
  op_name: str,
) -> np.ndarray:
  first = col[0]
  path = _path(structure, leaf_index)
  shapes = [np.shape(v) for v in col]
  rank = len(shapes[0])
  if any(len(s) != rank for s in shapes):
    if not all(map(tree.is_leaf, col)):
      _raise_structure_mismatch(elements, op_name)
    raise ValueError(
      f"{op_name}: leaf {path!r} has different ranks in one batch: "
      f"{_groups(shapes)}. Padding needs equal ranks."
    )
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
        f"element's size, or None to pad to the batch maximum."
      )
    target.append(size)
  target_shape = tuple(target)
  is_string = _is_string(first)
  dtype = np.dtype(object) if is_string else _dtype_of(first)
  fill = _padding_value(pad_value, is_string, first, dtype, path, op_name)
  if all(s == target_shape for s in shapes):
    return _stack_column(col, leaf_index, structure, elements, op_name)
  if not is_string and any(v.dtype != dtype for v in col):
    _diagnose_column(col, leaf_index, structure, elements, op_name, None, padded=True)
  n = len(col)
  out = np.full((n,) + target_shape, fill, dtype=dtype)
  if rank == 1 and n >= _MASK_PAD_MIN_ROWS and target_shape[0] <= _MASK_PAD_MAX_LENGTH:
    lengths = np.fromiter((s[0] for s in shapes), np.int64, n)
    flat = np.concatenate(col)
    out[np.arange(target_shape[0]) < lengths[:, None]] = flat
  elif rank == 1:
    for i, (value, s) in enumerate(zip(col, shapes)):
      out[i, : s[0]] = value
  else:
    for i, (value, s) in enumerate(zip(col, shapes)):
      out[(i,) + tuple(slice(0, d) for d in s)] = value
  return out
