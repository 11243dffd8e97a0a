"""`prefetch`: produces elements ahead on a background thread."""

from __future__ import annotations

import collections
import threading
import time
import weakref
from typing import Any

from jaxfeed.ops import autotune, parallel, tree
from jaxfeed.ops.base import AUTOTUNE, Node, OpIterator, check_positive_int, check_state, state_int

__all__ = ["PrefetchNode", "PrefetchIterator", "DEFAULT_AUTOTUNE_BUFFER_SIZE"]

DEFAULT_AUTOTUNE_BUFFER_SIZE = 4
"""The buffer size AUTOTUNE starts from until the autotuner adjusts it."""

_MAX_AUTOTUNE_BUFFER_SIZE = 1024

# Kinds of buffered entries, in the order the producer met them.
_ELEMENT, _END, _ERROR = 0, 1, 2


class PrefetchNode(Node):
  """Elements of its input, produced up to `buffer_size` ahead on a thread.

  Args:
    parent: the input node.
    buffer_size: the most elements buffered ahead; `jaxfeed.AUTOTUNE` starts
      at `DEFAULT_AUTOTUNE_BUFFER_SIZE` and lets the autotuner resize it; 0
      passes elements through with no thread.
  """

  op_name = "prefetch"

  def __init__(self, parent: Node, buffer_size: int):
    super().__init__([parent])
    if buffer_size != AUTOTUNE or isinstance(buffer_size, bool):
      try:
        buffer_size = check_positive_int(buffer_size, self.op_name, "buffer_size", allow_zero=True)
      except ValueError:
        raise ValueError(
          f"prefetch: buffer_size must be an integer >= 0 or "
          f"jaxfeed.AUTOTUNE (-1), got {buffer_size!r}."
        ) from None
    self.buffer_size = int(buffer_size)

  def make_iterator(self) -> "PrefetchIterator":
    size = DEFAULT_AUTOTUNE_BUFFER_SIZE if self.buffer_size == AUTOTUNE else self.buffer_size
    return PrefetchIterator(
      self.parents[0].make_iterator(), size, autotuned=self.buffer_size == AUTOTUNE
    )

  def spec_params(self) -> dict:
    return {"buffer_size": self.buffer_size}

  def cardinality(self) -> int | None:
    return self.parents[0].cardinality()


def _nbytes(element: Any) -> int:
  return sum(getattr(leaf, "nbytes", 8) for leaf in tree.flatten(element))


class _Buffer:
  """The bounded buffer between the producer thread and the consumer.

  Shared by both sides; holds no reference to the iterator. The fast path
  takes no lock: the producer appends to `entries` and counts `produced`,
  the consumer pops and counts `consumed` (each counter has one writer).
  A side that must wait sets its `*_waiting` flag and re-checks under the
  lock before sleeping; the other side, after its change, notifies under
  the lock only when it sees that flag, so no wake-up is lost.
  """

  def __init__(self, capacity: int):
    self.capacity = capacity
    self.entries: collections.deque = collections.deque()
    self.cond = threading.Condition(threading.Lock())
    self.stop = False
    self.produced = 0
    self.consumed = 0
    self.producer_waiting = False
    self.consumer_waiting = False
    self.full_s = 0.0  # Seconds the producer waited for room (autotuner).

  def wake(self) -> None:
    with self.cond:
      self.cond.notify_all()


def _produce(parent: OpIterator, buffer: _Buffer, interval: int) -> None:
  """The producer thread: pulls from parent until the end or a stop.

  Every `interval`-th entry carries the parent's state right after it (an
  anchor), from which the consumer's state is expressed.
  """
  entries = buffer.entries
  cond = buffer.cond
  while True:
    # Wait for room before pulling, so the parent is never more than
    # `capacity` elements ahead of the consumer.
    if buffer.produced - buffer.consumed >= buffer.capacity:
      start = time.perf_counter()
      with cond:
        buffer.producer_waiting = True
        while buffer.produced - buffer.consumed >= buffer.capacity and not buffer.stop:
          cond.wait()
        buffer.producer_waiting = False
      buffer.full_s += time.perf_counter() - start
    if buffer.stop:
      return
    kind, seed, anchor = _ELEMENT, 0, None
    try:
      element = next(parent)
      seed = parent.last_seed
    except StopIteration:
      kind, element = _END, None
    except BaseException as exc:  # noqa: BLE001 -- re-raised in the consumer
      kind, element = _ERROR, exc
    if kind != _END:
      if (buffer.produced + 1) % interval == 0:
        try:
          anchor = parent.get_state()
        except BaseException as exc:  # noqa: BLE001 -- surfaced in order
          kind, element = _ERROR, exc
    if buffer.stop:
      return
    buffer.produced += 1
    entries.append((kind, element, seed, anchor))
    if buffer.consumer_waiting:
      buffer.wake()
    del element
    if kind == _END:
      return


def _stop_producer(buffer: _Buffer, threads: list) -> None:
  """Stops and joins the producer (close(), set_state() and GC)."""
  with buffer.cond:
    buffer.stop = True
    buffer.entries.clear()
    buffer.cond.notify_all()
  current = threading.current_thread()
  for thread in threads:
    if thread is not current:
      # Waits at most for the parent's element being produced right now.
      thread.join()
  threads.clear()


class PrefetchIterator(OpIterator):
  """Iterator of `PrefetchNode`.

  The state is a parent state saved by the producer at or before the last
  element returned, plus `skip`, the number of elements returned after it
  (parent states are saved every `parallel.ANCHOR_INTERVAL` elements, or
  after every element when the parent does not replay identically).
  Restoring discards the buffer, restores the parent and drops `skip` of its
  elements, so resume is exact.
  """

  op_name = "prefetch"
  stats_one_to_one = True

  def __init__(self, parent: OpIterator, buffer_size: int, autotuned: bool = False):
    super().__init__([parent])
    self._parent = parent
    self._buffer_size = buffer_size
    self._autotuned = autotuned and buffer_size > 0
    self.wait_s = 0.0  # Seconds the consumer waited on an empty buffer.
    self._element_bytes = 0  # Size of a recent element (autotuner's RAM use).
    self._num_returned = 0
    self._last_seed = 0
    self._finished = False  # the end was returned; the producer has exited
    self._interval = 1
    # Elements returned since the producer started, and the newest parent
    # state (anchor) among them: (elements returned before it, state).
    self._position = 0
    self._anchor: tuple[int, Any] = (0, None)
    self._buffer: _Buffer | None = None
    self._threads: list[threading.Thread] = []
    self._finalizer: weakref.finalize | None = None

  # -- tuning hook ---------------------------------------------------------
  @property
  def buffer_size(self) -> int:
    """The most elements buffered ahead (the autotuner may assign it)."""
    return self._buffer_size

  @buffer_size.setter
  def buffer_size(self, value: int) -> None:
    value = int(value)
    if self._buffer_size == 0 or value < 1:
      raise ValueError(
        f"prefetch: buffer_size can be changed to an integer >= 1 on a "
        f"prefetch built with buffer_size >= 1 or AUTOTUNE, got {value!r} "
        f"(built with {self._buffer_size})."
      )
    self._buffer_size = value
    buffer = self._buffer
    if buffer is not None:
      with buffer.cond:
        buffer.capacity = value
        buffer.cond.notify_all()

  def tunables(self) -> list:
    """The buffer-size knob, for prefetches built with AUTOTUNE."""
    if not self._autotuned:
      return []
    return [
      autotune.Knob(
        name="prefetch/buffer_size",
        kind="buffer",
        get=lambda: self._buffer_size,
        set=lambda value: setattr(self, "buffer_size", value),
        minimum=1,
        maximum=_MAX_AUTOTUNE_BUFFER_SIZE,
        wait_s=lambda: self.wait_s,
        producer_blocked_s=lambda: 0.0 if self._buffer is None else self._buffer.full_s,
        unit_bytes=lambda: self._element_bytes,
      )
    ]

  @property
  def num_buffered(self) -> int:
    """Elements produced and not yet returned."""
    buffer = self._buffer
    return 0 if buffer is None else len(buffer.entries)

  def _stats_fields(self) -> dict:
    if self._buffer_size == 0:
      return {}
    return {"elements": self._num_returned}

  def _stats_buffer_fill(self) -> float | None:
    capacity = self._buffer_size
    return min(1.0, self.num_buffered / capacity) if capacity else None

  # -- iteration -----------------------------------------------------------
  def _start(self) -> None:
    self._interval = parallel.anchor_interval(self._parent)
    self._position = 0
    self._anchor = (0, self._parent.get_state())
    buffer = _Buffer(self._buffer_size)
    thread = threading.Thread(
      target=_produce,
      args=(self._parent, buffer, self._interval),
      name="jaxfeed-prefetch",
      daemon=True,
    )
    self._buffer = buffer
    self._threads = [thread]
    self._finalizer = weakref.finalize(self, _stop_producer, buffer, self._threads)
    self._finalizer.atexit = False  # A daemon thread; never block exit.
    thread.start()

  def __next__(self) -> Any:
    if self._buffer_size == 0:
      return next(self._parent)
    if self._closed:
      raise RuntimeError("prefetch: the iterator is closed.")
    if self._finished:
      raise StopIteration
    buffer = self._buffer
    if buffer is None:
      self._start()
      buffer = self._buffer
    entries = buffer.entries
    if not entries:
      start = time.perf_counter()
      with buffer.cond:
        buffer.consumer_waiting = True
        while not entries:
          buffer.cond.wait()
        buffer.consumer_waiting = False
      self.wait_s += time.perf_counter() - start
    kind, element, seed, anchor = entries.popleft()
    buffer.consumed += 1
    if buffer.producer_waiting:
      buffer.wake()
    if kind != _END:
      self._position += 1
      if anchor is not None:
        self._anchor = (self._position, anchor)
    if kind == _ELEMENT:
      self._last_seed = seed
      if self._autotuned and self._num_returned % 64 == 0:
        self._element_bytes = _nbytes(element)
      self._num_returned += 1
      return element
    if kind == _END:
      self._finished = True
      raise StopIteration
    try:
      raise element
    finally:
      del element

  @property
  def last_seed(self) -> int:
    if self._buffer_size == 0:
      return self._parent.last_seed
    return self._last_seed

  # -- state ---------------------------------------------------------------
  def get_state(self) -> dict:
    if self._buffer is None:
      # No producer touches the parent: its own state is exact.
      return {"op": self.op_name, "own": {"skip": 0}, "parents": [self._parent.get_state()]}
    anchor_position, anchor = self._anchor
    return {
      "op": self.op_name,
      "own": {"skip": self._position - anchor_position},
      "parents": [anchor],
    }

  def set_state(self, state: dict) -> None:
    check_state(state, self.op_name, 1)
    skip = state_int(state.get("own"), "skip", self.op_name)
    self._stop()
    self._parent.set_state(state["parents"][0])
    parallel.drop_replayed(self._parent, skip, self.op_name)
    self._finished = False

  def _stop(self) -> None:
    if self._finalizer is not None:
      self._finalizer()
    self._finalizer = None
    self._buffer = None

  def _close_own(self) -> None:
    # The producer must be joined before the parents are closed.
    self._stop()
