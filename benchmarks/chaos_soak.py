"""Many seeded chaos schedules against the service; a table of what broke.

  python -m benchmarks.chaos_soak [--runs=1000] [--seed=0] [--verbose]

Runs the schedules of seeds seed, seed+1, ... (tests/chaos/schedule.py: a
processing mode, a small pipeline and a sequence of faults: workers killed,
stopped, restarted, connections cut or stalled, the dispatcher restarted,
its journal torn, a bit flipped in its work_dir, its disk full for a while,
the dispatcher restarted without its state or stopped past its heartbeat
timeout, a record that segfaults the workers that map it) one after
another, each on its own dispatcher and worker processes, and prints per
mode the runs, faults injected by kind, elements checked, violations of the
mode's guarantee and hangs, then the seeds of the failing runs with their
first violation line, and those of runs whose cluster did not start (not
counted). Rerun one with
`--runs=1 --seed=SEED --verbose`.
"""

from __future__ import annotations

import argparse
import collections
import pathlib
import sys
import tempfile
import time

_TESTS = pathlib.Path(__file__).resolve().parents[1] / "tests"
for _folder in ("chaos", "service"):
  if str(_TESTS / _folder) not in sys.path:
    sys.path.insert(0, str(_TESTS / _folder))

import schedule as schedule_lib  # pylint: disable=g-import-not-at-top,wrong-import-position

from benchmarks import record as results  # pylint: disable=wrong-import-position


def _table(records: list) -> str:
  modes = sorted({r.mode for r in records}) + ["all"]
  rows = []
  for mode in modes:
    of_mode = [r for r in records if mode in ("all", r.mode)]
    faults = collections.Counter(k for r in of_mode for k in r.faults_injected)
    rows.append(
      (
        mode,
        len(of_mode),
        sum(faults.values()),
        sum(r.elements_checked for r in of_mode),
        sum(1 for r in of_mode if r.violation and not r.hang),
        sum(1 for r in of_mode if r.hang),
      )
    )
  header = ("mode", "runs", "faults", "elements", "violations", "hangs")
  lines = ["%-16s %6s %7s %10s %10s %6s" % header]
  lines += ["%-16s %6d %7d %10d %10d %6d" % row for row in rows]
  by_kind = collections.Counter(k for r in records for k in r.faults_injected)
  lines.append("")
  lines.append("faults injected by kind:")
  lines += [f"  {kind:32s} {by_kind[kind]:6d}" for kind in schedule_lib.FAULT_KINDS]
  flips = collections.Counter(f for r in records for f in r.flips)
  lines.append(
    f"work_dir bit flips: {flips['refused']} refused to start naming file and "
    f"offset, {flips['served']} served (the read's guarantee checked)"
  )
  return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--runs", type=int, default=1000)
  parser.add_argument("--seed", type=int, default=0, help="seed of the first run")
  parser.add_argument(
    "--verbose",
    action="store_true",
    help="print each schedule (failing runs' schedules and whole violations are always printed)",
  )
  args = parser.parse_args(argv)
  if args.runs < 1:
    parser.error(f"--runs must be >= 1, got {args.runs}")
  records = []
  errors = []  # (seed, why): runs whose cluster did not start, not counted
  start = time.monotonic()
  for seed in range(args.seed, args.seed + args.runs):
    schedule = schedule_lib.draw(seed)
    try:
      with tempfile.TemporaryDirectory(prefix="chaos_soak_") as work_dir:
        record = schedule_lib.run(schedule, work_dir)
    except RuntimeError as e:  # a server did not start (say, its port was taken)
      errors.append((seed, str(e).splitlines()[0]))
      print(f"seed {seed:6d} {schedule.mode:16s} ERROR     {errors[-1][1]}", flush=True)
      continue
    records.append(record)
    status = "ok" if record.ok else ("HANG" if record.hang else "VIOLATION")
    print(
      f"seed {seed:6d} {record.mode:16s} {status:9s} faults="
      f"{','.join(record.faults_injected) or '-'} elements={record.elements_checked} "
      f"{record.elapsed_s:.1f}s",
      flush=True,
    )
    if args.verbose or record.violation:  # a failure's whole story, servers' logs too
      print(f"  {schedule}")
      if record.violation:
        print("  " + record.violation.replace("\n", "\n  "))
  print()
  print(f"{len(records)} runs in {time.monotonic() - start:.0f}s")
  print(_table(records))
  failing = [r for r in records if not r.ok]
  results.row(
    {
      "workload": "W9",
      "system": "jaxfeed service",
      "runs": len(records),
      "violations": sum(1 for r in records if r.violation and not r.hang),
      "hangs": sum(1 for r in records if r.hang),
      "runs_not_made": len(errors),
      "failing_seeds": [r.seed for r in failing],
    },
    echo=False,
  )
  print()
  print(f"failing seeds ({len(failing)}):")
  for r in failing:
    first = r.violation.splitlines()[0] if r.violation else ""
    print(f"  {r.seed:6d} {r.mode:16s} {','.join(r.faults_injected)}: {first}")
  if errors:
    print()
    print(f"runs not made ({len(errors)}):")
    for seed, why in errors:
      print(f"  {seed:6d} {why}")
  return 1 if failing or errors else 0


if __name__ == "__main__":
  with results.run("chaos_soak"):
    code = main()
  sys.exit(code)
