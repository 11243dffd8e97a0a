"""Where a `parallel_epochs` service read stands, so that it can resume.

In a `parallel_epochs` job every worker runs the whole pipeline: each task
is one stream, the pipeline's elements in the pipeline's order. For a
pipeline whose order is a function of the pipeline (an index-based input:
`range`, `from_tensor_slices`, `from_source` with a seeded `IndexSampler`,
and per-record seeds after it), every stream is the same sequence, whichever
worker runs it. `StreamProgress` follows how many elements the consumer took
of each stream, as of its last `next()`. Its state (small and JSON-able):

  {"version": 1, "streams": [[taken, closed], ...]}

one entry per stream the read had, in the order its tasks appeared: the
elements the consumer took of it, and whether the stream was over (it ended,
or its worker was lost, and the consumer took all that arrived).

A read restored from such a state starts a new job and gives its tasks the
open (not closed) streams in order, one each: the worker drops the first
`taken` elements of its task's stream (it computes them, but sends none; see
`jaxfeed.service.worker.delivery`). Which worker continues which stream does not
matter, since the streams are alike. Together the two reads deliver what
the uninterrupted read would have: every stream's elements once.

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

STATE_VERSION = 1


class StreamTag(NamedTuple):
  """The stream (in the order its task appeared) an element came from."""
  slot: int


def _is_count(value: Any) -> bool:
  return wire.is_int(value) and value >= 0


def check_state(state: Any) -> list[list]:
  """The [taken, closed] entries of a `StreamProgress.state()`.

  Raises:
    read_state.ResumeStateError: naming what is wrong.
  """
  streams = state.get("streams") if isinstance(state, dict) else None
  if (not isinstance(state, dict) or state.get("version") != STATE_VERSION
      or set(state) != {"version", "streams"} or not isinstance(streams, list)
      or not all(isinstance(s, list) and len(s) == 2 and _is_count(s[0])
                 and isinstance(s[1], bool) for s in streams)):
    raise read_state.ResumeStateError(
        f"A parallel_epochs read's state must be a dict with version "
        f"{STATE_VERSION} and 'streams', a list of [taken >= 0, closed], got "
        f"{str(state):.200}.")
  return [list(s) for s in streams]


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
    self._unassigned = [i for i, (_, closed) in enumerate(self._streams) if not closed]
    # slot -> (taken when its task started, the task's fetcher).
    self._tasks: dict[int, tuple[int, Any]] = {}

  @property
  def unassigned(self) -> int:
    """Restored open streams still without a task."""
    with self._lock:
      return len(self._unassigned)

  def assign(self) -> tuple[int, int]:
    """A new task's stream: the next restored open one, else a new one.
    Returns (its slot, the elements of it the task's worker drops first)."""
    with self._lock:
      if self._unassigned:
        slot = self._unassigned.pop(0)
      else:
        slot = len(self._streams)
        self._streams.append([0, False])
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
      return sum(1 for _, closed in self._streams if not closed)
