"""Ephemeral sharing: jobs reading one dataset share one worker pipeline.

Jobs that read the same dataset (the same graph fingerprint, so the same
dataset id) in `parallel_epochs` mode with `ephemeral_sharing=True` get, on
each worker, readers of one `SharedStream` instead of a pipeline each. The
stream keeps a byte-bounded sliding window of encoded frames; every reader
(one per job's task) has its own position in it:

- The producer runs up to `ahead` frames past the fastest reader, so that
  reader never waits on a pipeline the others are not using; it never runs
  further, so no one pays for elements nobody reads.
- Frames every reader has passed, and frames only slower readers have yet to
  read once the window holds more than `window_bytes`, are evicted from the
  front. A reader whose next frame was evicted skips to the oldest frame still
  there and counts what it skipped (`elements_skipped` in its statistics), as
  tf.data service's cross-trainer cache does; a slow job never holds the
  others back.
- A new reader starts at the oldest frame of the window, so a job that joins
  while others are reading first reads what is already made.
- The stream is ephemeral: it stops when its last reader leaves, and the next
  job builds a new one.

A finite pipeline ends every reader once it has read the window to the end.
Sharing makes sense for endless pipelines (`.repeat()`) read by several
trainers at once, e.g. the trials of a hyperparameter search.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
import traceback
from typing import Any, Callable, Generator

from jaxfeed.ops import op_stats
from jaxfeed.service.protocol import wire
from jaxfeed.service.worker import task_pipeline
from jaxfeed.service.worker import task_runner

_POLL_S = 0.1


class SharedStream:
  """One pipeline's frames, read by the tasks of several jobs.

  Args:
    make_iterator: Builds the pipeline (called on the stream's thread).
    window_bytes: Most bytes of frames kept once every frame in the window
      has been read by the fastest reader.
    ahead: Frames the producer may make past the fastest reader.
    on_finished: Called with each reader's task id once the pipeline ended.
    on_empty: Called (without locks held) after the last reader left.
  """

  def __init__(
    self,
    make_iterator: Callable[[], Any],
    window_bytes: int,
    ahead: int,
    on_finished: Callable[[int], None] | None = None,
    on_empty: Callable[["SharedStream"], None] | None = None,
  ):
    self._window_bytes = window_bytes
    self._ahead = ahead
    self._on_finished = on_finished
    self._on_empty = on_empty
    self._pipeline: Any = None  # the shared iterator, for its op statistics
    self._cond = threading.Condition()
    self._frames: collections.deque[wire.Frame] = collections.deque()
    self._base = 0  # absolute index of self._frames[0]
    self._bytes = 0
    self._positions: dict[int, int] = {}  # task id -> next absolute index
    self._skipped: dict[int, int] = {}
    self._done = False
    self._error: Exception | None = None
    self._stopped = False
    self.produced = 0
    self.evicted = 0
    self.peak_bytes = 0
    self._thread = threading.Thread(
      target=self._produce, args=(make_iterator,), name="jaxfeed-shared-stream", daemon=True
    )
    self._thread.start()

  # -- readers --------------------------------------------------------------
  def op_rows(self) -> list[dict]:
    """The per-op `stats()` rows of the shared pipeline."""
    return op_stats.rows_of(self._pipeline)

  def add_reader(self, task_id: int) -> "SharedStreamReader | None":
    """A reader for the task, starting at the oldest frame; None if the
    stream already stopped or ended (the caller then makes a new stream)."""
    with self._cond:
      if self._stopped or self._done:
        return None
      self._positions.setdefault(task_id, self._base)
      self._skipped.setdefault(task_id, 0)
      self._cond.notify_all()
    return SharedStreamReader(self, task_id)

  def remove_reader(self, task_id: int) -> None:
    with self._cond:
      self._positions.pop(task_id, None)
      last = not self._positions and not self._stopped
      if last:
        self._stopped = True
      self._cond.notify_all()
    if last:
      if self._thread is not threading.current_thread():
        self._thread.join(timeout=10)
      if self._on_empty is not None:
        self._on_empty(self)

  def has_reader(self, task_id: int) -> bool:
    with self._cond:
      return task_id in self._positions

  @property
  def num_readers(self) -> int:
    with self._cond:
      return len(self._positions)

  def _end(self) -> int:
    return self._base + len(self._frames)

  def next_frame(self, task_id: int, is_active: Callable[[], bool]) -> wire.Frame | None | bool:
    """The reader's next frame; None at the end of the pipeline; False when
    is_active() turned false or the reader was removed. Raises the
    pipeline's error."""
    with self._cond:
      while True:
        position = self._positions.get(task_id)
        if position is None:
          return False
        if position < self._base:  # evicted before this reader got to it
          self._skipped[task_id] += self._base - position
          position = self._positions[task_id] = self._base
        if position < self._end():
          frame = self._frames[position - self._base]
          self._positions[task_id] = position + 1
          self._evict()
          self._cond.notify_all()
          return frame
        if self._error is not None:
          raise self._error
        if self._done:
          return None
        if not is_active():
          return False
        self._cond.wait(_POLL_S)

  def skipped(self, task_id: int) -> int:
    with self._cond:
      return self._skipped.get(task_id, 0)

  # -- producer -----------------------------------------------------------------
  def _evict(self) -> None:
    """Drops frames from the front that every reader passed, then (over the
    byte bound) frames the fastest reader passed (lock held)."""
    if not self._positions:
      return
    slowest, fastest = min(self._positions.values()), max(self._positions.values())
    while self._frames and (
      self._base < slowest or (self._bytes > self._window_bytes and self._base < fastest)
    ):
      self._bytes -= self._frames.popleft().nbytes
      self._base += 1
      self.evicted += 1

  def _wanted(self) -> bool:
    if not self._positions:
      return False
    if self._end() - max(self._positions.values()) >= self._ahead:
      return False
    return self._bytes <= self._window_bytes or not self._frames

  def _produce(self, make_iterator: Callable[[], Any]) -> None:
    iterator = None
    try:
      iterator = self._pipeline = make_iterator()
      while True:
        with self._cond:
          while not self._stopped and not self._wanted():
            self._cond.wait(_POLL_S)
          if self._stopped:
            return
        try:
          element = next(iterator)
        except StopIteration:
          break
        frame = wire.encode_frame(element)
        with self._cond:
          self._frames.append(frame)
          self._bytes += frame.nbytes
          self.produced += 1
          self.peak_bytes = max(self.peak_bytes, self._bytes)
          self._evict()
          self._cond.notify_all()
    except Exception as e:  # pylint: disable=broad-except
      logging.warning("Shared pipeline failed: %s\n%s", e, traceback.format_exc())
      with self._cond:
        self._error = e
        self._cond.notify_all()
    finally:
      task_pipeline.close_quietly(iterator, "a shared pipeline")
      with self._cond:
        self._done = True
        finished = [] if self._error is not None or self._stopped else list(self._positions)
        self._cond.notify_all()
      if self._on_finished is not None:
        for task_id in finished:
          self._on_finished(task_id)

  @property
  def error(self) -> Exception | None:
    with self._cond:
      return self._error

  @property
  def done(self) -> bool:
    with self._cond:
      return self._done


class SharedStreamReader:
  """A task's view of a `SharedStream`; what the worker serves it from."""

  num_consumers = 0
  exactly_once = False

  def __init__(self, stream: SharedStream, task_id: int):
    self.stream = stream
    self.task_id = task_id

  def take(self, consumer_index: int, local_round: int, wait_s: float) -> Any:
    """The reader's next (frame, index), waiting up to wait_s; None if none
    came in time; `task_runner.Ended` at the pipeline's end. Raises
    TaskFailed (see `task_runner.TaskRunner.take`)."""
    del consumer_index
    deadline = time.monotonic() + wait_s
    try:
      frame = self.stream.next_frame(self.task_id, lambda: time.monotonic() < deadline)
    except Exception as e:  # pylint: disable=broad-except
      raise task_runner.TaskFailed(
        f"Task {self.task_id}'s shared pipeline failed: {type(e).__name__}: {e}",
        getattr(e, "grpc_status", None) or task_runner.status_of(e),
      ) from e
    if frame is None:
      return task_runner.Ended(task_runner.end_stats(self.stats(), self.op_rows()))
    if frame is False:
      if not self.stream.has_reader(self.task_id):
        raise task_runner.TaskFailed(
          f"Task {self.task_id} was stopped on this worker.", "UNAVAILABLE"
        )
      return None
    return frame, local_round

  def frames(
    self, is_active: Callable[[], bool], consumer_index: int = 0, local_round: int = 0
  ) -> Generator[tuple[wire.Frame, int], None, dict | None]:
    """Yields (frame, index) until the pipeline ends; returns the reader's
    statistics then, None when is_active() turned false first."""
    while is_active():
      item = self.take(consumer_index, local_round, _POLL_S)
      if isinstance(item, task_runner.Ended):
        return item.stats
      if item is not None:
        yield item
        local_round += 1
    return None

  @property
  def progress(self) -> int:
    """Frames the shared pipeline made (see `TaskRunner.progress`)."""
    return self.stream.produced

  def stats(self) -> dict:
    return {"elements_skipped": self.stream.skipped(self.task_id)}

  def op_rows(self) -> list[dict]:
    return self.stream.op_rows()

  @property
  def finished(self) -> bool:
    return self.stream.done and self.stream.error is None

  def stop(self) -> None:
    self.stream.remove_reader(self.task_id)
