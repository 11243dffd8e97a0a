"""The benchmark page's plots, as SVG drawn from the recorded runs: rates
per system (one bar chart per workload), the dispatcher-scale curve and W4t
epoch by epoch. The same results give the same bytes (fixed hash salt, no
dates, text kept as text)."""

from __future__ import annotations

import io
from typing import Callable

from benchmarks import report_rows

Results = report_rows.Results

# (workload title, benchmark, workload) of the bar charts.
BARS = (
  ("W1 per element, images/s", "w1_per_element", "W1 per-element"),
  ("W2, elements/s", "run", "W2"),
  ("W3a bucketing, sequences/s", "run", "W3-bucketing"),
  ("W3b packing, sequences/s", "run", "W3-packing"),
  ("W4 through the service, images/s", "w4_service", "W4"),
  ("W7 JPEG Examples, images/s", "w7_images", "W7"),
  ("W8 text, tokens/s", "w8_text", "W8"),
)


def _file_name(workload: str) -> str:
  return "rates_" + "".join(c if c.isalnum() else "_" for c in workload).strip("_") + ".svg"


def _bars(results: Results, benchmark: str, workload: str) -> list[tuple[str, float]]:
  return [
    (line["system"], float(line["rate"]))
    for line, _ in results.rows(benchmark, workload)
    if isinstance(line.get("rate"), (int, float)) and "system" in line
  ]


def _dispatcher(results: Results) -> list[dict]:
  return sorted(
    (line for line, _ in results.rows("dispatcher_scale", "dispatcher scale")),
    key=lambda line: (line["workers"], line["clients"]),
  )


def _w4t(results: Results) -> list[tuple[str, list[float]]]:
  series = []
  for workers in (1, 2):
    found = results.get("w4_service", "W4t", f"jaxfeed service ({workers} workers)")
    vs = results.get("w4_service", "W4t", f"jaxfeed service ({workers} workers) vs plain socket")
    if found and vs:
      workers_text = f"{workers} worker{'s' * (workers > 1)}"
      series.append((f"jaxfeed service, {workers_text}", found[0]["rates"]))
      series.append(
        (f"plain socket, right before each {workers_text} epoch", vs[0]["socket_rates"])
      )
  return series


def _regimes(results: Results) -> dict[str, dict[str, list[tuple[float, float]]]]:
  """Kind -> mode -> (compute per element, rate) of the autocache regimes."""
  found: dict[str, dict[str, list[tuple[float, float]]]] = {}
  for line, _ in results.rows("autocache_regimes", "autocache regimes"):
    if isinstance(line.get("rate"), (int, float)) and "kind" in line:
      points = found.setdefault(line["kind"], {}).setdefault(line["mode"], [])
      points.append((float(line["cost_us"]), float(line["rate"])))
  return {kind: {m: sorted(p) for m, p in modes.items()} for kind, modes in found.items()}


def titles(results: Results) -> dict[str, str]:
  """File name -> title of every plot the results make."""
  found = {
    _file_name(workload): title
    for title, benchmark, workload in BARS
    if _bars(results, benchmark, workload)
  }
  if _dispatcher(results):
    found["dispatcher_scale.svg"] = "The dispatcher's p99 latency and CPU as the pod grows"
  if _w4t(results):
    found["w4t_epochs.svg"] = "W4t epoch by epoch: the service against a plain socket"
  if _regimes(results):
    found["autocache_regimes.svg"] = "Autocache regimes: the policy against fixed modes"
  return found


def _figure(draw: Callable) -> bytes:
  # Here, not at the top: pyplot takes seconds to import (3.6 s at load 20
  # on 2 cores), and the tables, `--no-plots` and the test need none of it.
  import matplotlib  # pylint: disable=import-outside-toplevel

  matplotlib.use("Agg")
  from matplotlib import pyplot  # pylint: disable=import-outside-toplevel

  with matplotlib.rc_context(
    {
      "svg.hashsalt": "jaxfeed",
      "svg.fonttype": "none",
      "font.size": 9,
      "axes.spines.top": False,
      "axes.spines.right": False,
    }
  ):
    figure = draw(pyplot)
    out = io.StringIO()
    figure.savefig(out, format="svg", bbox_inches="tight", metadata={"Date": None, "Creator": None})
    pyplot.close(figure)
  return out.getvalue().encode()


def _bar_chart(title: str, bars: list[tuple[str, float]]) -> Callable:
  def draw(pyplot):
    figure, axes = pyplot.subplots(figsize=(6.4, 0.45 * len(bars) + 0.9))
    names = [name for name, _ in bars][::-1]
    values = [value for _, value in bars][::-1]
    # jaxfeed, the peers, and references (limits, a plain socket) lighter.
    colors = [
      "#1f77b4"
      if name.startswith("jaxfeed")
      else "#808080"
      if name.startswith(tuple(report_rows.PEER_NAMES))
      else "#c8c8c8"
      for name in names
    ]
    axes.barh(names, values, color=colors)
    if max(values) / max(min(values), 1e-9) > 50:
      axes.set_xscale("log")
    for y, value in enumerate(values):
      axes.annotate(
        report_rows.rate(value), (value, y), xytext=(3, 0), textcoords="offset points", va="center"
      )
    axes.set_title(title, loc="left")
    return figure

  return draw


def _dispatcher_chart(lines: list[dict]) -> Callable:
  def draw(pyplot):
    figure, (latency, cpu) = pyplot.subplots(1, 2, figsize=(8, 3.2))
    workers = [line["workers"] for line in lines]
    kinds = sorted({kind for line in lines for kind in line["latency_ms"]})
    for kind in kinds:
      latency.plot(
        workers,
        [line["latency_ms"].get(kind, {}).get("p99") for line in lines],
        marker="o",
        label=kind,
      )
    for axes in (latency, cpu):
      axes.set_xscale("log", base=2)
      axes.set_xticks(workers, [str(w) for w in workers])
      axes.minorticks_off()
    latency.set_title("p99 latency by call, one run per size", loc="left")
    latency.set_xlabel("workers (clients: twice as many)")
    latency.set_ylabel("p99 latency, ms")
    latency.legend(fontsize=7)
    cpu.plot(workers, [line["dispatcher_cpu_share"] for line in lines], marker="o")
    cpu.set_title("the dispatcher's CPU", loc="left")
    cpu.set_xlabel("workers")
    cpu.set_ylabel("dispatcher CPU, cores")
    cpu.set_ylim(bottom=0)
    figure.tight_layout()
    return figure

  return draw


def _w4t_chart(series: list[tuple[str, list[float]]]) -> Callable:
  def draw(pyplot):
    figure, axes = pyplot.subplots(figsize=(6.4, 3.2))
    for index, (name, rates) in enumerate(series):  # a service and its socket: one color
      axes.plot(
        range(1, len(rates) + 1),
        rates,
        marker="o",
        color=f"C{index // 2}",
        linestyle="--" if name.startswith("plain") else "-",
        label=name,
      )
    axes.set_title("W4t, MB/s: each service epoch and the socket epoch before it", loc="left")
    axes.set_xlabel("timed epoch")
    axes.set_ylabel("MB/s")
    axes.set_ylim(bottom=0)
    axes.xaxis.get_major_locator().set_params(integer=True)
    axes.legend(fontsize=7)
    return figure

  return draw


def _regimes_chart(regimes: dict[str, dict[str, list[tuple[float, float]]]]) -> Callable:
  def draw(pyplot):
    figure, panes = pyplot.subplots(1, len(regimes), figsize=(6.4, 3.2), squeeze=False)
    for axes, (kind, modes) in zip(panes[0], sorted(regimes.items(), reverse=True)):
      for index, (mode, points) in enumerate(sorted(modes.items())):
        axes.plot(
          [max(cost, 1.0) for cost, _ in points],  # 0 us on the log axis: at 1
          [rate for _, rate in points],
          marker="o",
          color=f"C{index}",
          linestyle="-" if mode.startswith("auto") else "--",
          label=mode,
        )
      axes.set_xscale("log")
      axes.set_yscale("log")
      axes.set_title(kind, loc="left", fontsize=9)
      axes.set_xlabel("compute per element, us (0 at 1)")
    panes[0][0].set_ylabel("elements/s over all epochs")
    panes[0][0].legend(fontsize=7)
    figure.tight_layout()
    return figure

  return draw


def render(results: Results) -> dict[str, tuple[str, bytes]]:
  """File name -> (title, SVG) of every plot."""
  names = titles(results)
  out = {}
  for title, benchmark, workload in BARS:
    name = _file_name(workload)
    if name in names:
      out[name] = (names[name], _figure(_bar_chart(title, _bars(results, benchmark, workload))))
  if "dispatcher_scale.svg" in names:
    out["dispatcher_scale.svg"] = (
      names["dispatcher_scale.svg"],
      _figure(_dispatcher_chart(_dispatcher(results))),
    )
  if "w4t_epochs.svg" in names:
    out["w4t_epochs.svg"] = (names["w4t_epochs.svg"], _figure(_w4t_chart(_w4t(results))))
  if "autocache_regimes.svg" in names:
    out["autocache_regimes.svg"] = (
      names["autocache_regimes.svg"],
      _figure(_regimes_chart(_regimes(results))),
    )
  return out
