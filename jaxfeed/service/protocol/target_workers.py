"""Which workers a client reads (tf.data service's `target_workers`).

- "any": every worker of the job.
- "local": only the workers in the client's own process (a `WorkerServer`
  started inside the trainer); a read fails at once when the process has
  none. Such reads take their batches through memory, not a socket.
- "auto" (the default): every worker except those tagged "COLOCATED"
  (`WorkerConfig.worker_tags`: workers that run on other trainers' hosts)
  in other processes, as tf.data service decides: a trainer reads its own
  colocated worker and the shared ones, never another trainer's.

A worker tells the dispatcher its process (`process_id`) and tags with its
heartbeats; a client tells its process and target when it joins a job. The
dispatcher creates a job's tasks only on workers some client of the job
may read (so a "local" job's splits never wait on a worker nobody reads),
and each client reads only the tasks it may.
"""

from __future__ import annotations

import os
import secrets
import socket
from typing import Any, Iterable

AUTO, ANY, LOCAL = "auto", "any", "local"
TARGET_WORKERS = (AUTO, ANY, LOCAL)
COLOCATED = "COLOCATED"  # tf.data's tag of workers that run on trainer hosts

_process: tuple[int, str] = (0, "")


def check_target_workers(value: Any) -> str:
  """Validates a target (any case, as tf.data writes "AUTO") and returns it
  in lower case."""
  if isinstance(value, str) and value.lower() in TARGET_WORKERS:
    return value.lower()
  raise ValueError(f"target_workers must be one of {TARGET_WORKERS} (any case), got {value!r}.")


def process_id() -> str:
  """This process's identity: its host, pid and a random part (new after a
  fork, so a child never passes for its parent)."""
  global _process
  pid = os.getpid()
  if _process[0] != pid:
    _process = (pid, f"{socket.gethostname()}/{pid}/{secrets.token_hex(6)}")
  return _process[1]


def reads(
  target: str, client_process: str, worker_process: str, worker_tags: Iterable[str]
) -> bool:
  """Whether a client of `client_process` reading with `target` reads a
  worker of `worker_process` tagged `worker_tags`.

  Args:
    target: "auto", "any" or "local" ("": "auto").
    client_process: the client's `process_id()` ("": unknown, not local).
    worker_process: the worker's ("": unknown, not local).
    worker_tags: the worker's tags ("COLOCATED" in any case counts).

  Returns:
    True when the client reads it.
  """
  local = bool(client_process) and client_process == worker_process
  if target == LOCAL:
    return local
  if target == ANY or local:
    return True
  return not any(tag.upper() == COLOCATED for tag in worker_tags)
