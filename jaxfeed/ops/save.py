"""`Dataset.save`: writes a pipeline's output to a folder `Dataset.load` reads.

tf.data's `Dataset.save(path, compression=None, shard_func=None)`. The
elements go to chunks of the format `jaxfeed.ops.save_format` describes
(the format of `jaxfeed.service.distributed_save` too), in order: loading
gives them back in the order they were saved. With `shard_func`, elements
of one shard go to the same chunks (a new chunk once a shard's pending
elements reach the chunk size), and loading reads the chunks in the order
they were written. As in tf.data, a save into a folder that holds a saved
dataset replaces it; the manifest, which says the save is complete, is
written last, so an interrupted save is never loaded.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Iterable, Iterator

from etils import epath
import numpy as np

from jaxfeed.ops import save_format
from jaxfeed.ops import tree

__all__ = ["save", "start_folder", "clear_folder"]

# A chunk holds at most this many elements or bytes (in memory before the
# array_record writer compresses them: at most this much is held per shard).
CHUNK_ELEMENTS = 1 << 16
CHUNK_BYTES = 64 << 20


def clear_folder(path: epath.Path) -> None:
  """Removes the saved dataset at `path` (manifest first: never complete-looking)."""
  for name in (save_format.MANIFEST_JSON, save_format.SAVE_JSON, save_format.DATASET_PB):
    if (path / name).exists():
      (path / name).unlink()
  for name in (save_format.CHUNKS, "tmp"):
    if (path / name).exists():
      (path / name).rmtree()


def start_folder(path: epath.Path, save: dict, replace: bool) -> None:
  """Makes `path` a saved dataset being written, described by `save`.

  Raises:
    FileExistsError: `path` holds other files, or a saved dataset when
      `replace` is False.
  """
  if path.exists():
    if (path / save_format.SAVE_JSON).exists():
      if not replace:
        raise FileExistsError(f"{path} holds a saved dataset already.")
      clear_folder(path)
    elif any(path.iterdir()):
      raise FileExistsError(
        f"save: {path} is a non-empty folder that holds no saved dataset; give a new "
        "or empty folder."
      )
  path.mkdir(parents=True, exist_ok=True)
  save_format.write_json(
    path / save_format.SAVE_JSON,
    {"format": save_format.FORMAT, "version": save_format.VERSION, **save},
  )


def _nbytes(element: Any) -> int:
  return sum(
    np.asarray(leaf).nbytes if not isinstance(leaf, (bytes, str)) else len(leaf)
    for leaf in tree.flatten(element)
  )


def _chunks_in_order(elements: Iterator[Any]) -> Iterator[list]:
  pending, size = [], 0
  for element in elements:
    pending.append(element)
    size += _nbytes(element)
    if len(pending) >= CHUNK_ELEMENTS or size >= CHUNK_BYTES:
      yield pending
      pending, size = [], 0
  if pending:
    yield pending


def _chunks_by_shard(elements: Iterator[Any], shard_func: Callable) -> Iterator[list]:
  pending: dict[int, tuple[list, int]] = {}
  for element in elements:
    shard = shard_func(element)
    try:
      shard = int(np.asarray(shard))
    except (TypeError, ValueError):
      raise TypeError(f"save: shard_func must return an integer, got {shard!r:.80}.") from None
    items, size = pending.get(shard, ([], 0))
    items.append(element)
    size += _nbytes(element)
    if len(items) >= CHUNK_ELEMENTS or size >= CHUNK_BYTES:
      pending.pop(shard, None)
      yield items
    else:
      pending[shard] = (items, size)
  for shard in sorted(pending):
    yield pending[shard][0]


def save(
  elements: Iterable[Any],
  path: str | os.PathLike,
  fingerprint: str,
  compression: str | None = None,
  shard_func: Callable | None = None,
  checkpoint_args: Any = None,
) -> dict:
  """Writes `elements` as a saved dataset at `path`; returns its manifest."""
  if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
    raise TypeError(f"save: path must be a non-empty str or path, got {path!r}.")
  if checkpoint_args is not None:
    raise ValueError(
      "save: checkpoint_args (tf.train.CheckpointManager arguments) has no "
      "jaxfeed counterpart; a save that stops is written again whole, or "
      "use jaxfeed.service.distributed_save, which resumes."
    )
  if shard_func is not None and not callable(shard_func):
    raise TypeError(f"save: shard_func must be callable, got {shard_func!r}.")
  save_format.array_record_options(compression)  # checked before anything is written
  folder = epath.Path(path)
  start_folder(
    folder,
    {
      "writer": "save",
      "fingerprint": fingerprint,
      "compression": compression,
      "num_chunks": -1,
      "num_positions": -1,
      "chunk_positions": 0,
    },
    replace=True,
  )
  iterator = iter(elements)
  try:
    groups = (
      _chunks_in_order(iterator) if shard_func is None else _chunks_by_shard(iterator, shard_func)
    )
    chunks = {}
    for index, group in enumerate(groups):
      chunks[index] = save_format.write_chunk(folder, index, group, compression)
  finally:
    close = getattr(iterator, "close", None)
    if close is not None:
      close()
  return save_format.finalize(folder, save_format.read_save(folder), chunks)
