"""The worker's state (`WorkerState`): its tasks and the clients' streams of
them, and its heartbeats to the dispatcher; `client_calls` answers the
clients' calls from it, which `server` serves over gRPC and the data socket."""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time
from typing import Any, Callable

import grpc

from jaxfeed.service import metrics as metrics_lib
from jaxfeed.service.protocol import data_socket
from jaxfeed.service.protocol import rpc
from jaxfeed.service.protocol.protos import service_pb2 as pb
from jaxfeed.service.protocol import target_workers
from jaxfeed.service.protocol.sharding import ShardingPolicy
from jaxfeed.service.worker import dataset_cache
from jaxfeed.service.worker import delivery
from jaxfeed.service.worker import round_assembly
from jaxfeed.service.worker import save_writer
from jaxfeed.service.worker import shared_stream
from jaxfeed.service.worker import task_pipeline
from jaxfeed.service.worker import task_runner as task_runner_lib
from jaxfeed.service.worker.config import WorkerConfig

_DRAIN_IDLE_S = 2.0  # draining: a task unread this long has no consumer left
_DISPATCHER = "/jaxfeed.service.Dispatcher/"
# A heartbeat call's deadline: this until the dispatcher told its heartbeat
# timeout, then that fraction of it, so that a call hung on a connection that
# broke without a reset is given up (and the next one made) before the
# dispatcher takes this worker for dead.
_HEARTBEAT_DEADLINE_S = 10.0
_HEARTBEAT_DEADLINE_FRACTION = 1 / 3
# The longest a finished task's end waits for the dispatcher to hear of it.
_FINISH_REPORT_TIMEOUT_S = 2.0
# The deadline of one split or definition request: a busy dispatcher answers
# late, and an answer given up on is asked for again (and waited for again);
# only a connection that broke without a reset needs it at all.
_DISPATCHER_CALL_S = 30.0
# Clients' goodbyes kept for the next heartbeat, at most (a pod's worth many times).
_MAX_GOODBYES = 1 << 16


class WorkerState:
  """The worker's state; owned by WorkerServer, referenced by its threads."""

  def __init__(self, config: WorkerConfig, address: str):
    self.config = config
    self.address = address
    self.data_address = ""
    self.lock = threading.Lock()
    self.tasks: dict[int, task_runner_lib.TaskRunner | shared_stream.SharedStreamReader] = {}
    self.shared_streams: dict[str, shared_stream.SharedStream] = {}  # by dataset id
    self.finished: set[int] = set()
    self.task_added = threading.Condition(self.lock)
    self.stop = threading.Event()
    self.draining = threading.Event()  # no new splits: finish what it has
    self.dynamic_tasks: set[int] = set()  # tasks that read DYNAMIC splits
    self.dataset_defs = dataset_cache.DatasetCache(
      config.dataset_cache_entries, config.dataset_cache_bytes
    )
    self.streams = delivery.Registry()  # what each client of a task gets
    self._held: list[tuple[int, int, list[int]]] = []  # not yet reported
    # Exactly-once: (task id, splits made) whose report failed, for the next heartbeat.
    self._made: list[tuple[int, list[int]]] = []
    # Goodbyes of clients, not yet forwarded: (job id, client id) -> ticket.
    self._goodbyes: dict[tuple[int, int], pb.ClientGoodbye] = {}
    self.served = metrics_lib.ServedCounts()  # for --metrics_port
    # Told to the dispatcher with every heartbeat: a process restarted on this
    # address has a new one, so its predecessor's tasks count as lost.
    self.incarnation = secrets.token_hex(8)
    # Task id -> the number of its next GetSplits request (see GetSplitsRequest).
    self._split_requests: dict[int, int] = {}
    # Task id -> the answer to its first GetSplits, which came with the task
    # (TaskInfo.first_splits): (ranges, end_of_splits), until the task uses it.
    self._first_splits: dict[int, tuple[list, bool]] = {}
    channel = rpc.make_channel(config.dispatcher_address, config.max_message_bytes, config.tls)
    self.channel = channel
    token = config.worker_token
    # The key of the clients' read tickets, from the dispatcher's answer to a
    # heartbeat: None before the first answer, b"" when it issues none.
    self.ticket_key: bytes | None = None
    self.rejected: str | None = None  # why the dispatcher refused this worker
    # Why this worker stopped on its own: its dispatcher did not answer for
    # config.dispatcher_timeout_s.
    self.gave_up: str | None = None
    # The heartbeat interval the dispatcher asks for (0: the configured one).
    self.paced_interval_s = 0.0
    self.heartbeat_deadline_s = _HEARTBEAT_DEADLINE_S
    # The last clients the dispatcher listed: (clients_version, the tasks
    # it listed them for, task id -> client ids).
    self._listed: tuple[int, frozenset[int], dict[int, set[int]]] = (0, frozenset(), {})
    self.heartbeat_call = rpc.Caller(
      channel, _DISPATCHER + "WorkerHeartbeat", pb.WorkerHeartbeatResponse, token
    )
    self.dataset_call = rpc.Caller(
      channel, _DISPATCHER + "GetDatasetDef", pb.GetDatasetDefResponse, token
    )
    self.splits_call = rpc.Caller(channel, _DISPATCHER + "GetSplits", pb.GetSplitsResponse, token)
    self.saves = save_writer.SaveWriters(
      channel,
      token,
      lambda: self.address,
      self.incarnation,
      config.pickled_udf_secret,
      config.udf_modules,
    )

  # -- heartbeats and tasks ----------------------------------------------------
  def heartbeat(self, timeout_s: float = _HEARTBEAT_DEADLINE_S) -> None:
    sent_at = time.monotonic()
    held = self.streams.take_held()
    with self.lock:
      current = list(self.tasks)
      finished = list(self.finished)
      held, self._held = self._held + held, []
      goodbyes, self._goodbyes = self._goodbyes, {}
      made = self._made + [
        (task_id, runner.take_made())
        for task_id, runner in self.tasks.items()
        if isinstance(runner, task_runner_lib.TaskRunner)
      ]
      made, self._made = [(t, s) for t, s in made if s], []
    listed_version, listed_tasks, listed = self._listed
    # Draining or stopping, it starts no new task: splits sent with one would
    # wait unread until it leaves (at-most-once: lost).
    starts_tasks = not (self.draining.is_set() or self.stop.is_set())
    try:
      response = self.heartbeat_call(
        pb.WorkerHeartbeatRequest(
          worker_address=self.address,
          data_address=self.data_address,
          incarnation=self.incarnation,
          current_tasks=current,
          finished_tasks=finished,
          splits_per_request=self.config.splits_per_request if starts_tasks else -1,
          # The lists held cover exactly these tasks: they may stay.
          known_clients_version=(listed_version if listed_tasks == frozenset(current) else 0),
          held_splits=[pb.HeldSplits(task_id=t, client_id=c, starts=s) for t, c, s in held],
          client_goodbyes=_goodbye_messages(goodbyes),
          pid=os.getpid(),
          parent_pid=os.getppid(),
          made_splits=[pb.TaskSplits(task_id=t, starts=s) for t, s in made],
          process_id=target_workers.process_id(),
          worker_tags=self.config.worker_tags,
        ),
        timeout=min(timeout_s, self.heartbeat_deadline_s),
      )
    except BaseException:
      with self.lock:  # reported with the next heartbeat
        self._held = held + self._held
        self._goodbyes = {**goodbyes, **self._goodbyes}
        self._made = made + self._made
      raise
    # Before the new tasks: a dispatcher that started without the last one's
    # state gives ids that say nothing of the definitions kept.
    self.dataset_defs.meet(response.dispatcher_incarnation)
    self.ticket_key = response.ticket_key
    self.paced_interval_s = response.heartbeat_interval_s
    if response.heartbeat_timeout_s > 0:
      self.heartbeat_deadline_s = response.heartbeat_timeout_s * _HEARTBEAT_DEADLINE_FRACTION
    for task in response.new_tasks:
      self.start_task(task)
    if response.active_saves and not self.draining.is_set():
      self.saves.update(response.active_saves)
    for task_id in response.tasks_to_delete:
      with self.lock:
        runner = self.tasks.pop(task_id, None)
        self.finished.discard(task_id)
        self._first_splits.pop(task_id, None)
        self._split_requests.pop(task_id, None)
        self.dynamic_tasks.discard(task_id)
      if runner is not None:
        runner.stop()
    if not response.clients_unchanged:
      listed = {t.task_id: set(t.client_ids) for t in response.task_clients}
      self._listed = (response.clients_version, frozenset(current), listed)
    self._drop_streams(listed, sent_at)

  def _drop_streams(self, clients: dict[int, set[int]], listed_at: float) -> None:
    """Forgets the streams of tasks gone from this worker and of clients the
    dispatcher no longer lists (those that came after `listed_at` may just
    not have been listed yet)."""
    with self.lock:
      tasks = set(self.tasks)
    self.streams.drop(
      lambda task_id, client_id, stream: (
        task_id in tasks
        and (task_id not in clients or client_id in clients[task_id] or stream.created > listed_at)
      )
    )

  def start_task(self, task: pb.TaskInfo) -> None:
    self.served.track(task)

    def make_iterator() -> Any:
      return self._make_iterator(task)

    # Checked and added under one lock hold: the heartbeat thread and a
    # client's first request (find_task) may both learn of a new task, and
    # two runners of one task would serve its consumers different streams.
    # A runner only starts its thread here; the pipeline is built on it.
    with self.lock:
      if task.task_id in self.tasks or self.stop.is_set() or self.draining.is_set():
        return
      if task.ephemeral_sharing:
        self.tasks[task.task_id] = self._shared_reader(task)
        self.task_added.notify_all()
        return
      if task.sharding_policy == ShardingPolicy.DYNAMIC.value:
        self.dynamic_tasks.add(task.task_id)
        if task.HasField("first_splits"):
          self._first_splits[task.task_id] = (
            [(r.start, r.stop) for r in task.first_splits.ranges],
            task.first_splits.end_of_splits,
          )
      self.tasks[task.task_id] = task_runner_lib.TaskRunner(
        task.task_id,
        make_iterator,
        self.config.buffer_size,
        task.num_consumers,
        on_finished=self._on_finished,
        round_timeout_s=task.round_timeout_s or round_assembly.DEFAULT_ROUND_TIMEOUT_S,
        max_window_batches=self.config.max_window_batches,
        exactly_once=task.exactly_once,
      )
      self.task_added.notify_all()

  def _shared_reader(self, task: pb.TaskInfo) -> shared_stream.SharedStreamReader:
    """A reader of the dataset's shared pipeline, started if need be (lock held)."""
    stream = self.shared_streams.get(task.dataset_id)
    reader = stream.add_reader(task.task_id) if stream is not None else None
    if reader is None:

      def forget(ended: shared_stream.SharedStream, dataset_id: str = task.dataset_id) -> None:
        with self.lock:
          if self.shared_streams.get(dataset_id) is ended:
            del self.shared_streams[dataset_id]

      stream = shared_stream.SharedStream(
        lambda: self._make_iterator(task),
        self.config.sharing_window_bytes,
        self.config.buffer_size,
        on_finished=self._on_finished,
        on_empty=forget,
      )
      self.shared_streams[task.dataset_id] = stream
      reader = stream.add_reader(task.task_id)
    return reader

  def _on_finished(self, task_id: int) -> None:
    with self.lock:
      self.finished.add(task_id)
    # Told at once, not at the next heartbeat: a read ends only once the
    # dispatcher knows all of its tasks finished, and a short epoch would
    # otherwise wait most of a heartbeat interval after its last batch.
    if self.stop.is_set():
      return
    try:
      self.heartbeat(_FINISH_REPORT_TIMEOUT_S)
    except grpc.RpcError:
      pass  # the heartbeat thread reports it
    except Exception:  # pylint: disable=broad-except
      # Not the task's failure: its end must still reach its consumers.
      logging.exception("Reporting finished task %d failed", task_id)

  def _make_iterator(self, task: pb.TaskInfo) -> Any:
    def gone() -> bool:  # nobody needs the task's pipeline any more
      with self.lock:  # start_task adds the task under it
        return self.stop.is_set() or (not task.ephemeral_sharing and task.task_id not in self.tasks)

    dataset_def = self.dataset_defs.get(task.dataset_id, task.dataset_fingerprint)
    if dataset_def is None:
      dataset_def = self._ask_dispatcher(
        self.dataset_call,
        pb.GetDatasetDefRequest(dataset_id=task.dataset_id),
        f"Fetching dataset {task.dataset_id}",
        gone,
      ).dataset
      dataset_cache.check_fingerprint(task, dataset_def)
      self.dataset_defs.put(task.dataset_id, dataset_def)

    fetching = threading.Lock()  # one request of the task at a time: they are numbered

    def fetch_ranges() -> tuple[list, bool]:
      if self.draining.is_set():
        return [], True
      with fetching:
        return fetch_numbered()

    def fetch_numbered() -> tuple[list, bool]:
      with self.lock:
        request_seq = self._split_requests.get(task.task_id, 1)
        first = self._first_splits.pop(task.task_id, None) if request_seq == 1 else None
        if first is not None:  # request 1 was answered with the task
          if task.task_id in self.tasks:
            self._split_requests[task.task_id] = 2
          return first
      # While the dispatcher is away, the task waits here for more splits
      # (and its clients with it) for up to dispatcher_timeout_s.
      response = self._ask_dispatcher(
        self.splits_call,
        pb.GetSplitsRequest(
          job_id=task.job_id,
          task_id=task.task_id,
          max_ranges=self.config.splits_per_request,
          request_seq=request_seq,
        ),
        f"Fetching splits of job {task.job_id}",
        gone,
      )
      with self.lock:
        if task.task_id in self.tasks:
          self._split_requests[task.task_id] = request_seq + 1
      return [(r.start, r.stop) for r in response.ranges], response.end_of_splits

    if task.exactly_once:
      return task_pipeline.split_by_split(
        dataset_def,
        task,
        self.config.pickled_udf_secret,
        fetch_ranges,
        udf_modules=self.config.udf_modules,
      )
    return task_pipeline.task_iterator(
      dataset_def,
      task,
      self.config.pickled_udf_secret,
      fetch_ranges,
      self.config.autocache_dir,
      self.config.udf_modules,
      self.config.autocache_policy,
    )

  def _ask_dispatcher(
    self, caller: rpc.Caller, request: Any, what: str, gone: Callable[[], bool]
  ) -> Any:
    """A task's call to the dispatcher, made again while it is away (for up
    to dispatcher_timeout_s) unless the task is `gone()` meanwhile."""
    try:
      return rpc.call_with_retry(
        caller,
        request,
        self.config.dispatcher_timeout_s,
        what,
        attempt_s=_DISPATCHER_CALL_S,
        cancelled=gone,
      )
    except rpc.ServiceError as e:
      cause = e.__cause__
      code = cause.code() if isinstance(cause, grpc.RpcError) else None
      if code == grpc.StatusCode.NOT_FOUND:
        # The dispatcher gave the task up (it took this worker for dead, or
        # it is a new one that never knew it): the task is lost, as if this
        # worker had died, not failed.
        e.grpc_status = "NOT_FOUND"  # type: ignore[attr-defined]
      elif code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        raise rpc.ServiceError(
          f"{what} failed: the dispatcher at {self.config.dispatcher_address} did not "
          f"answer for {self.config.dispatcher_timeout_s:g} s (the worker's "
          f"dispatcher_timeout_s); last error: {code.name}: {cause.details()}"
        ) from e
      raise

  def find_task(self, task_id: int, timeout_s: float = 5.0) -> task_runner_lib.TaskRunner:
    """The task's runner, waiting briefly: clients may learn of a task first."""
    deadline = time.monotonic() + timeout_s
    with self.lock:
      known = task_id in self.tasks
    if not known and not self.stop.is_set():
      try:  # ask the dispatcher now rather than at the next heartbeat
        self.heartbeat()
      except grpc.RpcError:
        pass
    with self.lock:
      while task_id not in self.tasks:
        left = deadline - time.monotonic()
        if left <= 0 or self.stop.is_set():
          raise rpc.NotFoundError(f"Worker {self.address} has no task {task_id}.")
        self.task_added.wait(min(left, 0.1))
      return self.tasks[task_id]

  def open_stream(
    self, request: pb.GetElementsRequest, kick: Callable[[], None], transport: str
  ) -> tuple[delivery.ClientStream, object]:
    """The client's stream of the task, attached to a new connection over
    `transport` ("grpc", "socket" or "memory") that `kick` ends; returns it
    and the connection's token (see `delivery.ClientStream.attach`)."""
    runner = self.find_task(request.task_id)
    self.served.connected(transport)
    window = min(request.window or delivery.DEFAULT_WINDOW, delivery.MAX_WINDOW)
    stream = self.streams.get_or_add(
      request.task_id,
      request.client_id,
      lambda: delivery.ClientStream(
        self.served.counting(request.task_id, runner),
        runner.exactly_once,
        request.consumer_index,
        request.round,
        window,
        request.received,
        resumable=bool(request.client_id),
        skip=request.skip,
      ),
    )
    return stream, stream.attach(request.received, kick)

  def hold_goodbye(self, goodbye: pb.ClientGoodbye) -> None:
    """Keeps a client's goodbye (checked by `client_calls`) for the next
    heartbeat. Raises DataConnectionError when it holds too many."""
    with self.lock:
      if len(self._goodbyes) >= _MAX_GOODBYES:
        raise data_socket.DataConnectionError(
          f"Worker {self.address} already holds {_MAX_GOODBYES} goodbyes.", "RESOURCE_EXHAUSTED"
        )
      self._goodbyes[(goodbye.job_id, goodbye.client_id)] = goodbye

  def drain(self, timeout_s: float) -> bool:
    """Takes no new splits, lets DYNAMIC tasks finish the splits they hold
    and their consumers take every batch, and stops the other tasks (their
    pipelines would run whole epochs). A task no consumer read for
    _DRAIN_IDLE_S is not waited for. True if all drained in time."""
    self.draining.set()
    with self.lock:
      runners = list(self.tasks.items())
    for task_id, runner in runners:
      if not isinstance(runner, task_runner_lib.TaskRunner) or (
        runner.num_consumers or task_id not in self.dynamic_tasks
      ):
        with self.lock:
          self.tasks.pop(task_id, None)
        runner.stop()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
      with self.lock:
        # A task nobody has read for a while has no consumer left to wait for.
        left = [r for r in self.tasks.values() if not r.drained and r.idle_s < _DRAIN_IDLE_S]
      if not left:
        return True
      time.sleep(0.05)
    return False

  def leave(self) -> None:
    """Tells the dispatcher this worker is gone (best effort), with the tasks
    that finished: their splits were all delivered."""
    with self.lock:
      finished = list(self.finished)
      goodbyes, self._goodbyes = self._goodbyes, {}
    try:
      self.heartbeat_call(
        pb.WorkerHeartbeatRequest(
          worker_address=self.address,
          incarnation=self.incarnation,
          finished_tasks=finished,
          leaving=True,
          client_goodbyes=_goodbye_messages(goodbyes),
        ),
        timeout=2,
      )
    except grpc.RpcError:
      pass

  def shutdown(self) -> None:
    self.stop.set()
    self.saves.close()
    with self.lock:
      runners = list(self.tasks.values())
      self.tasks.clear()
      self.task_added.notify_all()
    for runner in runners:
      runner.stop()
    self.channel.close()


def _goodbye_messages(goodbyes: dict[tuple[int, int], pb.ClientGoodbye]) -> list[pb.ClientGoodbye]:
  return list(goodbyes.values())
