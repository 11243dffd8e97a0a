"""The folder `Dataset.save` and `jaxfeed.service.distributed_save` write.

A saved dataset is a folder of chunks, each a directory renamed into place
whole once written (so a chunk is there complete or not at all, and a second
writer of the same chunk finds it there and drops its copy):

  PATH/
    save.json              what is being saved: format, chunking, compression,
                           the pipeline's fingerprint (written first)
    dataset.pb             distributed saves: the pipeline's DatasetDef, so a
                           restarted dispatcher resumes from the folder alone
    chunks/00000042/       chunk 42 (positions [42 * C, 43 * C) of a
                           distributed save; the 43rd chunk of a local one)
        records.array_record   one record per element (`encode_element`)
        chunk.json             elements, bytes, element spec of the chunk
    manifest.json          written last: every chunk in order, the element
                           spec, totals; its presence says the save is complete
    tmp/                   writers' scratch
    failed.json            distributed saves whose chunk kept failing: why

Records are in the array_record format (random access, a hash per chunk of
records), so `jaxfeed.ops.load.SavedDatasetSource` reads element `i` of the
saved dataset directly. `save.json`, `chunk.json` and `manifest.json` carry a
SHA-256 of their own content (`checksum`), checked on every read.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import struct
import uuid
from typing import Any, Iterable

from etils import epath
import numpy as np

from jaxfeed.ops import tree
from jaxfeed.ops.element_spec import TensorSpec, spec_of_value
from jaxfeed.sources import array_record_source

__all__ = [
  "FORMAT",
  "SaveFormatError",
  "ChunkInfo",
  "Progress",
  "encode_element",
  "decode_element",
  "write_chunk",
  "read_json",
  "write_json",
  "chunk_dir",
  "committed_chunks",
  "progress",
  "finalize",
  "array_record_options",
  "check_not_failed",
  "spec_to_json",
  "spec_from_json",
]

FORMAT = "jaxfeed.saved_dataset"
VERSION = 1
SAVE_JSON = "save.json"
MANIFEST_JSON = "manifest.json"
FAILED_JSON = "failed.json"
DATASET_PB = "dataset.pb"
CHUNKS = "chunks"
RECORDS = "records.array_record"
CHUNK_JSON = "chunk.json"
_MAGIC = b"JFE1"
_PREFIX = struct.Struct("<4sI")
# tf.data's save names -> array_record writer options.
_COMPRESSIONS = {
  None: "uncompressed",
  "": "uncompressed",
  "NONE": "uncompressed",
  "SNAPPY": "snappy",
  "ZSTD": "zstd",
}


class SaveFormatError(ValueError):
  """A saved dataset's folder is incomplete, damaged or of another format."""


def array_record_options(compression: str | None) -> str:
  """The array_record writer options of tf.data's `compression` argument."""
  key = compression.upper() if isinstance(compression, str) else compression
  if key not in _COMPRESSIONS:
    raise ValueError(
      f"save: compression must be None, 'SNAPPY' or 'ZSTD', got {compression!r} "
      "('GZIP' has no array_record codec: use 'ZSTD')."
    )
  return f"group_size:1,{_COMPRESSIONS[key]}"


# -- elements as records -------------------------------------------------------
def _structure(element: Any) -> Any:
  if isinstance(element, dict):
    for key in element:
      if not isinstance(key, str):
        raise TypeError(f"save: dict keys must be str, got {key!r}.")
    return {"d": [[k, _structure(v)] for k, v in element.items()]}
  if isinstance(element, tuple):
    return {"t": [_structure(v) for v in element]}
  if isinstance(element, list):
    return {"l": [_structure(v) for v in element]}
  return None


def _build(encoded: Any) -> Any:
  if encoded is None:
    return 0
  ((kind, items),) = encoded.items()
  if kind == "d":
    return {k: _build(v) for k, v in items}
  built = [_build(v) for v in items]
  return tuple(built) if kind == "t" else built


_PY_KINDS = ((bool, "B"), (int, "i"), (float, "f"), (complex, "c"))


def _leaf(leaf: Any) -> tuple[list, bytes]:
  """A leaf's header entry ([kind, dtype, shape]) and raw bytes."""
  if isinstance(leaf, bytes):
    return ["b", "|u1", [len(leaf)]], leaf
  if isinstance(leaf, str):
    raw = leaf.encode("utf-8")
    return ["s", "|u1", [len(raw)]], raw
  kind = "g" if isinstance(leaf, np.generic) else "a"
  for py_type, code in _PY_KINDS:
    if type(leaf) is py_type:  # pylint: disable=unidiomatic-typecheck
      kind = code
  array = np.asarray(leaf)
  if array.dtype.hasobject:
    raise TypeError(f"save: cannot store an object array without pickle: {leaf!r:.80}.")
  return [kind, array.dtype.str, list(array.shape)], array.tobytes()


def _encode(element: Any) -> tuple[bytes, bytes]:
  """(header, record): the header names the structure, kinds, dtypes and shapes."""
  entries, payload = [], []
  for leaf in tree.flatten(element):
    entry, raw = _leaf(leaf)
    entries.append(entry)
    payload.append(raw)
  header = json.dumps({"s": _structure(element), "l": entries}, separators=(",", ":")).encode()
  return header, b"".join([_PREFIX.pack(_MAGIC, len(header)), header, *payload])


def encode_element(element: Any) -> bytes:
  """One element (a pytree of arrays, scalars, bytes, str) as a record."""
  return _encode(element)[1]


def decode_element(record: bytes, where: str = "record") -> Any:
  """Inverse of `encode_element`; SaveFormatError for a malformed record."""
  try:
    magic, size = _PREFIX.unpack_from(record)
    if magic != _MAGIC:
      raise ValueError(f"bad magic {magic!r}")
    header = json.loads(record[_PREFIX.size : _PREFIX.size + size])
    data = memoryview(bytearray(record[_PREFIX.size + size :]))
    leaves, offset = [], 0
    for kind, dtype, shape in header["l"]:
      dtype = np.dtype(dtype)
      count = int(np.prod(shape, dtype=np.int64))
      array = np.frombuffer(data, dtype, count, offset).reshape(shape)
      offset += count * dtype.itemsize
      if kind == "b":
        leaves.append(array.tobytes())
      elif kind == "s":
        leaves.append(array.tobytes().decode("utf-8"))
      elif kind == "a":
        leaves.append(array)
      elif kind == "g":
        leaves.append(array[()])
      else:
        leaves.append({"B": bool, "i": int, "f": float, "c": complex}[kind](array[()]))
    if offset != len(data):
      raise ValueError(f"{len(data) - offset} bytes after the last leaf")
    return tree.unflatten(_build(header["s"]), leaves)
  except (ValueError, TypeError, KeyError, struct.error) as e:
    raise SaveFormatError(f"{where} is not a saved element: {e}") from e


# -- element specs as JSON -------------------------------------------------------
def spec_to_json(spec: Any) -> Any:
  if isinstance(spec, TensorSpec):
    return {"shape": list(spec.shape), "dtype": spec.dtype.str}
  if isinstance(spec, dict):
    return {"d": [[k, spec_to_json(v)] for k, v in spec.items()]}
  return {"t" if isinstance(spec, tuple) else "l": [spec_to_json(v) for v in spec]}


def spec_from_json(encoded: Any) -> Any:
  if "dtype" in encoded:
    return TensorSpec(tuple(encoded["shape"]), np.dtype(encoded["dtype"]))
  ((kind, items),) = encoded.items()
  if kind == "d":
    return {k: spec_from_json(v) for k, v in items}
  built = [spec_from_json(v) for v in items]
  return tuple(built) if kind == "t" else built


def _merge_spec(spec: Any, element: Any) -> Any:
  other = tree.map_structure(spec_of_value, element)
  if spec is None:
    return other
  if not tree.same_structure(spec, other):
    raise TypeError(
      f"save: element structure {tree.structure_str(element)} differs from "
      f"the earlier elements' {spec}."
    )
  return tree.map_structure(TensorSpec.most_specific_compatible, spec, other)


# -- JSON files with a checksum ------------------------------------------------------
def _digest(content: dict) -> str:
  canonical = json.dumps(content, sort_keys=True, separators=(",", ":"))
  return hashlib.sha256(canonical.encode()).hexdigest()


def write_json(path: epath.Path, content: dict) -> None:
  """Writes `content` with its checksum, atomically (temporary file, fsync, rename)."""
  text = json.dumps({**content, "checksum": _digest(content)}, indent=1, sort_keys=True)
  tmp = path.parent / f".{path.name}.{uuid.uuid4().hex[:12]}"
  with open(os.fspath(tmp), "w", encoding="utf-8") as f:
    f.write(text)
    f.flush()
    os.fsync(f.fileno())
  os.replace(os.fspath(tmp), os.fspath(path))


def read_json(path: epath.Path) -> dict:
  """A file `write_json` wrote; SaveFormatError if its checksum does not match."""
  try:
    content = json.loads(path.read_text())
    checksum = content.pop("checksum")
  except (OSError, ValueError, KeyError, AttributeError) as e:
    raise SaveFormatError(f"Saved dataset file {path} is unreadable: {e}") from e
  if checksum != _digest(content):
    raise SaveFormatError(
      f"Saved dataset file {path} is damaged: its checksum does not match its content."
    )
  return content


# -- chunks ---------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ChunkInfo:
  """A committed chunk: its index, elements, bytes and element spec (JSON)."""

  index: int
  num_elements: int
  num_bytes: int
  element_spec: Any


def chunk_dir(path: epath.Path, index: int) -> epath.Path:
  return path / CHUNKS / f"{index:08d}"


def write_chunk(
  path: epath.Path, index: int, elements: Iterable[Any], compression: str | None
) -> ChunkInfo | None:
  """Writes chunk `index` of the saved dataset at `path` from `elements` and
  commits it (a rename of its whole directory). Returns its info, or None
  when another writer committed the chunk first (this copy is dropped: a
  committed chunk is never written twice)."""
  options = array_record_options(compression)
  path = epath.Path(path)
  tmp = path / "tmp" / f"{index:08d}-{uuid.uuid4().hex[:12]}"
  tmp.mkdir(parents=True)
  try:
    spec = None
    count = 0

    def records():
      nonlocal spec, count
      last_header = None
      for element in elements:
        header, record = _encode(element)
        if header != last_header:  # same header, same spec: merged already
          spec = _merge_spec(spec, element)
          last_header = header
        count += 1
        yield record

    array_record_source.write_array_record(tmp / RECORDS, records(), options)
    _fsync_file(tmp / RECORDS)
    info = ChunkInfo(
      index,
      count,
      os.path.getsize(os.fspath(tmp / RECORDS)),
      None if spec is None else spec_to_json(spec),
    )
    write_json(
      tmp / CHUNK_JSON,
      {
        "index": index,
        "num_elements": info.num_elements,
        "num_bytes": info.num_bytes,
        "element_spec": info.element_spec,
      },
    )
    final = chunk_dir(path, index)
    final.parent.mkdir(parents=True, exist_ok=True)
    try:
      # Fails when the chunk is there: a committed chunk is never replaced.
      os.rename(os.fspath(tmp), os.fspath(final))
    except OSError:
      if (final / CHUNK_JSON).exists():
        return None
      raise
    _fsync_dir(final.parent)
    return info
  finally:
    if tmp.exists():
      tmp.rmtree()
    if (path / MANIFEST_JSON).exists():  # complete meanwhile: leave no scratch behind
      _remove_empty(tmp.parent)


def _remove_empty(folder: epath.Path) -> None:
  try:
    os.rmdir(os.fspath(folder))
  except OSError:
    pass  # not empty (another writer's scratch), or gone


def _fsync_file(path: epath.Path) -> None:
  fd = os.open(os.fspath(path), os.O_RDONLY)
  try:
    os.fsync(fd)
  finally:
    os.close(fd)


def _fsync_dir(path: epath.Path) -> None:
  try:
    _fsync_file(path)
  except OSError:
    pass  # not every filesystem syncs directories


def committed_chunks(path: epath.Path) -> dict[int, ChunkInfo]:
  """The chunks committed under `path`, by index."""
  found: dict[int, ChunkInfo] = {}
  folder = epath.Path(path) / CHUNKS
  if not folder.exists():
    return found
  for entry in folder.iterdir():
    if not entry.name.isdigit():
      continue
    content = read_json(entry / CHUNK_JSON)
    found[int(entry.name)] = ChunkInfo(
      int(entry.name), content["num_elements"], content["num_bytes"], content["element_spec"]
    )
  return found


def finalize(path: epath.Path, save: dict, chunks: dict[int, ChunkInfo]) -> dict:
  """Writes the manifest of a save whose every chunk is committed; returns it."""
  path = epath.Path(path)
  ordered = [chunks[i] for i in sorted(chunks)]
  spec = None
  for chunk in ordered:
    if chunk.element_spec is None:
      continue
    other = spec_from_json(chunk.element_spec)
    spec = (
      other
      if spec is None
      else tree.map_structure(TensorSpec.most_specific_compatible, spec, other)
    )
  manifest = {
    "format": FORMAT,
    "version": VERSION,
    "fingerprint": save.get("fingerprint", ""),
    "compression": save.get("compression"),
    "complete": True,
    "num_elements": sum(c.num_elements for c in ordered),
    "num_bytes": sum(c.num_bytes for c in ordered),
    "element_spec": None if spec is None else spec_to_json(spec),
    "chunks": [
      {"index": c.index, "num_elements": c.num_elements, "num_bytes": c.num_bytes} for c in ordered
    ],
  }
  write_json(path / MANIFEST_JSON, manifest)
  tmp = path / "tmp"
  if tmp.exists():
    tmp.rmtree()
  return manifest


def read_save(path: epath.Path) -> dict:
  """The save.json of the saved dataset at `path`."""
  path = epath.Path(path)
  if not (path / SAVE_JSON).exists():
    raise SaveFormatError(f"{path} is not a saved dataset: it has no {SAVE_JSON}.")
  save = read_json(path / SAVE_JSON)
  if save.get("format") != FORMAT or save.get("version") != VERSION:
    raise SaveFormatError(
      f"{path / SAVE_JSON} is of format {save.get('format')!r} "
      f"version {save.get('version')!r}; this jaxfeed reads "
      f"{FORMAT!r} version {VERSION}."
    )
  return save


def check_not_failed(path: epath.PathLike) -> None:
  """Raises SaveFormatError with the reason if the save at `path` failed."""
  path = epath.Path(path)
  if (path / FAILED_JSON).exists():
    raise SaveFormatError(f"The save at {path} failed: {read_json(path / FAILED_JSON)['error']}")


@dataclasses.dataclass(frozen=True)
class Progress:
  """How far a save is: chunks committed of those expected (-1: unknown
  until the end), elements and bytes so far, whether it is complete, and
  why it failed ("" unless it did)."""

  path: str
  complete: bool
  chunks_done: int
  chunks_expected: int
  num_elements: int
  num_bytes: int
  writer: str
  error: str = ""


def progress(path: epath.PathLike) -> Progress:
  """The progress of the save at `path` (complete or not)."""
  path = epath.Path(path)
  save = read_save(path)
  if (path / MANIFEST_JSON).exists():
    manifest = read_json(path / MANIFEST_JSON)
    count = len(manifest["chunks"])
    return Progress(
      os.fspath(path),
      True,
      count,
      count,
      manifest["num_elements"],
      manifest["num_bytes"],
      save["writer"],
    )
  chunks = committed_chunks(path)
  error = read_json(path / FAILED_JSON)["error"] if (path / FAILED_JSON).exists() else ""
  return Progress(
    os.fspath(path),
    False,
    len(chunks),
    int(save["num_chunks"]),
    sum(c.num_elements for c in chunks.values()),
    sum(c.num_bytes for c in chunks.values()),
    save["writer"],
    error,
  )
