"""A short `benchmarks.autoscale_jobs` (W13): its rows say what each job got."""

from __future__ import annotations

import os

import pytest

from benchmarks import autoscale_jobs
from benchmarks import record

pytestmark = pytest.mark.timeout(120)


def test_a_short_per_job_run_gives_the_heavy_job_more_workers(monkeypatch):
  monkeypatch.setenv(
    "PYTHONPATH", os.pathsep.join([str(record.REPO), os.environ.get("PYTHONPATH", "")])
  )
  row = autoscale_jobs.measure(
    "per_job",
    {
      "seconds": 8.0,
      "max_workers": 4,
      "model_ms": 6.0,
      "light_ms": 2.0,
      "heavy_ms": 20.0,
      "interval_s": 0.4,
    },
  )
  light, heavy = row["jobs"]["light"], row["jobs"]["heavy"]
  assert light["workers"] == 1 and heavy["workers"] >= 2, row
  assert light["elements_per_s"] > 0 and heavy["elements_per_s"] > 0
  assert 0 < row["worker_seconds"] <= 8.0 * 4 and row["most_workers"] <= 4


def test_bad_options_name_what_is_allowed():
  with pytest.raises(SystemExit, match="unknown option '--sconds=3'; allowed: --seconds="):
    autoscale_jobs.main(["autoscale_jobs", "--sconds=3"])
  with pytest.raises(SystemExit, match=r"--policies must name some of .*got \['each'\]"):
    autoscale_jobs.main(["autoscale_jobs", "--policies=each"])


def test_rounds_are_reported_as_medians():
  rows = [
    {
      "way": "pool",
      "jobs": {"a": {"workers": w, "elements_per_s": r}},
      "worker_seconds": s,
      "most_workers": w,
      "load_before": [float(w)],
    }
    for w, r, s in ((1, 10.0, 5.0), (3, 30.0, 9.0), (2, 20.0, 7.0))
  ]
  row = autoscale_jobs.median_row(rows)
  assert row["jobs"] == {"a": {"workers": 2, "elements_per_s": 20.0}}
  assert row["worker_seconds"] == 7.0 and row["most_workers"] == 2 and row["rounds"] == 3
  assert row["load_before"] == [[1.0], [3.0], [2.0]]
