"""`Dataset.load`: a saved dataset (`Dataset.save`, `distributed_save`) read back.

tf.data's `Dataset.load(path)`. The saved elements are a random-access
source (`SavedDatasetSource`): element `i` is record `i` of the chunks in
order, so `from_source(source, IndexSampler(..., shuffle=True))` shuffles
them globally and shards them by host, and DYNAMIC sharding splits them
between service workers. A save that is not complete is refused, or waited
for with `wait=True`.
"""

from __future__ import annotations

import os
import time
from typing import Any

from etils import epath
import numpy as np

from jaxfeed.ops import save_format
from jaxfeed.ops.from_source import SourceNode
from jaxfeed.sources.array_record_source import ArrayRecordSource
from jaxfeed.sources.base import RecordSource

__all__ = ["SavedDatasetSource", "load_node", "wait_until_complete"]

_POLL_S = 0.2


def wait_until_complete(path: epath.PathLike, timeout_s: float | None = None) -> dict:
  """The manifest of the save at `path` once it is complete.

  Raises:
    TimeoutError: still incomplete after `timeout_s` (None: waits forever).
    jaxfeed.ops.save_format.SaveFormatError: the save failed (a chunk's
      pipeline kept raising), with the reason.
  """
  path = epath.Path(path)
  deadline = None if timeout_s is None else time.monotonic() + timeout_s
  while not (path / save_format.MANIFEST_JSON).exists():
    save_format.check_not_failed(path)
    if deadline is not None and time.monotonic() > deadline:
      progress = save_format.progress(path)
      raise TimeoutError(
        f"The save at {path} is still incomplete after {timeout_s:g} s "
        f"({progress.chunks_done} of {progress.chunks_expected} chunks)."
      )
    time.sleep(_POLL_S)
  return save_format.read_json(path / save_format.MANIFEST_JSON)


class SavedDatasetSource(RecordSource):
  """The elements of a complete saved dataset, by index (pytrees, not bytes).

  Args:
    path: The folder `Dataset.save` or `jaxfeed.service.distributed_save` wrote.
    wait: Wait for an incomplete save to complete instead of refusing it.

  Raises:
    jaxfeed.ops.save_format.SaveFormatError: `path` is no saved dataset, is
      damaged, or (without `wait`) is not complete yet.
  """

  def __init__(self, path: str | os.PathLike, wait: bool = False):
    if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
      raise TypeError(f"load: path must be a non-empty str or path, got {path!r}.")
    self._path = os.fspath(path)
    folder = epath.Path(self._path)
    if wait:
      wait_until_complete(folder)
    save_format.read_save(folder)
    if not (folder / save_format.MANIFEST_JSON).exists():
      save_format.check_not_failed(folder)
      progress = save_format.progress(folder)
      expected = (
        "an unknown number of" if progress.chunks_expected < 0 else progress.chunks_expected
      )
      raise save_format.SaveFormatError(
        f"The save at {self._path} is incomplete ({progress.chunks_done} of {expected} "
        f"chunks written): it is still being written or its writer stopped. Wait for it "
        f"with Dataset.load(path, wait=True), or see `jaxfeed inspect {self._path}`."
      )
    self.manifest = save_format.read_json(folder / save_format.MANIFEST_JSON)
    chunks = [c for c in self.manifest["chunks"] if c["num_elements"] > 0]
    self._records = (
      ArrayRecordSource(
        [os.fspath(save_format.chunk_dir(folder, c["index"]) / save_format.RECORDS) for c in chunks]
      )
      if chunks
      else None
    )
    if self._records is not None and len(self._records) != self.manifest["num_elements"]:
      raise save_format.SaveFormatError(
        f"The save at {self._path} is damaged: its chunks hold {len(self._records)} "
        f"elements, its manifest says {self.manifest['num_elements']}."
      )

  @property
  def element_spec(self) -> Any:
    """The saved elements' spec (None for an empty save)."""
    spec = self.manifest["element_spec"]
    return None if spec is None else save_format.spec_from_json(spec)

  def __len__(self) -> int:
    return int(self.manifest["num_elements"])

  def _read(self, index: int) -> Any:
    return save_format.decode_element(self._records[index], self._where(index))

  def _read_many(self, indices: np.ndarray) -> list:
    return [
      save_format.decode_element(record, self._where(i))
      for i, record in zip(indices.tolist(), self._records.get_many(indices))
    ]

  def _where(self, index: int) -> str:
    return f"element {index} of the save at {self._path}"

  def spec_params(self) -> dict:
    return {"path": self._path}

  def fingerprint_params(self) -> dict:
    return {"chunks": self.manifest["chunks"], "fingerprint": self.manifest["fingerprint"]}

  def close(self) -> None:
    if self._records is not None:
      self._records.close()


def load_node(path: str | os.PathLike, wait: bool = False, sampler: Any = None) -> SourceNode:
  """The `from_source` node over the save at `path` (see `SavedDatasetSource`)."""
  return SourceNode(SavedDatasetSource(path, wait), sampler)
