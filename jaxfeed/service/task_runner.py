"""A worker's running task: its pipeline thread and bounded frame buffer."""

from __future__ import annotations

import collections
import logging
import threading
import traceback
from typing import Any, Callable, Iterator

from jaxfeed.service import wire

_POLL_S = 0.1


class TaskFailed(RuntimeError):
  """The task's pipeline raised; `status` is the gRPC status name to report."""

  def __init__(self, message: str, status: str = "INTERNAL"):
    super().__init__(message)
    self.status = status


class TaskRunner:
  """Runs one task's pipeline on a thread into a bounded buffer of frames.

  Plain jobs keep one FIFO that every consumer of the task pulls from (a
  frame goes to exactly one of them). Round-robin jobs (num_consumers K > 0)
  group the frames into rounds of K; consumer i gets frame i of each round
  this worker owns, and a round is dropped once all K consumers took theirs.
  """

  def __init__(self, task_id: int, make_iterator: Callable[[], Any],
               buffer_size: int, num_consumers: int = 0,
               on_finished: Callable[[int], None] | None = None):
    self.task_id = task_id
    self.num_consumers = num_consumers
    self._buffer_size = buffer_size
    self._cond = threading.Condition()
    self._fifo: collections.deque = collections.deque()
    self._rounds: dict[int, list] = {}      # local round -> K frames
    self._served: dict[int, set] = {}       # local round -> consumers served
    self._next_round = 0
    self._pending: list = []
    self._done = False
    self._error: TaskFailed | None = None
    self._stop = threading.Event()
    self._on_finished = on_finished
    self._thread = threading.Thread(
        target=self._produce, args=(make_iterator,),
        name=f"jaxfeed-task-{task_id}", daemon=True)
    self._thread.start()

  # -- producer ---------------------------------------------------------------
  def _full(self) -> bool:
    if self.num_consumers:
      return len(self._rounds) >= self._buffer_size
    return len(self._fifo) >= self._buffer_size

  def _produce(self, make_iterator: Callable[[], Any]) -> None:
    iterator = None
    try:
      iterator = make_iterator()
      for element in iterator:
        frame = wire.encode(element)
        with self._cond:
          while self._full() and not self._stop.is_set():
            self._cond.wait(_POLL_S)
          if self._stop.is_set():
            return
          self._add(frame)
          self._cond.notify_all()
    except Exception as e:  # pylint: disable=broad-except
      status = getattr(e, "grpc_status", None) or _status_of(e)
      message = f"Task {self.task_id} failed: {type(e).__name__}: {e}"
      logging.warning("%s\n%s", message, traceback.format_exc())
      with self._cond:
        self._error = TaskFailed(message, status)
    finally:
      if iterator is not None and hasattr(iterator, "close"):
        try:
          iterator.close()
        except Exception:  # pylint: disable=broad-except
          logging.exception("Closing task %d's pipeline failed", self.task_id)
      with self._cond:
        self._done = True
        self._cond.notify_all()
      if self._error is None and not self._stop.is_set() and self._on_finished:
        self._on_finished(self.task_id)

  def _add(self, frame: bytes) -> None:
    if not self.num_consumers:
      self._fifo.append(frame)
      return
    self._pending.append(frame)
    if len(self._pending) == self.num_consumers:
      self._rounds[self._next_round] = self._pending
      self._served[self._next_round] = set()
      self._next_round += 1
      self._pending = []

  # -- consumers ----------------------------------------------------------------
  def frames(self, is_active: Callable[[], bool], consumer_index: int = 0,
             local_round: int = 0) -> Iterator[tuple[bytes, int]]:
    """Yields (frame, local round) until the task ends; raises TaskFailed."""
    if self.num_consumers and not 0 <= consumer_index < self.num_consumers:
      raise TaskFailed(f"consumer_index {consumer_index} is outside "
                       f"[0, {self.num_consumers}) of task {self.task_id}.",
                       "INVALID_ARGUMENT")
    while True:
      with self._cond:
        while True:
          if self._stop.is_set():
            raise TaskFailed(f"Task {self.task_id} was stopped on this worker.",
                             "UNAVAILABLE")
          if self.num_consumers:
            frames = self._rounds.get(local_round)
            if frames is not None:
              frame = frames[consumer_index]
              served = self._served[local_round]
              served.add(consumer_index)
              if len(served) == self.num_consumers:
                del self._rounds[local_round], self._served[local_round]
                self._cond.notify_all()
              break
            if local_round < self._next_round:  # already dropped
              raise TaskFailed(
                  f"Round {local_round} of task {self.task_id} was already "
                  "served to every consumer.", "OUT_OF_RANGE")
          elif self._fifo:
            frame = self._fifo.popleft()
            self._cond.notify_all()
            break
          if self._error is not None:
            raise self._error
          if self._done:
            return
          if not is_active():
            return
          self._cond.wait(_POLL_S)
      yield frame, local_round
      local_round += 1

  # -- lifetime ---------------------------------------------------------------
  @property
  def finished(self) -> bool:
    return self._done and self._error is None

  def stop(self) -> None:
    self._stop.set()
    with self._cond:
      self._cond.notify_all()
    if self._thread is not threading.current_thread():
      self._thread.join(timeout=10)


def _status_of(error: Exception) -> str:
  from jaxfeed.service import spec as spec_lib  # pylint: disable=g-import-not-at-top
  if isinstance(error, spec_lib.UDFImportError):
    return "FAILED_PRECONDITION"
  if isinstance(error, spec_lib.SpecError):
    return "INVALID_ARGUMENT"
  return "INTERNAL"
