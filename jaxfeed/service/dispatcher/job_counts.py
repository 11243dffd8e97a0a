"""What each job's consumers took and waited, for the dispatcher's metrics
(`jaxfeed_job_client_elements_total`, `jaxfeed_job_client_wait_seconds_total`).

Clients report cumulative counts of their own read (heartbeats, and their
goodbye). A job's count is what its live clients reported plus what every
client that left had reported when it left, so it never goes down while the
job lives, however clients come and go: Prometheus counters may only fall
when the process restarts (the counts are not journaled; a restarted
dispatcher counts again from what live clients report).
"""

from __future__ import annotations

import dataclasses
from typing import Container


@dataclasses.dataclass
class Counts:
  """Elements consumed and seconds waited for them."""

  elements: int = 0
  wait_s: float = 0.0

  def add(self, other: "Counts") -> None:
    self.elements += other.elements
    self.wait_s += other.wait_s


class JobCounts:
  """Per-job consumer counts; the caller holds the dispatcher's lock."""

  def __init__(self):
    # (job id, client id) -> the client's latest cumulative report.
    self._live: dict[tuple[int, int], Counts] = {}
    # Job id -> what its clients that left had reported.
    self._left: dict[int, Counts] = {}

  def report(self, job_id: int, client_id: int, elements: int, wait_s: float) -> None:
    """A client's cumulative counts; a report older than one already had
    (a delayed heartbeat) lowers nothing."""
    counts = self._live.setdefault((job_id, client_id), Counts())
    counts.elements = max(counts.elements, int(elements))
    counts.wait_s = max(counts.wait_s, float(wait_s))

  def client_left(self, job_id: int, client_id: int) -> None:
    """Moves a client's counts into its job's total of clients that left."""
    counts = self._live.pop((job_id, client_id), None)
    if counts is not None:
      self._left.setdefault(job_id, Counts()).add(counts)

  def totals(self) -> dict[int, Counts]:
    """Job id -> everything its clients, live or gone, reported (one pass)."""
    totals: dict[int, Counts] = {}
    for job_id, counts in self._left.items():
      totals.setdefault(job_id, Counts()).add(counts)
    for (job_id, _), counts in self._live.items():
      totals.setdefault(job_id, Counts()).add(counts)
    return totals

  def keep(self, jobs: Container[int]) -> None:
    """Forgets the jobs that no longer exist (a job is deleted once its
    last client left, so only totals of clients that left remain)."""
    for job_id in [j for j in self._left if j not in jobs]:
      del self._left[job_id]
