"""`python -m jaxfeed.service.dispatcher`, timing each RPC's handler inside it.

  python -m benchmarks.dispatcher_scale_server --timing_file=PATH [dispatcher flags]

Runs the dispatcher's command line unchanged, with every method of its
servicer wrapped to note (end time, seconds spent in the handler: the state
lock, the work and the journal's fsync; not gRPC's queues). Once
`PATH.window` holds "START STOP" in `time.monotonic()` seconds (the same
clock in every process of a machine) and `PATH.done` exists, it writes the
handler times of that window (and of every join and goodbye, which come
before and after it) to PATH as JSON: method -> sorted seconds, and under
"gc" the garbage collector's pauses of the window (seconds each, every
generation; "gc2": the full collections alone).
"""

from __future__ import annotations

import gc
import json
import os
import sys
import threading
import time

from jaxfeed.service.dispatcher import server as dispatcher

# Timed whenever they come: before the window (joins) and after it (goodbyes).
BURSTS = ("GetOrCreateJob", "ReleaseJobClient")
METHODS = (
  "RegisterDataset",
  "GetDatasetDef",
  "GetOrCreateJob",
  "ClientHeartbeat",
  "ReleaseJobClient",
  "WorkerHeartbeat",
  "GetSplits",
)


def _timed(name: str, method, times: list):
  def handler(self, request, context):
    start = time.monotonic()
    try:
      return method(self, request, context)
    finally:
      end = time.monotonic()
      times.append((name, end, end - start))  # list.append is atomic

  return handler


def _time_collections(times: list) -> None:
  """Notes each garbage collection as ("gc", end time, seconds)."""
  started = [0.0]

  def callback(phase: str, info: dict) -> None:
    if phase == "start":
      started[0] = time.monotonic()
    else:
      end = time.monotonic()
      times.append(("gc", end, end - started[0]))
      if info["generation"] == 2:
        times.append(("gc2", end, end - started[0]))

  gc.callbacks.append(callback)


def _write_when_asked(path: str, times: list) -> None:
  window_path = f"{path}.window"
  while not os.path.exists(window_path):
    time.sleep(0.2)
  time.sleep(0.3)  # a moment for the window's last reads to be noted
  done_path = f"{path}.done"
  while not os.path.exists(done_path):  # the goodbyes come after the window
    time.sleep(0.2)
  with open(window_path) as f:
    start, stop = (float(x) for x in f.read().split())
  by_method: dict[str, list[float]] = {}
  for name, end, seconds in list(times):
    # The joins come before the window and the goodbyes after it: all kept.
    if start <= end <= stop or name in BURSTS:
      by_method.setdefault(name, []).append(seconds)
  with open(f"{path}.tmp", "w") as f:
    json.dump({name: sorted(v) for name, v in by_method.items()}, f)
  os.replace(f"{path}.tmp", path)


def main() -> None:
  timing_file = next(a.split("=", 1)[1] for a in sys.argv if a.startswith("--timing_file="))
  sys.argv = [a for a in sys.argv if not a.startswith("--timing_file=")]
  times: list = []
  for name in METHODS:
    setattr(
      dispatcher._DispatcherServicer,
      name,  # pylint: disable=protected-access
      _timed(name, getattr(dispatcher._DispatcherServicer, name), times),
    )  # pylint: disable=protected-access
  _time_collections(times)
  threading.Thread(target=_write_when_asked, args=(timing_file, times), daemon=True).start()
  from absl import app  # pylint: disable=g-import-not-at-top

  dispatcher.define_flags()
  app.run(dispatcher.main)


if __name__ == "__main__":
  main()
