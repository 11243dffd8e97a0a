"""Resuming an op by replaying its input: which parents repeat their
elements when restored, and dropping the elements already returned.

A map-like op's state is a saved parent state (an anchor) plus `skip`, the
elements after it already returned, and `consumed_ahead` (see
`parallel_executor.ParallelExecutor`); restoring sets the parent to the
anchor and drops those elements again without running work on them.
"""

from __future__ import annotations

from typing import Any

from jaxfeed.ops.base import OpIterator, PipelineStateError

__all__ = [
  "ANCHOR_INTERVAL",
  "anchor_interval",
  "check_replay_state",
  "drop_replayed",
  "replays_identically",
  "skip_outputs",
]

ANCHOR_INTERVAL = 32
"""Pulls between two parent-state anchors when the parent replays exactly."""


def replays_identically(iterator: OpIterator) -> bool:
  """Whether restoring `iterator` to a state repeats the same elements.

  False when an iterator in its subtree returns elements in a timing-dependent
  order; such iterators set the attribute `deterministic = False`.
  """
  stack = [iterator]
  while stack:
    it = stack.pop()
    if getattr(it, "deterministic", True) is False:
      return False
    stack.extend(it.parents)
  return True


def anchor_interval(parent: OpIterator) -> int:
  """Pulls between two saved parent states (see `ParallelExecutor`)."""
  return ANCHOR_INTERVAL if replays_identically(parent) else 1


def drop_replayed(parent: OpIterator, count: int, op_name: str) -> None:
  """Drops the next `count` elements of a just-restored parent.

  Uses the parent's `skip_elements(count)` where it has one. An element whose
  pull raised counts as dropped (it was returned, as that exception, before
  the state was saved).
  """
  skip = getattr(parent, "skip_elements", None)
  if skip is not None and count:
    dropped = skip(count)
    if dropped < count:
      _replay_ended(op_name, dropped, count)
    return
  for index in range(count):
    try:
      next(parent)
    except StopIteration:
      _replay_ended(op_name, index, count)
    except Exception:  # noqa: BLE001 -- returned as an error before the save
      pass


def _replay_ended(op_name: str, index: int, count: int) -> None:
  raise PipelineStateError(
    f"Cannot restore op {op_name!r}: its input ended after {index} of the "
    f"{count} elements to replay; the state belongs to other data."
  )


def skip_outputs(iterator: Any, count: int) -> int:
  """Skips up to `count` outputs by pulling them; returns how many."""
  skipped = 0
  while skipped < count:
    try:
      next(iterator)
    except StopIteration:
      break
    skipped += 1
  return skipped


def check_replay_state(own: Any, op_name: str) -> tuple[int, list[int]]:
  """Reads `{"skip": n, "consumed_ahead": [...]}` of a saved own state."""
  skip = own.get("skip", 0) if isinstance(own, dict) else None
  ahead = own.get("consumed_ahead", []) if isinstance(own, dict) else None
  if (
    not isinstance(skip, int)
    or isinstance(skip, bool)
    or skip < 0
    or not isinstance(ahead, list)
    or not all(isinstance(o, int) and not isinstance(o, bool) and o > skip for o in ahead)
  ):
    raise PipelineStateError(
      f"Cannot restore op {op_name!r}: own state needs an int 'skip' >= 0 "
      f"and 'consumed_ahead', a list of ints > skip, got {own!r}."
    )
  return skip, ahead
