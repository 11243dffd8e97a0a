"""A flipped bit anywhere in a dispatcher's work_dir (journal and snapshot,
every record kind): a restarted dispatcher process refuses to start, naming
the file and the offset of the damaged line, or it serves exactly the right
state (the same dataset ids, every exactly-once position once)."""

from __future__ import annotations

import concurrent.futures
import pathlib
import shutil

import pytest

import work_dir_damage
from service_cluster import ServiceProcess

pytestmark = pytest.mark.timeout(300)

FLIP_SEEDS = range(30)
PARTS = 4  # the flips are checked in this many tests (each starts a dispatcher per flip)
# Every kind a busy dispatcher journals, and what its snapshot holds.
JOURNAL_KINDS = {
  "header",
  "dataset",
  "job",
  "task",
  "client",
  "splits",
  "splits_issued",
  "splits_acked",
  "splits_held",
  "task_finished",
  "task_lost",
  "client_released",
  "job_deleted",
  "fix_workers",
}
SNAPSHOT_KINDS = {
  "header",
  "ids",
  "dataset",
  "job",
  "task",
  "client",
  "splits",
  "splits_issued",
  "splits_reply",
  "splits_held",
  "splits_lost",
  "ticket_master",
  "fix_workers",
}


@pytest.fixture(scope="module")
def golden(tmp_path_factory):
  """A busy dispatcher's work_dir, SIGKILLed, and the state it must give."""
  work_dir = tmp_path_factory.mktemp("golden")
  truth = work_dir_damage.make_busy_work_dir(lambda *flags: start(work_dir, *flags))
  (work_dir / "LOCK").unlink()
  return work_dir, truth


def start(work_dir: pathlib.Path, *flags: str) -> ServiceProcess:
  return ServiceProcess(
    "dispatcher",
    "--port=0",
    f"--work_dir={work_dir}",
    *work_dir_damage.FLAGS,
    *flags,
    log_path=work_dir.parent / f"{work_dir.name}.log",
  )


def restart_on(work_dir: pathlib.Path, truth: work_dir_damage.Truth) -> str:
  """Starts a dispatcher on `work_dir`: "refused: <its last log line>", or
  "served" once it gave `truth` (AssertionError if it did not)."""
  try:
    dispatcher = start(work_dir)
  except RuntimeError:  # exited before serving
    log = (work_dir.parent / f"{work_dir.name}.log").read_text().strip().splitlines()
    return "refused: " + (log[-1] if log else "")
  try:
    truth.check(dispatcher.address)
  finally:
    dispatcher.kill()
  return "served"


def test_the_work_dir_holds_every_record_kind(golden):
  work_dir, _ = golden
  present = work_dir_damage.kinds_present(work_dir)
  assert {("journal", k) for k in JOURNAL_KINDS} <= present, present
  assert {("snapshot", k) for k in SNAPSHOT_KINDS} <= present, present


def test_an_intact_work_dir_serves_the_right_state(golden, tmp_path):
  work_dir, truth = golden
  copy = tmp_path / "intact"
  shutil.copytree(work_dir, copy)
  assert restart_on(copy, truth) == "served"


def test_the_flips_cover_the_record_kinds(golden):
  work_dir, _ = golden
  flips = work_dir_damage.flip_positions(work_dir, FLIP_SEEDS)
  assert len({f.kinds for f in flips}) >= 15
  assert {f.name for f in flips} >= {"snapshot.json"}
  assert len({f.name for f in flips}) >= 2


@pytest.mark.parametrize("part", range(PARTS))
def test_a_flipped_bit_refuses_to_start_naming_file_and_offset_or_serves_the_right_state(
  golden, tmp_path, part
):
  work_dir, truth = golden
  flips = work_dir_damage.flip_positions(work_dir, FLIP_SEEDS)
  flips += work_dir_damage.targeted_flips(work_dir)  # a valid line with other values
  flips = flips[part::PARTS]

  def one(index_flip):
    index, flip = index_flip
    copy = tmp_path / f"flip{index}"
    shutil.copytree(work_dir, copy)
    flip.apply(copy)
    try:
      outcome = restart_on(copy, truth)
    except AssertionError as e:
      return f"{flip}: served the wrong state: {e}"
    if outcome.startswith("refused") and not (
      str(copy / flip.name) in outcome and f"byte {flip.line_start} " in outcome
    ):
      return f"{flip}: refused without naming the file and the line's offset: {outcome}"
    return None if outcome == "served" or outcome.startswith("refused") else outcome

  with concurrent.futures.ThreadPoolExecutor(3) as pool:
    outcomes = list(pool.map(one, enumerate(flips)))
  failures = [o for o in outcomes if o is not None]
  assert not failures, "\n".join(failures)
