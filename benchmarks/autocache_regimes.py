"""Autocache regimes: the autocache policy against always-cache and
never-cache while the compute per element grows (Cachew's switch).

  python -m benchmarks.autocache_regimes [--costs=0,10,30,100,200]
      [--elements=8000] [--epochs=10] [--element_kib=16] [--rounds=3]

A user's pipeline, as written: `Dataset.range(N).map(preprocess)
.autocache(directory, policy=...)` ("whole pass": its cache is written by a
complete pass and read whole), and `Dataset.from_source(source,
IndexSampler(N, shuffle=True)).map(preprocess).autocache(...)` ("by record":
kept by record index). `preprocess` spends `cost` microseconds of CPU, then
makes an element of `element_kib` KiB. Each measurement reads `epochs`
epochs (a `for` loop each, as a training loop does) from a fresh folder,
so the first epoch's profiling and writing are counted; the disk is synced
before each, so that no measurement pays for an earlier one's writes, and
one unrecorded measurement per kind warms the process up first. Modes run
interleaved, `rounds` times; a row gives the median rate. The policy's rows
give its decision and its rate over the better fixed mode's
(`of_best_fixed`).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time

import numpy as np

from benchmarks import record

WORKLOAD = "autocache regimes"
MODES = {"auto": "auto policy", "always": "always cache", "never": "never cache"}
KINDS = ("whole pass", "by record")


def preprocessing(cost_us: float, floats: int):
  """The map function: `cost_us` of CPU, then an element of `floats` float32."""

  def preprocess(x):
    started = time.perf_counter()
    while time.perf_counter() - started < cost_us * 1e-6:
      pass
    element = np.empty(floats, np.float32)
    element.fill(float(np.asarray(x).ravel()[0]))
    return element

  return preprocess


def pipeline(kind: str, cost_us: float, args: argparse.Namespace, folder: str, policy: str):
  import jaxfeed

  fn = preprocessing(cost_us, args.element_kib * 256)
  if kind == "whole pass":
    dataset = jaxfeed.Dataset.range(args.elements).map(fn)
  else:
    source = jaxfeed.ArraySource(np.arange(args.elements, dtype=np.int64))
    sampler = jaxfeed.IndexSampler(args.elements, shuffle=True, seed=0)
    dataset = jaxfeed.Dataset.from_source(source, sampler).map(fn)
  return dataset.autocache(folder, policy=policy)


def measure(kind: str, cost_us: float, policy: str, args: argparse.Namespace) -> tuple[float, str]:
  """(elements/s over the epochs, the last decision recorded) from a fresh folder."""
  from jaxfeed.ops import autocache_policy

  os.sync()  # the last measurement's writes reach the disk before this one
  folder = tempfile.mkdtemp(prefix="autocache-regimes-")
  try:
    dataset = pipeline(kind, cost_us, args, folder, policy)
    start = time.perf_counter()
    count = 0
    for _ in range(args.epochs):
      for _ in dataset:
        count += 1
    elapsed = time.perf_counter() - start
    records = autocache_policy.read_records(folder)
    return count / elapsed, records[0]["decision"] if records else "-"
  finally:
    shutil.rmtree(folder, ignore_errors=True)


def run(args: argparse.Namespace) -> list[dict]:
  rates: dict[tuple, list[float]] = {}
  decisions: dict[tuple, str] = {}
  order = list(MODES)
  for kind in KINDS:  # warms up the process (imports, allocator), not recorded
    measure(kind, args.costs[0], "always", args)
  for round_index in range(args.rounds):
    for kind in KINDS:
      for cost in args.costs:
        for policy in order[round_index % 3 :] + order[: round_index % 3]:
          rate, decision = measure(kind, cost, policy, args)
          rates.setdefault((kind, cost, policy), []).append(rate)
          decisions[(kind, cost, policy)] = decision
  rows = []
  for kind in KINDS:
    for cost in args.costs:
      median = {p: statistics.median(rates[(kind, cost, p)]) for p in MODES}
      best_fixed = max(median["always"], median["never"])
      for policy, label in MODES.items():
        row = {
          "workload": WORKLOAD,
          "system": "jaxfeed",
          "mode": label,
          "way": f"{kind}, {cost:g} us/element",
          "kind": kind,
          "cost_us": cost,
          "unit": "elements/s",
          "rate": round(median[policy]),
          "elements": args.elements,
          "epochs": args.epochs,
          "element_kib": args.element_kib,
          "rounds": args.rounds,
        }
        if policy == "auto":
          row["decision"] = decisions[(kind, cost, policy)]
          row["of_best_fixed"] = round(median[policy] / best_fixed, 3)
        rows.append(row)
  return rows


def _costs(text: str) -> list[float]:
  try:
    costs = [float(c) for c in text.split(",") if c]
  except ValueError:
    raise argparse.ArgumentTypeError(
      f"--costs takes microseconds separated by commas, e.g. 0,10,100; got {text!r}"
    ) from None
  if not costs or min(costs) < 0:
    raise argparse.ArgumentTypeError(f"--costs must be >= 0 microseconds, got {text!r}")
  return costs


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--costs", type=_costs, default=_costs("0,10,30,100,200"))
  parser.add_argument("--elements", type=int, default=8000)
  parser.add_argument("--epochs", type=int, default=10)
  parser.add_argument("--element_kib", type=int, default=16)
  parser.add_argument("--rounds", type=int, default=3)
  args = parser.parse_args(argv)
  for name in ("elements", "epochs", "element_kib", "rounds"):
    if getattr(args, name) < 1:
      parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
  with record.run("autocache_regimes"):
    for row in run(args):
      record.row(row)


if __name__ == "__main__":
  main()
