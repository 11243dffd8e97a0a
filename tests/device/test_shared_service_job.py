"""Two JAX processes (jax.distributed on CPU, gloo) reading one shared
`distributed_epoch` service job from real dispatcher and worker processes,
with a collective in every step: the job's batches are dealt out to the two
consumers as they ask, so their inputs end at different steps, and both must
still end at the same step."""

import json
import pathlib
import sys

import pytest

import shared_service_worker as worker
from jax_processes import run_processes

_SERVICE_TESTS = str(pathlib.Path(__file__).resolve().parents[1] / "service")
if _SERVICE_TESTS not in sys.path:
  sys.path.insert(0, _SERVICE_TESTS)

from service_cluster import ServiceProcess  # pylint: disable=g-import-not-at-top,wrong-import-position

WORKER = str(pathlib.Path(worker.__file__).resolve())
NUM_PROCESSES = 2
TIMEOUT_S = 150

pytestmark = pytest.mark.timeout(TIMEOUT_S + 60)


@pytest.fixture(scope="module")
def dispatcher():
  """A dispatcher (one position per split and batch row) and one worker."""
  started = [ServiceProcess("dispatcher", "--port=0", f"--split_size={worker.BATCH}")]
  try:
    started.append(
      ServiceProcess(
        "worker", f"--dispatcher_address={started[0].address}", "--heartbeat_interval_s=0.2"
      )
    )
    yield started[0].address
  finally:
    for process in reversed(started):  # workers first: they say goodbye
      process.stop()


def read_shared_job(
  dispatcher: str, job_name: str, policies: list[str], *mode: str
) -> dict[str, list[dict]]:
  """{end_of_input policy: [report of process 0, report of process 1]}."""
  timed_out, results = run_processes(
    WORKER, NUM_PROCESSES, [dispatcher, job_name, ",".join(policies), *mode], TIMEOUT_S
  )
  reports: dict[str, list[dict]] = {}
  for i, (returncode, stdout, stderr) in enumerate(results):
    assert not timed_out, f"process {i} hung (killed after {TIMEOUT_S} s):\n{stderr[-3000:]}"
    assert returncode == 0, f"process {i} failed:\n{stderr[-4000:]}"
    for line in stdout.splitlines():
      if line.startswith("{"):
        report = json.loads(line)
        reports.setdefault(report.pop("end_of_input"), []).append(report)
  return reports


@pytest.fixture(scope="module")
def uneven(dispatcher):
  """Both policies, read by one pair of processes (one job each)."""
  return read_shared_job(dispatcher, "shared", ["stop_at_shortest", "pad"])


def test_a_shared_job_ending_unevenly_stops_every_process_at_the_same_step(uneven):
  reports = uneven["stop_at_shortest"]
  assert reports[0]["steps"] == reports[1]["steps"]
  assert reports[0]["sums"] == reports[1]["sums"]
  assert reports[0]["batches"] == reports[0]["steps"]
  # An odd number of batches: one process had fewer, and both stopped there.
  assert 1 <= reports[0]["steps"] <= worker.BATCHES // 2


def test_a_shared_job_ending_unevenly_pads_to_the_longest_process_exactly_once(uneven):
  reports = uneven["pad"]
  assert reports[0] == reports[1]
  # Every batch of the job took part in one step of both processes' loops.
  assert sum(reports[0]["valid_rows"]) == worker.RECORDS
  assert sum(reports[0]["sums"]) == sum(range(worker.RECORDS))
  assert worker.BATCHES // 2 < reports[0]["steps"] < worker.BATCHES


@pytest.mark.parametrize("restored_before", [0, 1])
def test_a_shared_job_saved_at_step_k_resumes_in_new_processes_exactly_once(
  dispatcher, tmp_path, restored_before
):
  job = f"resume{restored_before}"
  saved = read_shared_job(dispatcher, job, ["pad"], "save", str(tmp_path))["pad"]
  if restored_before:
    # Restored from the same checkpoint, read on and preempted again: its
    # job stays on the dispatcher (job_gc_timeout_s), but the next restore
    # must read the rest of the epoch from the checkpoint again, on its own.
    again = read_shared_job(dispatcher, job, ["pad"], "restore_ahead", str(tmp_path))["pad"]
    assert again[0]["steps"] == worker.AHEAD
  resumed = read_shared_job(dispatcher, job, ["pad"], "restore", str(tmp_path))["pad"]
  assert saved[0] == saved[1] and resumed[0] == resumed[1]
  assert saved[0]["steps"] == worker.SAVE_AT + worker.AHEAD
  assert resumed[0]["batches"] == worker.SAVE_AT + resumed[0]["steps"]
  # Steps up to the checkpoint, then the restored read: every record once
  # over both processes (the AHEAD steps after the checkpoint came again).
  rows = saved[0]["valid_rows"][: worker.SAVE_AT] + resumed[0]["valid_rows"]
  sums = saved[0]["sums"][: worker.SAVE_AT] + resumed[0]["sums"]
  assert sum(rows) == worker.RECORDS
  assert sum(sums) == sum(range(worker.RECORDS))
