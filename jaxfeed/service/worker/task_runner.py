"""A worker's running task: its pipeline thread and bounded frame buffer."""

from __future__ import annotations

import collections
import json
import logging
import threading
import time
import traceback
from typing import Any, Callable, Generator

from jaxfeed.ops import op_stats
from jaxfeed.service.protocol import spec as spec_lib
from jaxfeed.service.protocol import wire
from jaxfeed.service.worker import round_assembly
from jaxfeed.service.worker import task_pipeline

_POLL_S = 0.1


class TaskFailed(RuntimeError):
  """The task's pipeline raised; `status` is the gRPC status name to report."""

  def __init__(self, message: str, status: str = "INTERNAL"):
    super().__init__(message)
    self.status = status


def end_stats(counters: dict, rows: list[dict]) -> dict:
  """What a task's consumer gets at the task's end: its counters and, under
  "ops", the final per-op rows of its pipeline (made JSON-safe), so that a
  client sees the whole task's breakdown however late it asks."""
  if not rows:
    return counters
  return {**counters, "ops": json.loads(json.dumps(rows, default=str))}


class Ended:
  """What `take` returns once a task ended: its round statistics."""

  __slots__ = ("stats",)

  def __init__(self, stats: dict | None):
    self.stats = stats


class TaskRunner:
  """Runs one task's pipeline on a thread into a bounded buffer of frames.

  Plain jobs keep one FIFO that every consumer of the task pulls from (a
  frame goes to exactly one of them). Exactly-once jobs keep that FIFO in
  whole splits: a split's frames are queued once the split ended, and one
  consumer sends all of them, then the split's end. Round-robin jobs
  (num_consumers K > 0) assemble rounds of K batches of one bucket key and
  close them when every consumer took its batch or when the round timed out;
  see `jaxfeed.service.worker.round_assembly` for the rules.

  Args:
    task_id: The dispatcher's task id.
    make_iterator: Builds the task's pipeline (called on the task's thread).
    buffer_size: Ready batches (plain jobs) or rounds (round-robin jobs) held.
    num_consumers: K; 0 for a plain job.
    on_finished: Called with the task id once the pipeline ended cleanly,
      before `take` reports the end.
    round_timeout_s: Round-robin: how long a round waits for late consumers
      once its first consumer took its batch.
    max_window_batches: Round-robin: most batches waiting in partial bucket
      windows.
    exactly_once: The iterator yields `task_pipeline.SplitEnd` after each
      split (and `WAITING` while it has none); buffer_size then counts frames
      of whole splits, and one split in progress is held beyond it.
  """

  def __init__(
    self,
    task_id: int,
    make_iterator: Callable[[], Any],
    buffer_size: int,
    num_consumers: int = 0,
    on_finished: Callable[[int], None] | None = None,
    round_timeout_s: float = round_assembly.DEFAULT_ROUND_TIMEOUT_S,
    max_window_batches: int = round_assembly.DEFAULT_MAX_WINDOW_BATCHES,
    exactly_once: bool = False,
  ):
    self.task_id = task_id
    self.exactly_once = exactly_once
    self._split_frames: list[wire.Frame] = []  # exactly-once: the split in progress
    self._made: list[int] = []  # exactly-once: splits made, not yet reported
    # Elements made plus items consumers took: clients tell a pipeline stuck
    # on a record (a UDF that never returns) from a slow one by it.
    self.progress = 0
    self._fifo_frames = 0
    self._last_taken = time.monotonic()  # when a consumer last took a frame
    self.num_consumers = num_consumers
    self._buffer_size = buffer_size
    self._cond = threading.Condition()
    self._fifo: collections.deque = collections.deque()
    self._assembler: round_assembly.RoundAssembler | None = None
    self._rounds: round_assembly.RoundBuffer | None = None
    self._setup_error: Exception | None = None
    if num_consumers:
      self._rounds = round_assembly.RoundBuffer(num_consumers, buffer_size, round_timeout_s)
      try:
        self._assembler = round_assembly.RoundAssembler(num_consumers, max_window_batches)
      except ValueError as e:  # the worker's limit, reported to every consumer
        e.grpc_status = "FAILED_PRECONDITION"
        self._setup_error = e
    self._done = False
    self._error: TaskFailed | None = None
    self._pipeline: Any = None  # the task's iterator, for its op statistics
    self._stop = threading.Event()
    self._on_finished = on_finished
    self._thread = threading.Thread(
      target=self._produce, args=(make_iterator,), name=f"jaxfeed-task-{task_id}", daemon=True
    )
    self._thread.start()

  # -- producer ---------------------------------------------------------------
  def _full(self) -> bool:
    if self._rounds is not None:  # closing timed-out rounds may make room
      if self._rounds.close_expired():
        self._cond.notify_all()
      return self._rounds.full
    if self.exactly_once:  # whole splits: one always fits
      return bool(self._fifo) and self._fifo_frames >= self._buffer_size
    return len(self._fifo) >= self._buffer_size

  def _wait_for_room_locked(self) -> bool:
    """Waits (lock held) until the buffer has room; False once stopped."""
    while self._full() and not self._stop.is_set():
      self._cond.wait(_POLL_S)
    return not self._stop.is_set()

  def _produce(self, make_iterator: Callable[[], Any]) -> None:
    iterator = None
    try:
      if self._setup_error is not None:
        raise self._setup_error
      iterator = self._pipeline = make_iterator()
      for element in iterator:
        self.progress += element is not task_pipeline.WAITING
        if self.exactly_once:
          if not self._take_split_element(element):
            return
          continue
        key = rows = None
        if self._assembler is not None:
          key = round_assembly.bucket_key(element)
          rows = round_assembly.batch_rows(element)
        frame = wire.encode_frame(element)
        with self._cond:
          if not self._wait_for_room_locked():
            return
          self._add(frame, key, rows)
          self._cond.notify_all()
    except Exception as e:  # pylint: disable=broad-except
      status = getattr(e, "grpc_status", None) or status_of(e)
      message = f"Task {self.task_id} failed: {type(e).__name__}: {e}"
      logging.warning("%s\n%s", message, traceback.format_exc())
      with self._cond:
        self._error = TaskFailed(message, status)
    finally:
      task_pipeline.close_quietly(iterator, f"task {self.task_id}'s pipeline")
      if self._error is None and not self._stop.is_set() and self._on_finished:
        # Before the end reaches a consumer: a client that saw every stream
        # of its read end finds the job finished when it asks right after.
        self._on_finished(self.task_id)
      with self._cond:
        if self._assembler is not None and self._error is None and not self._stop.is_set():
          self._assembler.finish()
        self._done = True
        self._cond.notify_all()

  def _take_split_element(self, element: Any) -> bool:
    """Exactly-once: collects a split's frames and queues the whole split at
    its end. Returns False once the runner was stopped."""
    if element is task_pipeline.WAITING:
      return not self._stop.is_set()
    if not isinstance(element, task_pipeline.SplitEnd):
      self._split_frames.append(wire.encode_frame(element))
      return not self._stop.is_set()
    frames, self._split_frames = self._split_frames, []
    with self._cond:
      self._made.append(element.start)  # made: a loss from now on is not its fault
      if not self._wait_for_room_locked():
        return False
      self._fifo.append(((element.start, element.stop), frames))
      self._fifo_frames += len(frames)
      self._cond.notify_all()
    return True

  def _add(self, frame: wire.Frame, key: Any, rows: Any) -> None:
    if self._assembler is None:
      self._fifo.append(frame)
      return
    completed = self._assembler.add(frame, key, rows)
    if completed is not None:
      self._rounds.put(completed)

  # -- consumers ----------------------------------------------------------------
  def take(self, consumer_index: int, local_round: int, wait_s: float) -> Any:
    """The consumer's next item, waiting up to wait_s for it.

    Returns (frame, local round); exactly-once tasks: ((split start, stop),
    frames) of a whole split; `Ended` at the task's end; None if nothing came in
    time. Raises TaskFailed.
    """
    if self.num_consumers and not 0 <= consumer_index < self.num_consumers:
      raise TaskFailed(
        f"consumer_index {consumer_index} is outside "
        f"[0, {self.num_consumers}) of task {self.task_id}.",
        "INVALID_ARGUMENT",
      )
    deadline = time.monotonic() + wait_s
    with self._cond:
      while True:
        if self._stop.is_set():
          raise TaskFailed(f"Task {self.task_id} was stopped on this worker.", "UNAVAILABLE")
        if self._rounds is not None:
          if self._rounds.close_expired():
            self._cond.notify_all()
          got = self._rounds.take(consumer_index, local_round)
          if got is not None:
            self.progress += 1
            self._last_taken = time.monotonic()
            self._cond.notify_all()
            return got
          ended = self._done and self._rounds.exhausted(local_round)
        elif self._fifo:
          item = self._fifo.popleft()
          self.progress += 1
          self._last_taken = time.monotonic()
          if self.exactly_once:
            self._fifo_frames -= len(item[1])
          self._cond.notify_all()
          return item if self.exactly_once else (item, local_round)
        else:
          ended = self._done
        if self._error is not None:
          raise self._error
        if ended:
          return Ended(end_stats(self._stats_locked(), self.op_rows()))
        left = deadline - time.monotonic()
        if left <= 0:
          return None
        self._cond.wait(min(left, _POLL_S))

  def frames(
    self, is_active: Callable[[], bool], consumer_index: int = 0, local_round: int = 0
  ) -> Generator[tuple[wire.Frame | None, int], None, dict | None]:
    """Yields (frame, local round) until the task ends; raises TaskFailed.

    Exactly-once tasks yield (frame, split start) for each frame of a split,
    then (None, split start).

    Returns the task's round statistics (see `stats`) when the task ended,
    None when `is_active()` turned false first.
    """
    while is_active():
      item = self.take(consumer_index, local_round, _POLL_S)
      if item is None:
        continue
      if isinstance(item, Ended):
        return item.stats
      if self.exactly_once:
        (start, _), frames = item
        for frame in frames:
          yield frame, start
        yield None, start
        continue
      frame, local_round = item
      yield frame, local_round
      local_round += 1
    return None

  def take_made(self) -> list[int]:
    """Exactly-once: the starts of the splits made since the last call."""
    with self._cond:
      made, self._made = self._made, []
    return made

  def stats(self) -> dict:
    """Round-robin counters (rounds made, windows and batches dropped, see
    `jaxfeed.service.worker.round_assembly`); empty for plain jobs."""
    with self._cond:
      return self._stats_locked()

  def op_rows(self) -> list[dict]:
    """The per-op `stats()` rows of the task's pipeline (none before it is
    built)."""
    return op_stats.rows_of(self._pipeline)

  def _stats_locked(self) -> dict:
    if self._rounds is None:
      return {}
    assembler = self._assembler.stats if self._assembler is not None else {}
    return {**self._rounds.stats, **assembler}

  def buffer_fill(self) -> float:
    """How full (0..1) the buffer of produced batches (rounds, for
    round-robin jobs) is."""
    with self._cond:
      if self._rounds is not None:
        held = self._rounds.open_rounds
      else:
        held = self._fifo_frames if self.exactly_once else len(self._fifo)
      return min(1.0, held / self._buffer_size)

  # -- lifetime ---------------------------------------------------------------
  @property
  def finished(self) -> bool:
    return self._done and self._error is None

  @property
  def idle_s(self) -> float:
    """Seconds since a consumer last took a frame (or the task started)."""
    with self._cond:
      return time.monotonic() - self._last_taken

  @property
  def drained(self) -> bool:
    """The pipeline ended and consumers took everything it made."""
    with self._cond:
      if not self._done:
        return False
      if self._error is not None:
        return True
      if self._rounds is not None:
        return self._rounds.open_rounds() == 0
      return not self._fifo

  def stop(self) -> None:
    self._stop.set()
    with self._cond:
      self._cond.notify_all()
    if self._thread is not threading.current_thread():
      self._thread.join(timeout=10)


def status_of(error: Exception) -> str:
  if isinstance(error, spec_lib.UDFImportError):
    return "FAILED_PRECONDITION"
  if isinstance(error, spec_lib.SpecError):
    return "INVALID_ARGUMENT"
  return "INTERNAL"
