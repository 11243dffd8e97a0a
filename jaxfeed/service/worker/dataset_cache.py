"""The dataset definitions a worker keeps for later tasks (`DatasetCache`).

A task names its dataset by id and by the fingerprint of its definition
(`TaskInfo.dataset_fingerprint`); the cache answers only for both, so a
definition it holds is never used for a task of another pipeline, whatever
ids a dispatcher hands out. It forgets everything when the worker meets a
new dispatcher incarnation (one that started without the state of the last),
and holds at most a number of definitions and of bytes, the least recently
used going first.
"""

from __future__ import annotations

import collections
import logging
import threading

from jaxfeed.service.protocol.protos import service_pb2 as pb


class DefinitionMismatchError(RuntimeError):
  """The dispatcher's definition of a task's dataset is not the one the task
  was made for."""

  grpc_status = "FAILED_PRECONDITION"  # how the task's clients are told


def check_fingerprint(task: pb.TaskInfo, dataset_def: pb.DatasetDef) -> None:
  """Raises DefinitionMismatchError unless `dataset_def` has the fingerprint
  `task` names (a task of a dispatcher that names none passes)."""
  if task.dataset_fingerprint and dataset_def.fingerprint != task.dataset_fingerprint:
    raise DefinitionMismatchError(
      f"Task {task.task_id} of job {task.job_id} was made for dataset "
      f"{task.dataset_id} with fingerprint {task.dataset_fingerprint}, but the "
      f"dispatcher's definition of that id has fingerprint {dataset_def.fingerprint}: "
      "the worker runs no other pipeline in its place."
    )


class DatasetCache:
  """Dataset id -> definition, bounded; thread-safe.

  Args:
    max_entries: most definitions kept.
    max_bytes: most bytes of definitions kept (serialized); a definition
      larger than this is not kept.
  """

  def __init__(self, max_entries: int, max_bytes: int):
    self.max_entries = max_entries
    self.max_bytes = max_bytes
    self._lock = threading.Lock()
    self._defs: collections.OrderedDict[str, tuple[pb.DatasetDef, int]] = collections.OrderedDict()
    self._bytes = 0
    self.incarnation = ""  # of the dispatcher the definitions came from

  def get(self, dataset_id: str, fingerprint: str) -> pb.DatasetDef | None:
    """The definition kept for `dataset_id` if its fingerprint is
    `fingerprint`, else None (also when `fingerprint` is empty: a dispatcher
    that names none is asked every time)."""
    with self._lock:
      held = self._defs.get(dataset_id)
      if held is None or not fingerprint or held[0].fingerprint != fingerprint:
        return None
      self._defs.move_to_end(dataset_id)
      return held[0]

  def put(self, dataset_id: str, dataset_def: pb.DatasetDef) -> None:
    """Keeps `dataset_def`, dropping the least recently used past the bounds."""
    size = dataset_def.ByteSize()
    with self._lock:
      self._drop(dataset_id)
      if size > self.max_bytes:
        return
      self._defs[dataset_id] = (dataset_def, size)
      self._bytes += size
      while len(self._defs) > self.max_entries or self._bytes > self.max_bytes:
        self._drop(next(iter(self._defs)))

  def meet(self, incarnation: str) -> None:
    """The dispatcher's incarnation, from its answer to a heartbeat: a new
    one knows none of the ids the last one gave, so their definitions go."""
    with self._lock:
      if not incarnation or incarnation == self.incarnation:
        return
      if self.incarnation:
        logging.info(
          "The dispatcher is a new incarnation (%s, was %s): forgetting %d dataset definitions.",
          incarnation,
          self.incarnation,
          len(self._defs),
        )
      self.incarnation = incarnation
      self._defs.clear()
      self._bytes = 0

  def _drop(self, dataset_id: str) -> None:
    held = self._defs.pop(dataset_id, None)
    if held is not None:
      self._bytes -= held[1]

  def __len__(self) -> int:
    with self._lock:
      return len(self._defs)

  @property
  def nbytes(self) -> int:
    """Bytes of the definitions kept."""
    with self._lock:
      return self._bytes
