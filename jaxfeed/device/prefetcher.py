"""`DevicePrefetcher`: host batches -> global jax.Arrays, read ahead on a thread."""

from __future__ import annotations

import copy
import queue
import threading
from typing import Any, Callable
import warnings
import weakref

import jax

from jaxfeed.device.placement import BatchPlacer, ShardingLike

_END = "end"
_BATCH = "batch"
_ERROR = "error"

_JOIN_TIMEOUT_S = 60.0


def _produce(iterator: Any, place: Callable[[Any], Any], has_state: bool,
             out: queue.SimpleQueue, slots: threading.Semaphore,
             stop: threading.Event) -> None:
  """Thread body. It references no DevicePrefetcher, so GC can close it."""
  try:
    while True:
      slots.acquire()  # One slot per batch not yet taken by the consumer.
      if stop.is_set():
        return
      try:
        batch = next(iterator)
      except StopIteration:
        out.put((_END, iterator.get_state() if has_state else None))
        return
      # The state right after this batch: resuming from it yields the next.
      state = iterator.get_state() if has_state else None
      arrays = place(batch)
      del batch
      jax.block_until_ready(arrays)
      out.put((_BATCH, arrays, state))
  except BaseException as e:  # pylint: disable=broad-except
    # Surfaces on the consumer's next(); the exception keeps its traceback.
    out.put((_ERROR, e))


class _Resources:
  """The iterator and the producer thread; closed by close() or on GC."""

  def __init__(self, iterator: Any):
    self.iterator = iterator
    self.thread: threading.Thread | None = None
    self.queue: queue.SimpleQueue | None = None
    self.slots: threading.Semaphore | None = None
    self.stop: threading.Event | None = None

  def start(self, place: Callable[[Any], Any], has_state: bool,
            prefetch: int) -> None:
    self.queue = queue.SimpleQueue()
    self.slots = threading.Semaphore(prefetch)
    self.stop = threading.Event()
    self.thread = threading.Thread(
        target=_produce, name="jaxfeed-device-prefetch", daemon=True,
        args=(self.iterator, place, has_state, self.queue, self.slots,
              self.stop))
    self.thread.start()

  def stop_thread(self) -> None:
    thread = self.thread
    if thread is None:
      return
    self.stop.set()
    self.slots.release()  # Wakes a producer waiting for a free slot.
    thread.join(_JOIN_TIMEOUT_S)
    if thread.is_alive():
      warnings.warn(
          f"DevicePrefetcher: the input iterator did not return within "
          f"{_JOIN_TIMEOUT_S:.0f} s of close(); its thread is left running.",
          RuntimeWarning, stacklevel=3)
    self.thread = self.queue = self.slots = self.stop = None

  def close(self) -> None:
    self.stop_thread()
    close = getattr(self.iterator, "close", None)
    if callable(close):
      close()


class DevicePrefetcher:
  """Iterates global `jax.Array` batches built from a host batch iterator.

  `host_iterator` yields pytrees of numpy arrays whose leading dimension is this
  process's share of the global batch; it needs `__next__` and, for
  checkpointing, `get_state()` / `set_state()`; `close()` is called if present.
  The prefetcher owns it: `close()` closes it. Batches must not be modified by
  the host iterator after they are yielded (on one device the array may alias
  the host buffer).

  Each batch becomes global arrays (`jax.make_array_from_process_local_data`):
  along the batch axis the global size is the local size times the number of
  processes. With `prefetch > 0`, a background thread keeps up to `prefetch`
  batches ready on device; `prefetch=0` places each batch in `next()`.

  `get_state()` is the host iterator's state as of the last batch returned by
  `next()`, not the read-ahead position, so restoring it with `set_state()`
  (here or into a fresh iterator of the same pipeline) resumes exactly.

  Args:
    host_iterator: the iterator of host-local numpy batch pytrees.
    sharding: a `jax.sharding.Sharding` for every leaf, a pytree of them with
      the batch's structure (or a prefix of it), a callable leaf -> Sharding,
      or None for `batch_sharding()` (batch split over all devices). 0-d
      leaves are replicated.
    prefetch: batches kept ready ahead of the consumer (>= 0).
  """

  def __init__(self, host_iterator: Any, sharding: ShardingLike = None, *,
               prefetch: int = 2):
    if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
      raise ValueError(
          f"DevicePrefetcher: prefetch must be an integer >= 0, got {prefetch!r}.")
    if not callable(getattr(host_iterator, "__next__", None)):
      raise TypeError(
          "DevicePrefetcher: host_iterator must be an iterator (with "
          f"__next__), got {type(host_iterator).__name__}.")
    self._place = BatchPlacer(sharding)
    self._prefetch = prefetch
    self._has_state = callable(getattr(host_iterator, "get_state", None))
    self._state = host_iterator.get_state() if self._has_state else None
    self._resources = _Resources(host_iterator)
    self._finalizer = weakref.finalize(self, self._resources.close)
    self._outcome: Any = None  # _END or the producer's exception, once seen.
    self._closed = False
    self._start()

  def _start(self) -> None:
    self._outcome = None
    if self._prefetch:
      self._resources.start(self._place, self._has_state, self._prefetch)

  # -- iteration ----------------------------------------------------------
  def __iter__(self) -> "DevicePrefetcher":
    return self

  def __next__(self) -> Any:
    if self._closed:
      raise RuntimeError("DevicePrefetcher: next() after close().")
    if self._outcome is not None:
      if self._outcome is _END:
        raise StopIteration
      raise self._outcome
    if not self._prefetch:
      return self._next_sync()
    item = self._resources.queue.get()
    self._resources.slots.release()
    if item[0] is _BATCH:
      self._state = item[2]
      return item[1]
    if item[0] is _END:
      self._state = item[1]
      self._outcome = _END
      raise StopIteration
    self._outcome = item[1]
    raise self._outcome

  def _next_sync(self) -> Any:
    iterator = self._resources.iterator
    try:
      batch = next(iterator)
      state = iterator.get_state() if self._has_state else None
      arrays = self._place(batch)
    except StopIteration:
      self._state = iterator.get_state() if self._has_state else None
      self._outcome = _END
      raise
    except Exception as e:
      self._outcome = e  # Like the threaded mode: later calls fail the same.
      raise
    self._state = state
    return arrays

  # -- state ----------------------------------------------------------------
  def get_state(self) -> dict:
    """The host iterator's state as of the last batch `next()` returned."""
    if not self._has_state:
      raise TypeError(
          f"DevicePrefetcher: the host iterator "
          f"{type(self._resources.iterator).__name__} has no get_state(); "
          "checkpointing needs a jaxfeed pipeline iterator.")
    return copy.deepcopy(self._state)

  def set_state(self, state: dict) -> None:
    """Restores the host iterator and restarts read-ahead from there."""
    if self._closed:
      raise RuntimeError("DevicePrefetcher: set_state() after close().")
    iterator = self._resources.iterator
    if not callable(getattr(iterator, "set_state", None)):
      raise TypeError(
          f"DevicePrefetcher: the host iterator {type(iterator).__name__} has "
          "no set_state(); restoring needs a jaxfeed pipeline iterator.")
    self._resources.stop_thread()
    iterator.set_state(state)
    self._state = iterator.get_state() if self._has_state else copy.deepcopy(state)
    self._start()

  # -- lifetime -------------------------------------------------------------
  def close(self) -> None:
    """Stops the read-ahead thread and closes the host iterator. Idempotent."""
    self._closed = True
    self._finalizer()

  def __enter__(self) -> "DevicePrefetcher":
    return self

  def __exit__(self, *exc: Any) -> None:
    self.close()
