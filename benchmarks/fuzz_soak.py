"""Soak fuzzing of the service's decoders and servers.

  python -m benchmarks.fuzz_soak --cases=1000000

Runs `--cases` mutated inputs through the in-process decoder targets of
`tests/fuzz/fuzz_targets.py` (frames, gRPC chunk streams, data-socket
streams, dataset specs, journal replay), in batches, each batch in a child
process under an address-space limit (a crash, segfault, hang or unbounded
allocation fails its batch, not the run), then `--server_cases` cases
against real dispatcher and worker processes on every port. Prints one row
per target: cases, crashes, hangs, the largest RSS growth seen, and the
answers by kind. Exits non-zero if anything crashed or hung.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import pathlib
import subprocess
import sys
import time

import numpy as np
import psutil

from benchmarks import record
from jaxfeed import _lifetime

REPO = pathlib.Path(__file__).resolve().parents[1]
FUZZ_DIR = REPO / "tests" / "fuzz"
sys.path[:0] = [str(FUZZ_DIR), str(REPO / "tests" / "service")]

# Share of the cases per in-process target: the cheap decoders get more.
WEIGHTS = {
  "wire_frame": 0.35,
  "element_chunks": 0.25,
  "data_socket_client": 0.10,
  "dataset_spec": 0.20,
  "journal_replay": 0.10,
}
BATCH = 20_000


class Row:
  """What one target's cases came to."""

  def __init__(self, target: str):
    self.target = target
    self.cases = self.crashes = self.hangs = 0
    self.rss_growth_mb = 0.0
    self.seconds = 0.0
    self.outcomes: collections.Counter = collections.Counter()
    self.failures: list = []


def run_batch(row: Row, cases: int, seed: int, rlimit_mb: int, timeout_s: float) -> None:
  env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
  started = time.monotonic()
  try:
    result = _lifetime.run(
      [
        sys.executable,
        str(FUZZ_DIR / "fuzz_targets.py"),
        f"--targets={row.target}",
        f"--cases={cases}",
        f"--seed={seed}",
        f"--rlimit_mb={rlimit_mb}",
      ],
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      text=True,
      timeout=timeout_s,
      env=env,
    )
  except subprocess.TimeoutExpired:
    row.hangs += 1
    row.failures.append(f"batch seed {seed}: no result within {timeout_s:.0f} s")
    return
  finally:
    row.seconds += time.monotonic() - started
  if result.returncode != 0:
    row.crashes += 1
    row.failures.append(
      f"batch seed {seed}: child exited {result.returncode}: {result.stderr[-500:]}"
    )
    return
  (stats,) = json.loads(result.stdout)
  row.cases += stats["cases"]
  row.crashes += stats["crashes"]
  row.hangs += stats["hangs"]
  row.rss_growth_mb = max(row.rss_growth_mb, stats["max_rss_growth_mb"])
  row.outcomes.update(stats["outcomes"])
  row.failures += [f"seed {seed}: {f[0]}: {f[1]} input {f[2][:300]}" for f in stats["failures"]]
  row.failures.sort(key=lambda f: "HANG" not in f)  # the rarer kind first


def run_servers(cases: int, seed: int) -> Row:
  """Fuzzes a real dispatcher and worker; checks they live, stay bounded and serve."""
  import jaxfeed  # pylint: disable=g-import-not-at-top
  from server_fuzz import ServerFuzzer  # pylint: disable=g-import-not-at-top
  from service_cluster import ServiceProcess  # pylint: disable=g-import-not-at-top

  row = Row("servers (dispatcher+worker)")
  started = time.monotonic()
  dispatcher = ServiceProcess("dispatcher", "--heartbeat_timeout_s=3")
  worker = ServiceProcess(
    "worker", f"--dispatcher_address={dispatcher.address}", "--heartbeat_interval_s=0.2"
  )
  processes = (dispatcher, worker)

  def read_one_epoch() -> None:
    dataset = jaxfeed.Dataset.range(20).batch(5)
    with dataset.distribute(dispatcher.address, timeout_s=60).make_iterator() as iterator:
      got = np.concatenate(list(iterator)).tolist()
    if got != list(range(20)):
      raise AssertionError(f"The servers served {got} after fuzzing.")

  rss = lambda: {p: psutil.Process(p.proc.pid).memory_info().rss / (1 << 20) for p in processes}
  alive = lambda: all(p.proc.poll() is None for p in processes)
  fuzzer = None
  try:
    read_one_epoch()
    before = rss()
    fuzzer = ServerFuzzer(dispatcher.address, worker.address, worker.data_address, seed)
    fuzzer.run(cases, alive)
    after = rss()
    row.rss_growth_mb = max(after[p] - before[p] for p in processes)
    row.cases = fuzzer.cases
    row.outcomes.update(fuzzer.outcomes)
    internal = sum(n for answer, n in fuzzer.outcomes.items() if "INTERNAL" in answer)
    row.crashes += internal
    if internal:
      row.failures.append(f"{internal} answers were INTERNAL (an unexpected exception)")
    if fuzzer.slowest_s > 30:
      row.hangs += 1
      row.failures.append(f"a case took {fuzzer.slowest_s:.1f} s")
    read_one_epoch()
  except Exception as e:  # pylint: disable=broad-except  # reported in the table
    row.crashes += 1
    row.failures.append(f"{type(e).__name__}: {e!s:.500}")
  finally:
    if fuzzer is not None:
      fuzzer.close()
    if not alive():
      row.crashes += 1
      row.failures.append("a server process died")
    worker.stop()
    dispatcher.stop()
  row.seconds = time.monotonic() - started
  return row


def print_table(rows: list[Row]) -> None:
  print(
    f"\n{'target':<28} {'cases':>9} {'crashes':>8} {'hangs':>6} {'max RSS growth':>15} "
    f"{'cases/s':>8}  errors by kind"
  )
  for row in rows:
    errors = ", ".join(f"{kind}={n}" for kind, n in row.outcomes.most_common() if kind != "ok")
    rate = row.cases / row.seconds if row.seconds else 0.0
    print(
      f"{row.target:<28} {row.cases:>9} {row.crashes:>8} {row.hangs:>6} "
      f"{row.rss_growth_mb:>12.1f} MB {rate:>8.0f}  ok={row.outcomes['ok']}, {errors}"
    )
  for row in rows:
    for failure in row.failures[:5]:
      print(f"  {row.target}: {failure}")


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument(
    "--cases", type=int, default=100_000, help="in-process cases, shared among the decoder targets"
  )
  parser.add_argument(
    "--server_cases",
    type=int,
    default=None,
    help="cases against the servers (default: cases / 200, 300 to 5000)",
  )
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument(
    "--rlimit_mb",
    type=int,
    default=1024,
    help="address space each child may use beyond its start-up size",
  )
  parser.add_argument("--targets", default="", help="comma-separated; empty: all")
  args = parser.parse_args()
  names = [n for n in args.targets.split(",") if n] or list(WEIGHTS)
  server_cases = args.server_cases
  if server_cases is None:
    server_cases = min(5000, max(300, args.cases // 200))
  rows = []
  for index, name in enumerate(names):
    row = Row(name)
    total = max(1, round(args.cases * WEIGHTS[name] / sum(WEIGHTS[n] for n in names)))
    for batch, start in enumerate(range(0, total, BATCH)):
      cases = min(BATCH, total - start)
      run_batch(
        row,
        cases,
        args.seed * 1_000_003 + index * 10_007 + batch,
        args.rlimit_mb,
        timeout_s=120 + cases * 0.05,
      )
      print(
        f"{name}: {row.cases} cases, {row.crashes} crashes, {row.hangs} hangs",
        file=sys.stderr,
        flush=True,
      )
    rows.append(row)
  if server_cases:
    rows.append(run_servers(server_cases, args.seed))
  print_table(rows)
  for row in rows:
    record.row(
      {
        "workload": "fuzz",
        "system": row.target,
        "cases": row.cases,
        "crashes": row.crashes,
        "hangs": row.hangs,
        "rss_growth_mb": round(row.rss_growth_mb, 1),
        "seconds": round(row.seconds, 1),
        "outcomes": dict(row.outcomes),
      },
      echo=False,
    )
  return 1 if any(row.crashes or row.hangs for row in rows) else 0


if __name__ == "__main__":
  with record.run("fuzz_soak"):
    code = main()
  sys.exit(code)
