"""Coordinated round-robin reads on a worker: bucket windows and round closing.

A round-robin job (`num_consumers=K`) hands its batches out in rounds: round
`r` of a worker holds K batches and consumer `i` receives batch `i`. Each
global round is served by one worker (see `jaxfeed.service.client`), so
whatever the worker puts in one round reaches all K consumers in the same
step.

Round assembly (`RoundAssembler`). The task's batches are grouped by their
bucket key: the tuple of every leaf's shape without its first (batch)
dimension, so batches padded to the same sequence length share a key. Each key
has a window; the moment a window holds K batches it becomes the next round.
Windows fill one batch at a time, so at most one is ever ready and rounds come
in the order their windows fill (the oldest ready window first). Partial
windows are dropped, never padded or mixed with another key:

* at the end of the input, every partial window is dropped
  (`windows_dropped_at_end`, `batches_dropped_at_end`, `rows_dropped_at_end`);
* at most `max_window_batches` batches wait in partial windows; when a new
  batch leaves more than that, the oldest partial window (the one whose first
  batch arrived earliest) is dropped (`windows_dropped_over_limit`,
  `batches_dropped_over_limit`, `rows_dropped_over_limit`).

Rows are the first dimension of a batch's first leaf; `peak_window_batches`
is the most batches that waited in partial windows at once.

Round closing (`RoundBuffer`). At most `capacity` assembled rounds wait for
their consumers. A round closes when every consumer took its batch, or
`round_timeout_s` after the first consumer took its batch of that round: the
batches of consumers that did not come in time are dropped
(`rounds_closed_incomplete`, `batches_dropped_late`, `rows_dropped_late`)
and those consumers count as absent. Rounds do not wait for absent consumers: while a consumer is
absent, a round closes as soon as every present consumer took its batch, so a
dead consumer costs the others one timeout, not one per round. A consumer
that asks for a closed round is handed the oldest round still open (or, if
none is, the next one assembled) and is present again; the rounds it skipped
are never served to it.
"""

from __future__ import annotations

import collections
import time
from typing import Any, Callable

import numpy as np

from jaxfeed.ops import tree

BucketKey = tuple
# A consumer that stops reading for this long loses rounds (see the module
# docstring); it must exceed the longest pause of a training loop.
DEFAULT_ROUND_TIMEOUT_S = 60.0
DEFAULT_MAX_WINDOW_BATCHES = 1024


def bucket_key(batch: Any) -> BucketKey:
  """Every leaf's shape without its first (batch) dimension, in leaf order."""
  return tuple(np.shape(leaf)[1:] for leaf in tree.flatten(batch))


def batch_rows(batch: Any) -> int:
  """The first dimension of the batch's first leaf (0 for a scalar leaf)."""
  leaves = tree.flatten(batch)
  shape = np.shape(leaves[0]) if leaves else ()
  return int(shape[0]) if shape else 0


class RoundAssembler:
  """Groups batches into per-key windows; a full window (K batches) is a round.

  Args:
    num_consumers: K, the batches of one round.
    max_window_batches: Most batches held in partial windows; must be at
      least K - 1 so that any window can fill.
  """

  def __init__(self, num_consumers: int, max_window_batches: int):
    if num_consumers < 1:
      raise ValueError(f"num_consumers must be >= 1, got {num_consumers}.")
    if max_window_batches < num_consumers - 1:
      raise ValueError(
        f"max_window_batches={max_window_batches} cannot hold a window of "
        f"num_consumers={num_consumers} batches: it must be >= "
        f"{num_consumers - 1}."
      )
    self.num_consumers = num_consumers
    self.max_window_batches = max_window_batches
    # Key -> [(frame, rows)]; insertion order is the arrival of each window's
    # first batch, so the first entry is the oldest partial window.
    self._windows: collections.OrderedDict = collections.OrderedDict()
    self._pending = 0
    self.stats = {
      "windows_dropped_at_end": 0,
      "batches_dropped_at_end": 0,
      "rows_dropped_at_end": 0,
      "windows_dropped_over_limit": 0,
      "batches_dropped_over_limit": 0,
      "rows_dropped_over_limit": 0,
      "peak_window_batches": 0,
    }

  @property
  def pending_batches(self) -> int:
    """Batches waiting in partial windows."""
    return self._pending

  def add(self, frame: Any, key: BucketKey, rows: int) -> list | None:
    """Adds one batch; returns the round's K (frame, rows) when its window fills."""
    window = self._windows.get(key)
    if window is None:
      window = self._windows[key] = []
    window.append((frame, rows))
    self._pending += 1
    completed = None
    if len(window) == self.num_consumers:
      del self._windows[key]
      self._pending -= self.num_consumers
      completed = window
    while self._pending > self.max_window_batches:
      self._drop_oldest("over_limit")
    if self._pending > self.stats["peak_window_batches"]:
      self.stats["peak_window_batches"] = self._pending
    return completed

  def finish(self) -> None:
    """The input ended: drops every partial window."""
    while self._windows:
      self._drop_oldest("at_end")

  def _drop_oldest(self, why: str) -> None:
    _, window = self._windows.popitem(last=False)
    self._pending -= len(window)
    self.stats[f"windows_dropped_{why}"] += 1
    self.stats[f"batches_dropped_{why}"] += len(window)
    self.stats[f"rows_dropped_{why}"] += sum(rows for _, rows in window)


class _Round:
  __slots__ = ("frames", "rows", "served", "first_taken")

  def __init__(self, batches: list):
    self.frames = [frame for frame, _ in batches]
    self.rows = [rows for _, rows in batches]
    self.served: set[int] = set()
    self.first_taken: float | None = None


class RoundBuffer:
  """Assembled rounds waiting for their K consumers; not thread-safe.

  Args:
    num_consumers: K.
    capacity: Most rounds held at once (`full` tells the producer to wait).
    round_timeout_s: How long the other consumers have to take their batch of
      a round once the first consumer took its batch.
    clock: Monotonic seconds (tests pass a fake one).
  """

  def __init__(
    self,
    num_consumers: int,
    capacity: int,
    round_timeout_s: float,
    clock: Callable[[], float] = time.monotonic,
  ):
    self.num_consumers = num_consumers
    self.capacity = capacity
    self.round_timeout_s = round_timeout_s
    self._clock = clock
    self._rounds: dict[int, _Round] = {}
    self._next_round = 0
    self._absent: set[int] = set()
    self.stats = {
      "rounds": 0,
      "rounds_closed_incomplete": 0,
      "batches_dropped_late": 0,
      "rows_dropped_late": 0,
    }

  @property
  def full(self) -> bool:
    return len(self._rounds) >= self.capacity

  @property
  def open_rounds(self) -> int:
    return len(self._rounds)

  def put(self, batches: list) -> int:
    """Adds the next round, K (frame, rows); returns its index."""
    index = self._next_round
    self._rounds[index] = _Round(batches)
    self._next_round += 1
    self.stats["rounds"] += 1
    return index

  def take(self, consumer: int, wanted: int) -> tuple[Any, int] | None:
    """(frame, round) for `consumer` at round `wanted` or, if that round is
    closed, at the oldest round still open; None while it is not assembled."""
    index = wanted
    if index < self._next_round and index not in self._rounds:
      later = [r for r in self._rounds if r >= index]
      index = min(later) if later else self._next_round
    found = self._rounds.get(index)
    if found is None:
      return None
    found.served.add(consumer)
    if found.first_taken is None:
      found.first_taken = self._clock()
    self._absent.discard(consumer)
    frame = found.frames[consumer]
    self._close_if_done(index, found)
    return frame, index

  def close_expired(self) -> bool:
    """Closes rounds whose timeout passed; True if any closed."""
    now = self._clock()
    expired = [
      (i, r)
      for i, r in self._rounds.items()
      if r.first_taken is not None and now - r.first_taken >= self.round_timeout_s
    ]
    for index, found in expired:
      self._absent.update(set(range(self.num_consumers)) - found.served)
      self._close(index, found)
    if expired:  # rounds that waited only for a now absent consumer
      for index, found in list(self._rounds.items()):
        self._close_if_done(index, found)
    return bool(expired)

  def exhausted(self, wanted: int) -> bool:
    """No round at or after `wanted` is open (with the input ended: none will be)."""
    return not any(r >= wanted for r in self._rounds)

  def _close_if_done(self, index: int, found: _Round) -> None:
    if found.served and found.served >= set(range(self.num_consumers)) - self._absent:
      self._close(index, found)

  def _close(self, index: int, found: _Round) -> None:
    missing = [c for c in range(self.num_consumers) if c not in found.served]
    if missing:
      self.stats["rounds_closed_incomplete"] += 1
      self.stats["batches_dropped_late"] += len(missing)
      self.stats["rows_dropped_late"] += sum(found.rows[c] for c in missing)
    del self._rounds[index]
