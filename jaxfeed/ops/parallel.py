"""The parallel-execution engine shared by map-like ops.

`ParallelExecutor` applies a work function to the elements of a parent
iterator on a pool of threads, with at most `parallelism` elements pulled but
not yet returned. Elements are pulled from the parent in the consumer's thread,
so the parent iterator (and its state) is only ever touched by one thread.

Resume contract (details in `ParallelExecutor`): the state is a saved parent
state at or before the oldest element not yet returned, the number of
elements after it that were all returned (`skip`), and, for
`deterministic=False` only, the offsets of later elements already returned
(`consumed_ahead`). Restoring replays the parent from the saved state and
drops those elements without running work on them, so the outputs after a
restore are exactly the ones the uninterrupted iterator had left to return
(for `deterministic=False`, as a multiset: their order is the completion
order). Parent states are saved every `ANCHOR_INTERVAL` pulls, or before
every pull when the parent itself does not replay identically.

A worker's exception is re-raised, with the worker's traceback, by the
`next()` that would have returned its element; the iterator then continues with
the following elements (like tf.data).

The pieces live in their own modules and are re-exported here for the ops:
`parallel_executor` (the threads), `replay` (resuming by replaying the
input) and `udf_args` (the arguments map-like ops share).
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from jaxfeed.ops import autotune, batch_placement
from jaxfeed.ops.base import AUTOTUNE, OpIterator, PipelineStateError, check_state
from jaxfeed.ops.parallel_executor import ParallelExecutor
from jaxfeed.ops.replay import (
  ANCHOR_INTERVAL,
  anchor_interval,
  check_replay_state,
  drop_replayed,
  replays_identically,
  skip_outputs,
)
from jaxfeed.ops.udf_args import (
  BACKENDS,
  MAX_AUTOTUNE_PARALLELISM,
  call_unpacked,
  check_backend,
  check_callable,
  check_deterministic,
  check_num_parallel_calls,
  check_writes_out,
  default_autotune_parallelism,
  resolve_parallelism,
  usable_cores,
  with_writes_out,
  without_out,
)

__all__ = [
  "ParallelExecutor",
  "ParallelMapIterator",
  "ANCHOR_INTERVAL",
  "BACKENDS",
  "anchor_interval",
  "call_unpacked",
  "check_backend",
  "check_callable",
  "check_deterministic",
  "check_num_parallel_calls",
  "check_replay_state",
  "check_writes_out",
  "default_autotune_parallelism",
  "drop_replayed",
  "replays_identically",
  "resolve_parallelism",
  "skip_outputs",
  "usable_cores",
  "with_writes_out",
  "without_out",
]


class ParallelMapIterator(OpIterator):
  """Iterator of an element-wise op, run in the consumer thread or parallel.

  Subclasses set `op_name` and implement `_apply(element)`, the sequential
  path. `work_fn(element, seed)` is what the worker threads run; it must not
  reference the iterator (so that garbage collection can stop the threads).

  With `num_parallel_calls` None or 1 no thread is started. Otherwise a
  `ParallelExecutor` runs `work_fn`; `parallelism` reads and sets its width.
  The state is `{"skip": n, "consumed_ahead": [...]}` plus a parent state
  (see `ParallelExecutor`), identical in layout for both paths, so a
  checkpoint of the sequential path restores into the parallel one and vice
  versa (except a `deterministic=False` state with returned-ahead elements,
  which needs the parallel path).
  """

  _pool: Any = None
  """A `process_pool.ProcessPool` the subclass drives (backend="process"),
  closed after the executor's threads."""

  stats_one_to_one = True
  places_batches = False
  """Whether a following `batch` may read through `next_batch`: one output
  per input, so the workers can write each into its row of the batch."""

  def __init__(
    self,
    parent: OpIterator,
    work_fn: Callable[[Any, int], Any],
    num_parallel_calls: int | None,
    deterministic: bool,
    writes_out: bool = False,
  ):
    super().__init__([parent])
    self._parent = parent
    self._autotuned = num_parallel_calls == AUTOTUNE
    if num_parallel_calls is None or num_parallel_calls == 1:
      self.executor: ParallelExecutor | None = None
    else:
      self.executor = ParallelExecutor(
        parent,
        work_fn,
        resolve_parallelism(num_parallel_calls),
        deterministic,
        self.op_name,
        writes_out,
      )
    # Read by `replays_identically`: unordered outputs do not replay.
    self.deterministic = self.executor is None or self.executor.deterministic

  def _apply(self, element: Any) -> Any:
    raise NotImplementedError

  def __next__(self) -> Any:
    executor = self.executor
    if executor is None:
      return self._apply(next(self._parent))
    value = executor.next()
    if type(value) is batch_placement.Placed:
      # Read one at a time after batches: the row, as an array of its own.
      return value.element(copy=True)
    return value

  @property
  def next_batch(self) -> Callable[[int], tuple[Any, np.ndarray]]:
    """The batched-read protocol (`jaxfeed.ops.stacking`) of an ordered
    parallel op with one output per input: see `batch_placement`."""
    executor = self.executor
    if not self.places_batches or executor is None or not executor.deterministic:
      raise AttributeError("next_batch")
    return executor.next_batch

  @property
  def batched_reads_declined(self) -> bool:
    """Whether `batch` should read one element at a time after all: the
    outputs are not worth placing (see `batch_placement.MIN_ELEMENT_BYTES`),
    and next() per element costs less than `next_batch`'s bookkeeping."""
    return self.executor is not None and self.executor.placement_declined

  @property
  def last_seed(self) -> int:
    if self.executor is None:
      return self._parent.last_seed
    return self.executor.last_seed

  def _skip_one_to_one(self, count: int) -> int:
    """`skip_elements` for ops with one output per input (see skip.py)."""
    if self.executor is not None:
      return self.executor.skip(count)
    skip_parent = getattr(self._parent, "skip_elements", None)
    if skip_parent is None:
      return skip_outputs(self, count)
    return skip_parent(count)

  @property
  def parallelism(self) -> int:
    """Elements processed at once (the autotuner may assign it)."""
    return 1 if self.executor is None else self.executor.parallelism

  @parallelism.setter
  def parallelism(self, value: int) -> None:
    if self.executor is None:
      raise ValueError(
        f"{self.op_name}: parallelism can only be changed on an op built "
        f"with num_parallel_calls > 1 or AUTOTUNE."
      )
    self.executor.parallelism = value

  def _stats_fields(self) -> dict:
    executor = self.executor
    if executor is None:
      return {}
    fields = {"parallelism": executor.parallelism, "busy_seconds": executor.busy_s}
    if self.stats_one_to_one:
      fields["elements"] = executor.num_returned
    return fields

  def _stats_buffer_fill(self) -> float | None:
    executor = self.executor
    if executor is None:
      return None
    return min(1.0, executor.num_ready / executor.parallelism)

  def tunables(self) -> list:
    """The parallelism knob, for ops built with AUTOTUNE."""
    if not self._autotuned or self.executor is None:
      return []
    executor = self.executor
    return [
      autotune.Knob(
        name=f"{self.op_name}/parallelism",
        kind="threads",
        get=lambda: executor.parallelism,
        set=lambda value: setattr(executor, "parallelism", value),
        # The autotuner's CPU budget (jaxfeed.Options) is the real bound.
        minimum=1,
        maximum=MAX_AUTOTUNE_PARALLELISM,
        wait_s=lambda: executor.wait_s,
        busy_s=lambda: executor.busy_s,
      )
    ]

  def get_state(self) -> dict:
    if self.executor is None:
      return {
        "op": self.op_name,
        "own": {"skip": 0, "consumed_ahead": []},
        "parents": [self._parent.get_state()],
      }
    return {
      "op": self.op_name,
      "own": self.executor.own_state(),
      "parents": [self.executor.parent_state()],
    }

  def set_state(self, state: dict) -> None:
    check_state(state, self.op_name, 1)
    own = state.get("own")
    if self.executor is not None:
      self.executor.restore(state["parents"][0], own)
      return
    skip, consumed_ahead = check_replay_state(own, self.op_name)
    if consumed_ahead:
      raise PipelineStateError(
        f"Cannot restore op {self.op_name!r}: the state lists elements "
        f"returned out of order (deterministic=False), which only a "
        f"parallel {self.op_name} can resume; got {own!r}."
      )
    self._parent.set_state(state["parents"][0])
    drop_replayed(self._parent, skip, self.op_name)

  def _close_own(self) -> None:
    if self.executor is not None:
      self.executor.close()  # Joins the threads before their processes stop.
    if self._pool is not None:
      self._pool.close()
