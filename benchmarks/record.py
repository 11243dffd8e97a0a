"""Benchmark results as data: every benchmark's JSON rows, with where and
how they were measured, in `benchmarks/results/<benchmark>.json`.

A benchmark's main runs inside `with record.run("w4_service"):` and emits
each row with `record.row(line)` (which also prints it as one JSON line).
When the block ends without an error, the run is written with its context:
the commit (and whether the checkout differed from it), the machine (cores,
CPU model, memory), the load average at start and end, the date, the Python,
jax and peer versions, and the exact command.

One file per benchmark, holding the latest run of every (workload, system):
a new run replaces the rows it measured again and keeps the others, so that
`git diff` shows a rerun as old figures against new ones, row by row, and
runs of one benchmark with other arguments (the dispatcher at other sizes,
W3 alone) stay beside each other. `python -m benchmarks.report` renders the
README's table and docs/benchmarks.md from these files.

`JAXFEED_BENCHMARK_RESULTS=DIR` writes into DIR instead (the test suite
points it at a temporary directory, so that no test overwrites a recorded
run).
"""

from __future__ import annotations

import contextlib
import datetime
import importlib.metadata
import json
import os
import pathlib
import platform
import shlex
import subprocess
import sys
from typing import Any, Iterator

REPO = pathlib.Path(__file__).resolve().parent.parent
RESULTS_DIR = REPO / "benchmarks" / "results"
ENV_DIR = "JAXFEED_BENCHMARK_RESULTS"
# Written by `benchmarks.report` and by benchmark runs: a checkout that differs
# from its commit only here still runs exactly the commit's code.
OUTPUTS = (
  "benchmarks/results",
  "README.md",
  "docs/benchmarks.md",
  "docs/images/benchmarks",
  "docs/dispatcher_scale.md",
  "docs/llm_text.md",
  "docs/concepts/coordinated_reads.md",
)
VERSIONS = ("jax", "jaxlib", "numpy", "tensorflow-cpu", "grain")

_current: list["Run"] = []


def results_dir() -> pathlib.Path:
  """Where runs are written: $JAXFEED_BENCHMARK_RESULTS or benchmarks/results."""
  return pathlib.Path(os.environ.get(ENV_DIR) or RESULTS_DIR)


def _git(*args: str) -> str:
  try:
    return subprocess.run(
      ["git", *args], cwd=REPO, capture_output=True, text=True, check=True, timeout=30
    ).stdout.strip()
  except (OSError, subprocess.SubprocessError):
    return ""


def commit() -> dict:
  """HEAD's hash and whether tracked files other than the outputs differ."""
  head = _git("rev-parse", "HEAD")
  changed = _git(
    "status",
    "--porcelain",
    "--untracked-files=no",
    "--",
    ".",
    *(f":(exclude){path}" for path in OUTPUTS),
  )
  return {"commit": head or "unknown", "dirty": bool(changed) if head else None}


def _cpu_model() -> str:
  try:
    with open("/proc/cpuinfo", encoding="utf-8") as f:
      for line in f:
        if line.startswith("model name"):
          return line.split(":", 1)[1].strip()
  except OSError:
    pass
  return platform.processor() or platform.machine()


def machine() -> dict:
  """Cores (usable by this process, and online), CPU model, memory, OS."""
  cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
  memory_gib = None
  if hasattr(os, "sysconf") and "SC_PHYS_PAGES" in os.sysconf_names:
    memory_gib = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
  return {
    "cores": cores,
    "cpus_online": os.cpu_count(),
    "cpu_model": _cpu_model(),
    "memory_gib": memory_gib,
    "system": f"{platform.system()} {platform.machine()}",
  }


def load_average() -> list[float]:
  return [round(x, 2) for x in os.getloadavg()]


def versions() -> dict:
  """Python's and the installed peers' versions (absent: not installed)."""
  found = {"python": platform.python_version()}
  for name in VERSIONS:
    try:
      found[name] = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      pass
  return found


def command() -> str:
  """This process's command line as it was typed, the interpreter as `python`."""
  argv = list(getattr(sys, "orig_argv", sys.argv))
  if argv and (argv[0] == sys.executable or os.path.basename(argv[0]).startswith("python")):
    argv[0] = "python"
  return " ".join(shlex.quote(a) for a in argv)


class Run:
  """One run of a benchmark: its context and the rows it emitted."""

  def __init__(self, benchmark: str):
    self.benchmark = benchmark
    self.rows: list[dict] = []
    self.context = {
      "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
      "command": command(),
      **commit(),
      "machine": machine(),
      "load_average_start": load_average(),
      "versions": versions(),
    }
    if os.environ.get("XLA_FLAGS"):
      self.context["xla_flags"] = os.environ["XLA_FLAGS"]

  def finish(self) -> dict:
    self.context["load_average_end"] = load_average()
    return {"context": self.context, "rows": self.rows}


def row(line: dict, echo: bool = True) -> dict:
  """Prints `line` as one JSON line (unless not `echo`) and adds it to the
  run in progress, if any."""
  if echo:
    print(json.dumps(line), flush=True)
  if _current:
    _current[-1].rows.append(line)
  return line


@contextlib.contextmanager
def run(benchmark: str) -> Iterator[Run]:
  """Records the rows emitted inside the block as one run of `benchmark`;
  writes them when the block ends without an error (a nested run adds to the
  outer one)."""
  if _current:
    yield _current[-1]
    return
  current = Run(benchmark)
  _current.append(current)
  try:
    yield current
  except SystemExit as exit_:  # absl's app.run exits when main returns
    if exit_.code not in (None, 0):
      raise
    _save(current)
    raise
  finally:
    _current.pop()
  _save(current)


def _save(current: Run) -> None:
  if current.rows:
    path = save(current.benchmark, current.finish())
    print(f"recorded {len(current.rows)} rows in {path}", file=sys.stderr, flush=True)


def row_key(line: dict) -> tuple:
  """What a row measured: a later row with the same key replaces it."""
  return tuple(str(line.get(key, "")) for key in ("workload", "system", "way", "mode"))


def load(path: pathlib.Path) -> dict:
  with open(path, encoding="utf-8") as f:
    data = json.load(f)
  if not isinstance(data, dict) or not isinstance(data.get("runs"), list):
    raise ValueError(f"{path}: not a benchmark results file (expected an object with 'runs').")
  return data


def save(benchmark: str, new_run: dict) -> pathlib.Path:
  """Adds `new_run` to the benchmark's file; earlier rows with a (workload,
  system) the new run measured again are dropped, and runs left empty."""
  directory = results_dir()
  directory.mkdir(parents=True, exist_ok=True)
  path = directory / f"{benchmark}.json"
  runs = load(path)["runs"] if path.exists() else []
  measured = {row_key(line) for line in new_run["rows"]}
  kept = []
  for old in runs:
    rows = [line for line in old["rows"] if row_key(line) not in measured]
    if rows:
      kept.append({**old, "rows": rows})
  data = {"benchmark": benchmark, "runs": kept + [new_run]}
  tmp = path.with_suffix(".json.tmp")
  tmp.write_text(dumps(data), encoding="utf-8")
  os.replace(tmp, path)
  return path


_FIRST = ("workload", "system", "way", "mode", "unit", "rate")


def _ordered(line: dict) -> dict:
  """What a row measured and its rate first, the rest by name."""
  first = [k for k in _FIRST if k in line]
  return {k: line[k] for k in first + sorted(k for k in line if k not in _FIRST)}


def dumps(data: dict) -> str:
  """JSON with one row per line, each beginning with what it measured: a
  rerun's diff is the rows that changed."""

  def one(value: Any) -> str:
    return json.dumps(value, sort_keys=True)

  lines = ["{", f' "benchmark": {one(data["benchmark"])},', ' "runs": [']
  for i, entry in enumerate(data["runs"]):
    lines.append("  {")
    lines.append('   "context": {')
    context = sorted(entry["context"].items())
    lines += [
      f"    {one(k)}: {one(v)}{',' if j < len(context) - 1 else ''}"
      for j, (k, v) in enumerate(context)
    ]
    lines.append("   },")
    lines.append('   "rows": [')
    lines += [
      f"    {json.dumps(_ordered(line))}{',' if j < len(entry['rows']) - 1 else ''}"
      for j, line in enumerate(entry["rows"])
    ]
    lines.append("   ]")
    lines.append("  }" + ("," if i < len(data["runs"]) - 1 else ""))
  lines += [" ]", "}", ""]
  return "\n".join(lines)


def runs(directory: pathlib.Path | None = None) -> list[dict]:
  """Every recorded run, each row with its run's context, by file name."""
  directory = directory or results_dir()
  found = []
  for path in sorted(directory.glob("*.json")):
    data = load(path)
    for entry in data["runs"]:
      found.append({"benchmark": data.get("benchmark", path.stem), **entry})
  return found
