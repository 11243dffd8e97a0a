"""`ArraySource`: records are slices of an in-memory pytree of arrays."""

from __future__ import annotations

import hashlib
import operator
import pickle
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from jaxfeed.sources.base import RecordSource, check_indices

__all__ = ["ArraySource"]


class ArraySource(RecordSource):
  """Random access to the rows of a pytree of arrays.

  The pytree is nested dicts / lists / tuples / namedtuples (containers, as
  in JAX) whose leaves are arrays (numpy, jax or anything `np.asarray`
  accepts) sharing their first dimension, the record axis. `src[i]` is the
  pytree with every leaf indexed at `i`, like `from_tensor_slices`: read-only
  numpy views into the source's arrays, numpy scalars for 1-D leaves.
  `get_many` returns the same read-only views (no copy: batching copies
  anyway) and `get_batch` returns the stacked batch itself, a fresh array.
  """

  def __init__(self, data: Any):
    paths: list[Any] = []
    leaves: list[Any] = []
    self._structure = _flatten(data, "", paths, leaves)
    if not leaves:
      raise ValueError(
        "ArraySource: data has no array leaves; give a pytree (dict / list "
        "/ tuple) of arrays that share their first dimension."
      )
    arrays = []
    for path, leaf in zip(paths, leaves):
      array = np.asarray(leaf)
      if array.ndim == 0:
        raise ValueError(
          f"ArraySource: leaf {path or '<root>'} is a scalar; every leaf "
          "needs a first (record) dimension."
        )
      arrays.append(_read_only(array))
    lengths = {a.shape[0] for a in arrays}
    if len(lengths) != 1:
      listing = ", ".join(f"{p or '<root>'}: {a.shape[0]}" for p, a in zip(paths, arrays))
      raise ValueError(
        "ArraySource: all leaves must share their first dimension (the "
        f"number of records); got leaf lengths {listing}."
      )
    self._paths = paths
    self._leaves = arrays
    self._length: int = lengths.pop()
    self._content_hash: str | None = None
    self._build = _compile(self._structure)

  def __len__(self) -> int:
    return self._length

  @property
  def data(self) -> Any:
    """The whole pytree (read-only views)."""
    return self._build(self._leaves)

  def _read(self, index: int) -> Any:
    return self._build([leaf[index] for leaf in self._leaves])

  def _read_many(self, indices: np.ndarray) -> list[Any]:
    # Views into the read-only leaves, like src[i]: copying rows here would
    # cost more than the whole record read.
    leaves = self._leaves
    return [self._build([leaf[i] for leaf in leaves]) for i in indices.tolist()]

  def get_batch(self, indices: Sequence[int] | np.ndarray) -> Any:
    """The records at `indices` stacked: the pytree with fancy-indexed leaves."""
    indices = check_indices(indices, self._length, "ArraySource")
    return self._build([leaf[indices] for leaf in self._leaves])

  def spec_params(self) -> dict[str, Any]:
    """`{"data": pytree}`: arrays, the one source whose params are not JSON."""
    return {"data": self.data}

  def identity(self) -> dict[str, Any]:
    """Each leaf's dtype and shape per record (see `RecordSource.identity`)."""
    return {
      "leaves": {
        p or "<root>": f"{a.dtype}{list(a.shape[1:])}" for p, a in zip(self._paths, self._leaves)
      }
    }

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
    leaves = ", ".join(
      f"{p or '<root>'}: {a.dtype}{list(a.shape[1:])}" for p, a in zip(self._paths, self._leaves)
    )
    return (
      f"ArraySource(num_records={self._length}, leaves={{{leaves}}}, "
      f"content_hash={self.content_hash()})"
    )

  def __getstate__(self) -> dict[str, Any]:
    state = self.__dict__.copy()
    del state["_build"]  # closures; rebuilt from the structure
    return state

  def __setstate__(self, state: dict[str, Any]) -> None:
    self.__dict__.update(state)
    self._leaves = [_read_only(a) for a in self._leaves]
    self._build = _compile(self._structure)


def _read_only(array: np.ndarray) -> np.ndarray:
  """A read-only view: src[i] hands out views, the caller's array stays as is."""
  view: np.ndarray = array.view()
  view.flags.writeable = False
  return view


# The structure is the pytree with every leaf replaced by _LEAF; dict key
# order is kept so records look like the data the user passed in.
_LEAF = None


def _flatten(tree: Any, path: str, paths: list[Any], leaves: list[Any]) -> Any:
  if isinstance(tree, dict):
    return {k: _flatten(v, f"{path}[{k!r}]", paths, leaves) for k, v in tree.items()}
  if isinstance(tree, (list, tuple)):
    children = [_flatten(v, f"{path}[{i}]", paths, leaves) for i, v in enumerate(tree)]
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):  # namedtuple
      return ("namedtuple", type(tree), children)
    return ("tuple" if isinstance(tree, tuple) else "list", None, children)
  paths.append(path)
  leaves.append(tree)
  return _LEAF


def _compile(structure: Any) -> Callable[[Sequence[Any]], Any]:
  """A function from the list of leaf values to the pytree."""
  if isinstance(structure, dict) and all(v is _LEAF for v in structure.values()):
    keys = tuple(structure)  # the common flat dict, built in one call
    return lambda values: dict(zip(keys, values))
  counter = iter(range(1 << 62))
  return _compile_node(structure, counter)


def _compile_node(structure: Any, counter: Iterator[int]) -> Callable[[Sequence[Any]], Any]:
  if structure is _LEAF:
    return operator.itemgetter(next(counter))
  if isinstance(structure, dict):
    items = [(k, _compile_node(v, counter)) for k, v in structure.items()]
    return lambda values: {k: build(values) for k, build in items}
  kind, cls, children = structure
  builders = [_compile_node(c, counter) for c in children]
  if kind == "list":
    return lambda values: [build(values) for build in builders]
  if kind == "tuple":
    return lambda values: tuple([build(values) for build in builders])
  return lambda values: cls(*[build(values) for build in builders])


def _structure_key(structure: Any) -> Any:
  """A repr-stable form of the structure (class objects by qualified name)."""
  if structure is _LEAF:
    return None
  if isinstance(structure, dict):
    return [(repr(k), _structure_key(v)) for k, v in structure.items()]
  kind, cls, children = structure
  name = None if cls is None else f"{cls.__module__}.{cls.__qualname__}"
  return (kind, name, [_structure_key(c) for c in children])
