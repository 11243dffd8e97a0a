"""Per-job metrics of a real dispatcher process as an operator reads them:
labelled by job name, counters that never go down while clients come and go."""

from __future__ import annotations

import json
import time

import pytest

import jaxfeed
from test_metrics import DASHBOARD, _metrics_url, scrape, value

pytest.importorskip("prometheus_client.parser")

pytestmark = pytest.mark.timeout(120)


def _wait_for(url: str, name: str, want: float, **labels: str) -> dict:
  """The first scrape in which `name{labels}` equals `want` (30 s at most)."""
  deadline = time.monotonic() + 30
  while True:
    samples = scrape(url)
    got = samples.get((name, tuple(sorted(labels.items()))))
    if got == want:
      return samples
    assert time.monotonic() < deadline, (name, labels, got, want)
    time.sleep(0.05)


@pytest.mark.parametrize("goodbye", ["call", "worker"])
def test_a_jobs_counters_keep_what_a_client_that_left_consumed(cluster, tmp_path, goodbye):
  # "worker": from one live client on, clients say goodbye through a worker.
  flags = ["--goodbye_via_worker_clients=1"] if goodbye == "worker" else []
  dispatcher = cluster(
    "dispatcher",
    "--port=0",
    f"--work_dir={tmp_path}",
    "--metrics_port=0",
    "--nojournal_fsync",
    *flags,
  )
  url = _metrics_url(dispatcher)
  worker_url = _metrics_url(
    cluster(
      "worker",
      f"--dispatcher_address={dispatcher.address}",
      "--port=0",
      "--metrics_port=0",
      "--heartbeat_interval_s=0.2",
    )
  )
  dataset = jaxfeed.Dataset.range(10**6).distribute(dispatcher.address, job_name="train")
  elements = "jaxfeed_job_client_elements_total"
  with dataset.make_iterator() as staying:
    next(staying)
    with dataset.make_iterator() as leaving:
      for _ in range(100):
        next(leaving)
      before = _wait_for(url, elements, 101, job="train")
      time.sleep(1.2)  # the dispatcher counts its live clients once a second
    assert value(before, "jaxfeed_job_clients", job="train") == 2
    assert value(before, "jaxfeed_job_workers", job="train") == 1
    assert value(before, "jaxfeed_job_client_wait_seconds_total", job="train") > 0
    waited = value(before, "jaxfeed_job_client_wait_seconds_total", job="train")
    after = _wait_for(url, "jaxfeed_job_clients", 1, job="train")
    # The client that left took its 100 elements with it before the fix.
    assert value(after, elements, job="train") == 101
    assert value(after, "jaxfeed_job_client_wait_seconds_total", job="train") >= waited
    for _ in range(49):
      next(staying)
  # Closed right after its last element: its goodbye carries what its last
  # heartbeat may not have.
  idle = _wait_for(url, "jaxfeed_job_clients", 0, job="train")
  assert value(idle, elements, job="train") == 150
  assert value(idle, "jaxfeed_dispatcher_client_goodbyes_total", via=goodbye) == 2
  assert not [
    labels
    for name, labels in idle
    if name.startswith("jaxfeed_job_") and dict(labels).get("job") != "train"
  ]
  # The workers' per-job series carry the same label.
  assert value(scrape(worker_url), "jaxfeed_worker_elements_served_total", job="train") >= 150


def test_an_anonymous_job_is_labelled_by_its_id(cluster, tmp_path):
  dispatcher = cluster(
    "dispatcher", "--port=0", f"--work_dir={tmp_path}", "--metrics_port=0", "--nojournal_fsync"
  )
  url = _metrics_url(dispatcher)
  cluster(
    "worker", f"--dispatcher_address={dispatcher.address}", "--port=0", "--heartbeat_interval_s=0.2"
  )
  with jaxfeed.Dataset.range(10**6).distribute(dispatcher.address).make_iterator() as it:
    for _ in range(10):
      next(it)
    deadline = time.monotonic() + 30
    while True:
      samples = scrape(url)
      jobs = [
        dict(labels)["job"]
        for name, labels in samples
        if name == "jaxfeed_job_client_elements_total"
      ]
      if jobs and value(samples, "jaxfeed_job_client_elements_total", job=jobs[0]) == 10:
        break
      assert time.monotonic() < deadline, samples
      time.sleep(0.05)
  assert len(jobs) == 1 and jobs[0].isdigit() and int(jobs[0]) > 0
  assert value(samples, "jaxfeed_job_workers", job=jobs[0]) == 1


def test_the_dashboard_shows_each_jobs_workers_and_rates_by_job():
  dashboard = json.loads(DASHBOARD.read_text())
  queries = {t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])}
  by_job = {q for q in queries if "by (job)" in q and '{job=~"$job"}' in q}
  for name in (
    "jaxfeed_job_workers",
    "rate(jaxfeed_job_client_elements_total",
    "rate(jaxfeed_job_client_wait_seconds_total",
    "rate(jaxfeed_worker_elements_served_total",
  ):
    assert [q for q in by_job if name in q], (name, sorted(queries))
  assert "job" in [v["name"] for v in dashboard["templating"]["list"]]
