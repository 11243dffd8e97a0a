"""The task lists the dispatcher sends clients, built once per change.

Every client heartbeat answers with the tasks of the client's job, each with
a read ticket (two HMACs). A shared job read by 2,048 clients from 1,024
workers would rebuild the same 1,024 entries for every heartbeat; instead the
list is built when a task or worker changed since, and carries a version so
that a client that already holds it gets an answer without the tasks.
"""

from __future__ import annotations

import dataclasses
import itertools
import random
from typing import Callable, Iterable

from jaxfeed.service.protocol.protos import service_pb2 as pb


@dataclasses.dataclass(frozen=True)
class TaskList:
  """A job's tasks as sent to clients.

  Attributes:
    version: Changes whenever `tasks` does; never 0.
    tasks: The tasks on live workers.
    all_finished: Every task of the job (live worker or not) has finished.
    serialized: A ClientHeartbeatResponse with `tasks` only, serialized.
  """

  version: int
  tasks: tuple[pb.TaskInfo, ...]
  all_finished: bool
  serialized: bytes


class TaskListCache:
  """Per-job TaskLists, rebuilt lazily after `changed()`.

  Not thread-safe: used under the dispatcher's state lock.
  """

  def __init__(self):
    # Versions start at a random point, so a version a client kept from
    # before a dispatcher restart does not name a list of the new one.
    self._versions = itertools.count(random.getrandbits(40) << 16 | 1)
    self._epoch = 0
    self._lists: dict[int, tuple[int, TaskList]] = {}  # job id -> (epoch, list)
    # Job id -> (task id, data address) -> its TaskInfo: each ticket is
    # computed once.
    self._infos: dict[int, dict[tuple[int, str], pb.TaskInfo]] = {}

  def changed(self) -> None:
    """A task or worker changed: every list is rebuilt when next asked for."""
    self._epoch += 1

  def forget(self, job_id: int) -> None:
    """Drops what was kept for a deleted job."""
    self._lists.pop(job_id, None)
    self._infos.pop(job_id, None)

  def get(
    self,
    job_id: int,
    tasks: Callable[[], Iterable[tuple[int, str, bool, bool]]],
    task_info: Callable[[int], pb.TaskInfo],
  ) -> TaskList:
    """The job's TaskList.

    Args:
      job_id: The job.
      tasks: Called on a rebuild: (task id, data address, on a live worker,
        finished) of every task of the job.
      task_info: Called on a rebuild for a task not built before: its TaskInfo.
    """
    cached = self._lists.get(job_id)
    if cached is not None and cached[0] == self._epoch:
      return cached[1]
    infos, all_finished = [], True
    known = self._infos.setdefault(job_id, {})
    for task_id, data_address, live, finished in tasks():
      all_finished = all_finished and finished
      if not live:
        continue
      info = known.get((task_id, data_address))
      if info is None:
        info = known[(task_id, data_address)] = task_info(task_id)
      infos.append(info)
    infos_tuple = tuple(infos)
    if (
      cached is not None
      and cached[1].tasks == infos_tuple
      and (cached[1].all_finished == all_finished)
    ):
      built = cached[1]  # the same list: clients that hold it keep it
    else:
      built = TaskList(
        next(self._versions),
        infos_tuple,
        all_finished,
        pb.ClientHeartbeatResponse(tasks=infos_tuple).SerializeToString(),
      )
    self._lists[job_id] = (self._epoch, built)
    return built
