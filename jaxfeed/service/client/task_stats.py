"""Per-op statistics of a service read's tasks, asked of the workers.

A client's `DistributedIterator.stats()` asks each worker it reads from for
its task's pipeline rows (the worker's `GetTaskStats`, with the task's read
ticket) and shows them before its own row, each tagged with the worker's
address and the task id. It asks at most once every `MAX_AGE_S`, so a loop
calling `stats()` every step does not make a call per worker per step. A
worker that does not answer keeps the rows it gave last; a task that ended
shows the final rows its worker sent with the end of its stream (under
"ops" in the end's statistics).
"""

from __future__ import annotations

import concurrent.futures
import time
from typing import Any, Iterable

import grpc

from jaxfeed.service.protocol import rpc
from jaxfeed.service.protocol import wire
from jaxfeed.service.protocol.protos import service_pb2 as pb

METHOD = "/jaxfeed.service.Worker/GetTaskStats"
TIMEOUT_S = 2.0
"""How long one worker may take to answer."""

MAX_AGE_S = 1.0
"""How old a running task's rows may be before the workers are asked again."""

END_ROWS_KEY = "ops"
"""The key of the final rows in a task's end-of-stream statistics."""


def _tagged(rows: Any, worker_address: str, task_id: int) -> list[dict] | None:
  """`rows` tagged with `worker` and `task`; None unless a list of rows."""
  if not isinstance(rows, list) or not all(isinstance(r, dict) and "op" in r for r in rows):
    return None
  return [{**row, "worker": worker_address, "task": task_id} for row in rows]


def fetch_rows(
  worker_address: str, task_id: int, read_ticket: str, tls: Any = None, timeout_s: float = TIMEOUT_S
) -> list[dict] | None:
  """The task's rows from its worker, tagged with `worker` and `task`; None
  when the worker did not answer or answered something malformed."""
  channel = rpc.make_channel(worker_address, tls=tls)
  try:
    caller = rpc.Caller(channel, METHOD, pb.GetTaskStatsResponse, read_ticket or None)
    response = caller(pb.GetTaskStatsRequest(task_id=task_id), timeout=timeout_s)
    stats = wire.decode_json_object(response.stats_json.encode(), "Task statistics")
  except (grpc.RpcError, wire.WireFormatError):
    return None
  finally:
    channel.close()
  return _tagged(stats.get("ops"), worker_address, task_id)


def refresh(known: dict[int, list[dict]], tasks: Iterable[Any], tls: Any = None) -> list[dict]:
  """Asks the workers of `tasks` (`pb.TaskInfo`s still read) for their rows
  in parallel, updates `known` (task id -> rows) with the answers, and
  returns every known task's rows."""
  tasks = list(tasks)
  if tasks:
    with concurrent.futures.ThreadPoolExecutor(
      min(8, len(tasks)), thread_name_prefix="jaxfeed-task-stats"
    ) as pool:
      answers = pool.map(
        lambda t: fetch_rows(t.worker_address, t.task_id, t.read_ticket, tls), tasks
      )
      for task, rows in zip(tasks, answers):
        if rows is not None:
          known[task.task_id] = rows
  return [row for task_id in sorted(known) for row in known[task_id]]


class TaskRows:
  """The rows of a read's tasks: asked of the workers of running tasks at
  most every `MAX_AGE_S`, taken from the end of the stream for ended ones."""

  def __init__(self):
    self._known: dict[int, list[dict]] = {}  # task id -> its tagged rows
    self._asked_at: float | None = None

  def rows(
    self, running: Iterable[Any], ended: Iterable[tuple[Any, dict]], tls: Any = None
  ) -> list[dict]:
    """Every known task's rows, in task order.

    Args:
      running: `pb.TaskInfo`s of the tasks still read.
      ended: (`pb.TaskInfo`, end-of-stream statistics) of the tasks whose
        stream ended.
      tls: The read's TLS settings, for the calls.
    """
    for task, stats in ended:
      rows = _tagged(stats.get(END_ROWS_KEY), task.worker_address, task.task_id)
      if rows is not None:
        self._known[task.task_id] = rows
    running = list(running)
    now = time.monotonic()
    if running and (self._asked_at is None or now - self._asked_at >= MAX_AGE_S):
      self._asked_at = now
      refresh(self._known, running, tls)
    return [row for task_id in sorted(self._known) for row in self._known[task_id]]
