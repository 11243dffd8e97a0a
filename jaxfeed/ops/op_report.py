"""The per-op stats as text: the table `Loader.report()` and `jaxfeed
inspect` print, the op to fix first and how (`bottleneck`, `report`).

The stats themselves are sampled in `jaxfeed/ops/op_stats.py`; this module
is imported only where a report is printed (`import jaxfeed` does not).
"""

from __future__ import annotations

from typing import Iterable


INPUT_BOUND_FRACTION = 0.1
"""A loop that waits this share of its time for batches is input bound."""


def bottleneck(rows: Iterable[dict]) -> dict | None:
  """The row of the op that limits throughput: the most self time per unit
  of parallelism (an op with 4 threads busy 4 s took 1 s of wall time)."""
  best, best_cost = None, 0.0
  for row in rows:
    cost = row.get("self_seconds", 0.0) / max(1, row.get("parallelism") or 1)
    if cost > best_cost:
      best, best_cost = row, cost
  return best


def _advice(row: dict) -> str:
  op = row["op"]
  backend = row.get("backend")
  if isinstance(backend, str) and backend.startswith("process"):
    return (
      f"it runs on {row.get('parallelism') or 1} worker processes already: make "
      "its functions cheaper, or give the pipeline more cores"
    )
  if "map" in op or "filter" in op:
    if row.get("autotune") or backend:
      return (
        f"it already uses AUTOTUNE (parallelism {row.get('parallelism') or 1} "
        "now): make its function cheaper, or pass backend='process' if the "
        "function is Python-heavy (threads share the GIL)"
      )
    return (
      "give it more parallelism (num_parallel_calls=jaxfeed.AUTOTUNE, or "
      "backend='process' for Python-heavy functions) or make its "
      "function cheaper"
    )
  if op in ("from_source", "from_tensor_slices", "range", "interleave"):
    return "read faster: more parallel reads (interleave) or faster storage"
  if "batch" in op:
    return "batch fewer or smaller elements, or vectorize the ops before it"
  return "make it cheaper or move work out of it"


_COLUMNS = (
  ("op", "op", "{}"),
  ("elements", "elements", "{}"),
  ("self_seconds", "self s", "{:.3f}"),
  ("wait_seconds", "wait s", "{:.3f}"),
  ("buffer_fill", "fill", "{:.2f}"),
  ("parallelism", "par", "{}"),
)


def _name(row: dict, backend: bool = True) -> str:
  """The op, what runs it (a fused chain's backend, unless not `backend`),
  and the worker it runs on for a service read's worker rows."""
  name = str(row["op"])
  if backend and isinstance(row.get("backend"), str):
    name += f" [{row['backend']}]"
  worker = row.get("worker")
  return f"{name} (worker {worker})" if worker else name


_BACKENDS = {
  "inline": "in the consumer's thread",
  "thread": "on threads",
  "process": "in worker processes",
}
_PICKS = {"inline": "inline", "thread": "threads", "process": "processes"}


def backend_lines(rows: Iterable[dict]) -> list[str]:
  """A line per op that chose how to run (a fused chain, see
  `jaxfeed.ops.process_batch`): what runs it, what AUTOTUNE measured and
  why it picked what it did."""
  lines = []
  for row in rows:
    backend = row.get("backend")
    if backend is None or not row.get("reason"):
      continue
    where = _BACKENDS.get(backend, backend)
    if backend == "process" and row.get("num_workers"):
      where += f" ({row['num_workers']})"
    picked = row.get("picked")
    if row.get("measuring"):
      how = "AUTOTUNE is measuring the backends"
    elif picked is not None and "rates" in row:
      how = f"AUTOTUNE picked {_PICKS.get(picked, picked)}"
    else:
      how = "as asked"
    lines.append(f"{_name(row, backend=False)} runs {where}; {how}: {row['reason']}.")
  return lines


def _fused_parts(rows: list[dict], i: int) -> int:
  """How many rows just before row `i` are the parts of row `i`: the ops a
  fused op runs as they are (e.g. a process-or-thread chain on threads),
  whose labels joined by "+" are its label. 0 when it is no such op."""
  label, worker = rows[i]["op"], rows[i].get("worker")
  if "+" not in str(label):
    return 0
  for count in range(2, i + 1):
    parts = rows[i - count : i]
    if "+".join(str(r["op"]) for r in parts) == label and all(
      r.get("worker") == worker for r in parts
    ):
      return count
  return 0


def _display_order(rows: list[dict]) -> list[tuple[dict, int]]:
  """(row, depth) in table order: a fused op comes before the rows of its
  parts, which are indented under it, so the same work reads as one group
  rather than as two ops."""
  shown: list[tuple[dict, int]] = []
  for i, row in enumerate(rows):
    count = _fused_parts(rows, i)
    if not count:
      shown.append((row, 0))
      continue
    parts = shown[-count:]
    del shown[-count:]
    depth = min(d for _, d in parts)
    shown.append((row, depth))
    shown.extend((part, d + 1) for part, d in parts)
  return shown


def format_table(rows: list[dict]) -> str:
  """The rows as a fixed-width text table, with each op's share of self time."""
  total = sum(r.get("self_seconds", 0.0) for r in rows) or 1.0
  header = [title for _, title, _ in _COLUMNS] + ["self %"]
  lines = [header]
  for row, depth in _display_order(rows):
    cells = ["  " * depth + _name(row)]
    for key, _, fmt in _COLUMNS[1:]:
      value = row.get(key)
      cells.append("-" if value is None else fmt.format(value))
    cells.append(f"{100 * row.get('self_seconds', 0.0) / total:.0f}")
    lines.append(cells)
  widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
  return "\n".join(
    "  ".join(
      cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(line, widths))
    )
    for line in lines
  )


def _remote_read(row: dict) -> str:
  """Where the time goes when no op here measured any: a read of a pipeline
  that runs on other machines (the service), seen from this process."""
  return (
    f"No op in this process has measured time: it is spent in the service "
    f"read ({row['op']!r}), whose pipeline runs on the workers. This process "
    f"waited {row['read_wait_seconds']:.3f} s for {row.get('elements') or 0} "
    f"elements from {row.get('service_workers', 0)} worker(s) "
    f"({row.get('received', 0)} received, {row.get('reconnects', 0)} "
    "reconnections); the workers' op rows follow at most once a second and "
    "at the end of their streams."
  )


def report(rows: list[dict], loader_stats: dict | None = None) -> str:
  """The table plus a verdict: input bound or not, and which op to fix.

  Args:
    rows: op rows (`stats()["ops"]`, worker rows included).
    loader_stats: `Loader.stats()`'s counters, when a training loop ran.
  """
  lines = [format_table(rows), ""]
  if loader_stats is not None and loader_stats.get("batches"):
    fraction = loader_stats.get("input_bound_fraction", 0.0)
    if fraction >= INPUT_BOUND_FRACTION:
      lines.append(
        f"Input bound: the training loop waited {100 * fraction:.0f}% of its time for batches."
      )
    else:
      lines.append(
        f"Not input bound: the training loop waited only "
        f"{100 * fraction:.0f}% of its time for batches; the model "
        "step is the bottleneck."
      )
  lines.extend(backend_lines(rows))
  slowest = bottleneck(rows)
  remote = [r for r in rows if "read_wait_seconds" in r]
  if slowest is None and remote:
    lines.append(_remote_read(remote[-1]))
  elif slowest is None:
    lines.append("No op has measured time yet.")
  else:
    total = sum(r.get("self_seconds", 0.0) for r in rows) or 1.0
    share = 100 * slowest["self_seconds"] / total
    where = f" on worker {slowest['worker']}" if slowest.get("worker") else ""
    lines.append(
      f"Op to fix: {slowest['op']!r}{where} ({share:.0f}% of the pipeline's "
      f"self time, parallelism {slowest.get('parallelism') or 1}): "
      f"{_advice(slowest)}."
    )
  return "\n".join(lines)
