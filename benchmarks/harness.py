"""Timing, memory sampling and reporting shared by the benchmark scripts.

Every benchmark prints one JSON line per (workload, system) with the median
rate over the measured epochs (after one warm-up epoch), the peak RSS seen
while that system ran, and — on the jaxfeed line — the ratio to the best peer.
"""

from __future__ import annotations

import gc
import json
import statistics
import threading
import time
from typing import Callable, Iterable

import psutil


class PeakRSS:
  """Samples this process's RSS on a thread while a block runs."""

  def __init__(self, interval_s: float = 0.01):
    self._interval = interval_s
    self._stop = threading.Event()
    self._thread: threading.Thread | None = None
    self.peak_bytes = 0
    self.start_bytes = 0

  def __enter__(self) -> "PeakRSS":
    process = psutil.Process()
    self.start_bytes = self.peak_bytes = process.memory_info().rss

    def sample():
      while not self._stop.wait(self._interval):
        self.peak_bytes = max(self.peak_bytes, process.memory_info().rss)

    self._thread = threading.Thread(target=sample, name="peak-rss", daemon=True)
    self._thread.start()
    return self

  def __exit__(self, *exc) -> None:
    self._stop.set()
    self._thread.join()


def measure(make_epoch: Callable[[], Iterable], count: Callable[[object], int],
            epochs: int = 3) -> dict:
  """Runs one warm-up and `epochs` timed epochs; returns rate and memory.

  Args:
    make_epoch: returns a fresh iterable over one epoch.
    count: number of items (images, elements, sequences) in one output.
    epochs: timed epochs after the warm-up.

  Returns:
    {"rate": median items/s, "rates": [...], "items": per epoch,
     "peak_rss_mb": peak RSS while running, "rss_growth_mb": peak - start}.
  """
  gc.collect()
  rates = []
  items = 0
  with PeakRSS() as rss:
    for epoch in range(epochs + 1):
      items = 0
      start = time.perf_counter()
      iterator = make_epoch()
      for output in iterator:
        items += count(output)
      elapsed = time.perf_counter() - start
      close = getattr(iterator, "close", None)
      if close is not None:
        close()
      if epoch:
        rates.append(items / elapsed)
  return {
      "rate": statistics.median(rates),
      "rates": [round(r, 1) for r in rates],
      "items": items,
      "peak_rss_mb": round(rss.peak_bytes / 2**20, 1),
      "rss_growth_mb": round((rss.peak_bytes - rss.start_bytes) / 2**20, 1),
  }


def report(workload: str, results: dict[str, dict], unit: str,
           extra: dict[str, dict] | None = None) -> list[dict]:
  """Prints one JSON line per system; jaxfeed rows get `ratio_vs_best_peer`."""
  peers = {k: v["rate"] for k, v in results.items() if not k.startswith("jaxfeed")}
  best_peer = max(peers.items(), key=lambda kv: kv[1]) if peers else None
  lines = []
  for system, result in results.items():
    line = {"workload": workload, "system": system, "unit": unit,
            "rate": round(result["rate"], 1)}
    line.update({k: v for k, v in result.items() if k != "rate"})
    line.update((extra or {}).get(system, {}))
    if system.startswith("jaxfeed") and best_peer:
      line["best_peer"] = best_peer[0]
      line["ratio_vs_best_peer"] = round(result["rate"] / best_peer[1], 3)
    print(json.dumps(line), flush=True)
    lines.append(line)
  return lines
