"""A client's stream of a task's items, resumable across connections.

Each item a worker sends a client of a task (a frame, or the end of an
exactly-once split) carries a sequence number counted per (task, client).
The worker keeps the items it took for the client in a resend buffer until
the client acknowledges them: on the open connection every few items, and
in its request when it connects again after a connection broke. A new
connection goes on at the first item the client has not received, so a
broken connection to a live worker loses nothing and delivers nothing
twice, in every processing mode and over either transport. The worker takes
no new item for the client while `window` items wait for acknowledgment,
which bounds the buffer (plus one exactly-once split, which is taken
whole).

What the client has received is what it acknowledges, not what the
kernel accepted: bytes in socket buffers when a connection breaks are sent
again. While it has nothing to send, a connection sends a keepalive every
KEEPALIVE_S, so the client tells a stalled connection from a slow pipeline;
the keepalive carries the task's progress counter (`Idle`), so the client
also tells a slow pipeline from one stuck on a record.

A stream lives on the worker until its task ends or the dispatcher no longer
lists its client (it left or timed out); `Registry` keeps them.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Any, Callable, Generator

from jaxfeed.service.protocol import wire
from jaxfeed.service.worker import task_runner

KEEPALIVE_S = 1.0
DEFAULT_WINDOW = 32
MAX_WINDOW = 1024
_WAIT_S = 0.2  # longest wait inside `ClientStream.items` between checks


class Idle(int):
  """What `ClientStream.items` yields while it has nothing to send: the
  task's progress counter (elements its pipeline made plus items its
  consumers took), which keepalives carry, so that a client tells a worker
  stuck on a record from a slow one."""


class Item:
  """One numbered item of a client's stream: a frame, or (frame None) the
  end of the exactly-once split [round, split_stop)."""

  __slots__ = ("seq", "frame", "round", "split_stop")

  def __init__(self, seq: int, frame: wire.Frame | None, round_index: int, split_stop: int = 0):
    self.seq = seq
    self.frame = frame
    self.round = round_index
    self.split_stop = split_stop


class ClientStream:
  """What one client of a task gets from the task's source, with resends.

  Args:
    source: the task's `TaskRunner` or `SharedStreamReader` (`take`).
    exactly_once: the source gives whole splits.
    consumer_index: round-robin reads: the client's consumer index.
    local_round: round-robin reads: the first round the client wants.
    window: most unacknowledged items before the stream waits.
    first_seq: the number of the stream's first item.
    resumable: False for a client that cannot resume (it sent no client
      id): an item counts as acknowledged once it was handed to the
      connection.
    skip: plain (not exactly-once, not round-robin) streams: items of the
      source to drop before the first one sent (a resumed read, see
      `jaxfeed.service.protocol.stream_state`).
  """

  def __init__(
    self,
    source: Any,
    exactly_once: bool,
    consumer_index: int,
    local_round: int,
    window: int,
    first_seq: int = 0,
    resumable: bool = True,
    skip: int = 0,
  ):
    self._source = source
    self._exactly_once = exactly_once
    self._consumer_index = consumer_index
    self._round = local_round
    self._window = window
    self._resumable = resumable
    self._skip = max(0, skip)
    self._cond = threading.Condition()
    self._taking = threading.Lock()  # keeps the source's order in the buffer
    self._unacked: collections.deque[Item] = collections.deque()
    self._base = first_seq  # seq of _unacked[0]: everything before was acknowledged
    self._ended: dict | None = None
    self._end_seen = False
    self._owner: object | None = None
    self._kick: Callable[[], None] | None = None
    self.held: list[int] = []  # exactly-once: splits taken, not yet reported
    self.created = time.monotonic()

  @property
  def _end_seq(self) -> int:
    return self._base + len(self._unacked)

  def ack(self, received: int) -> None:
    """The client has received every item before `received`."""
    with self._cond:
      while self._unacked and self._base < received:
        self._unacked.popleft()
        self._base += 1
      self._cond.notify_all()

  def wait_for_ack(self, timeout_s: float) -> None:
    with self._cond:
      self._cond.wait(timeout_s)

  def attach(self, received: int, kick: Callable[[], None]) -> object:
    """A new connection that goes on at item `received`; an older one stops
    (`kick` ends it if it blocks). Returns the connection's token."""
    with self._cond:
      if not self._base <= received <= self._end_seq:
        raise task_runner.TaskFailed(
          f"The client has received {received} items, but this worker kept "
          f"items {self._base} to {self._end_seq} of its stream: it cannot "
          "go on without a gap or a repeat.",
          "DATA_LOSS",
        )
      old_kick, self._kick = self._kick, kick
      self._owner = token = object()
    self.ack(received)
    if old_kick is not None:
      old_kick()
    return token

  def take_held(self) -> list[int]:
    """Exactly-once: starts of the splits taken since the last call."""
    with self._cond:
      held, self.held = self.held, []
    return held

  def close(self) -> None:
    """Ends the connection serving the stream, if any."""
    with self._cond:
      kick, self._kick, self._owner = self._kick, None, None
      self._cond.notify_all()
    if kick is not None:
      kick()

  def items(
    self,
    token: object,
    received: int,
    is_active: Callable[[], bool],
    wait_for_ack: Callable[[float], None],
  ) -> Generator[Item | None, None, dict | None]:
    """The items from `received` on, `Idle` while there is nothing to
    send; returns the task's statistics at its end, None once the connection
    was superseded or `is_active()` turned false. `wait_for_ack(s)` waits
    up to s seconds for the client's acknowledgments (a transport reads
    them itself or gets them from another thread). Raises TaskFailed."""
    cursor = received
    while True:
      with self._cond:
        if self._owner is not token or not is_active():
          return None
        cursor = max(cursor, self._base)
        item = self._unacked[cursor - self._base] if cursor < self._end_seq else None
        ended, stats = item is None and self._end_seen, self._ended
        full = len(self._unacked) >= self._window
      if item is not None:
        cursor += 1
        yield item
        if not self._resumable:
          self.ack(cursor)
      elif ended:
        return stats
      elif full:
        wait_for_ack(_WAIT_S)
        yield self.idle()
      elif not self._take():
        yield self.idle()

  def idle(self) -> Idle:
    return Idle(getattr(self._source, "progress", 0))

  def _take(self) -> bool:
    """Takes the source's next item into the buffer; False if none came."""
    with self._taking:
      got = self._source.take(self._consumer_index, self._round, _WAIT_S)
      if got is None:
        return False
      with self._cond:
        if isinstance(got, task_runner.Ended):
          self._ended, self._end_seen = got.stats, True
        elif self._exactly_once:
          (start, stop), frames = got
          for frame in frames:
            self._unacked.append(Item(self._end_seq, frame, start))
          self._unacked.append(Item(self._end_seq, None, start, stop))
          self.held.append(start)
        else:
          frame, local_round = got
          self._round = local_round + 1
          if self._skip:
            # Dropped; "none came", so that the transport keeps its
            # keepalives going while a long skip runs.
            self._skip -= 1
            return False
          self._unacked.append(Item(self._end_seq, frame, local_round))
        self._cond.notify_all()
      return True


class Registry:
  """The worker's client streams, by (task id, client id)."""

  def __init__(self):
    self._lock = threading.Lock()
    self._streams: dict[tuple[int, int], ClientStream] = {}

  def get_or_add(
    self, task_id: int, client_id: int, make: Callable[[], ClientStream]
  ) -> ClientStream:
    """The client's stream of the task; client id 0 gets a new one each
    time (a client that cannot resume)."""
    if not client_id:
      return make()
    with self._lock:
      stream = self._streams.get((task_id, client_id))
      if stream is None:
        stream = self._streams[(task_id, client_id)] = make()
      return stream

  def find(self, task_id: int, client_id: int) -> ClientStream | None:
    with self._lock:
      return self._streams.get((task_id, client_id))

  def take_held(self) -> list[tuple[int, int, list[int]]]:
    """(task id, client id, split starts) taken since the last call."""
    with self._lock:
      streams = list(self._streams.items())
    held = [(task_id, client_id, stream.take_held()) for (task_id, client_id), stream in streams]
    return [entry for entry in held if entry[2]]

  def drop(self, keep: Callable[[int, int, ClientStream], bool]) -> None:
    """Closes and forgets the streams for which keep(task, client, stream)
    is false."""
    with self._lock:
      dropped = [k for k, s in self._streams.items() if not keep(*k, s)]
      streams = [self._streams.pop(k) for k in dropped]
    for stream in streams:
      stream.close()
