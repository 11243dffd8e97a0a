"""A short `benchmarks.autocache_regimes`: its rows say what each mode ran
at, and the policy's rows what it decided."""

import argparse

import pytest

from benchmarks import autocache_regimes


def test_rows_give_each_mode_and_the_policys_decision():
  args = argparse.Namespace(costs=[0.0, 2000.0], elements=150, epochs=3, element_kib=256, rounds=1)
  rows = autocache_regimes.run(args)
  assert len(rows) == 2 * 2 * 3  # kinds x costs x modes
  by = {(r["kind"], r["cost_us"], r["mode"]): r for r in rows}
  for kind in autocache_regimes.KINDS:
    # 256 KiB made in microseconds: computed; 2 ms of CPU each: cached.
    assert by[(kind, 0.0, "auto policy")]["decision"] == "compute"
    assert by[(kind, 2000.0, "auto policy")]["decision"] in ("read", "write")
    for cost in (0.0, 2000.0):
      assert all(by[(kind, cost, mode)]["rate"] > 0 for mode in autocache_regimes.MODES.values())
      assert by[(kind, cost, "auto policy")]["of_best_fixed"] > 0


def test_bad_arguments_are_named():
  with pytest.raises(SystemExit):
    autocache_regimes.main(["--costs=a,b"])
  with pytest.raises(SystemExit):
    autocache_regimes.main(["--epochs=0"])
