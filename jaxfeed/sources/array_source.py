"""`ArraySource`: records are slices of an in-memory pytree of arrays."""

from __future__ import annotations

import hashlib
import pickle
from typing import Any, Sequence

import numpy as np

from jaxfeed.sources.base import RecordSource, check_indices

__all__ = ["ArraySource"]


class ArraySource(RecordSource):
  """Random access to the rows of a pytree of arrays.

  The pytree is nested dicts / lists / tuples whose leaves are arrays (numpy,
  jax or anything `np.asarray` accepts) sharing their first dimension, the
  record axis. `src[i]` is the pytree with every leaf sliced at `i`: read-only
  numpy views into the source's arrays (0-d arrays for 1-D leaves).
  `get_many` returns independent rows (one fancy-indexing copy per leaf) and
  `get_batch` returns the stacked batch itself.
  """

  def __init__(self, data: Any):
    paths, leaves = [], []
    self._structure = _flatten(data, "", paths, leaves)
    if not leaves:
      raise ValueError(
          "ArraySource: data has no array leaves; give a pytree (dict / list "
          "/ tuple) of arrays that share their first dimension.")
    arrays = []
    for path, leaf in zip(paths, leaves):
      array = np.asarray(leaf)
      if array.ndim == 0:
        raise ValueError(
            f"ArraySource: leaf {path or '<root>'} is a scalar; every leaf "
            "needs a first (record) dimension.")
      view = array.view()
      view.flags.writeable = False  # src[i] hands out views into these
      arrays.append(view)
    lengths = {a.shape[0] for a in arrays}
    if len(lengths) != 1:
      listing = ", ".join(
          f"{p or '<root>'}: {a.shape[0]}" for p, a in zip(paths, arrays))
      raise ValueError(
          "ArraySource: all leaves must share their first dimension (the "
          f"number of records); got leaf lengths {listing}.")
    self._paths = paths
    self._leaves = arrays
    self._length = lengths.pop()
    self._content_hash: str | None = None

  def __len__(self) -> int:
    return self._length

  @property
  def data(self) -> Any:
    """The whole pytree (read-only views)."""
    return _unflatten(self._structure, iter(self._leaves))

  def _read(self, index: int) -> Any:
    return _unflatten(self._structure,
                      (leaf[index, ...] for leaf in self._leaves))

  def _read_many(self, indices: np.ndarray) -> list:
    taken = [leaf[indices] for leaf in self._leaves]
    structure = self._structure
    return [_unflatten(structure, (t[j, ...] for t in taken))
            for j in range(len(indices))]

  def get_batch(self, indices: Sequence[int] | np.ndarray) -> Any:
    """The records at `indices` stacked: the pytree with fancy-indexed leaves."""
    indices = check_indices(indices, self._length, "ArraySource")
    return _unflatten(self._structure,
                      (leaf[indices] for leaf in self._leaves))

  def spec_params(self) -> dict:
    """`{"data": pytree}`: arrays, the one source whose params are not JSON."""
    return {"data": self.data}

  def content_hash(self) -> str:
    """A short hash of structure, dtypes, shapes and bytes of every leaf."""
    if self._content_hash is None:
      digest = hashlib.blake2b(digest_size=8)
      digest.update(repr(_structure_key(self._structure)).encode())
      for path, leaf in zip(self._paths, self._leaves):
        digest.update(f"{path}|{leaf.dtype.str}|{leaf.shape}|".encode())
        if leaf.dtype.hasobject:
          digest.update(pickle.dumps(leaf.tolist(), protocol=4))
        else:
          digest.update(np.ascontiguousarray(leaf).data)
      self._content_hash = digest.hexdigest()
    return self._content_hash

  def __repr__(self) -> str:
    leaves = ", ".join(f"{p or '<root>'}: {a.dtype}{list(a.shape[1:])}"
                       for p, a in zip(self._paths, self._leaves))
    return (f"ArraySource(num_records={self._length}, leaves={{{leaves}}}, "
            f"content_hash={self.content_hash()})")

  def __getstate__(self) -> dict:
    state = self.__dict__.copy()
    state["_leaves"] = [np.asarray(a) for a in self._leaves]
    return state

  def __setstate__(self, state: dict) -> None:
    self.__dict__.update(state)
    leaves = []
    for a in self._leaves:
      view = a.view()
      view.flags.writeable = False
      leaves.append(view)
    self._leaves = leaves


# The structure is the pytree with every leaf replaced by _LEAF; dict key
# order is kept so records look like the data the user passed in.
_LEAF = None


def _flatten(tree: Any, path: str, paths: list, leaves: list) -> Any:
  if isinstance(tree, dict):
    return {k: _flatten(v, f"{path}[{k!r}]", paths, leaves)
            for k, v in tree.items()}
  if isinstance(tree, (list, tuple)):
    children = [_flatten(v, f"{path}[{i}]", paths, leaves)
                for i, v in enumerate(tree)]
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):  # namedtuple
      return ("namedtuple", type(tree), children)
    return ("tuple" if isinstance(tree, tuple) else "list", None, children)
  paths.append(path)
  leaves.append(tree)
  return _LEAF


def _unflatten(structure: Any, leaves) -> Any:
  if structure is _LEAF:
    return next(leaves)
  if isinstance(structure, dict):
    return {k: _unflatten(v, leaves) for k, v in structure.items()}
  kind, cls, children = structure
  values = [_unflatten(c, leaves) for c in children]
  if kind == "list":
    return values
  if kind == "tuple":
    return tuple(values)
  return cls(*values)


def _structure_key(structure: Any) -> Any:
  """A repr-stable form of the structure (class objects by qualified name)."""
  if structure is _LEAF:
    return None
  if isinstance(structure, dict):
    return [(repr(k), _structure_key(v)) for k, v in structure.items()]
  kind, cls, children = structure
  name = None if cls is None else f"{cls.__module__}.{cls.__qualname__}"
  return (kind, name, [_structure_key(c) for c in children])
