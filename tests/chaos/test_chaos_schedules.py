"""Seeded chaos schedules (tests/chaos/schedule.py) and hand-written ones.

Each run starts its own dispatcher and workers, reads while faults hit them
from outside (SIGKILL, SIGSTOP, restarts in place, connections reset with a
proxy or `ss -K`, stalled connections, a torn journal tail, a record that
segfaults the workers that map it, a bit flipped in the work_dir, a full
disk, a dispatcher restarted without its state or stopped past its heartbeat
timeout) and checks the guarantee of its mode (DESIGN.md §4). The seeds here
are a fixed sample that covers every mode and fault kind;
benchmarks/chaos_soak.py runs many more.
"""

from __future__ import annotations

import collections

import pytest

from schedule import FAULT_KINDS, MODES, POISON, Fault, Schedule, draw, run

pytestmark = pytest.mark.timeout(400)

# 5: an exactly-once read of a record that kills every worker; 9: an
# at-most-once read of one that kills the first, and a dispatcher restarted
# without its state; 12 and 16: a dispatcher stopped past its heartbeat
# timeout; 13, 14 and 17 flip a bit in the work_dir. DISK_SEEDS: a full
# disk, exactly-once and at-most-once.
DISK_SEEDS = (6, 25)
CI_SEEDS = (4, 5, 9, 12, 13, 14, 16, 17, 33) + DISK_SEEDS


def _assert_ok(record) -> None:
  assert record.ok, (
    f"seed {record.seed} ({record.mode}, faults {record.faults_injected}): {record.violation}"
  )


def test_seeds_cover_every_mode_and_fault_kind():
  schedules = [draw(seed) for seed in CI_SEEDS]
  assert {s.mode for s in schedules} == set(MODES)
  kinds = collections.Counter(f.kind for s in schedules for f in s.faults)
  kinds.update(POISON for s in schedules if s.poison)
  assert set(kinds) == set(FAULT_KINDS), set(FAULT_KINDS) - set(kinds)
  assert {s.poison for s in schedules if s.poison} == {"always", "once"}


def test_a_seed_always_draws_the_same_schedule():
  assert draw(12345) == draw(12345)
  assert draw(12345) != draw(12346)


@pytest.mark.parametrize("seed", CI_SEEDS)
def test_seeded_schedule_keeps_its_guarantee(seed, tmp_path):
  _assert_ok(run(draw(seed), str(tmp_path)))


def _schedule(mode: str, proxied: bool, *faults: Fault) -> Schedule:
  return Schedule(
    seed=0,
    mode=mode,
    num_records=400,
    batch_size=4,
    split_size=8,
    num_workers=1,
    worker_buffer_size=4,
    proxied_workers=proxied,
    slow_map=True,
    consumer_delay_s=0.002,
    faults=faults,
  )


# A broken or stalled connection to a live worker loses nothing, in any mode.
CONNECTION_FAULTS = {
  "proxy_cut": (True, Fault(20, "worker_cut")),
  "ss_cut": (False, Fault(20, "worker_cut")),
  "proxy_stall": (True, Fault(20, "worker_stall", duration_s=1.5)),
  "sigstop": (False, Fault(20, "worker_stop", duration_s=1.5)),
}


@pytest.mark.parametrize("fault", list(CONNECTION_FAULTS))
@pytest.mark.parametrize("mode", MODES)
def test_a_broken_connection_to_a_live_worker_loses_nothing(mode, fault, tmp_path):
  proxied, injected = CONNECTION_FAULTS[fault]
  record = run(_schedule(mode, proxied, injected), str(tmp_path))
  _assert_ok(record)
  assert record.faults_injected == [injected.kind]
  assert record.elements_checked == 400


@pytest.mark.parametrize("mode", MODES)
def test_dispatcher_connections_cut_and_stalled(mode, tmp_path):
  record = run(
    _schedule(
      mode,
      True,
      Fault(10, "dispatcher_cut"),
      Fault(30, "dispatcher_stall", duration_s=1.5),
      Fault(50, "dispatcher_cut"),
    ),
    str(tmp_path),
  )
  _assert_ok(record)
  assert record.elements_checked == 400


@pytest.mark.parametrize("mode", MODES)
def test_dispatcher_restarts_after_a_torn_journal_tail_twice(mode, tmp_path):
  # The second restart replays what the first one appended after the torn tail.
  record = run(
    _schedule(
      mode,
      False,
      Fault(15, "dispatcher_torn_restart"),
      Fault(45, "dispatcher_torn_restart", duration_s=0.2),
    ),
    str(tmp_path),
  )
  _assert_ok(record)
  assert record.faults_injected == ["dispatcher_torn_restart"] * 2


@pytest.mark.parametrize("mode", MODES)
def test_dispatcher_stopped_past_its_heartbeat_timeout(mode, tmp_path):
  # Woken, it takes its healthy worker for dead, at-most-once would lose
  # what the worker held; and the read outlives the stop.
  record = run(_schedule(mode, False, Fault(20, "dispatcher_pause", duration_s=6.5)), str(tmp_path))
  _assert_ok(record)
  assert record.faults_injected == ["dispatcher_pause"]
  assert record.elements_checked == 400


@pytest.mark.parametrize("mode", MODES)
def test_dispatcher_restarted_without_state_under_live_workers(mode, tmp_path):
  # No wrong data: the running read ends or fails saying why, and a new
  # pipeline read right after gets its own data only (schedule._probe).
  record = run(
    _schedule(mode, False, Fault(20, "dispatcher_stateless_restart", duration_s=0.3)), str(tmp_path)
  )
  _assert_ok(record)
  assert record.faults_injected == ["dispatcher_stateless_restart"]
