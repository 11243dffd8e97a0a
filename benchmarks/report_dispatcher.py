"""The tables of docs/dispatcher_scale.md, rendered from the dispatcher-scale
runs recorded in benchmarks/results/dispatcher_scale.json (one row per pod
size, `python -m benchmarks.dispatcher_scale --json`): the curve, the
latency of every call, the join storm, the targets at the largest size and
what the largest size's CPU per call projects for larger pods."""

from __future__ import annotations

from jaxfeed.service.dispatcher.config import DispatcherConfig
from jaxfeed.service.dispatcher.heartbeat_pacing import CLIENT_DEFAULT_INTERVAL_S
from jaxfeed.service.dispatcher.heartbeat_pacing import WORKER_DEFAULT_INTERVAL_S

from benchmarks import report_rows
from benchmarks.report_rows import table

Results = report_rows.Results
Row = report_rows.Row

BENCHMARK, WORKLOAD = "dispatcher_scale", "dispatcher scale"
# In the order a party makes them: steady traffic, then the two bursts.
KINDS = ("WorkerHeartbeat", "GetSplits", "ClientHeartbeat", "GetOrCreateJob", "ReleaseJobClient")
STEADY = KINDS[:3]
# The targets at pod scale (1,024 workers, 2,048 clients).
P99_MS, CPU_CORES, REPLAY_S = 100.0, 0.6, 5.0
# The simulator's defaults (`benchmarks.dispatcher_scale --elements_per_s
# --splits_per_request --jobs`), which the projection assumes too.
ELEMENTS_PER_S, SPLITS_PER_REQUEST, JOBS = 1000.0, 2, 2


def ms(value: float) -> str:
  """Three significant digits, thousands with a comma: 0.87, 25.2, 1,499."""
  return f"{value:,.0f}" if value >= 100 else report_rows.three_digits(value)


def recorded(results: Results) -> list[tuple[Row, report_rows.Context]]:
  """The latest run of every size, smallest first."""
  return sorted(
    results.rows(BENCHMARK, WORKLOAD), key=lambda rc: (rc[0]["workers"], rc[0]["clients"])
  )


def _size(line: Row) -> str:
  return f"{line['workers']:,} / {line['clients']:,}"


def cpu_ms_per_rpc(line: Row) -> float:
  return line["dispatcher_cpu_share"] / line["rpcs_per_s"] * 1000


def _goodbyes(line: Row) -> str:
  counts = line.get("goodbyes", {})
  parts = [
    f"{counts[via]:,} {what}"
    for via, what in (
      ("call", "calls"),
      ("worker", "through workers"),
      ("timeout", "timed out"),
      ("refused", "refused"),
      ("stale", "stale"),
    )
    if counts.get(via)
  ]
  return ", ".join(parts) or "none"


def curve(results: Results) -> str:
  rows = [
    [
      _size(line),
      f"{line['seconds']:g} s",
      report_rows.rate(line["rpcs_per_s"]),
      f"{line['dispatcher_cpu_share']:g}",
      f"{cpu_ms_per_rpc(line):.2f} ms",
      str(line["failed_rpcs"]),
      _goodbyes(line),
      f"{line['release_all_s']:g} s",
      f"{line['restart_replay_s']:g} s",
      f"{line['dispatcher_rss_mb']:.0f} MB",
      f"{line['simulator_cpu_share']:g} / {ms(line['simulator_loop_lag_ms']['p99'])}",
      f"{line['machine_busy_cores']:g}",
      report_rows.measured(context),
    ]
    for line, context in recorded(results)
  ]
  if not rows:
    return "No run recorded yet.\n"
  return table(
    [
      "workers / clients",
      "window",
      "RPC/s",
      "dispatcher CPU, cores",
      "CPU per RPC",
      "failed RPCs",
      "goodbyes",
      "all released after",
      "restart replay",
      "dispatcher RSS",
      "simulators: CPU, loop lag p99 ms",
      "machine busy, cores",
      "measured",
    ],
    rows,
  )


def _three(timings: dict | None) -> str:
  if not timings:
    return ""
  return " / ".join(ms(timings[q]) for q in ("p50", "p99", "max"))


def latency(results: Results) -> str:
  rows = []
  for line, _ in recorded(results):
    for kind in KINDS:
      calls = line["rpcs"].get(kind, 0)
      if not calls:
        rows.append([_size(line), kind, "no call", "", ""])
        continue
      rows.append(
        [
          _size(line),
          kind,
          f"{calls:,}",
          _three(line["latency_ms"].get(kind)),
          _three(line.get("handler_ms", {}).get(kind)),
        ]
      )
  if not rows:
    return "No run recorded yet.\n"
  return table(
    [
      "workers / clients",
      "RPC",
      "calls",
      "callers' p50 / p99 / max, ms",
      "handlers' p50 / p99 / max, ms",
    ],
    rows,
  )


def join_storm(results: Results) -> str:
  rows = []
  for line, _ in recorded(results):
    storm = line["joins_latency_ms"]
    rows.append(
      [
        _size(line),
        f"{line['clients']:,} in {line['joins_s']:g} s",
        f"{line['joins_dispatcher_cpu_s']:g} s",
        " / ".join(f"{line['joins_rpcs'].get(kind, 0):,}" for kind in STEADY),
        " / ".join(
          ms(storm[kind]["p99"]) if line["joins_rpcs"].get(kind) else "no call" for kind in STEADY
        ),
        " / ".join(ms(line["latency_ms"]["GetOrCreateJob"][q]) for q in ("p50", "p99")),
        " / ".join(
          ms(line["simulator_burst_lag_ms"][burst]["p99"]) for burst in ("joins", "goodbyes")
        ),
      ]
    )
  if not rows:
    return "No run recorded yet.\n"
  return table(
    [
      "workers / clients",
      "joins",
      "dispatcher CPU in the storm",
      "other calls in the storm, WH / GS / CH",
      "their callers' p99 ms",
      "joins' p50 / p99 ms",
      "simulators' loop lag p99 ms, joins / goodbyes",
    ],
    rows,
  )


def _worst_p99(line: Row) -> tuple[str, float]:
  called = [kind for kind in KINDS if line["rpcs"].get(kind)]
  return max(((kind, line["latency_ms"][kind]["p99"]) for kind in called), key=lambda kp: kp[1])


def targets(results: Results) -> str:
  found = recorded(results)
  if not found:
    return "No run recorded yet.\n"
  line, context = max(found, key=lambda rc: (rc[0]["workers"], rc[0]["seconds"]))
  kind, p99 = _worst_p99(line)
  met = lambda ok: "yes" if ok else "**no**"
  rows = [
    [
      f"every RPC kind's callers' p99 <= {P99_MS:g} ms",
      f"{ms(p99)} ms ({kind})",
      met(p99 <= P99_MS),
    ],
    [
      f"dispatcher CPU <= {CPU_CORES:g} core",
      f"{line['dispatcher_cpu_share']:g}",
      met(line["dispatcher_cpu_share"] <= CPU_CORES),
    ],
    ["no failed RPC", str(line["failed_rpcs"]), met(line["failed_rpcs"] == 0)],
    [
      f"restart replay <= {REPLAY_S:g} s",
      f"{line['restart_replay_s']:g} s",
      met(line["restart_replay_s"] <= REPLAY_S),
    ],
  ]
  return (
    f"At {line['workers']:,} workers and {line['clients']:,} clients, a "
    f"{line['seconds']:g} s window ({report_rows.measured(context)}; "
    f"{line['machine_busy_cores']:g} of the machine's {line['machine_cores']} cores "
    "busy):\n\n" + table(["target", "measured", "met"], rows)
  )


# ----------------------------------------------------------------------------
# Larger pods, projected from the largest run's CPU per call
# ----------------------------------------------------------------------------
def modelled_rpcs(workers: int, config: DispatcherConfig | None = None) -> dict[str, float]:
  """Calls a second of `workers` workers and twice as many clients in JOBS
  shared DYNAMIC jobs, at the default pacing: heartbeats at the paced
  intervals, GetSplits as the simulator's workers ask (ELEMENTS_PER_S per
  task, SPLITS_PER_REQUEST splits a call). Joins and goodbyes are bursts,
  not counted."""
  config = config or DispatcherConfig()
  pacing = config.heartbeat_pacing
  worker_s = (
    pacing.worker_interval(workers, config.heartbeat_timeout_s) or WORKER_DEFAULT_INTERVAL_S
  )
  client_s = (
    pacing.client_interval(2 * workers, config.client_timeout_s) or CLIENT_DEFAULT_INTERVAL_S
  )
  positions = pacing.split_size(config.split_size, workers) * SPLITS_PER_REQUEST
  return {
    "WorkerHeartbeat": workers / worker_s,
    "ClientHeartbeat": 2 * workers / client_s,
    "GetSplits": JOBS * workers * ELEMENTS_PER_S / positions,
  }


def largest_within(cores: float, cpu_ms: float, step: int = 64) -> int:
  """The most workers (in steps of `step`) whose modelled calls take at most
  `cores` at `cpu_ms` a call."""
  workers = 0
  while sum(modelled_rpcs(workers + step).values()) * cpu_ms / 1000 <= cores:
    workers += step
    if workers > 1_000_000:
      break
  return workers


def capacity(results: Results) -> str:
  found = recorded(results)
  if not found:
    return "No run recorded yet.\n"
  line, context = max(found, key=lambda rc: (rc[0]["workers"], rc[0]["seconds"]))
  cpu_ms = cpu_ms_per_rpc(line)
  rows = []
  for workers in sorted({line["workers"], 2048, 4096}):
    calls = modelled_rpcs(workers)
    total = sum(calls.values())
    rows.append(
      [
        f"{workers:,} / {2 * workers:,}",
        " / ".join(f"{calls[kind]:,.0f}" for kind in STEADY),
        f"{total:,.0f}",
        f"{line['rpcs_per_s']:,.0f}" if workers == line["workers"] else "",
        f"{total * cpu_ms / 1000:.2f}",
      ]
    )
  most = largest_within(CPU_CORES, cpu_ms)
  return (
    f"At the CPU per call measured at {_size(line)} "
    f"({cpu_ms:.2f} ms; {report_rows.measured(context)}):\n\n"
    + table(
      [
        "workers / clients",
        "modelled calls/s, WH / GS / CH",
        "in all",
        "measured",
        "dispatcher CPU, cores",
      ],
      rows,
    )
    + f"\nWithin {CPU_CORES:g} of a core at that CPU per call: about {most:,} workers "
    f"and {2 * most:,} clients.\n"
  )


def blocks(results: Results) -> dict[str, str]:
  """The generated blocks of docs/dispatcher_scale.md, by name."""
  return {
    "curve": curve(results),
    "latency": latency(results),
    "join-storm": join_storm(results),
    "targets": targets(results),
    "capacity": capacity(results),
  }
