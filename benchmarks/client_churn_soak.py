"""Many short service reads in one client process; a table of what broke.

  python -m benchmarks.client_churn_soak [--rounds=10] [--seconds=60]
      [--threads=20] [--elements=64] [--timeout_s=30]

Starts a dispatcher and `--workers` worker processes once, then per round a
client process (under `python -X dev`, with `faulthandler` on) in which
`--threads` threads each run, back to back, `distribute()` -> read
`--elements` batches -> `close()` for `--seconds` (every `--drop_every`-th
read drops its iterator instead of closing it, as `itertools.islice(ds, n)`
does, so that the garbage collector ends it). The reads cycle through the
processing modes (parallel_epochs, distributed_epoch, exactly-once).

A round fails when its client process dies (a signal or an exit status
other than 0), when a read raises, or when some thread finishes no read for
twice `--timeout_s`: the client then dumps every thread's stack (SIGUSR1,
printed under the round), this process reads from the same service to show
whether the service itself still answers, and the client is killed. Prints
one line per round and a table: reads, reads/s, the slowest read, errors,
hangs and how the client ended.
"""

from __future__ import annotations

import argparse
import collections
import faulthandler
import gc
import itertools
import json
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import threading
import time

from benchmarks import harness
from benchmarks import record
from jaxfeed import _lifetime

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
MODES = (
  ("parallel_epochs", "at_most_once"),
  ("distributed_epoch", "at_most_once"),
  ("distributed_epoch", "exactly_once"),
)
_STATUS_EVERY_S = 1.0


def _pipeline():
  import jaxfeed  # pylint: disable=g-import-not-at-top

  return jaxfeed.Dataset.range(1 << 20).batch(8)


def read_once(
  address: str, index: int, elements: int, timeout_s: float, close: bool = True
) -> None:
  """One short read: distribute, take `elements` batches, close (or drop)."""
  mode, visitation = MODES[index % len(MODES)]
  dataset = _pipeline().distribute(address, mode, visitation=visitation, timeout_s=timeout_s)
  iterator = iter(dataset)
  for _ in range(elements):
    next(iterator)
  if close:
    iterator.close()


# -- the client process ---------------------------------------------------------
def client_main(args: argparse.Namespace) -> int:
  """Runs the churn; prints a JSON status line every second, then a final one."""
  _lifetime.die_with_parent_from_env()
  faulthandler.enable()
  faulthandler.register(signal.SIGUSR1, all_threads=True)
  if args.gc_threshold:
    gc.set_threshold(args.gc_threshold)
  lock = threading.Lock()
  done = [0] * args.threads  # reads finished per thread
  errors: collections.Counter[str] = collections.Counter()
  slowest = [0.0]
  deadline = time.monotonic() + args.seconds
  counter = itertools.count()

  def churn(thread_index: int) -> None:
    while time.monotonic() < deadline:
      n = next(counter)
      started = time.monotonic()
      try:
        read_once(
          args.address,
          thread_index + n,
          args.elements,
          args.timeout_s,
          close=not args.drop_every or n % args.drop_every != args.drop_every - 1,
        )
      except Exception as e:  # pylint: disable=broad-except
        with lock:
          errors[f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"] += 1
        continue
      with lock:
        done[thread_index] += 1
        slowest[0] = max(slowest[0], time.monotonic() - started)

  threads = [
    threading.Thread(target=churn, args=(i,), name=f"churn-{i}", daemon=True)
    for i in range(args.threads)
  ]
  for thread in threads:
    thread.start()
  while any(t.is_alive() for t in threads):
    time.sleep(_STATUS_EVERY_S)
    with lock:
      print(
        json.dumps({"done": list(done), "errors": dict(errors), "slowest_s": round(slowest[0], 3)}),
        flush=True,
      )
  for thread in threads:
    thread.join()
  with lock:
    print(
      json.dumps(
        {
          "final": True,
          "done": list(done),
          "errors": dict(errors),
          "slowest_s": round(slowest[0], 3),
        }
      ),
      flush=True,
    )
  return 0


# -- the soak -------------------------------------------------------------------
def _env() -> dict:
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")])
  env.setdefault("GRPC_VERBOSITY", "ERROR")
  env.setdefault("JAX_PLATFORMS", "cpu")
  return env


def _start(role: str, *flags: str) -> tuple[subprocess.Popen, str]:
  proc = _lifetime.popen(
    [sys.executable, "-m", f"jaxfeed.service.{role}", *flags],
    stdout=subprocess.PIPE,
    stderr=subprocess.DEVNULL,
    env=_env(),
    text=True,
  )
  return proc, harness.printed_address(proc, f"jaxfeed {role}")


def _probe(address: str, timeout_s: float) -> str:
  """A read of the same service from this process: whether the service answers."""
  started = time.monotonic()
  try:
    read_once(address, 0, 4, timeout_s)
  except Exception as e:  # pylint: disable=broad-except
    return f"probe read failed after {time.monotonic() - started:.2f}s: {e}"
  return f"probe read from another process took {time.monotonic() - started:.2f}s"


def run_round(args: argparse.Namespace, address: str) -> dict:
  """One client process; returns what happened to it."""
  command = [
    sys.executable,
    *(["-X", "dev"] if args.dev else []),
    "-m",
    "benchmarks.client_churn_soak",
    "--client",
    f"--address={address}",
    f"--seconds={args.seconds}",
    f"--threads={args.threads}",
    f"--elements={args.elements}",
    f"--timeout_s={args.timeout_s}",
    f"--drop_every={args.drop_every}",
    f"--gc_threshold={args.gc_threshold}",
  ]
  proc = _lifetime.popen(
    command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=_env(), text=True
  )
  stderr: list[str] = []
  reader = threading.Thread(target=lambda: stderr.extend(proc.stderr), daemon=True)
  reader.start()
  last = {"done": [0] * args.threads, "errors": {}, "slowest_s": 0.0}
  progress_at = [time.monotonic()] * args.threads
  hang, probe, started = "", "", time.monotonic()
  for line in proc.stdout:
    try:
      status = json.loads(line)
    except ValueError:
      continue
    now = time.monotonic()
    for i, (old, new) in enumerate(zip(last["done"], status["done"])):
      if new != old:
        progress_at[i] = now
    last = status
    stuck = [i for i, at in enumerate(progress_at) if now - at > 2 * args.timeout_s]
    if stuck and not status.get("final") and now - started < args.seconds + 4 * args.timeout_s:
      hang = f"{len(stuck)} threads finished no read for {2 * args.timeout_s:.0f}s"
      proc.send_signal(signal.SIGUSR1)  # every thread's stack to stderr
      time.sleep(1.0)
      probe = _probe(address, args.timeout_s)
      proc.kill()
      break
    if now - started > args.seconds + 4 * args.timeout_s:
      hang = "the client did not end"
      proc.send_signal(signal.SIGUSR1)
      time.sleep(1.0)
      proc.kill()
      break
  code = proc.wait()
  reader.join(timeout=10)
  elapsed = time.monotonic() - started
  ended = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit {code}"
  if hang:
    ended = "killed (hang)"
  reads = sum(last["done"])
  return {
    "reads": reads,
    "reads_per_s": reads / max(elapsed, 1e-9),
    "slowest_s": last["slowest_s"],
    "errors": last["errors"],
    "hang": hang,
    "probe": probe,
    "ended": ended,
    "ok": code == 0 and not hang and not last["errors"],
    "stderr": "".join(stderr),
  }


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rounds", type=int, default=10)
  parser.add_argument("--seconds", type=float, default=60.0)
  parser.add_argument("--threads", type=int, default=20)
  parser.add_argument("--elements", type=int, default=64)
  parser.add_argument("--workers", type=int, default=2)
  parser.add_argument("--timeout_s", type=float, default=30.0)
  parser.add_argument(
    "--dev",
    action=argparse.BooleanOptionalAction,
    default=True,
    help="run the client under python -X dev",
  )
  parser.add_argument(
    "--drop_every",
    type=int,
    default=4,
    help="every N-th read drops its iterator instead of closing it (0: none)",
  )
  parser.add_argument(
    "--gc_threshold",
    type=int,
    default=0,
    help="the client's gc.set_threshold (0: Python's default): smaller collects more often",
  )
  parser.add_argument(
    "--log_dir",
    default="",
    help="where failing rounds' client stderr goes (default: a new temporary folder)",
  )
  parser.add_argument("--client", action="store_true", help=argparse.SUPPRESS)
  parser.add_argument("--address", default="", help=argparse.SUPPRESS)
  args = parser.parse_args(argv)
  if args.client:
    return client_main(args)
  if args.rounds < 1 or args.threads < 1 or args.seconds <= 0:
    parser.error("--rounds, --threads and --seconds must be positive")
  args.log_dir = args.log_dir or tempfile.mkdtemp(prefix="client_churn_soak_")
  dispatcher, address = _start("dispatcher", "--port=0")
  procs = [dispatcher]
  try:
    for _ in range(args.workers):
      procs.append(_start("worker", f"--dispatcher_address={address}", "--port=0")[0])
    results = []
    for number in range(1, args.rounds + 1):
      load = os.getloadavg()[0]
      result = run_round(args, address)
      results.append(result)
      print(
        f"round {number:3d} {'ok' if result['ok'] else 'FAILED':6s} "
        f"reads={result['reads']} ({result['reads_per_s']:.1f}/s) "
        f"slowest={result['slowest_s']:.2f}s {result['ended']} load={load:.1f}"
        + (f" hang: {result['hang']}; {result['probe']}" if result["hang"] else "")
        + (f" errors={result['errors']}" if result["errors"] else ""),
        flush=True,
      )
      if not result["ok"] and result["stderr"]:
        path = pathlib.Path(args.log_dir) / f"round{number}.stderr"
        path.write_text(result["stderr"])
        print(
          f"  client stderr: {path}; its first lines (the failing thread):\n  "
          + "\n  ".join(result["stderr"].splitlines()[:40]),
          flush=True,
        )
  finally:
    harness.stop_processes(procs, 15)
  print()
  print(
    "%-6s %8s %8s %10s %7s %6s  %s"
    % ("round", "reads", "reads/s", "slowest_s", "errors", "hang", "client ended")
  )
  for number, r in enumerate(results, 1):
    print(
      "%-6d %8d %8.1f %10.2f %7d %6s  %s"
      % (
        number,
        r["reads"],
        r["reads_per_s"],
        r["slowest_s"],
        sum(r["errors"].values()),
        "yes" if r["hang"] else "no",
        r["ended"],
      )
    )
  failed = sum(1 for r in results if not r["ok"])
  record.row(
    {
      "workload": "client churn",
      "system": "jaxfeed service",
      "rounds": len(results),
      "failed_rounds": failed,
      "reads": sum(r["reads"] for r in results),
      "slowest_s": max(r["slowest_s"] for r in results),
    },
    echo=False,
  )
  print(f"\n{len(results) - failed} of {len(results)} rounds clean")
  return 1 if failed else 0


if __name__ == "__main__":
  with record.run("client_churn_soak"):
    code = main()
  sys.exit(code)
