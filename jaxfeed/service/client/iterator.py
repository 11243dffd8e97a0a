"""The iterator of a service read (`DistributedIterator`): elements as they
arrive, or round by round for round-robin reads."""

from __future__ import annotations

import queue
import time
import warnings
from typing import Any

from jaxfeed.ops import base
from jaxfeed.ops import index_ranges
from jaxfeed.ops import state_identity
from jaxfeed.service.client import read as client_read
from jaxfeed.service.client import reaper
from jaxfeed.service.client import task_stats
from jaxfeed.service.client.fetcher import Fetcher
from jaxfeed.service.client.read import POLL_S
from jaxfeed.service.protocol import read_state
from jaxfeed.service.protocol import rpc
from jaxfeed.service.protocol import spec as spec_lib
from jaxfeed.service.protocol import split_failures
from jaxfeed.service.protocol import stream_state


class DistributedIterator(base.OpIterator):
  """Iterator over a service read; `close()` leaves the job.

  State: exactly-once reads save which splits the consumer took and resume
  from it on a new job (`jaxfeed.service.protocol.read_state`); parallel_epochs reads
  that are neither shared nor round-robin save how much of each worker's
  stream it took and resume each stream on a new job (`jaxfeed.service.
  stream_state`); other reads restore only a state of nothing read. The
  positions those states name belong to the pipeline's split input: when
  the client holds the pipeline (`distribute`, not `from_dataset_id`), they
  record what defines its order (a `from_source`'s sampler and source, see
  `jaxfeed.ops.state_identity`), and restoring into a read of another
  pipeline raises PipelineStateError naming what differs.

  Failures: a `next()` that waits `timeout_s` while no worker makes
  progress on the read raises ServiceError; an exactly-once read whose
  split ended `--max_split_attempts` workers raises `PoisonSplitError`; an
  at-most-once read that lost positions with its workers says so at its end
  (`PositionsLostWarning`, and `lost_positions`); see
  `jaxfeed.service.protocol.split_failures`.
  """

  op_name = "distribute"  # DistributedNode's

  def __init__(self, node: Any):
    """`node` is the `jaxfeed.service.client.distribute.DistributedNode` read."""
    super().__init__(())
    self._read = client_read.ReadState(node)
    self._elements = 0
    self._round = 0  # round-robin: the next global round wanted
    self._last_round = -1
    self._heads: dict[int, tuple] = {}  # task id -> (element, local round) not yet due
    self._skipped = {"rounds_skipped": 0, "rounds_of_ended_workers": 0}
    self._ended_pending = 0
    self._worker_rows = task_stats.TaskRows()
    self._identity = _split_input_identity(node)
    self._lost_warned = False
    # Not closed inside the garbage collector: see jaxfeed.service.client.reaper.
    self._finalizer = reaper.track(self, self._read)

  @property
  def elements_by_worker(self) -> dict[str, int]:
    """Elements received so far from each worker address."""
    with self._read.lock:
      return dict(self._read.elements_by_worker)

  @property
  def job_id(self) -> int:
    return self._read.job_id

  @property
  def lost_positions(self) -> list[tuple[int, int]]:
    """At-most-once DYNAMIC reads: the [start, stop) positions of the splits
    that workers were reading when they were lost (their elements that had
    not reached this client are lost; see
    `jaxfeed.service.protocol.split_failures`). Empty when none was lost."""
    return list(self._read.lost_positions)

  @property
  def last_round(self) -> int:
    """Round-robin reads: the global round of the last batch returned (-1
    before the first); consumers' batches of one round share a bucket."""
    return self._last_round

  def stats(self) -> dict:
    """Per-op rows of the workers' pipelines and of this read, and, for
    round-robin reads, what this consumer received and missed.

    `ops`: each worker task's rows (see `OpIterator.stats`; tagged with
    `worker` and `task`; asked of the workers at most once a second, an
    ended task's final rows come with its end, see
    `jaxfeed.service.client.task_stats`), then this read's own row.

    `rounds_received`: batches returned; `rounds_skipped`: rounds that closed
    before this consumer took its batch (it was late, see the module
    docstring), including, at the end, those after its last batch;
    `rounds_of_ended_workers`: rounds without a batch because their worker
    had ended or died while another worker still served later rounds (the
    same for every consumer). `workers` maps each worker address
    whose stream ended to that task's counters (`jaxfeed.service.
    round_assembly`: rounds, windows and batches dropped), and the counters'
    totals over those workers are given at the top level too.
    """
    fetchers = list(self._read.fetchers.values())
    rows = self._worker_rows.rows(
      [f.task for f in fetchers if not f.done],
      [(f.task, f.end_stats) for f in fetchers if f.done and f.end_stats],
      self._read.node.tls,
    )
    stats = {
      "ops": rows + super().stats()["ops"],
      "rounds_received": self._elements if self._read.node.num_consumers else 0,
      **self._skipped,
      "workers": {},
    }
    for fetcher in fetchers:
      counters = {
        key: value for key, value in fetcher.end_stats.items() if key != task_stats.END_ROWS_KEY
      }
      if counters:
        stats["workers"][fetcher.task.worker_address] = counters
        for key, value in counters.items():
          if isinstance(value, (int, float)):
            stats[key] = stats.get(key, 0) + value
    return stats

  def _stats_fields(self) -> dict:
    """The read's own row: elements taken, and what this client saw of the
    service (`op_report.report` names them): seconds it waited for batches,
    the workers it read from, batches received, reconnections."""
    read = self._read
    fetchers = list(read.fetchers.values())
    return {
      "elements": read.consumed,
      "read_wait_seconds": round(read.wait_s, 4),
      "service_workers": len({f.task.worker_address for f in fetchers}),
      "received": sum(f.received for f in fetchers),
      "reconnects": sum(f.reconnects for f in fetchers),
    }

  def _stats_buffer_fill(self) -> float | None:
    return self._read.buffer.qsize() / self._read.capacity

  def _raise_error(self) -> None:
    error = self._read.error
    if error is not None:
      if isinstance(error, (rpc.ServiceError, spec_lib.SpecError, ValueError)):
        raise error
      raise rpc.ServiceError(f"Reading from the service failed: {error}") from error

  def __next__(self) -> Any:
    read = self._read
    start = time.monotonic()
    try:
      element = self._next_round() if read.node.num_consumers else self._next_element()
    finally:
      read.wait_s += time.monotonic() - start
    read.consumed += 1
    return element

  def _end(self) -> None:
    """Raises StopIteration, after warning of the positions the read lost."""
    lost = self._read.lost_positions
    if lost and not self._lost_warned:
      self._lost_warned = True
      warnings.warn(
        split_failures.PositionsLostWarning(
          split_failures.lost_message(self._read.dataset_id, lost)
        ),
        stacklevel=4,
      )
    raise StopIteration

  def _next_element(self) -> Any:
    read = self._read
    waiting_since = time.monotonic()
    while True:
      try:
        item = read.buffer.get(timeout=POLL_S)
      except queue.Empty:
        item = None
      if item is client_read.END:
        self._end()
      if item is not None:
        element, tag = item
        if isinstance(tag, read_state.SplitTag):
          read.progress.took(tag)
        elif isinstance(tag, stream_state.StreamTag):
          read.streams.took(tag.slot)
        self._elements += 1
        return element
      self._raise_error()
      if read.finished and read.buffer.empty():
        self._end()
      if read.stop.is_set():
        raise StopIteration
      read.check_progress(waiting_since)

  # -- round-robin reads ---------------------------------------------------------
  def _head(self, fetcher: Fetcher) -> tuple | None:
    """The fetcher's next (element, local round), kept until its round is due."""
    task_id = fetcher.task.task_id
    head = self._heads.get(task_id)
    if head is None:
      try:
        head = self._heads[task_id] = fetcher.out.get(timeout=POLL_S)
      except queue.Empty:
        return None
    return head

  def _drained(self, fetcher: Fetcher) -> bool:
    # `ended` first: once the thread ended, nothing more is put.
    return fetcher.ended and fetcher.out.empty() and fetcher.task.task_id not in self._heads

  def _next_round(self) -> Any:
    read = self._read
    waiting_since = time.monotonic()
    while True:
      self._raise_error()
      if read.stop.is_set():
        raise StopIteration
      read.check_progress(waiting_since)
      by_index, num_workers = read.round_fetchers()
      if all(self._drained(f) for f in by_index.values()) and (
        read.finished or (by_index and len(by_index) >= num_workers)
      ):
        self._count_rounds_never_reached(by_index, num_workers)
        raise StopIteration
      index = self._round % num_workers if num_workers else 0
      fetcher = by_index.get(index)
      if fetcher is None:
        if read.finished:  # this worker never served the job
          self._skip("rounds_of_ended_workers")
        else:
          time.sleep(POLL_S)
        continue
      head = self._head(fetcher)
      if head is None:
        if self._drained(fetcher):
          # The worker says how many rounds it made: the ones we did not get
          # closed before we came.
          made = fetcher.end_stats.get("rounds", 0)
          late = self._round // num_workers < made
          self._skip("rounds_skipped" if late else "rounds_of_ended_workers")
        continue
      element, local_round = head
      got = local_round * num_workers + index
      if got > self._round:  # the rounds up to `got` closed before we came
        self._skip("rounds_skipped")
        continue
      del self._heads[fetcher.task.task_id]
      if got < self._round:  # a replaced task starting over; already past it
        continue
      self._round += 1
      self._last_round = got
      self._elements += 1
      self._skipped["rounds_of_ended_workers"] += self._ended_pending
      self._ended_pending = 0
      return element

  def _skip(self, why: str) -> None:
    if why == "rounds_of_ended_workers":
      # Counted once a later round arrives: after the last one, they are
      # just the end of the read.
      self._ended_pending += 1
    else:
      self._skipped[why] += 1
    self._round += 1

  def _count_rounds_never_reached(self, by_index: dict, num_workers: int) -> None:
    """At the end: rounds the workers made past our position closed unseen."""
    for index, fetcher in by_index.items():
      made = fetcher.end_stats.get("rounds", 0)
      first = max(0, -(-(self._round - index) // num_workers))
      self._skipped["rounds_skipped"] += max(0, made - first)
    self._round = max(
      self._round,
      max((f.end_stats.get("rounds", 0) * num_workers for f in by_index.values()), default=0),
    )
    self._ended_pending = 0

  def _get_own_state(self) -> dict:
    read = self._read
    if read.node.visitation == "exactly_once":
      state = {
        "elements_read": self._elements,
        "splits": read.progress.state(),
        "job_name": read.node.job_name or "",
      }
    elif read.streams is not None:
      state = {"elements_read": self._elements, "streams": read.streams.state()}
    else:
      return {"elements_read": self._elements}
    if self._identity is not None:
      state["identity"] = self._identity
    return state

  def _set_own_state(self, state: dict) -> None:
    """Exactly-once reads go on where the state was taken, on a new job (see
    `jaxfeed.service.protocol.read_state`), and so do parallel_epochs reads of
    index-based pipelines (`jaxfeed.service.protocol.stream_state`); other reads only
    restore a state of nothing read."""
    node = self._read.node
    kwargs = None
    if isinstance(state, dict) and ("splits" in state or "streams" in state):
      state_identity.check_identity(
        state.get("identity"), self._identity, self.op_name, resharded=False
      )
    try:
      if node.visitation == "exactly_once" and isinstance(state, dict) and "splits" in state:
        # A state not marked by a restore (`read_state.merge_process_states`)
        # is this consumer's alone: its own restore.
        kwargs = {
          "progress": read_state.SplitProgress(
            state["splits"], state.get("restore_id") or read_state.new_restore_id()
          )
        }
      elif self._read.streams is not None and isinstance(state, dict) and "streams" in state:
        _check_index_based(node)
        streams = stream_state.StreamProgress(state["streams"])
        streams.check_orders(node.identical_worker_streams)
        kwargs = {"streams": streams}
    except read_state.ResumeStateError as e:
      raise base.PipelineStateError(str(e)) from e
    if kwargs is not None:
      ((name, restored),) = kwargs.items()
      if restored.started or getattr(self._read, name).started:
        reaper.close_now(self._finalizer, self._read)  # else: a fresh read either way
        self._read = client_read.ReadState(node, **kwargs)
        self._finalizer = reaper.track(self, self._read)
      self._elements = int(state.get("elements_read", 0))
      return
    if state.get("elements_read", 0) != self._elements:
      raise base.PipelineStateError(
        f"A {node.policy.name} read with {node.visitation} visitation"
        f"{_sharing(node)} cannot resume at a position (state {str(state):.200}): "
        "the workers' output order is not reproducible. Only distributed_epoch "
        "reads with visitation='exactly_once' (see jaxfeed.service.protocol.read_state) "
        "and parallel_epochs reads without job_name, num_consumers or "
        "ephemeral_sharing (jaxfeed.service.protocol.stream_state) resume; start a new "
        "read, e.g. restore_checkpoint(..., restore_loader=False)."
      )

  def _close_own(self) -> None:
    reaper.close_now(self._finalizer, self._read)


def _sharing(node: Any) -> str:
  """How a read shares its job, for errors."""
  if node.num_consumers:
    return f" and num_consumers={node.num_consumers}"
  if node.ephemeral_sharing:
    return " and ephemeral_sharing=True"
  return f" of shared job {node.job_name!r}" if node.job_name else ""


def _split_input_identity(node: Any) -> dict | None:
  """What defines the positions a resumable read's state names: the
  identity of its pipeline's split input (a `from_source`'s sampler and
  source); None when the client does not hold the pipeline
  (`from_dataset_id`) or its input records none."""
  if node.dataset is None:
    return None
  try:
    split_input = index_ranges.split_input(node.dataset)
  except index_ranges.NotIndexAddressableError:
    return None
  identity = getattr(split_input, "identity", None)
  return identity if isinstance(identity, dict) else None


def _check_index_based(node: Any) -> None:
  """Raises PipelineStateError unless the read's pipeline (when the client
  has it) has an index-based input, whose streams are alike on every
  worker."""
  if node.dataset is None:
    return  # from_dataset_id: the dispatcher holds the pipeline
  try:
    index_ranges.split_input(node.dataset)
  except index_ranges.NotIndexAddressableError as e:
    raise base.PipelineStateError(
      "A parallel_epochs read resumes only a pipeline with one index-based "
      "input (range, from_tensor_slices, from_source, from_tfrecord), whose "
      f"order every worker repeats; pipeline {str(node.dataset):.200} has none, "
      "or several."
    ) from e
