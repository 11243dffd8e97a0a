"""A small `benchmarks.w6_service` (a tenth of W6's sequences, one epoch,
jaxfeed only) runs to the end: the coordinated read's counters come from
its iterators' stats, and every consumer's batch of a round has one
padded length."""

from __future__ import annotations

import pytest

from benchmarks import w6_service
from benchmarks import workloads

pytestmark = pytest.mark.timeout(120)


def test_coordinated_and_uncoordinated_reads_at_a_tenth_of_the_scale():
  lengths = workloads.w3_lengths(0.1)
  coordinated, uncoordinated = w6_service.run_jaxfeed(lengths, seed=0, epochs=1)
  assert coordinated["steps"] > 0 and coordinated["bucket_agreement"] == 1.0
  # From the consumers' `stats()`: every sequence is a row served, or one
  # dropped at the end of the job.
  # (bucket remainders are always left over at this size).
  assert 0 < coordinated["rows_dropped_at_end"] <= len(lengths) - coordinated["sequences"]
  assert coordinated["rounds_skipped"] >= 0
  assert coordinated["peak_window_batches_per_worker"] >= 1
  assert uncoordinated["steps"] > 0 and len(uncoordinated["sequences_per_s_per_epoch"]) == 1


def test_too_few_sequences_for_a_step_is_named():
  with pytest.raises(ValueError, match=r"use a larger --scale"):
    w6_service._summary("jaxfeed service", "coordinated", [], 10, 1.0, 100)  # pylint: disable=protected-access
