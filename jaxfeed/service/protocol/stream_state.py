"""Where a `parallel_epochs` service read stands, so that it can resume.

In a `parallel_epochs` job every worker runs the whole pipeline: each task
is one stream, the pipeline's elements in the order of the task's worker
index (`jaxfeed.service.worker.worker_orders`: worker i's samplers and
shuffles seeded from the pipeline's seeds and i; every task has index 0
under `identical_worker_streams=True`). For a pipeline whose order is a
function of the pipeline (an index-based input: `range`,
`from_tensor_slices`, `from_source` with a seeded `IndexSampler`, and
per-record seeds after it), a stream is a function of the pipeline and that
index, whichever worker runs it. `StreamProgress` follows how many elements
the consumer took of each stream, as of its last `next()`. Its state (small
and JSON-able):

  {"version": 2, "streams": [[taken, closed, worker_index], ...]}

one entry per stream the read had, in the order its tasks appeared: the
elements the consumer took of it, whether the stream was over (it ended, or
its worker was lost, and the consumer took all that arrived), and its task's
worker index. (Version 1 states, without the index, were saved when every
worker streamed the pipeline's own order: their streams have index 0.)

A read restored from such a state starts a new job, asking the dispatcher
to give its first tasks the worker indices of the open (not closed)
streams (`resume_worker_indices`), and gives each task the open stream of
its index: the worker drops the first `taken` elements of its task's
stream (it computes them, but sends none; see
`jaxfeed.service.worker.delivery`). Which worker continues a stream does not
matter, only its index. Together the two reads deliver what the
uninterrupted read would have: every stream's elements once. A state whose
open streams share an index (identical streams) resumes only with
`identical_worker_streams=True`, and one whose streams have other indices
than 0 only without it: `check_orders` says so.

Exact resume needs one worker per open stream:

- more workers in the new job's first task list than open streams would
  each add a whole epoch the uninterrupted read did not have: the read fails
  with `ResumeStateError`, naming both counts;
- fewer: the read waits up to its `timeout_s` for more workers, then fails
  the same way;
- a worker that joins the resumed job later starts a new stream from the
  start, as it would in any `parallel_epochs` read;
- no open stream: the restored read is over at once.

A shared job (`job_name`) spreads each task's elements over its consumers,
so no consumer knows a stream's position, and `ephemeral_sharing` lets a
job skip ahead: neither resumes.
"""

from __future__ import annotations

import threading
from typing import Any, NamedTuple

from jaxfeed.service.protocol import read_state
from jaxfeed.service.protocol import wire

STATE_VERSION = 2


class StreamTag(NamedTuple):
  """The stream (in the order its task appeared) an element came from."""

  slot: int


def _is_count(value: Any) -> bool:
  return wire.is_int(value) and value >= 0


def check_state(state: Any) -> list[list]:
  """The [taken, closed, worker_index] entries of a `StreamProgress.state()`
  (a version 1 state's [taken, closed] ones get index 0).

  Raises:
    read_state.ResumeStateError: naming what is wrong.
  """
  streams = state.get("streams") if isinstance(state, dict) else None
  version: Any = state.get("version") if isinstance(state, dict) else None
  size = {1: 2, STATE_VERSION: 3}.get(version) if wire.is_int(version) else None
  if (
    size is None
    or set(state) != {"version", "streams"}
    or not isinstance(streams, list)
    or not all(
      isinstance(s, list)
      and len(s) == size
      and _is_count(s[0])
      and isinstance(s[1], bool)
      and (size == 2 or _is_count(s[2]))
      for s in streams
    )
  ):
    raise read_state.ResumeStateError(
      f"A parallel_epochs read's state must be a dict with version "
      f"{STATE_VERSION} and 'streams', a list of [taken >= 0, closed, "
      f"worker_index >= 0] (version 1: [taken >= 0, closed]), got {str(state):.200}."
    )
  return [[*s, 0] if size == 2 else list(s) for s in streams]


class StreamProgress:
  """What the consumer of a `parallel_epochs` read took, stream by stream.

  Args:
    state: a `state()` to go on from (a restored read), or None.
  """

  def __init__(self, state: dict | None = None):
    self.resumed = state is not None
    self._lock = threading.Lock()
    self._streams = check_state(state) if state is not None else []
    # Restored open streams no task continues yet, in order.
    self._unassigned = [i for i, (_, closed, _) in enumerate(self._streams) if not closed]
    # slot -> (taken when its task started, the task's fetcher).
    self._tasks: dict[int, tuple[int, Any]] = {}

  @property
  def unassigned(self) -> int:
    """Restored open streams still without a task."""
    with self._lock:
      return len(self._unassigned)

  def open_orders(self) -> list[int]:
    """The worker indices of the restored open streams no task continues yet."""
    with self._lock:
      return [self._streams[slot][2] for slot in self._unassigned]

  def check_orders(self, identical: bool) -> None:
    """Refuses a restored state whose streams a read with(out)
    `identical_worker_streams` cannot continue.

    Raises:
      read_state.ResumeStateError: naming both.
    """
    orders = self.open_orders()
    if identical and any(orders):
      raise read_state.ResumeStateError(
        f"This parallel_epochs read was saved with each worker in its own order "
        f"(worker indices {orders}); a read with identical_worker_streams=True "
        "streams the pipeline's own order on every worker and cannot continue "
        "them. Resume with identical_worker_streams=False."
      )
    if not identical and len(set(orders)) < len(orders):
      raise read_state.ResumeStateError(
        f"This parallel_epochs read was saved with identical worker streams "
        f"({len(orders)} open streams of the pipeline's own order: "
        "identical_worker_streams=True, or a jaxfeed from before per-worker "
        "orders); resume with identical_worker_streams=True."
      )

  def assign(self, worker_index: int = 0) -> tuple[int, int]:
    """A new task's stream: the first restored open one of its worker
    index, else a new one. Returns (its slot, the elements of it the task's
    worker drops first)."""
    with self._lock:
      slot = next((s for s in self._unassigned if self._streams[s][2] == worker_index), None)
      if slot is not None:
        self._unassigned.remove(slot)
      else:
        slot = len(self._streams)
        self._streams.append([0, False, worker_index])
      return slot, self._streams[slot][0]

  def reading(self, slot: int, skip: int, fetcher: Any) -> None:
    """`fetcher` (with `ended` and `handed_on`) reads stream `slot` from
    element `skip` on."""
    with self._lock:
      self._tasks[slot] = (skip, fetcher)

  def took(self, slot: int) -> None:
    """The consumer took an element of stream `slot`."""
    with self._lock:
      self._streams[slot][0] += 1

  def state(self) -> dict:
    """The JSON-able state as of the consumer's last element."""
    with self._lock:
      streams = [list(s) for s in self._streams]
      tasks = dict(self._tasks)
    for slot, (skip, fetcher) in tasks.items():
      # `ended` first: once the fetcher ended, it hands nothing more on.
      ended = fetcher.ended
      streams[slot][1] = ended and skip + fetcher.handed_on == streams[slot][0]
    return {"version": STATE_VERSION, "streams": streams}

  @property
  def started(self) -> bool:
    """Whether the read had (or restored) any stream."""
    with self._lock:
      return bool(self._streams)

  @property
  def open_streams(self) -> int:
    with self._lock:
      return sum(1 for _, closed, _ in self._streams if not closed)
