"""The dispatcher's distributed saves (`jaxfeed.service.distributed_save`).

A save writes a pipeline's output to a folder in chunks (see
`jaxfeed.ops.save_format`): chunk k holds the elements of positions
[k * C, (k + 1) * C) of the pipeline's splittable input, so chunks are
handed out to workers as DYNAMIC splits are, first come first served. A
worker asks for a chunk (`SaveChunks`), writes it and commits it by renaming
its directory into place, then reports it with its next request. A chunk's
directory, once there, is never replaced: two writers of one chunk (a worker
taken for dead that was not) leave one copy.

What survives what:
- The folder is the save's state: `save.json` and `dataset.pb` say what to
  write, the chunk directories what is written. A dispatcher restarted with
  its `--work_dir` finds the saves in progress in `saves.json` there and
  reads the rest from their folders.
- Chunks handed to a worker that is lost (its heartbeats stop, or it
  restarts with a new incarnation) go back to the pool; so do those handed
  before a dispatcher restart. A worker's new request also returns what it
  was handed before and did not commit (its answer was lost).
- Once every chunk is committed the dispatcher writes the manifest, which
  makes the save complete (`Dataset.load` reads only complete saves).
- A chunk whose pipeline raises `max_split_attempts` times fails the save:
  `failed.json` says which chunk and why, and readers waiting for the save
  raise it. `distributed_save` of the same pipeline to the folder tries again.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import threading
from typing import Mapping

from etils import epath

from jaxfeed.ops import save as save_lib
from jaxfeed.ops import save_format
from jaxfeed.service.dispatcher.config import DispatcherConfig
from jaxfeed.service.protocol import import_paths
from jaxfeed.service.protocol import rpc
from jaxfeed.service.protocol import spec as spec_lib
from jaxfeed.service.protocol import spec_signature
from jaxfeed.service.protocol.protos import service_pb2 as pb

__all__ = ["SaveRegistry", "WRITER", "default_chunk_positions"]

WRITER = "distributed_save"
_REGISTRY = "saves.json"
# Default chunking: about this many chunks, each of at least one position.
_TARGET_CHUNKS = 64
_MAX_CHUNK_POSITIONS = 1 << 16


def default_chunk_positions(num_positions: int) -> int:
  return max(1, min(_MAX_CHUNK_POSITIONS, math.ceil(num_positions / _TARGET_CHUNKS)))


@dataclasses.dataclass
class _Save:
  path: str
  dataset: pb.DatasetDef
  compression: str
  num_positions: int
  chunk_positions: int
  num_chunks: int
  committed: set[int] = dataclasses.field(default_factory=set)
  # Chunk index -> (worker address, incarnation) writing it.
  assigned: dict[int, tuple[str, str]] = dataclasses.field(default_factory=dict)
  # Chunk index -> times its pipeline raised (not journaled: a restarted
  # dispatcher counts anew).
  failures: dict[int, int] = dataclasses.field(default_factory=dict)

  def chunk(self, index: int) -> pb.SaveChunk:
    if self.num_positions < 0:
      return pb.SaveChunk(index=index, start=0, stop=-1)
    start = index * self.chunk_positions
    return pb.SaveChunk(
      index=index, start=start, stop=min(self.num_positions, start + self.chunk_positions)
    )


class SaveRegistry:
  """The saves in progress; durable in `work_dir/saves.json` and their folders."""

  def __init__(self, config: DispatcherConfig):
    self._config = config
    self._lock = threading.Lock()
    self._saves: dict[str, _Save] = {}
    self._registry = (epath.Path(config.work_dir) / _REGISTRY) if config.work_dir else None
    if self._registry is not None and self._registry.exists():
      try:
        paths = save_format.read_json(self._registry)["paths"]
      except (save_format.SaveFormatError, KeyError) as e:
        # The saves stay in their folders: distributed_save again resumes each.
        logging.error("The distributed saves in progress are unknown: %s", e)
        paths = []
      for path in paths:
        try:
          self._resume(path)
        except (OSError, save_format.SaveFormatError) as e:
          logging.error("Distributed save at %s cannot be resumed: %s", path, e)
      self._write_registry()

  def _resume(self, path: str) -> _Save | None:
    """Loads the save at `path` from its folder (lock held or not yet shared)."""
    folder = epath.Path(path)
    if (folder / save_format.MANIFEST_JSON).exists():
      return None
    meta = save_format.read_save(folder)
    dataset = pb.DatasetDef.FromString((folder / save_format.DATASET_PB).read_bytes())
    save = _Save(
      path,
      dataset,
      meta["compression"] or "",
      meta["num_positions"],
      meta["chunk_positions"],
      meta["num_chunks"],
      set(save_format.committed_chunks(folder)),
    )
    self._saves[path] = save
    self._finish_if_done(save)
    return save

  def _write_registry(self) -> None:
    if self._registry is not None:
      save_format.write_json(self._registry, {"paths": sorted(self._saves)})

  def active_paths(self) -> list[str]:
    with self._lock:
      return sorted(self._saves)

  def start(self, request: pb.StartSaveRequest) -> pb.StartSaveResponse:
    """Registers the save (or resumes one of the same pipeline at its path)."""
    path = request.path
    if not path or not (os.path.isabs(path) or "://" in path):
      raise ValueError(f"StartSave: path must be absolute (the workers' view of it), got {path!r}.")
    spec_signature.check_signature(request.dataset, self._config.pickled_udf_secret)
    import_paths.check_spec_paths(request.dataset, self._config.udf_modules)
    save_format.array_record_options(request.compression or None)
    if request.chunk_positions < 0:
      raise ValueError(f"StartSave: chunk_positions must be >= 0, got {request.chunk_positions}.")
    dataset = pb.DatasetDef()
    dataset.CopyFrom(request.dataset)
    dataset.fingerprint = spec_lib.fingerprint(request.dataset)
    folder = epath.Path(path)
    with self._lock:
      save = self._saves.get(path)
      if save is None and (folder / save_format.SAVE_JSON).exists():
        meta = save_format.read_save(folder)
        if (folder / save_format.MANIFEST_JSON).exists():
          raise rpc.StatusError(
            "ALREADY_EXISTS",
            f"{path} holds a complete saved dataset already: load it, or save to another folder.",
          )
        if meta.get("writer") != WRITER or meta.get("fingerprint") != dataset.fingerprint:
          raise rpc.StatusError(
            "ALREADY_EXISTS",
            f"{path} holds an incomplete save of another pipeline "
            f"(writer {meta.get('writer')!r}, fingerprint {meta.get('fingerprint')!r}); "
            "remove it or save to another folder.",
          )
        if (folder / save_format.FAILED_JSON).exists():
          (folder / save_format.FAILED_JSON).unlink()  # asked again: it tries again
        if not (folder / save_format.DATASET_PB).exists():  # stopped before writing it
          _write_dataset(folder, dataset)
        save = self._resume(path)  # the same pipeline: it goes on
        self._write_registry()
      if save is not None:
        if save.dataset.fingerprint != dataset.fingerprint:
          raise rpc.StatusError("ALREADY_EXISTS", f"{path} is being saved from another pipeline.")
        return pb.StartSaveResponse(num_chunks=save.num_chunks, chunks_done=len(save.committed))
      num_positions = int(dataset.num_positions)
      chunk_positions = int(request.chunk_positions) or default_chunk_positions(
        max(num_positions, 0)
      )
      num_chunks = 1 if num_positions < 0 else math.ceil(num_positions / chunk_positions)
      try:
        save_lib.start_folder(
          folder,
          {
            "writer": WRITER,
            "fingerprint": dataset.fingerprint,
            "compression": request.compression or None,
            "num_chunks": num_chunks,
            "num_positions": num_positions,
            "chunk_positions": chunk_positions,
          },
          replace=False,
        )
      except FileExistsError as e:
        raise rpc.StatusError("ALREADY_EXISTS", str(e)) from None
      _write_dataset(folder, dataset)
      save = _Save(path, dataset, request.compression, num_positions, chunk_positions, num_chunks)
      self._saves[path] = save
      self._write_registry()
      self._finish_if_done(save)
      logging.info(
        "Distributed save to %s: %d chunks of %d positions.", path, num_chunks, chunk_positions
      )
      return pb.StartSaveResponse(num_chunks=num_chunks, chunks_done=0)

  def chunks(
    self, request: pb.SaveChunksRequest, live_workers: Mapping[str, str]
  ) -> pb.SaveChunksResponse:
    """Takes a worker's committed chunks and hands it the next ones.

    `live_workers`: address -> incarnation of the workers alive now.
    """
    with self._lock:
      save = self._saves.get(request.path)
      if save is None:
        return pb.SaveChunksResponse(finished=True)
      folder = epath.Path(save.path)
      for index in request.committed:
        if (
          0 <= index < save.num_chunks
          and (save_format.chunk_dir(folder, index) / save_format.CHUNK_JSON).exists()
        ):
          save.committed.add(index)
          save.assigned.pop(index, None)
      worker = (request.worker_address, request.incarnation)
      for failure in request.failed:
        if self._note_failure(save, failure):
          return pb.SaveChunksResponse(finished=True)
      for index, holder in list(save.assigned.items()):
        # This worker's earlier chunks: it asks only once it wrote them.
        if holder == worker or live_workers.get(holder[0]) != holder[1]:
          del save.assigned[index]
      if self._finish_if_done(save):
        return pb.SaveChunksResponse(finished=True)
      response = pb.SaveChunksResponse()
      if request.want_dataset:
        response.dataset.CopyFrom(save.dataset)
        response.compression = save.compression
      wanted = max(1, request.max_chunks)
      for index in range(save.num_chunks):
        if len(response.chunks) >= wanted:
          break
        if index not in save.committed and index not in save.assigned:
          save.assigned[index] = worker
          response.chunks.append(save.chunk(index))
      return response

  def _note_failure(self, save: _Save, failure: pb.SaveChunkFailure) -> bool:
    """Counts a chunk's failure; fails the save at the last attempt (lock held)."""
    if failure.index in save.committed or not 0 <= failure.index < save.num_chunks:
      return False
    count = save.failures.get(failure.index, 0) + 1
    save.failures[failure.index] = count
    save.assigned.pop(failure.index, None)
    if count < self._config.max_split_attempts:
      return False
    chunk = save.chunk(failure.index)
    where = "the whole pipeline" if chunk.stop < 0 else f"positions [{chunk.start}, {chunk.stop})"
    error = (
      f"chunk {failure.index} ({where}) of dataset {save.dataset.fingerprint} "
      f"raised {count} times (max_split_attempts={self._config.max_split_attempts}); "
      f"the last error: {failure.error}"
    )
    save_format.write_json(epath.Path(save.path) / save_format.FAILED_JSON, {"error": error})
    del self._saves[save.path]
    self._write_registry()
    logging.error("Distributed save to %s failed: %s", save.path, error)
    return True

  def _finish_if_done(self, save: _Save) -> bool:
    """Writes the manifest once every chunk is committed (lock held)."""
    if len(save.committed) < save.num_chunks:
      return False
    folder = epath.Path(save.path)
    save_format.finalize(
      folder, save_format.read_save(folder), save_format.committed_chunks(folder)
    )
    del self._saves[save.path]
    self._write_registry()
    logging.info("Distributed save to %s is complete.", save.path)
    return True


def _write_dataset(folder: epath.Path, dataset: pb.DatasetDef) -> None:
  """Writes the save's pipeline to its folder, atomically."""
  tmp = os.fspath(folder / f".{save_format.DATASET_PB}.tmp")
  with open(tmp, "wb") as f:
    f.write(dataset.SerializeToString())
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, os.fspath(folder / save_format.DATASET_PB))
