r"""What per-op statistics cost: W1 and W2 with `Options(stats=...)` on and off.

Rows, all in one run, taking turns one epoch each (on, off, on, off, ...)
so that changes of the machine's load hit both:

  * W1: in-memory images -> random crop/flip/normalize -> batch 128, as
    `benchmarks.workloads` builds it (batch-wise augment, and per element
    with AUTOTUNE);
  * W2: range(200k) -> map(x + 1) -> batch 1024 (`map(batched=True)`, and
    the per-element map).

Each row reports the median rate of its epochs with stats on and off and
the overhead, 1 - on / off (negative: on was faster, i.e. noise), and the
same for items per CPU second of this process (the sampling thread's CPU
included), which the machine's load disturbs less than wall time, and the
share of the process's CPU time used by the sampling thread itself (what
stats cost directly; the rest of a difference is the threads' switching
and the machine's noise).

  python -m benchmarks.stats_overhead [--rounds 9] [--scale 1.0] [--only W2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from benchmarks import workloads


def _w1(data, per_element: bool, stats: bool):
  import jaxfeed
  ds = workloads._w1_jaxfeed(data, batched=not per_element)  # pylint: disable=protected-access
  return ds.with_options(jaxfeed.Options(stats=stats))


def _w2(n: int, per_element: bool, stats: bool):
  import jaxfeed
  ds = jaxfeed.Dataset.range(n).map(workloads.add_one, batched=not per_element).batch(1024)
  return ds.with_options(jaxfeed.Options(stats=stats))


def _epoch_rates(dataset, count) -> tuple[float, float, float]:
  """Items per second, items per CPU second (this process, all threads) and
  the share of that CPU time the sampling thread used."""
  from jaxfeed.ops import op_stats
  items = 0
  start, cpu_start = time.perf_counter(), time.process_time()
  sampler_start = op_stats.sampler_cpu_seconds()
  with dataset.make_iterator() as iterator:
    for output in iterator:
      items += count(output)
  cpu = max(1e-9, time.process_time() - cpu_start)
  # close() joined the sampling thread, so its CPU time is counted.
  sampler = op_stats.sampler_cpu_seconds() - sampler_start
  return items / (time.perf_counter() - start), items / cpu, sampler / cpu


def run(rounds: int, scale: float, only: str | None = None) -> list[dict]:
  data = workloads.w1_data(scale)
  n = max(10_000, int(200_000 * scale))
  images = lambda b: len(b["label"])
  rows = {
      "W1": (lambda s: _w1(data, False, s), images, "images/s"),
      "W1 per-element": (lambda s: _w1(data, True, s), images, "images/s"),
      "W2": (lambda s: _w2(n, False, s), len, "elements/s"),
      "W2 per-element": (lambda s: _w2(n, True, s), len, "elements/s"),
  }
  lines = []
  for name, (make, count, unit) in rows.items():
    if only is not None and name != only:
      continue
    rates = {True: [], False: []}
    cpu_rates = {True: [], False: []}
    sampler_shares = []
    _epoch_rates(make(True), count)  # warm-up
    for r in range(rounds):
      order = (True, False) if r % 2 == 0 else (False, True)
      for stats in order:
        rate, cpu_rate, sampler_share = _epoch_rates(make(stats), count)
        rates[stats].append(rate)
        cpu_rates[stats].append(cpu_rate)
        if stats:
          sampler_shares.append(sampler_share)
    on, off = statistics.median(rates[True]), statistics.median(rates[False])
    cpu_on = statistics.median(cpu_rates[True])
    cpu_off = statistics.median(cpu_rates[False])
    line = {"workload": name, "unit": unit, "stats_on": round(on, 1),
            "stats_off": round(off, 1), "overhead": round(1 - on / off, 4),
            "per_cpu_second_on": round(cpu_on, 1),
            "per_cpu_second_off": round(cpu_off, 1),
            "cpu_overhead": round(1 - cpu_on / cpu_off, 4),
            "sampler_cpu_share": round(statistics.median(sampler_shares), 4),
            "rounds": rounds}
    print(json.dumps(line), flush=True)
    lines.append(line)
  return lines


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--rounds", type=int, default=9)
  parser.add_argument("--scale", type=float, default=1.0)
  parser.add_argument("--only", help="one workload row, e.g. 'W2 per-element'")
  args = parser.parse_args()
  run(args.rounds, args.scale, args.only)


if __name__ == "__main__":
  main()
