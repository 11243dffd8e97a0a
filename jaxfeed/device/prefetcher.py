"""`DevicePrefetcher`: host batches -> global jax.Arrays, read ahead on a thread."""

from __future__ import annotations

import copy
import itertools
import queue
import threading
from typing import Any, Callable, Mapping
import warnings
import weakref

import jax
from jax.sharding import Sharding

from jaxfeed.device import agreement
from jaxfeed.device import step_verdict
from jaxfeed.device.placement import BatchPlacer, ShardingLike

_END = "end"
_BATCH = "batch"
_ERROR = "error"

_JOIN_TIMEOUT_S = 60.0
# How long close() lets the producer finish its step before it closes the
# input under it (see `_Resources.close`).
_INTERRUPT_AFTER_S = 5.0

# Numbers the multi-process prefetchers of this process; every process creates
# them in the same order, so equal numbers name the same agreement.
_agreement_serials = itertools.count()


def _is_sharding(value: Any) -> bool:
  return isinstance(value, Sharding)


class _End(Exception):
  """The input ended for this step; carries the iterator state to keep."""

  def __init__(self, state: Any):
    super().__init__()
    self.state = state


class _HostSteps:
  """This process's batches, each agreed with the other processes when there
  are several (else checked alone), and the iterator state right after each
  step taken."""

  def __init__(
    self,
    iterator: Any,
    has_state: bool,
    state: Any,
    steps: agreement.StepAgreement | step_verdict.LocalSteps,
  ):
    self.iterator = iterator
    self._has_state = has_state
    self._state = state
    self._steps = steps
    self._exhausted = False

  def next(self, stop: threading.Event | None = None) -> tuple[Any, Any]:
    """(batch, state after it); raises `_End` when the input ended."""
    while True:
      batch = None
      if not self._exhausted:
        try:
          batch = next(self.iterator)
        except StopIteration:
          self._exhausted = True
          self._state = self.iterator.get_state() if self._has_state else None
      if isinstance(self._steps, agreement.StepAgreement):
        agreed = self._steps.step(batch, stop)
      else:
        agreed = self._steps.step(batch)
      if agreed is None:
        # If the processes agreed to end while this one still had a batch,
        # that batch is dropped: the state stays that of the last step taken.
        raise _End(self._state)
      if batch is not None and self._has_state:
        self._state = self.iterator.get_state()
      if agreed is not step_verdict.SKIP:
        return agreed, self._state
      # A dropped step: its batches are read (the state is past them), the
      # next step follows.


def _produce(
  steps: _HostSteps,
  place: Callable[[Any], Any],
  out: queue.SimpleQueue,
  slots: threading.Semaphore,
  stop: threading.Event,
) -> None:
  """Thread body. It references no DevicePrefetcher, so GC can close it."""
  try:
    while True:
      slots.acquire()  # One slot per batch not yet taken by the consumer.
      if stop.is_set():
        return
      try:
        batch, state = steps.next(stop)
      except _End as end:
        out.put((_END, end.state))
        return
      arrays = place(batch)
      del batch
      jax.block_until_ready(arrays)
      out.put((_BATCH, arrays, state))
  except agreement.Interrupted:
    return  # close() or set_state() stopped a wait for other processes.
  except BaseException as e:  # pylint: disable=broad-except
    # Surfaces on the consumer's next(); the exception keeps its traceback.
    out.put((_ERROR, e))


class _Resources:
  """The iterator and the producer thread; closed by close() or on GC."""

  def __init__(self, iterator: Any):
    self.iterator = iterator
    self.iterator_closed = False
    self.thread: threading.Thread | None = None
    self.queue: queue.SimpleQueue | None = None
    self.slots: threading.Semaphore | None = None
    self.stop: threading.Event | None = None

  def start(self, steps: _HostSteps, place: Callable[[Any], Any], prefetch: int) -> None:
    self.queue = queue.SimpleQueue()
    self.slots = threading.Semaphore(prefetch)
    self.stop = threading.Event()
    self.thread = threading.Thread(
      target=_produce,
      name="jaxfeed-device-prefetch",
      daemon=True,
      args=(steps, place, self.queue, self.slots, self.stop),
    )
    self.thread.start()

  def stop_thread(self, interrupt: Callable[[], None] | None = None) -> None:
    """Stops the producer; `interrupt()` is called if it is still busy
    `_INTERRUPT_AFTER_S` later (it is blocked in the input's next())."""
    thread = self.thread
    if thread is None:
      return
    self.stop.set()
    self.slots.release()  # Wakes a producer waiting for a free slot.
    if interrupt is not None:
      thread.join(_INTERRUPT_AFTER_S)
      if thread.is_alive():
        interrupt()
    thread.join(_JOIN_TIMEOUT_S)
    if thread.is_alive():
      warnings.warn(
        f"DevicePrefetcher: the input iterator did not return within "
        f"{_JOIN_TIMEOUT_S:.0f} s of close(); its thread is left running.",
        RuntimeWarning,
        stacklevel=3,
      )
    self.thread = self.queue = self.slots = self.stop = None

  def close(self) -> None:
    # A producer blocked in the input's next() returns only once the input
    # is closed: say, a read of a shared service job whose next batch waits
    # for a split that another process's loop, stopped at the same step,
    # still holds until its own loader closes. So the input is closed under
    # a producer that does not stop within `_INTERRUPT_AFTER_S`.
    self.stop_thread(interrupt=self._close_iterator)
    self._close_iterator()

  def _close_iterator(self) -> None:
    if self.iterator_closed:
      return
    self.iterator_closed = True
    close = getattr(self.iterator, "close", None)
    if callable(close):
      close()


class DevicePrefetcher:
  """Iterates global `jax.Array` batches built from a host batch iterator.

  `host_iterator` yields pytrees of numpy arrays whose leading dimension is this
  process's share of the global batch; it needs `__next__` and, for
  checkpointing, `get_state()` / `set_state()`; `close()` is called if present.
  The prefetcher owns it: `close()` closes it. Batches must not be modified by
  the host iterator after they are yielded (on CPU devices the arrays may
  alias the host buffers).

  Each batch becomes global arrays (`jax.make_array_from_process_local_data`):
  along the batch axis the global size is the local size times the number of
  processes. With `prefetch > 0`, a background thread keeps up to `prefetch`
  batches ready on device; `prefetch=0` places each batch in `next()`.

  When `host_reads_ahead` says the host iterator already produces batches
  ahead on its own thread (a pipeline ending in `prefetch`), batches go to
  CPU devices only and no other process takes part, `next()` places each
  batch itself and no thread is started (`places_inline`): placing on CPU
  devices is host work (a copy, or none when the batch's memory is 64-byte
  aligned and the devices alias it), which a thread could only run on the
  cores the pipeline already uses, after two more hand-offs of each batch.

  `get_state()` is the host iterator's state as of the last batch returned by
  `next()`, not the read-ahead position, so restoring it with `set_state()`
  (here or into a fresh iterator of the same pipeline) resumes exactly.

  A partial batch (fewer rows than a complete one, e.g. the last of an
  epoch without `drop_remainder`) is dropped, padded and masked, or an
  error, by `partial_batch` (see `jaxfeed.device.step_verdict`). In a
  multi-process job (`jax.process_count() > 1`) whose shardings span
  several processes' devices, the processes agree before each step whether it
  happens, how it is padded and that their local shapes can form one global
  array, so every process stops at the same step; see
  `jaxfeed.device.agreement`. Every process
  must create such prefetchers in the same order and call `set_state` the same
  number of times.

  Args:
    host_iterator: the iterator of host-local numpy batch pytrees.
    sharding: a `jax.sharding.Sharding` for every leaf, a pytree of them with
      the batch's structure (or a prefix of it), a callable leaf -> Sharding,
      or None for `batch_sharding()` (batch split over all devices). 0-d
      leaves are replicated.
    prefetch: batches kept ready ahead of the consumer (>= 0).
    partial_batch: what a batch with fewer rows than a complete one becomes:
      `"drop"` (its step is dropped), `"pad"` (zero rows up to the complete
      size and a bool leaf `"mask"` on every batch) or `"error"`; None for
      the default, "drop" (see `jaxfeed.device.step_verdict`).
    end_of_input: in multi-process jobs, `"stop_at_shortest"` (every process
      stops at the first step some process has no batch for) or `"pad"`
      (steps go on while any process has a batch; the others' rows are zeros
      and masked); None: "pad" under `partial_batch="pad"`, else
      "stop_at_shortest". `end_of_input="pad"` without `partial_batch` names
      its mask leaf `"valid"`. Ignored in one process.
    pad_to_common_shape: in multi-process jobs, zero-pad each leaf's
      dimensions after the first to the largest size any process has at that
      step (instead of failing when they differ). Ignored in one process.
    full_batch_rows: the rows of a complete batch of this process, when
      known (the Loader reads it from the pipeline); otherwise a batch is
      partial only when another process has more rows at that step.
    host_reads_ahead: whether `host_iterator` produces batches ahead on its
      own thread; lets placement on CPU devices run in `next()` (see above).
  """

  def __init__(
    self,
    host_iterator: Any,
    sharding: ShardingLike = None,
    *,
    prefetch: int = 2,
    end_of_input: str | None = None,
    pad_to_common_shape: bool = False,
    partial_batch: str | None = None,
    full_batch_rows: int | None = None,
    host_reads_ahead: bool = False,
  ):
    policy = step_verdict.resolve_policy(
      partial_batch, end_of_input, "DevicePrefetcher", pad_to_common_shape=bool(pad_to_common_shape)
    )
    self._policy = policy.with_full_rows(full_batch_rows)
    if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
      raise ValueError(f"DevicePrefetcher: prefetch must be an integer >= 0, got {prefetch!r}.")
    if not callable(getattr(host_iterator, "__next__", None)):
      raise TypeError(
        "DevicePrefetcher: host_iterator must be an iterator (with "
        f"__next__), got {type(host_iterator).__name__}."
      )
    mask_key = self._policy.mask_key
    if mask_key is not None and isinstance(sharding, Mapping) and mask_key not in sharding:
      # The mask leaf is split over the batch dimension like the batch.
      sharding = {
        **sharding,
        mask_key: next(iter(jax.tree_util.tree_leaves(sharding, is_leaf=_is_sharding)), None),
      }
    self._place = BatchPlacer(sharding)
    self._prefetch = prefetch
    self._agreement_name = None
    # Batches placed on this process's devices only are its own business.
    if jax.process_count() > 1 and self._place.spans_processes():
      client = agreement.distributed_client()
      if client is None:
        raise RuntimeError(
          "DevicePrefetcher: a multi-process job needs jax.distributed."
          "initialize() for the processes to agree on the end of input."
        )
      self._agreement_name = f"jaxfeed/end_of_input/{next(_agreement_serials)}"
    self._inline = not prefetch or (
      bool(host_reads_ahead) and self._agreement_name is None and self._place.on_cpu_devices_only()
    )
    self._generation = itertools.count()
    self._has_state = callable(getattr(host_iterator, "get_state", None))
    self._state = host_iterator.get_state() if self._has_state else None
    self._resources = _Resources(host_iterator)
    self._finalizer = weakref.finalize(self, self._resources.close)
    self._outcome: Any = None  # _END or the producer's exception, once seen.
    self._closed = False
    self._start()

  def _start(self) -> None:
    self._outcome = None
    if self._agreement_name is not None:
      # A restart (set_state) agrees on fresh keys: every process restarts.
      steps: Any = agreement.StepAgreement(
        self._policy,
        f"{self._agreement_name}/{next(self._generation)}",
        agreement.distributed_client(),
      )
    else:
      steps = step_verdict.LocalSteps(self._policy)
    self._steps = _HostSteps(self._resources.iterator, self._has_state, self._state, steps)
    if not self._inline:
      self._resources.start(self._steps, self._place, self._prefetch)

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
    if self._inline:
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
    try:
      batch, state = self._steps.next()
      arrays = self._place(batch)
    except _End as end:
      self._state = end.state
      self._outcome = _END
      raise StopIteration from None
    except Exception as e:
      self._outcome = e  # Like the threaded mode: later calls fail the same.
      raise
    self._state = state
    return arrays

  @property
  def places_inline(self) -> bool:
    """Whether `next()` places each batch itself (no read-ahead thread)."""
    return self._inline

  # -- state ----------------------------------------------------------------
  def get_state(self) -> dict:
    """The host iterator's state as of the last batch `next()` returned."""
    if not self._has_state:
      raise TypeError(
        f"DevicePrefetcher: the host iterator "
        f"{type(self._resources.iterator).__name__} has no get_state(); "
        "checkpointing needs a jaxfeed pipeline iterator."
      )
    return copy.deepcopy(self._state)

  def set_state(self, state: dict) -> None:
    """Restores the host iterator and restarts read-ahead from there."""
    if self._closed:
      raise RuntimeError("DevicePrefetcher: set_state() after close().")
    iterator = self._resources.iterator
    if not callable(getattr(iterator, "set_state", None)):
      raise TypeError(
        f"DevicePrefetcher: the host iterator {type(iterator).__name__} has "
        "no set_state(); restoring needs a jaxfeed pipeline iterator."
      )
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
