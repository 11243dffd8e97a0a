"""The autocache policy on real worker processes: per job and point, the
worker computes, writes or reads, exports its decisions by job name, and
`jaxfeed inspect DIR` says why; distributed_epoch jobs use it too."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import service_udfs

import jaxfeed
from test_metrics import _metrics_url, scrape

pytest.importorskip("prometheus_client.parser")

pytestmark = pytest.mark.timeout(180)

DECISIONS = "jaxfeed_autocache_decisions_total"


def decisions_of(samples: dict, job: str) -> dict[str, float]:
  return {
    dict(labels)["decision"]: value
    for (name, labels), value in samples.items()
    if name == DECISIONS and dict(labels).get("job") == job
  }


def test_workers_decide_per_job_export_the_decisions_and_explain_them(cluster, tmp_path):
  folder = tmp_path / "autocache"
  dispatcher = cluster("dispatcher", "--port=0")
  worker = cluster(
    "worker",
    f"--dispatcher_address={dispatcher.address}",
    "--heartbeat_interval_s=0.2",
    "--metrics_port=0",
    f"--autocache_dir={folder}",
  )
  url = _metrics_url(worker)
  costly = jaxfeed.Dataset.range(200).map(service_udfs.costly).autocache().repeat(3)
  xs = [int(e["x"]) for e in costly.distribute(dispatcher.address, job_name="costly")]
  assert sorted(xs) == sorted(list(range(200)) * 3)
  cheap = jaxfeed.Dataset.range(1500).map(service_udfs.big_cheap).autocache().repeat(2)
  xs = [int(e["x"]) for e in cheap.distribute(dispatcher.address, job_name="cheap")]
  assert sorted(xs) == sorted(list(range(1500)) * 2)
  source = jaxfeed.ArraySource({"x": np.arange(300)})
  by_record = (
    jaxfeed.Dataset.from_source(source, jaxfeed.IndexSampler(300, shuffle=True, seed=0))
    .map(service_udfs.costly_record)
    .autocache()
  )
  splits = by_record.distribute(dispatcher.address, "distributed_epoch", job_name="splits")
  assert sorted(int(e["x"]) for e in splits) == list(range(300))

  samples = scrape(url)
  costly_made = decisions_of(samples, "costly")
  # Its first pass profiles and writes; the two after it read.
  assert costly_made.get("write", 0) >= 1 and costly_made.get("read", 0) >= 2, costly_made
  assert set(decisions_of(samples, "cheap")) == {"compute"}, decisions_of(samples, "cheap")
  assert set(decisions_of(samples, "splits")) & {"write", "read"}, decisions_of(samples, "splits")

  shown = subprocess.run(
    [sys.executable, "-m", "jaxfeed.cli", "inspect", str(folder)],
    capture_output=True,
    text=True,
    timeout=60,
    check=True,
  )
  report = json.loads(shown.stdout)
  made = {d["job"]: d for d in report["decisions"]}
  assert made["costly"]["decision"] == "read" and "saves most" in made["costly"]["why"]
  assert made["cheap"]["decision"] == "compute" and " faster" in made["cheap"]["why"]
  assert made["splits"]["decision"] in ("read", "write") and "kept" in made["splits"]["why"]
  assert made["cheap"]["measurements"]["read_s"] > made["cheap"]["measurements"]["compute_s"]
  kept = {e["entry"] for e in report["entries"]}
  assert made["costly"]["point"] in kept and made["cheap"]["point"] not in kept
