"""Timing, memory sampling and reporting shared by the benchmark scripts.

Every benchmark prints one JSON line per (workload, system) with the median
rate over the measured epochs (after one warm-up epoch), the time to its
first output, the peak RSS seen while that system ran (of its server
processes too, for services), and — on the jaxfeed line — the ratio to the
best peer.
"""

from __future__ import annotations

import gc
import statistics
import subprocess
import threading
import time
from typing import Callable, Iterable, Sequence

import psutil

from benchmarks import record


def process_tree_cpu_s() -> float:
  """CPU seconds used so far by this process and its child processes (worker
  processes): those that ended and were reaped, and those that run."""
  import resource  # pylint: disable=import-outside-toplevel -- Unix only

  me = resource.getrusage(resource.RUSAGE_SELF)
  ended = resource.getrusage(resource.RUSAGE_CHILDREN)
  total = me.ru_utime + me.ru_stime + ended.ru_utime + ended.ru_stime
  for child in psutil.Process().children(recursive=True):
    try:
      total += sum(child.cpu_times()[:2])
    except psutil.Error:
      pass  # ended meanwhile: counted above from now on
  return total


class PeakRSS:
  """Samples RSS on a thread while a block runs: this process's, and the
  sum over `others` (pids of the servers a pipeline runs in) at each sample."""

  def __init__(self, interval_s: float = 0.01, others: Sequence[int] = ()):
    self._interval = interval_s
    self._others = [psutil.Process(pid) for pid in others]
    self._stop = threading.Event()
    self._thread: threading.Thread | None = None
    self.peak_bytes = 0
    self.start_bytes = 0
    self.others_peak_bytes = 0
    self.total_peak_bytes = 0

  def _others_bytes(self) -> int:
    total = 0
    for process in self._others:
      try:
        total += process.memory_info().rss
      except psutil.Error:  # exited: holds nothing now
        pass
    return total

  def _sample(self, process: psutil.Process) -> None:
    own, others = process.memory_info().rss, self._others_bytes()
    self.peak_bytes = max(self.peak_bytes, own)
    self.others_peak_bytes = max(self.others_peak_bytes, others)
    self.total_peak_bytes = max(self.total_peak_bytes, own + others)

  def __enter__(self) -> "PeakRSS":
    process = psutil.Process()
    self.start_bytes = process.memory_info().rss
    self._sample(process)

    def sample():
      while not self._stop.wait(self._interval):
        self._sample(process)

    self._thread = threading.Thread(target=sample, name="peak-rss", daemon=True)
    self._thread.start()
    return self

  def __exit__(self, *exc) -> None:
    self._stop.set()
    self._thread.join()

  def report(self) -> dict:
    """The peaks in MiB: `peak_rss_mb` (this process), `rss_growth_mb` (its
    peak less its start) and, with others, `servers_peak_rss_mb` and
    `total_peak_rss_mb` (this process plus its servers)."""
    mib = lambda b: round(b / 2**20, 1)
    result = {
      "peak_rss_mb": mib(self.peak_bytes),
      "rss_growth_mb": mib(self.peak_bytes - self.start_bytes),
    }
    if self._others:
      result["servers_peak_rss_mb"] = mib(self.others_peak_bytes)
      result["total_peak_rss_mb"] = mib(self.total_peak_bytes)
    return result


def measure(
  make_epoch: Callable[[], Iterable],
  count: Callable[[object], int],
  epochs: int = 3,
  servers: Sequence[int] = (),
  before_epoch: Callable[[], None] | None = None,
) -> dict:
  """Runs one warm-up and `epochs` timed epochs; returns rate and memory.

  Args:
    make_epoch: returns a fresh iterable over one epoch.
    count: number of items (images, elements, sequences) in one output.
    epochs: timed epochs after the warm-up.
    servers: pids of the processes the pipeline runs in besides this one
      (service dispatchers and workers); their RSS is reported too.
    before_epoch: run before each epoch, untimed (a baseline measured
      under the same load as the epoch right after it).

  Returns:
    {"rate": median items/s, "rates": [...], "items": per epoch,
     "first_batch_ms": median time from asking for an epoch to its first
     output, "first_batch_ms_warmup": the same of the warm-up epoch,
     "last_batch_to_end_ms": median time from the last output to the end,
     "peak_rss_mb": peak RSS of this process while running,
     "rss_growth_mb": peak - start, and with servers
     "servers_peak_rss_mb" and "total_peak_rss_mb"}.
  """
  gc.collect()
  rates, firsts, tails = [], [], []
  items = 0
  with PeakRSS(others=servers) as rss:
    for epoch in range(epochs + 1):
      items = 0
      first = None
      if before_epoch is not None:
        before_epoch()
      start = time.perf_counter()
      iterator = make_epoch()
      last = start
      for output in iterator:
        if first is None:
          first = time.perf_counter() - start
        items += count(output)
        last = time.perf_counter()
      end = time.perf_counter()
      elapsed = end - start
      close = getattr(iterator, "close", None)
      if close is not None:
        close()
      firsts.append(elapsed if first is None else first)
      tails.append(end - last)
      if epoch:
        rates.append(items / elapsed)
  return {
    "rate": statistics.median(rates),
    "rates": [round(r, 1) for r in rates],
    "items": items,
    "first_batch_ms": round(statistics.median(firsts[1:]) * 1e3, 1),
    "first_batch_ms_warmup": round(firsts[0] * 1e3, 1),
    "last_batch_to_end_ms": round(statistics.median(tails[1:]) * 1e3, 1),
    **rss.report(),
  }


def report(
  workload: str, results: dict[str, dict], unit: str, extra: dict[str, dict] | None = None
) -> list[dict]:
  """Prints one JSON line per system; jaxfeed rows get `ratio_vs_best_peer`."""
  peers = {k: v["rate"] for k, v in results.items() if not k.startswith("jaxfeed")}
  best_peer = max(peers.items(), key=lambda kv: kv[1]) if peers else None
  lines = []
  for system, result in results.items():
    line = {"workload": workload, "system": system, "unit": unit, "rate": round(result["rate"], 1)}
    line.update({k: v for k, v in result.items() if k != "rate"})
    line.update((extra or {}).get(system, {}))
    if system.startswith("jaxfeed") and best_peer:
      line["best_peer"] = best_peer[0]
      line["ratio_vs_best_peer"] = round(result["rate"] / best_peer[1], 3)
    record.row(line)
    lines.append(line)
  return lines


def printed_address(proc: subprocess.Popen, what: object = "") -> str:
  """The address on the next line a server process prints ("... on ADDRESS ...")."""
  line = proc.stdout.readline()
  if not line:
    raise RuntimeError(f"{what or proc.args} exited before reporting its address.")
  words = line.split()
  return words[words.index("on") + 1]


def stop_processes(procs: Sequence[subprocess.Popen], timeout_s: float = 10.0) -> None:
  """SIGTERM, then SIGKILL what is still running after `timeout_s`."""
  for proc in procs:
    proc.terminate()
  for proc in procs:
    try:
      proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
      proc.kill()
      proc.wait()
