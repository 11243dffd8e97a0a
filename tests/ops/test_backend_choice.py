"""AUTOTUNE's choice between inline, threads and processes, fed measurements.

The chooser is driven here with injected rates (no timing): it measures
every candidate, picks the fastest (ties to the cheaper), keeps measuring
while the pick runs, and moves when the rates change what is fastest.
"""

import pytest

from jaxfeed.ops import backend_choice
from jaxfeed.ops.backend_choice import BackendChooser

ALL = ["process", "inline", "thread"]


def _measure(chooser, rates, seconds=0.1):
  """Feeds windows at `rates` (backend -> rate) until the chooser runs one
  backend; returns the backends it measured, in order."""
  measured = []
  while chooser.measuring:
    backend = chooser.backend()
    measured.append(backend)
    chooser.record(backend, rates[backend], seconds)
  return measured


def _run(chooser, rates, seconds):
  """Runs the pick for `seconds` in windows of 1 s (measuring when told);
  returns the backends that ran, window by window."""
  ran = []
  for _ in range(int(seconds)):
    backend = chooser.backend()
    ran.append(backend)
    chooser.record(backend, rates[backend], 1.0)
  return ran


def test_measures_every_candidate_in_turns_then_runs_the_fastest():
  chooser = BackendChooser(ALL)
  rates = {"process": 40_000, "inline": 30_000, "thread": 20_000}
  assert _measure(chooser, rates) == ALL  # processes are clearly fastest
  assert chooser.backend() == "process"
  summary = chooser.summary()
  assert summary["picked"] == "process" and not summary["measuring"]
  assert summary["rates"] == {"process": 40_000, "inline": 30_000, "thread": 20_000}
  assert summary["reason"].startswith("processes 40,000/s > inline 30,000/s > threads 20,000/s")


def test_backends_too_close_to_tell_are_measured_again():
  chooser = BackendChooser(ALL)
  rates = {"process": 40_000, "inline": 36_000, "thread": 20_000}
  assert _measure(chooser, rates) == ALL + ["process", "inline"]
  assert chooser.backend() == "process"


def test_a_backend_counts_with_its_best_window():
  chooser = BackendChooser(["inline", "process"])
  for rates in (
    {"inline": 30_000, "process": 27_000},  # processes disturbed
    {"inline": 31_000, "process": 45_000},
  ):
    chooser.record("inline", rates["inline"], 0.1)
    chooser.record("process", rates["process"], 0.1)
  assert chooser.backend() == "process"
  assert chooser.rates == {"inline": 31_000, "process": 45_000}


def test_the_first_measurement_follows_the_order_given():
  # Threads and inline are measured while the worker processes start, and
  # inline once more after: the window taken while they started only counts
  # if it is the best.
  order = ["thread", "inline", "process", "inline"]
  chooser = BackendChooser(ALL, order=order)
  windows = {"thread": [15_000], "inline": [20_000, 30_000], "process": [45_000]}
  measured = []
  while chooser.measuring:
    backend = chooser.backend()
    measured.append(backend)
    chooser.record(backend, windows[backend].pop(0), 0.1)
  assert measured == order and chooser.backend() == "process"
  assert chooser.rates == {"thread": 15_000, "inline": 30_000, "process": 45_000}


def test_inline_wins_when_threads_and_processes_are_slower():
  # The W1 trap: threads slower than one thread, processes barely faster
  # than threads -- inline must win.
  chooser = BackendChooser(ALL)
  _measure(chooser, {"process": 25_000, "inline": 30_000, "thread": 22_000})
  assert chooser.backend() == "inline"


def test_a_tie_goes_to_the_backend_that_costs_less_cpu():
  chooser = BackendChooser(ALL)
  _measure(chooser, {"process": 30_500, "inline": 30_000, "thread": 30_400})
  assert chooser.backend() == "inline"
  assert "less CPU" in chooser.summary()["reason"]


def test_keeps_measuring_and_switches_back_when_the_load_changes():
  chooser = BackendChooser(ALL)
  rates = {"process": 40_000, "inline": 30_000, "thread": 20_000}
  _measure(chooser, rates)
  assert chooser.backend() == "process"
  # The machine gets busy: processes fall to 12k/s, inline to 25k/s. The
  # fall sends the chooser measuring the others again, within a few windows.
  busy = {"process": 12_000, "inline": 25_000, "thread": 15_000}
  ran = _run(chooser, busy, 8)
  assert ran[:2] == ["process"] * 2 and "inline" in ran
  assert chooser.backend() == "inline"
  assert chooser.rates["process"] == 12_000
  # Quiet again: inline runs on at 30k/s, which is no fall, until the next
  # periodic measurement finds processes faster and moves back.
  ran = _run(chooser, rates, backend_choice.EXPLORE_FIRST_S + 4)
  assert ran[0] == "inline" and ran[-1] == "process"
  first_process = ran.index("process")
  assert ran[first_process - 1] != "process"  # measured, then chosen


def test_a_short_dip_of_the_rate_measures_nothing_again():
  chooser = BackendChooser(ALL)
  rates = {"process": 40_000, "inline": 30_000, "thread": 20_000}
  _measure(chooser, rates)
  dip = {"process": 10_000, "inline": 30_000, "thread": 20_000}
  ran = [chooser.backend()]
  chooser.record("process", dip["process"], 0.5)  # one bad window ...
  ran += _run(chooser, rates, 3)  # ... then back to normal
  assert ran == ["process"] * 4


def test_noisy_windows_around_the_same_rate_measure_nothing_again():
  # A loaded machine: every other window of the pick is slowed down (other
  # processes took the cores), as its windows were when it was chosen by
  # its best one. Nothing changed: the others, slower, are not run again.
  chooser = BackendChooser(ALL)
  _measure(chooser, {"process": 20_000, "inline": 40_000, "thread": 10_000})
  ran = []
  for rate in [40_000, 8_000, 9_000] * 3:
    ran.append(chooser.backend())
    chooser.record(ran[-1], rate, 0.5)
  assert ran == ["inline"] * 9 and not chooser.measuring


def test_moves_when_the_function_changes_what_is_fastest():
  chooser = BackendChooser(ALL)
  _measure(chooser, {"process": 20_000, "inline": 30_000, "thread": 10_000})
  assert chooser.backend() == "inline"
  # The function gets dearer (a cache went cold): inline's rate falls.
  dear = {"process": 8_000, "inline": 4_000, "thread": 3_000}
  _run(chooser, dear, 8)
  assert chooser.backend() == "process"


def test_the_pick_stays_when_others_are_not_faster_by_the_margin():
  chooser = BackendChooser(ALL)
  _measure(chooser, {"process": 40_000, "inline": 30_000, "thread": 20_000})
  close = {"process": 40_000, "inline": 42_000, "thread": 20_000}  # +5% only
  ran = _run(chooser, close, 3 * backend_choice.EXPLORE_FIRST_S)
  assert "inline" in ran  # measured again ...
  assert chooser.backend() == "process"  # ... but not worth a switch
  assert "no switch" in chooser.summary()["reason"]


def test_measures_less_often_while_the_pick_stays_the_best():
  chooser = BackendChooser(ALL)
  rates = {"process": 40_000, "inline": 30_000, "thread": 20_000}
  _measure(chooser, rates)
  first = chooser.explore_every
  ran = _run(chooser, rates, 200)
  measurements = sum(1 for a, b in zip(ran, ran[1:]) if a == "process" and b != "process")
  assert chooser.explore_every > first
  assert chooser.explore_every <= backend_choice.EXPLORE_MAX_S
  assert 2 <= measurements <= 5  # 10 s, then 20, 40, 80, ... of running
  assert chooser.backend() == "process"


def test_excluded_backends_are_never_run_and_say_why():
  chooser = BackendChooser(ALL, excluded={"process": "one core"})
  assert _measure(chooser, {"inline": 1.0, "thread": 2.0}) == ["inline", "thread"]
  assert "no processes: one core" in chooser.summary()["reason"]
  # A backend that fails while being measured is dropped from the round.
  chooser = BackendChooser(ALL)
  assert chooser.backend() == "process"
  chooser.exclude("process", "they could not start")
  assert _measure(chooser, {"inline": 2.0, "thread": 1.0}) == ["inline", "thread"]
  assert chooser.backend() == "inline"


def test_a_single_candidate_runs_without_measuring():
  chooser = BackendChooser(ALL, excluded={"process": "x", "thread": "y"})
  assert chooser.backend() == "inline" and not chooser.measuring
  with pytest.raises(ValueError, match="no candidate"):
    BackendChooser(["inline"], excluded={"inline": "z"})
