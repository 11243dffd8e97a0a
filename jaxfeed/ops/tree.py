"""Small, fast pytree helpers for elements (dicts, tuples, lists, arrays).

Elements are nested dicts / tuples / lists whose leaves are numpy arrays or
scalars. These helpers avoid jax.tree_util on the per-element hot path.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Sequence

import numpy as np


def is_leaf(x: Any) -> bool:
  return not isinstance(x, (dict, tuple, list))


def flatten(tree: Any) -> list:
  """Leaves in a deterministic order (dict keys sorted)."""
  if isinstance(tree, dict):
    out = []
    for k in sorted(tree):
      out.extend(flatten(tree[k]))
    return out
  if isinstance(tree, (tuple, list)):
    out = []
    for v in tree:
      out.extend(flatten(v))
    return out
  return [tree]


def paths(tree: Any, prefix: str = "") -> list[str]:
  """'/'-joined leaf paths in `flatten` order ('' for a bare leaf)."""
  if isinstance(tree, dict):
    out = []
    for k in sorted(tree):
      out.extend(paths(tree[k], f"{prefix}/{k}" if prefix else str(k)))
    return out
  if isinstance(tree, (tuple, list)):
    out = []
    for i, v in enumerate(tree):
      out.extend(paths(v, f"{prefix}/{i}" if prefix else str(i)))
    return out
  return [prefix]


def unflatten(structure: Any, leaves: Sequence[Any]) -> Any:
  """Inverse of `flatten` given an example tree with the same structure."""
  return _build(structure, iter(leaves))


def _build(structure: Any, leaves: Iterator[Any]) -> Any:
  # A module-level recursion: a recursive closure would form a reference
  # cycle holding the leaves (whole batches) until the garbage collector ran.
  if isinstance(structure, dict):
    # Leaves come in sorted-key order; the result keeps the user's key order.
    built = {k: _build(structure[k], leaves) for k in sorted(structure)}
    return {k: built[k] for k in structure}
  if isinstance(structure, tuple):
    return tuple(_build(v, leaves) for v in structure)
  if isinstance(structure, list):
    return [_build(v, leaves) for v in structure]
  return next(leaves)


def map_structure(fn: Callable, *trees: Any) -> Any:
  """Applies fn leaf-wise over trees of identical structure."""
  first = trees[0]
  if isinstance(first, dict):
    return {k: map_structure(fn, *(t[k] for t in trees)) for k in first}
  if isinstance(first, tuple):
    return tuple(map_structure(fn, *vs) for vs in zip(*trees))
  if isinstance(first, list):
    return [map_structure(fn, *vs) for vs in zip(*trees)]
  return fn(*trees)


def same_structure(a: Any, b: Any) -> bool:
  if isinstance(a, dict):
    return isinstance(b, dict) and set(a) == set(b) and all(same_structure(a[k], b[k]) for k in a)
  if isinstance(a, (tuple, list)):
    return (
      type(a) is type(b) and len(a) == len(b) and all(same_structure(x, y) for x, y in zip(a, b))
    )
  return is_leaf(b)


def structure_str(tree: Any) -> str:
  """A short description of a tree's structure, shapes and dtypes."""
  if isinstance(tree, dict):
    return "{" + ", ".join(f"{k!r}: {structure_str(v)}" for k, v in tree.items()) + "}"
  if isinstance(tree, (tuple, list)):
    inner = ", ".join(structure_str(v) for v in tree)
    return f"({inner})" if isinstance(tree, tuple) else f"[{inner}]"
  arr = np.asarray(tree)
  return f"{arr.dtype}{list(arr.shape)}"
