"""The on-disk store of `cache` (`DiskStore`): a directory of chunk files,
written once by the first complete pass and read back by index.

On-disk format (`filename` given): the directory `filename` holds
`manifest.json` (element count, structure, leaf kinds, chunk list) and
`chunk-NNNNN.npz` files written with `np.savez` and read with
`allow_pickle=False`. Each chunk stores, per leaf, either one stacked array
(all elements of the chunk share a shape) or the raveled leaves concatenated
plus their shapes, and the elements' seeds. The directory is written under a
temporary name and renamed into place only once the pass is complete, so a
partially written cache is never read (a directory counts as complete only
once its manifest is there). An existing complete cache is read as is, even by
a different program (as in tf.data). Paths go through `etils.epath`, so
`gs://` and other remote paths work where their backend is installed.
"""

from __future__ import annotations

import bisect
import json
import os
import uuid
import weakref
from typing import Any

from etils import epath
import numpy as np

from jaxfeed.ops import tree

_MANIFEST = "manifest.json"
_FORMAT_VERSION = 1
_CHUNK_ELEMENTS = 4096
_CHUNK_BYTES = 64 << 20


class DiskStore:
  """The on-disk cache in directory `path`."""

  def __init__(self, path: str):
    self.path = path

  def describe(self) -> str:
    return f"cache {self.path!r}"

  def is_complete(self) -> bool:
    return (epath.Path(self.path) / _MANIFEST).exists()

  def writer(self) -> "_DiskWriter":
    return _DiskWriter(self.path)

  def reader(self) -> "_DiskReader":
    return _DiskReader(self.path)


def _remove_tree(path: str) -> None:
  try:
    epath.Path(path).rmtree()
  except OSError:
    pass


def _leaf_kind(leaf: Any, where: str) -> str:
  if isinstance(leaf, np.ndarray):
    if leaf.dtype == object:
      raise TypeError(f"{where}: cannot store an array of dtype object without pickle.")
    return "array"
  if isinstance(leaf, np.generic):
    return "scalar"
  for kind, types in (
    ("bool", bool),
    ("int", int),
    ("float", float),
    ("complex", complex),
    ("bytes", bytes),
    ("str", str),
  ):
    if isinstance(leaf, types):
      return kind
  if hasattr(leaf, "__array__"):
    return "array"
  raise TypeError(
    f"{where}: cannot store a leaf of type {type(leaf).__name__} "
    f"({leaf!r:.80}); leaves must be numpy arrays or scalars, Python "
    f"numbers, bytes or str."
  )


def _encode_structure(element: Any, where: str) -> Any:
  """A JSON description of an element's containers (leaves as None)."""
  if isinstance(element, dict):
    for key in element:
      if not isinstance(key, str):
        raise TypeError(f"{where}: dict keys must be str to be cached on disk, got {key!r}.")
    return {"dict": [[k, _encode_structure(v, where)] for k, v in element.items()]}
  if isinstance(element, tuple):
    return {"tuple": [_encode_structure(v, where) for v in element]}
  if isinstance(element, list):
    return {"list": [_encode_structure(v, where) for v in element]}
  return None


def _decode_structure(encoded: Any) -> Any:
  if encoded is None:
    return None
  if "dict" in encoded:
    return {k: _decode_structure(v) for k, v in encoded["dict"]}
  if "tuple" in encoded:
    return tuple(_decode_structure(v) for v in encoded["tuple"])
  return [_decode_structure(v) for v in encoded["list"]]


class _DiskWriter:
  """Writes one pass into a temporary directory; renames it on publish."""

  def __init__(self, path: str):
    self._path = path
    self._where = f"cache {path!r}"
    epath.Path(path).parent.mkdir(parents=True, exist_ok=True)
    self._tmp = epath.Path(f"{path}.tmp-{os.getpid()}-{uuid.uuid4().hex[:12]}")
    self._tmp.mkdir()
    # An abandoned (never published) pass leaves nothing behind.
    self._finalizer = weakref.finalize(self, _remove_tree, os.fspath(self._tmp))
    self._example: Any = None
    self._kinds: list[str] = []
    self._leaf_paths: list[str] = []
    self._pending: list[list] = []
    self._pending_seeds: list[int] = []
    self._pending_bytes = 0
    self._chunks: list[dict] = []
    self._count = 0

  def add(self, element: Any, seed: int) -> None:
    leaves = tree.flatten(element)
    if self._example is None:
      self._example = element
      self._structure = _encode_structure(element, self._where)
      self._leaf_paths = tree.paths(element)
      self._kinds = [_leaf_kind(leaf, self._where) for leaf in leaves]
      self._pending = [[] for _ in leaves]
    elif not tree.same_structure(self._example, element):
      raise TypeError(
        f"{self._where}: element {self._count} has structure "
        f"{tree.structure_str(element)}, but element 0 had "
        f"{tree.structure_str(self._example)}; cached elements must share "
        f"one structure."
      )
    for pending, leaf in zip(self._pending, leaves):
      pending.append(leaf)
      self._pending_bytes += getattr(leaf, "nbytes", 8)
    self._pending_seeds.append(seed)
    self._count += 1
    if len(self._pending_seeds) >= _CHUNK_ELEMENTS or self._pending_bytes >= _CHUNK_BYTES:
      self._flush()

  def _leaf_arrays(self, j: int) -> list[np.ndarray]:
    kind = self._kinds[j]
    values = self._pending[j]
    if kind in ("bytes", "str"):
      wanted = bytes if kind == "bytes" else str
      out = []
      for value in values:
        if not isinstance(value, wanted):
          raise TypeError(
            f"{self._where}: leaf {self._leaf_paths[j]!r} was {kind} in "
            f"element 0 but is {type(value).__name__} later."
          )
        raw = value if kind == "bytes" else value.encode("utf-8")
        out.append(np.frombuffer(raw, dtype=np.uint8))
      return out
    arrays = [np.asarray(value) for value in values]
    first = arrays[0]
    if first.dtype == object:
      raise TypeError(
        f"{self._where}: leaf {self._leaf_paths[j]!r} has dtype object, "
        f"which cannot be stored without pickle."
      )
    for array in arrays:
      if array.dtype != first.dtype or array.ndim != first.ndim:
        raise TypeError(
          f"{self._where}: leaf {self._leaf_paths[j]!r} has dtype "
          f"{array.dtype} and rank {array.ndim} in one element but "
          f"{first.dtype} and rank {first.ndim} in another; cached leaves "
          f"must keep their dtype and rank."
        )
    return arrays

  def _flush(self) -> None:
    if not self._pending_seeds:
      return
    payload = {"seeds": np.array(self._pending_seeds, dtype=np.uint64)}
    for j in range(len(self._pending)):
      arrays = self._leaf_arrays(j)
      shape = arrays[0].shape
      if all(a.shape == shape for a in arrays):
        payload[f"l{j}"] = np.stack(arrays)
      else:
        payload[f"l{j}_data"] = np.concatenate([a.ravel() for a in arrays])
        payload[f"l{j}_shapes"] = np.array([a.shape for a in arrays], dtype=np.int64).reshape(
          len(arrays), arrays[0].ndim
        )
      self._pending[j] = []
    name = f"chunk-{len(self._chunks):05d}.npz"
    with (self._tmp / name).open("wb") as f:
      np.savez(f, **payload)
    self._chunks.append({"file": name, "count": len(self._pending_seeds)})
    self._pending_seeds = []
    self._pending_bytes = 0

  def publish(self) -> None:
    self._flush()
    manifest = {
      "version": _FORMAT_VERSION,
      "num_elements": self._count,
      "structure": (self._structure if self._example is not None else None),
      "kinds": self._kinds,
      "chunks": self._chunks,
    }
    (self._tmp / _MANIFEST).write_text(json.dumps(manifest))
    path = epath.Path(self._path)
    try:
      if path.is_dir() and not any(path.iterdir()):
        path.rmdir()
      self._tmp.rename(path)
    except OSError:
      if not (path / _MANIFEST).exists():
        raise
      # Another pass completed the same cache first; it is equivalent.
      self._finalizer()
      return
    self._finalizer.detach()

  def abort(self) -> None:
    self._finalizer()


class _DiskReader:
  """Random access to the elements of a complete on-disk cache."""

  def __init__(self, path: str):
    self._path = path
    manifest_path = epath.Path(path) / _MANIFEST
    try:
      manifest = json.loads(manifest_path.read_text())
    except (OSError, ValueError) as exc:
      raise ValueError(f"cache {path!r}: cannot read {manifest_path}: {exc}.") from exc
    if manifest.get("version") != _FORMAT_VERSION:
      raise ValueError(
        f"cache {path!r}: unsupported format version "
        f"{manifest.get('version')!r}, expected {_FORMAT_VERSION}."
      )
    self.num_elements = int(manifest["num_elements"])
    self._kinds = manifest["kinds"]
    self._skeleton = _decode_structure(manifest["structure"])
    self._chunks = manifest["chunks"]
    self._starts = [0]
    for chunk in self._chunks:
      self._starts.append(self._starts[-1] + int(chunk["count"]))
    self._chunk_index = -1
    self._columns: list = []
    self._seeds: np.ndarray | None = None

  def _load(self, chunk_index: int) -> None:
    file = epath.Path(self._path) / self._chunks[chunk_index]["file"]
    try:
      with file.open("rb") as f, np.load(f, allow_pickle=False) as npz:
        arrays = {key: npz[key] for key in npz.files}
    except (OSError, ValueError) as exc:
      raise ValueError(f"cache {self._path!r}: cannot read {file}: {exc}.") from exc
    columns = []
    for j in range(len(self._kinds)):
      stacked = arrays.get(f"l{j}")
      if stacked is not None:
        columns.append(stacked)
      else:
        data, shapes = arrays[f"l{j}_data"], arrays[f"l{j}_shapes"]
        sizes = np.prod(shapes, axis=1) if shapes.shape[1] else np.ones(len(shapes), dtype=np.int64)
        offsets = np.concatenate([[0], np.cumsum(sizes)])
        columns.append(
          [data[offsets[i] : offsets[i + 1]].reshape(tuple(shapes[i])) for i in range(len(shapes))]
        )
    self._columns = columns
    self._seeds = arrays["seeds"]
    self._chunk_index = chunk_index

  def get(self, index: int) -> tuple[Any, int]:
    chunk_index = self._chunk_index
    if not (
      chunk_index >= 0 and self._starts[chunk_index] <= index < self._starts[chunk_index + 1]
    ):
      chunk_index = bisect.bisect_right(self._starts, index) - 1
      self._load(chunk_index)
    offset = index - self._starts[chunk_index]
    leaves = []
    for kind, column in zip(self._kinds, self._columns):
      # `[offset, ...]` keeps 0-d leaves arrays; ragged columns are lists.
      value = column[offset] if type(column) is list else column[offset, ...]
      if kind == "array":
        leaves.append(value)
      elif kind == "scalar":
        leaves.append(value[()])
      elif kind == "bytes":
        leaves.append(value.tobytes())
      elif kind == "str":
        leaves.append(value.tobytes().decode("utf-8"))
      else:  # Python numbers
        leaves.append({"bool": bool, "int": int, "float": float, "complex": complex}[kind](value))
    return tree.unflatten(self._skeleton, leaves), int(self._seeds[offset])
