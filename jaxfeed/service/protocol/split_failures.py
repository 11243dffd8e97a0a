"""What a read learns when workers die on its splits.

A record whose processing kills the worker (a segfault in a UDF, an
allocation the OOM killer ends) would, in an exactly-once read, kill every
worker the split goes to next. The dispatcher counts, per split, the
workers lost while they made it: a worker counts against the splits of its
latest GetSplits answer that it had not reported made (`made_splits` in its
heartbeats), since it makes them in order and asks again only once it made
them all. After `--max_split_attempts` such losses the split is handed out
no more and the job fails: each of its clients raises `PoisonSplitError`
naming the dataset, the split's positions and how each worker ended (its
exit signal or status where the dispatcher's own pool started it, else
"lost": its heartbeats stopped, which a crash, a kill, a network partition
or a stop all look like).

At-most-once reads do not read a lost worker's splits again: what it was
reading is lost. The dispatcher lists those splits' positions; the client
keeps them in its iterator's `lost_positions` and warns once, at the end of
the read (`PositionsLostWarning`, a `UserWarning`; `warnings.simplefilter(
"error", PositionsLostWarning)` makes it an error). Elements the worker had
made from earlier splits and buffered are lost too, without positions.
"""

from __future__ import annotations

import signal
from typing import Sequence

from jaxfeed.service.protocol import rpc

DEFAULT_MAX_SPLIT_ATTEMPTS = 2
# A lost worker whose process the dispatcher cannot ask about.
LOST = "lost (heartbeats stopped)"


class PoisonSplitError(rpc.ServiceError):
  """A split ended the lives of `max_split_attempts` workers: the read fails."""


class PositionsLostWarning(UserWarning):
  """An at-most-once read ended without the positions its lost workers read."""


def describe_exit(returncode: int | None) -> str:
  """How a process ended, from its `subprocess` return code (None: it runs)."""
  if returncode is None:
    return "lost (heartbeats stopped; its process still runs)"
  if returncode < 0:
    try:
      name = signal.Signals(-returncode).name
    except ValueError:
      name = f"signal {-returncode}"
    return f"killed by {name}"
  return f"exited with status {returncode}"


def poison_message(
  dataset_id: str, job_id: int, start: int, stop: int, deaths: Sequence[str], max_attempts: int
) -> str:
  """The error of a job whose split [start, stop) ended `deaths` (one entry
  per worker: "ADDRESS: how it ended")."""
  return (
    f"Dataset {dataset_id} (job {job_id}): the split of positions "
    f"[{start}, {stop}) ended {len(deaths)} worker(s) while they made it: "
    f"{'; '.join(deaths)}. It is not handed out again "
    f"(--max_split_attempts={max_attempts}): a record in it kills the worker "
    "that processes it (a crash in a UDF, or memory the OOM killer ends). "
    "Find it with the dataset read locally over those positions."
  )


def lost_message(dataset_id: str, ranges: Sequence[tuple[int, int]]) -> str:
  """The warning of an at-most-once read that lost `ranges`."""
  count = sum(stop - start for start, stop in ranges)
  shown = ", ".join(f"[{a}, {b})" for a, b in ranges[:8])
  more = f" and {len(ranges) - 8} more" if len(ranges) > 8 else ""
  return (
    f"Dataset {dataset_id}: this at-most-once read lost {count} positions "
    f"({shown}{more}) that workers were reading when they were lost; they "
    "are in the iterator's lost_positions. Read with "
    "visitation='exactly_once' to have lost workers' splits read again."
  )
