r"""What per-op statistics cost: W1 and W2 with `Options(stats=...)` on and off.

Workloads (rows):

  * W1: in-memory images -> random crop/flip/normalize -> batch 128, as
    `benchmarks.workloads` builds it (batch-wise augment, and per element
    with AUTOTUNE);
  * W2: range(200k) -> map(x + 1) -> batch 1024 (`map(batched=True)`, and
    the per-element map).

How it measures, all in one process and one run: every round takes one
sample with stats on and one with stats off, in alternating order (on, off,
then off, on, ...), so drifts of the machine's load hit both arms alike. A
sample runs whole epochs, each from a fresh iterator as a training loop
makes one per epoch, until it has lasted `--min_sample_s` (W2's epochs take
a few milliseconds: one epoch alone would time mostly the clock). Before
every sample, of either arm, the benchmark ends the sampling thread (which
outlives the last sampled pipeline by `op_stats.LINGER_S`) and waits for
it: both arms start alike, "off" runs with no sampling thread at all, and
"on" pays for starting it once per sample.

Per row it prints one JSON line with the median rate of each arm and the
overhead `1 - on / off` of those medians (negative: on was faster, i.e.
noise); the median and quartiles of the per-round ratios (each round's on
and off ran back to back: the quartiles show how much of the overhead is
noise); the same overhead for items per CPU second of this process (every
thread's CPU, the sampling thread's included; the machine's load disturbs
it less than wall time); the share of that CPU the sampling thread used and
its looks per second; the load average before and after the row; and, where
the pipeline picks a backend itself (W1 per element's AUTOTUNE), how often
each arm picked which (when the arms differ, their rates do not compare).

With `--amplify K` every round also takes a sample sampling K times as
often as the default; `extra_per_sample_ms` is then the wall (and CPU) time
each look at the stacks cost the pipeline, and `projected_overhead` that
cost at the default rate: an estimate that a loaded machine's noise hardly
touches, since the effect it measures is K times larger.

With `--wait_idle C` every round first waits (up to `IDLE_WAIT_S`) for half
a second in which the machine's other processes used less than C cores
(Linux's /proc/stat; on a shared machine the quiet moments between other
jobs): some costs show only on an idle machine (a thread waking on the idle
core, see `jaxfeed.ops.op_stats.SAMPLE_INTERVAL_S`) and load hides them.
`idle_rounds` says how many rounds found such a moment.

At the end a table gives each row's overheads against the 2% target.

  python -m benchmarks.stats_overhead [--rounds 9] [--scale 1.0]
      [--only 'W2 per-element'] [--min_sample_s 0.3] [--amplify 20]
      [--wait_idle 0.3]
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import time

from benchmarks import record
from benchmarks import workloads

TARGET = 0.02
"""The most stats on by default may cost (1 - on / off)."""

IDLE_WAIT_S = 30.0
"""The longest `--wait_idle` waits for a quiet moment before a round."""


def _busy_cores(seconds: float) -> float:
  """Cores that processes other than this one kept busy over `seconds`."""

  def read() -> tuple[float, float, float]:
    with open("/proc/stat", encoding="ascii") as f:
      ticks = [int(v) for v in f.readline().split()[1:]]
    return sum(ticks), ticks[3] + ticks[4], time.process_time()

  total, idle, cpu = read()
  time.sleep(seconds)
  total2, idle2, cpu2 = read()
  hz = os.sysconf("SC_CLK_TCK")
  elapsed = max(1, total2 - total) / (os.cpu_count() or 1)  # ticks per core
  busy = (total2 - total) - (idle2 - idle) - (cpu2 - cpu) * hz
  return max(0.0, busy / elapsed)


def _wait_idle(cores: float) -> bool:
  """Waits for half a second in which other processes used under `cores`."""
  deadline = time.monotonic() + IDLE_WAIT_S
  while time.monotonic() < deadline:
    if _busy_cores(0.5) < cores:
      return True
  return False


def _w1(data, per_element: bool, stats: bool):
  import jaxfeed

  ds = workloads._w1_jaxfeed(data, batched=not per_element)  # pylint: disable=protected-access
  return ds.with_options(jaxfeed.Options(stats=stats))


def _w2(n: int, per_element: bool, stats: bool):
  import jaxfeed

  ds = jaxfeed.Dataset.range(n).map(workloads.add_one, batched=not per_element).batch(1024)
  return ds.with_options(jaxfeed.Options(stats=stats))


def _backend(iterator) -> str | None:
  """The backend a process-or-thread op picked this epoch, if any."""
  for row in iterator.stats()["ops"]:
    if row.get("backend"):
      return str(row["backend"])
  return None


def _end_sampler() -> None:
  """Makes the lingering sampling thread end now, and waits until it has."""
  from jaxfeed.ops import op_stats

  linger, op_stats.LINGER_S = op_stats.LINGER_S, 0.0
  try:
    deadline = time.monotonic() + 30
    while op_stats.sampler_running() and time.monotonic() < deadline:
      time.sleep(0.01)
  finally:
    op_stats.LINGER_S = linger


def _sample(
  make, count, min_seconds: float, backends: collections.Counter
) -> tuple[float, float, float, float]:
  """Runs epochs for at least `min_seconds`; returns items per second, items
  per CPU second (this process, all threads), the sampling thread's share of
  that CPU and its looks per second."""
  from jaxfeed.ops import op_stats

  items = 0
  start, cpu_start = time.perf_counter(), time.process_time()
  sampler_start, samples_start = op_stats.sampler_cpu_seconds(), op_stats.samples_taken()
  while True:
    with make().make_iterator() as iterator:
      for output in iterator:
        items += count(output)
      backend = _backend(iterator)
    if backend is not None:
      backends[backend] += 1
    elapsed = time.perf_counter() - start
    if elapsed >= min_seconds:
      break
  cpu = max(1e-9, time.process_time() - cpu_start)
  sampler = op_stats.sampler_cpu_seconds() - sampler_start
  looks = op_stats.samples_taken() - samples_start
  return items / elapsed, items / cpu, sampler / cpu, looks / elapsed


def _quartiles(values: list[float]) -> list[float]:
  if len(values) < 2:
    return [values[0]] * 3 if values else [float("nan")] * 3
  q = statistics.quantiles(values, n=4, method="inclusive")
  return [q[0], q[1], q[2]]


def measure(
  name: str,
  make,
  count,
  unit: str,
  rounds: int,
  min_seconds: float,
  amplify: int = 0,
  wait_idle: float | None = None,
) -> dict:
  """One row: `make(stats)` builds the workload's dataset."""
  from jaxfeed.ops import op_stats

  arms = ["on", "off"] + (["amplified"] if amplify else [])
  rates = {arm: [] for arm in arms}
  cpu_rates = {arm: [] for arm in arms}
  sampler_share, looks = {arm: [] for arm in arms}, {arm: [] for arm in arms}
  backends = {arm: collections.Counter() for arm in arms}
  default_interval, default_cap = op_stats.SAMPLE_INTERVAL_S, op_stats.MAX_CPU_SHARE

  def take(arm: str, record: bool = True) -> None:
    # Every sample, of either arm, starts in a process without a sampling
    # thread, after the same short pause (an "on" sample's first epoch
    # starts the thread, its next epochs reuse it).
    _end_sampler()
    amplified = arm == "amplified"
    # Amplified: K times the rate, and no CPU cap that would slow it down.
    op_stats.SAMPLE_INTERVAL_S = default_interval / amplify if amplified else default_interval
    op_stats.MAX_CPU_SHARE = 1.0 if amplified else default_cap
    try:
      result = _sample(
        lambda: make(arm != "off"),
        count,
        min_seconds,
        backends[arm] if record else collections.Counter(),
      )
    finally:
      op_stats.SAMPLE_INTERVAL_S, op_stats.MAX_CPU_SHARE = default_interval, default_cap
    if record:
      for store, value in zip((rates, cpu_rates, sampler_share, looks), result):
        store[arm].append(value)

  load_before = os.getloadavg()[0]
  for arm in arms:  # warm-up: caches, imports, the autotuner's first choices
    take(arm, record=False)
  idle_rounds = 0
  for r in range(rounds):
    if wait_idle is not None:
      idle_rounds += _wait_idle(wait_idle)
    order = arms if r % 2 == 0 else arms[::-1]
    for arm in order:
      take(arm)
  load_after = os.getloadavg()[0]

  def overhead(values: dict, arm: str = "on") -> float:
    return 1 - statistics.median(values[arm]) / statistics.median(values["off"])

  pair = [1 - on / off for on, off in zip(rates["on"], rates["off"])]
  line = {
    "workload": name,
    "unit": unit,
    "stats_on": round(statistics.median(rates["on"]), 1),
    "stats_off": round(statistics.median(rates["off"]), 1),
    "overhead": round(overhead(rates), 4),
    "overhead_per_round_q1_median_q3": [round(q, 4) for q in _quartiles(pair)],
    "per_cpu_second_on": round(statistics.median(cpu_rates["on"]), 1),
    "per_cpu_second_off": round(statistics.median(cpu_rates["off"]), 1),
    "cpu_overhead": round(overhead(cpu_rates), 4),
    "sampler_cpu_share": round(statistics.median(sampler_share["on"]), 5),
    "looks_per_s": round(statistics.median(looks["on"]), 1),
    "rounds": rounds,
    "min_sample_s": min_seconds,
    "load_average": [round(load_before, 2), round(load_after, 2)],
    "cores": os.cpu_count(),
  }
  if wait_idle is not None:
    line["idle_rounds"] = idle_rounds
  if any(backends.values()):
    line["backends"] = {arm: dict(counter) for arm, counter in backends.items()}
  if amplify:
    extra_looks = statistics.median(looks["amplified"]) - statistics.median(looks["on"])
    if extra_looks > 0:
      # Seconds per item, amplified minus on, divided by the extra looks per
      # item: what one look cost, in wall time and in CPU time.
      rate_on, rate_amp = (statistics.median(rates[arm]) for arm in ("on", "amplified"))
      cpu_on, cpu_amp = (statistics.median(cpu_rates[arm]) for arm in ("on", "amplified"))
      looks_per_item = extra_looks / rate_amp
      wall_per_look = (1 / rate_amp - 1 / rate_on) / looks_per_item
      cpu_per_look = (1 / cpu_amp - 1 / cpu_on) / looks_per_item
      default_looks = statistics.median(looks["on"])
      line.update(
        {
          "amplified_looks_per_s": round(statistics.median(looks["amplified"]), 1),
          "amplified_overhead": round(overhead(rates, "amplified"), 4),
          "extra_per_sample_ms": {
            "wall": round(1e3 * wall_per_look, 4),
            "cpu": round(1e3 * cpu_per_look, 4),
          },
          "projected_overhead": round(wall_per_look * default_looks, 4),
        }
      )
  return line


def run(
  rounds: int,
  scale: float,
  only: str | None = None,
  min_seconds: float = 0.3,
  amplify: int = 0,
  wait_idle: float | None = None,
) -> list[dict]:
  data = workloads.w1_data(scale)
  n = max(10_000, int(200_000 * scale))
  images = lambda b: len(b["label"])
  rows = {
    "W1": (lambda s: _w1(data, False, s), images, "images/s"),
    "W1 per-element": (lambda s: _w1(data, True, s), images, "images/s"),
    "W2": (lambda s: _w2(n, False, s), len, "elements/s"),
    "W2 per-element": (lambda s: _w2(n, True, s), len, "elements/s"),
  }
  if only is not None and only not in rows:
    raise SystemExit(f"--only must be one of {sorted(rows)}, got {only!r}.")
  lines = []
  for name, (make, count, unit) in rows.items():
    if only is not None and name != only:
      continue
    line = measure(name, make, count, unit, rounds, min_seconds, amplify, wait_idle)
    record.row(line)
    lines.append(line)
  print(summary(lines), flush=True)
  return lines


def summary(lines: list[dict]) -> str:
  """A table of the rows' overheads against `TARGET`."""
  out = [
    f"\nstats on vs off (target: at most {100 * TARGET:.0f}% slower; negative: on was faster)",
    f"{'workload':16} {'wall':>7} {'rounds q1..q3':>17} {'CPU/item':>8} "
    f"{'projected':>9} {'load':>11}  verdict",
  ]
  for line in lines:
    q1, _, q3 = line["overhead_per_round_q1_median_q3"]
    projected = line.get("projected_overhead")
    worst = line["overhead"]
    verdict = "within target" if worst <= TARGET else "ABOVE target"
    if q1 <= TARGET < q3:
      verdict += " (noise spans the target)"
    out.append(
      f"{line['workload']:16} {100 * worst:+6.1f}% {100 * q1:+7.1f}..{100 * q3:+5.1f}% "
      f"{100 * line['cpu_overhead']:+7.1f}% "
      f"{'-' if projected is None else f'{100 * projected:+.2f}%':>9} "
      f"{line['load_average'][0]:5.1f}-{line['load_average'][1]:<5.1f}  {verdict}"
      + (f" ({line['idle_rounds']}/{line['rounds']} rounds idle)" if "idle_rounds" in line else "")
    )
  return "\n".join(out)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--rounds", type=int, default=9)
  parser.add_argument("--scale", type=float, default=1.0)
  parser.add_argument("--only", help="one workload row, e.g. 'W2 per-element'")
  parser.add_argument(
    "--min_sample_s",
    type=float,
    default=0.3,
    help="each sample runs whole epochs for at least this long",
  )
  parser.add_argument(
    "--amplify",
    type=int,
    default=0,
    help="also sample K times as often, to measure one look's cost",
  )
  parser.add_argument(
    "--wait_idle",
    type=float,
    default=None,
    metavar="CORES",
    help="before each round wait for other processes to use under CORES cores for half a second",
  )
  args = parser.parse_args()
  run(args.rounds, args.scale, args.only, args.min_sample_s, args.amplify, args.wait_idle)


if __name__ == "__main__":
  with record.run("stats_overhead"):
    main()
