"""The recorded runs as the report reads them, and the headline rows: which
recorded row each figure of the results tables comes from."""

from __future__ import annotations

import dataclasses
import pathlib
from typing import Callable, Iterator, Optional

from benchmarks import record

Row = dict
Context = dict
Found = Optional[tuple[Row, Context]]

PEER_NAMES = {"grain": "Grain", "tf.data": "tf.data"}


class Results:
  """Every recorded row with its run's context; a later run's row with the
  same (workload, system, way, mode) wins, as `record.save` keeps it."""

  def __init__(self, runs: list[dict]):
    self._runs = runs

  @classmethod
  def load(cls, directory: pathlib.Path | None = None) -> "Results":
    return cls(record.runs(directory))

  def benchmarks(self) -> list[str]:
    return sorted({entry["benchmark"] for entry in self._runs})

  def runs_of(self, benchmark: str) -> Iterator[tuple[Context, list[Row]]]:
    for entry in self._runs:
      if entry["benchmark"] == benchmark:
        yield entry["context"], entry["rows"]

  def rows(self, benchmark: str, workload: str) -> list[tuple[Row, Context]]:
    latest: dict[tuple, tuple[Row, Context]] = {}
    for context, rows in self.runs_of(benchmark):
      for line in rows:
        if line.get("workload") == workload:
          latest[record.row_key(line)] = (line, context)
    return list(latest.values())

  def get(
    self, benchmark: str, workload: str, system: str | None = None, way: str | None = None
  ) -> Found:
    for line, context in reversed(self.rows(benchmark, workload)):
      if (system is None or line.get("system") == system) and (
        way is None or line.get("way") == way
      ):
        return line, context
    return None

  def commits(self) -> set[str]:
    return {entry["context"].get("commit", "unknown") for entry in self._runs} - {"unknown"}


# ----------------------------------------------------------------------------
# Figures as text
# ----------------------------------------------------------------------------
def three_digits(value: float) -> str:
  return f"{value:.0f}" if value >= 100 else f"{value:.1f}" if value >= 10 else f"{value:.2f}"


def rate(value: float) -> str:
  """Three significant digits: 18.5M, 2.07M, 147k, 50.8k; 7549, 42.5 below 10k."""
  if value >= 1e6:
    return three_digits(value / 1e6) + "M"
  if value >= 1e4:
    return three_digits(value / 1e3) + "k"
  if value >= 100:
    return f"{value:.0f}"
  return f"{value:.3g}"


def ratio(value: float) -> str:
  return f"{value:.0f}x" if value >= 100 else f"{value:.1f}x" if value >= 10 else f"{value:.2f}x"


def percent(fraction: float) -> str:
  """0.78%, 2.82%, 29.9%."""
  return f"{fraction * 100:.2f}%" if abs(fraction) < 0.1 else f"{fraction * 100:.1f}%"


def load_range(context: Context) -> str:
  start = context.get("load_average_start", [None])[0]
  end = context.get("load_average_end", [None])[0]
  if start is None or end is None:
    return "load not recorded"
  low, high = sorted((start, end))
  return f"load {low:.1f}" if f"{low:.1f}" == f"{high:.1f}" else f"load {low:.1f}-{high:.1f}"


def measured(*contexts: Context) -> str:
  """`813439c`, load 5.1-6.2 (a + after the commit: uncommitted changes)."""
  seen, parts = set(), []
  for context in contexts:
    commit = context.get("commit", "unknown")[:7] + ("+" if context.get("dirty") else "")
    cores = context.get("machine", {}).get("cores", "?")
    text = f"`{commit}`, {cores} cores, {load_range(context)}"
    if text not in seen:
      seen.add(text)
      parts.append(text)
  return "; ".join(parts)


def describe_run(context: Context) -> str:
  machine = context.get("machine", {})
  versions = context.get("versions", {})
  peers = ", ".join(f"{k} {v}" for k, v in sorted(versions.items()) if k != "python")
  dirty = " (with uncommitted changes)" if context.get("dirty") else ""
  return (
    f"`{context.get('command', '?')}` at commit `{context.get('commit', '?')[:12]}`"
    f"{dirty}, {context.get('date', '?')}: {machine.get('cores', '?')} cores "
    f"({machine.get('cpu_model', '?')}), load average "
    f"{context.get('load_average_start', ['?'])[0]} at start and "
    f"{context.get('load_average_end', ['?'])[0]} at end; Python "
    f"{versions.get('python', '?')}, {peers}."
  )


def _cell(text: str) -> str:
  return text.replace("|", "\\|").replace("\n", " ")


def table(header: list[str], rows: list[list[str]]) -> str:
  """A Markdown table."""
  lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
  lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
  return "\n".join(lines) + "\n"


_FIGURES = (
  ("ratio_vs_best_peer", ratio),
  ("padding_fraction", percent),
  ("fraction_of_plain_socket", lambda x: f"{x:.2f}"),
  ("overhead_vs_host_only", percent),
  ("cpu_us_per_image", lambda x: f"{x:.0f} us"),
  ("tokens_per_cpu_second", rate),
  ("modelled_time_per_real_token", lambda x: f"{x:.3f}"),
  ("median_ms", lambda x: f"{x:g} ms"),
  ("first_batch_ms", lambda x: f"{x:g} ms"),
  ("ratio_vs_limit", percent),
  ("overhead", percent),
  ("cpu_overhead", percent),
  ("rpcs_per_s", rate),
  ("dispatcher_cpu_share", lambda x: f"{x:g} core"),
  ("failed_rpcs", str),
  ("restart_replay_s", lambda x: f"{x:g} s"),
  ("peak_rss_mb", lambda x: f"{x:.0f} MB"),
  ("decision", str),
  ("of_best_fixed", lambda x: f"{x:.2f}"),
)


def rows_table(rows: list[Row]) -> str:
  """A run's rows: what each measured, its rate and the figures it has of
  `_FIGURES`."""
  keys = [(k, f) for k, f in _FIGURES if any(k in line for line in rows)]
  bare = [line for line in rows if "rate" not in line and not any(k in line for k, _ in keys)]
  body = []
  for line in rows:
    what = " / ".join(str(line[k]) for k in ("system", "way", "mode") if k in line)
    value = (
      f"{rate(line['rate'])} {line.get('unit', '')}".strip()
      if isinstance(line.get("rate"), (int, float))
      else ""
    )
    body.append(
      [str(line.get("workload", "")), what, value]
      + [f(line[k]) if isinstance(line.get(k), (int, float, str)) else "" for k, f in keys]
      + ([_scalars(line) if line in bare else ""] if bare else [])
    )
  return table(
    ["workload", "system", "rate"] + [k for k, _ in keys] + (["figures"] if bare else []), body
  )


def _scalars(line: Row, most: int = 8) -> str:
  """A row's first numbers, for rows with no rate and none of `_FIGURES`."""
  flat = {}
  for key, value in line.items():  # one level of nesting: {"ratios": {"a": 1.5}} -> ratios.a
    flat.update(
      {f"{key}.{k}": v for k, v in value.items()} if isinstance(value, dict) else {key: value}
    )
  found = [
    f"{k} {v:g}" for k, v in flat.items() if isinstance(v, (int, float)) and not isinstance(v, bool)
  ]
  return ", ".join(found[:most]) + (", ..." if len(found) > most else "")


# ----------------------------------------------------------------------------
# Headline rows
# ----------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Headline:
  """A row of the results tables, and the runs its figures come from."""

  workload: str
  jaxfeed: str
  peer: str
  ratio: str
  target: str
  runs: tuple[Context, ...]

  @property
  def measured(self) -> str:
    return measured(*self.runs)

  @property
  def commands(self) -> str:
    """The recorded commands, to rerun the row."""
    found = dict.fromkeys(f"`{context.get('command', '?')}`" for context in self.runs)
    return "; ".join(found)


def _best(found: list[tuple[Row, Context]]) -> tuple[Row, Context] | None:
  return max(found, key=lambda rc: rc[0]["rate"]) if found else None


def _peer(system: str) -> str:
  return PEER_NAMES.get(system.split("-")[0], system)


def _backend(picked: object) -> str:
  """ " (on processes)": the backend AUTOTUNE picked, as W1's row gives it
  (a dict per op, or a list of them)."""
  ops = picked if isinstance(picked, list) else [picked]
  backends = [str(op["backend"]) for op in ops if isinstance(op, dict) and op.get("backend")]
  return f" (on {', '.join(backends)})" if backends else ""


def w1(results: Results) -> Headline | None:
  """W1 as users write it (`benchmarks.w1_per_element`): AUTOTUNE against
  the best main peer row."""
  auto = results.get("w1_per_element", "W1 per-element", "jaxfeed AUTOTUNE")
  if auto is None:
    return None
  peers = [
    rc
    for rc in results.rows("w1_per_element", "W1 per-element")
    if rc[0].get("main_row") and rc[0]["system"].startswith(("tf.data", "grain"))
  ]
  best = _best(peers)
  picked = _backend(auto[0].get("picked"))
  return Headline(
    "W1 images/s, a per-element function as users write it, AUTOTUNE",
    rate(auto[0]["rate"]) + picked,
    f"{best[0]['system']} {rate(best[0]['rate'])}" if best else "",
    ratio(auto[0]["rate"] / best[0]["rate"]) if best else "",
    ">= 1.5x tf.data and Grain",
    (auto[1], *([best[1]] if best else [])),
  )


def _vs_best_peer(
  results: Results,
  benchmark: str,
  workload: str,
  system: str,
  title: str,
  target: str,
  padding: bool = False,
) -> Headline | None:
  """`system` against the fastest tf.data or Grain row of its workload."""
  mine = results.get(benchmark, workload, system)
  if mine is None:
    return None
  best = _best(
    [
      rc
      for rc in results.rows(benchmark, workload)
      if rc[0].get("system", "").startswith(tuple(PEER_NAMES))
      and isinstance(rc[0].get("rate"), (int, float))
    ]
  )
  pad = lambda line: f", {percent(line['padding_fraction'])} padding" if padding else ""
  return Headline(
    title,
    rate(mine[0]["rate"]) + pad(mine[0]),
    f"{_peer(best[0]['system'])} {rate(best[0]['rate'])}{pad(best[0])}" if best else "",
    ratio(mine[0]["rate"] / best[0]["rate"]) if best else "",
    target,
    (mine[1], *([best[1]] if best else [])),
  )


def w2_per_element(results: Results) -> Headline | None:
  return _vs_best_peer(
    results, "run", "W2", "jaxfeed-per-element", "W2 elements/s, `map` per element", ">= 2x Grain"
  )


def w2_batched(results: Results) -> Headline | None:
  return _vs_best_peer(
    results, "run", "W2", "jaxfeed", "W2 elements/s, `map(batched=True)`", ">= 2x Grain"
  )


def w3_bucketing(results: Results) -> Headline | None:
  return _vs_best_peer(
    results,
    "run",
    "W3-bucketing",
    "jaxfeed-bucketing",
    "W3a bucketing, sequences/s",
    ">= tf.data",
    padding=True,
  )


def w3_packing(results: Results) -> Headline | None:
  return _vs_best_peer(
    results,
    "run",
    "W3-packing",
    "jaxfeed-packing",
    "W3b packing (first fit), sequences/s",
    ">= 3x Grain, padding <= Grain's",
    padding=True,
  )


def _two_workers(
  results: Results, benchmark: str, workload: str, name: str
) -> list[tuple[Row, Context]]:
  return [rc for rc in (results.get(benchmark, workload, name.format(n)) for n in (1, 2)) if rc]


def w4(results: Results) -> Headline | None:
  mine = _two_workers(results, "w4_service", "W4", "jaxfeed service ({} workers)")
  if not mine:
    return None
  best = _best(_two_workers(results, "w4_service", "W4", "tf.data service ({} workers)"))
  return Headline(
    "W4 images/s through the service, 1 / 2 workers",
    " / ".join(rate(line["rate"]) for line, _ in mine),
    f"tf.data service {rate(best[0]['rate'])}" if best else "",
    " / ".join(ratio(line["rate"] / best[0]["rate"]) for line, _ in mine) if best else "",
    ">= 1.5x",
    tuple(c for _, c in mine),
  )


def w4t(results: Results) -> Headline | None:
  mine = _two_workers(results, "w4_service", "W4t", "jaxfeed service ({} workers)")
  vs = _two_workers(results, "w4_service", "W4t", "jaxfeed service ({} workers) vs plain socket")
  socket = results.get("w4_service", "W4t", "plain TCP socket")
  if not mine or socket is None:
    return None
  tf = _best(_two_workers(results, "w4_service", "W4t", "tf.data service ({} workers)"))
  return Headline(
    "W4t MB/s through the service, 1 / 2 workers",
    " / ".join(rate(line["rate"]) for line, _ in mine),
    f"plain socket {rate(socket[0]['rate'])}"
    + (f" (tf.data service {rate(tf[0]['rate'])})" if tf else ""),
    " / ".join(f"{line['fraction_of_plain_socket']:.2f}" for line, _ in vs),
    ">= 0.8 of the socket, epoch by epoch",
    (socket[1],),
  )


def w6(results: Results) -> Headline | None:
  summary = results.get("w6_coordinated", "W6", way="summary")
  mine = results.get("w6_coordinated", "W6", way="coordinated (BucketPlan)")
  if summary is None or mine is None:
    return None
  lower = summary[0]["modelled_time_lower_by"]
  return Headline(
    "W6 modelled step time, 4 hosts",
    f"coordinated, {percent(mine[0]['padding_fraction'])} padding",
    "per-host bucketing / none",
    f"{ratio(lower['vs_per_host_bucketing_per_token'])} / "
    f"{ratio(lower['vs_no_bucketing_per_token'])} lower",
    ">= 1.5x / 3x, padding <= 5%",
    (summary[1],),
  )


def w7(results: Results) -> Headline | None:
  found = _vs_best_peer(
    results,
    "w7_images",
    "W7",
    "jaxfeed",
    "W7 images/s, JPEG Examples -> 224 crops",
    ">= 1.2x tf.data",
  )
  mine = results.get("w7_images", "W7", "jaxfeed")
  if found is None or mine is None or "ratio_vs_limit" not in mine[0]:
    return found
  return dataclasses.replace(
    found,
    jaxfeed=f"{found.jaxfeed} ({percent(mine[0]['ratio_vs_limit'])} of the limit)",
    target=found.target + ", >= 80% of the limit",
  )


def w8(results: Results) -> Headline | None:
  return _vs_best_peer(
    results,
    "w8_text",
    "W8",
    "jaxfeed (mix)",
    "W8 tokens/s, text mixed 70/30 and packed",
    ">= 3x Grain",
    padding=True,
  )


def w5(results: Results) -> Headline | None:
  default = results.get("w5_placement", "W5", "jaxfeed-loader-default")
  host = results.get("w5_placement", "W5", "jaxfeed-host-only")
  if default is None or host is None:
    return None
  zero = results.get("w5_placement", "W5", "jaxfeed-loader-prefetch0")
  return Headline(
    "W5 `Loader` on 8 CPU devices vs host only",
    f"default {percent(default[0]['overhead_vs_host_only'])} overhead"
    + (f", `prefetch=0` {percent(zero[0]['overhead_vs_host_only'])}" if zero else ""),
    f"host only {rate(host[0]['rate'])}",
    "",
    "default <= prefetch=0",
    (default[1],),
  )


def dispatcher(results: Results) -> Headline | None:
  found = [rc for rc in results.rows("dispatcher_scale", "dispatcher scale")]
  if not found:
    return None
  line, context = max(found, key=lambda rc: rc[0]["workers"])
  p99 = max(v["p99"] for v in line["latency_ms"].values())
  return Headline(
    f"Dispatcher: {line['workers']} workers, {line['clients']} clients, {line['seconds']:.0f} s",
    f"worst p99 {p99:g} ms, {line['dispatcher_cpu_share']:g} core, "
    f"{line['failed_rpcs']} failed, restart replay {line['restart_replay_s']:g} s",
    "",
    "",
    "p99 <= 100 ms, <= 0.6 core, 0 failed, replay <= 5 s",
    (context,),
  )


# (builder, in the README, command that records it)
HEADLINES: tuple[tuple[Callable[[Results], Headline | None], bool, str], ...] = (
  (w1, True, "python -m benchmarks.w1_per_element --epochs 3"),
  (w2_per_element, True, "python -m benchmarks.run --workloads=W2"),
  (w2_batched, True, "python -m benchmarks.run --workloads=W2"),
  (w3_bucketing, True, "python -m benchmarks.run --workloads=W3"),
  (w3_packing, True, "python -m benchmarks.run --workloads=W3"),
  (w4, True, "python -m benchmarks.w4_service --epochs=3"),
  (w4t, True, "python -m benchmarks.w4_service --epochs=3"),
  (w5, False, "python -m benchmarks.w5_placement --rounds=9 --aligned"),
  (w6, True, "python -m benchmarks.w6_coordinated"),
  (w7, True, "python -m benchmarks.w7_images --records 10000 --epochs 1 --repeats 2"),
  (w8, True, "python -m benchmarks.w8_text --repeats 5"),
  (
    dispatcher,
    False,
    "python -m benchmarks.dispatcher_scale --workers=1024 --clients=2048 --seconds=60 --json",
  ),
)


def headlines(results: Results, readme: bool) -> list[Headline]:
  found = (build(results) for build, in_readme, _ in HEADLINES if in_readme or not readme)
  return [h for h in found if h is not None]


def not_recorded(results: Results) -> list[tuple[str, str]]:
  """(builder name, command) of the headline rows no run has recorded."""
  return [(build.__name__, command) for build, _, command in HEADLINES if build(results) is None]
