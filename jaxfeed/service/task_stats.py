"""Per-op statistics of a service read's tasks, asked of the workers.

A client's `DistributedIterator.stats()` asks each worker it reads from for
its task's pipeline rows (the worker's `GetTaskStats`, with the task's read
ticket) and shows them before its own row, each tagged with the worker's
address and the task id. A worker that does not answer keeps the rows it
gave last; a task that ended keeps its last rows.
"""

from __future__ import annotations

import concurrent.futures
from typing import Any, Iterable

import grpc

from jaxfeed.service import rpc
from jaxfeed.service import wire
from jaxfeed.service.protos import service_pb2 as pb

METHOD = "/jaxfeed.service.Worker/GetTaskStats"
TIMEOUT_S = 2.0
"""How long one worker may take to answer."""


def fetch_rows(worker_address: str, task_id: int, read_ticket: str,
               tls: Any = None, timeout_s: float = TIMEOUT_S) -> list[dict] | None:
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
  rows = stats.get("ops")
  if not isinstance(rows, list) or not all(isinstance(r, dict) and "op" in r for r in rows):
    return None
  return [{**row, "worker": worker_address, "task": task_id} for row in rows]


def refresh(known: dict[int, list[dict]], tasks: Iterable[Any], tls: Any = None) -> list[dict]:
  """Asks the workers of `tasks` (`pb.TaskInfo`s still read) for their rows
  in parallel, updates `known` (task id -> rows) with the answers, and
  returns every known task's rows."""
  tasks = list(tasks)
  if tasks:
    with concurrent.futures.ThreadPoolExecutor(
        min(8, len(tasks)), thread_name_prefix="jaxfeed-task-stats") as pool:
      answers = pool.map(
          lambda t: fetch_rows(t.worker_address, t.task_id, t.read_ticket, tls), tasks)
      for task, rows in zip(tasks, answers):
        if rows is not None:
          known[task.task_id] = rows
  return [row for task_id in sorted(known) for row in known[task_id]]
