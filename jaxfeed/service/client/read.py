"""What a service read's threads share (`ReadState`): the job it joined at
the dispatcher (`jaxfeed.service.client.job_calls`), the heartbeats that keep
it and list its tasks, and a fetcher per task
(`jaxfeed.service.client.fetcher`)."""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any

import grpc

from jaxfeed.service.client import job_calls
from jaxfeed.service.client.fetcher import Fetcher
from jaxfeed.service.dispatcher import heartbeat_pacing
from jaxfeed.service.protocol import read_state
from jaxfeed.service.protocol import rpc
from jaxfeed.service.protocol import split_failures
from jaxfeed.service.protocol import stream_state
from jaxfeed.service.protocol import target_workers
from jaxfeed.service.protocol.protos import service_pb2 as pb
from jaxfeed.service.protocol.sharding import ShardingPolicy
from jaxfeed.service.worker import local_workers

POLL_S = 0.05
# A heartbeat answered this much later than the dispatcher asked for follows
# a silence (it was stopped, down or unreachable), not a listing.
_ANSWER_SLACK_S = 5.0
# The dispatcher is away for `check_progress` once its heartbeat answer is
# this much later than its interval: a read waits for it without counting.
_AWAY_AFTER_S = 1.0
# A read whose every task sent its whole stream waits this long (at most
# timeout_s) for the dispatcher to say the job finished, then ends without it.
_END_WITHOUT_DISPATCHER_S = 10.0
HEARTBEAT_TIMEOUT_S = 10.0  # the longest one heartbeat call may take
CLOSE_TIMEOUT_S = 15.0  # the longest close() waits for the read's threads, in all
END = object()  # put in the buffer when a read is over, to wake its consumer


def follows_streams(node: Any) -> bool:
  """Whether a read follows its streams to resume (`jaxfeed.service.
  stream_state`): parallel_epochs, not shared, not round-robin."""
  return (
    node.policy == ShardingPolicy.OFF
    and not node.job_name
    and not node.num_consumers
    and not node.ephemeral_sharing
  )


def check_local_workers(node: Any) -> None:
  """Raises ValueError for a target_workers="local" read in a process that
  runs no worker (tf.data's check)."""
  if node.target_workers == target_workers.LOCAL and local_workers.empty():
    raise ValueError(
      "Local reads require local workers, but no local worker is found: "
      "target_workers='local' reads only the workers of this process; start a "
      "jaxfeed.service.WorkerServer in it first (with the dispatcher's address), "
      "or read with target_workers='auto' or 'any'."
    )


class ReadState:
  """Everything a read's threads share; the iterator owns and closes it."""

  def __init__(
    self,
    node: Any,
    progress: read_state.SplitProgress | None = None,
    streams: stream_state.StreamProgress | None = None,
  ):
    """`node` is the `jaxfeed.service.client.distribute.DistributedNode` read;
    `progress`, what a restored exactly-once read's consumer took before;
    `streams`, what a restored parallel_epochs read's consumer took."""
    self.node = node
    check_local_workers(node)
    self.process = target_workers.process_id()
    # Exactly-once: what the consumer took (a restored read goes on from it).
    self.progress = progress or read_state.SplitProgress()
    # Reads that can resume per stream: what the consumer took of each.
    self.streams = streams or (stream_state.StreamProgress() if follows_streams(node) else None)
    self._first_tasks = True  # no task listed yet
    self.job_started = time.monotonic()  # reset once the job exists
    self.stop = threading.Event()
    self.wake = threading.Event()  # heartbeat now rather than at the interval
    self.lock = threading.Lock()
    self.error: BaseException | None = None
    self.elements_by_worker: dict[str, int] = {}
    # Exactly-once: splits to acknowledge, sent with each heartbeat until the
    # dispatcher has them durable.
    self.acks: list[int] = []
    self.handed_on: set[int] = set()  # exactly-once: splits this read has had
    # Reported to the dispatcher for autoscaling.
    self.consumed = 0
    self.wait_s = 0.0
    self.started = time.monotonic()
    capacity = node.max_outstanding_requests or 8
    self.buffer: queue.Queue = queue.Queue(maxsize=capacity)
    self.capacity = capacity
    self.fetchers: dict[int, Fetcher] = {}
    self.finished = False
    # The dispatcher did not answer the last heartbeat (it is stopped, down
    # or unreachable): the read goes on from its workers meanwhile.
    self.dispatcher_away = False
    self._away_logged = False
    self._answered_at = time.monotonic()  # the dispatcher's last heartbeat answer
    self._interval_s = heartbeat_pacing.CLIENT_DEFAULT_INTERVAL_S  # it asked for
    self._back_at = 0.0  # when it last answered after being away
    self.dataset_id = node.dataset_id or ""
    self.job_id = 0
    self.client_id = 0
    # At-most-once: positions of the splits lost workers were reading
    # (sorted [start, stop) pairs; see jaxfeed.service.protocol.split_failures).
    self.lost_positions: list[tuple[int, int]] = []
    # From the last heartbeat answer: say goodbye through a worker, with this
    # ticket (the dispatcher serves many clients), rather than by a call.
    self.goodbye_via_worker = False
    self.goodbye_ticket = ""
    self.channel = rpc.make_channel(node.service, tls=node.tls)
    self.ssl_context = node.tls.client_ssl_context() if node.tls is not None else None
    self.manager = threading.Thread(
      target=self._manage, daemon=True, name="jaxfeed-distribute-manager"
    )
    self.manager.start()

  # -- shared helpers -----------------------------------------------------------
  def put(self, out: queue.Queue, item: Any) -> bool:
    while not self.stop.is_set():
      try:
        out.put(item, timeout=POLL_S)
        return True
      except queue.Full:
        continue
    return False

  def count(self, worker: str) -> None:
    with self.lock:
      self.elements_by_worker[worker] = self.elements_by_worker.get(worker, 0) + 1

  def ack(self, split_start: int) -> bool:
    """Exactly-once: all of a split arrived; acknowledges it and returns True,
    or False if this read already had it (its worker sent it again because
    the connection broke while the split's end was going out)."""
    with self.lock:
      if split_start in self.handed_on:
        return False
      self.handed_on.add(split_start)
      self.acks.append(split_start)
      return True

  def fail(self, error: BaseException) -> None:
    with self.lock:
      if self.error is None:
        self.error = error

  # -- the manager thread ---------------------------------------------------------
  def _manage(self) -> None:
    node = self.node
    try:
      if self.streams is not None and self.streams.resumed and not self.streams.open_streams:
        self._end()  # every stream was over when the state was taken
        return
      dataset_id = self.dataset_id = node.resolve_dataset_id()
      job = job_calls.join_job(
        node,
        self.channel,
        dataset_id,
        self.progress,
        self.process,
        self.streams.open_orders()
        if self.streams is not None and not node.identical_worker_streams
        else (),
      )
      self.job_id, self.client_id = job.job_id, job.client_id
      self.job_started = time.monotonic()
      heartbeat = job_calls.dispatcher_caller(
        self.channel, "ClientHeartbeat", pb.ClientHeartbeatResponse, node.auth_token
      )
      last_ok = time.monotonic()
      # The last task list and its version: the dispatcher leaves the tasks
      # out of its answer while they stay the same.
      tasks, tasks_version = [], 0
      # The join answered the first heartbeat (a dispatcher that predates
      # first_heartbeat leaves it out: then the first heartbeat goes at once).
      answered = job.heartbeat if job.HasField("heartbeat") else None
      while not self.stop.is_set():
        self.wake.clear()
        if answered is not None:
          response, answered = answered, None
        else:
          with self.lock:
            acks = list(self.acks)
          try:
            response = heartbeat(
              pb.ClientHeartbeatRequest(
                job_id=self.job_id,
                client_id=self.client_id,
                acked_splits=acks,
                elements_consumed=self.consumed,
                consumer_wait_s=self.wait_s,
                read_elapsed_s=time.monotonic() - self.started,
                buffer_fill=self.buffer.qsize() / self.capacity,
                known_tasks_version=tasks_version,
              ),
              timeout=min(HEARTBEAT_TIMEOUT_S, node.timeout_s),
            )
            last_ok = time.monotonic()
            self.dispatcher_away = self._away_logged = False
            if not response.acks_pending:  # else sent again until durable
              with self.lock:
                del self.acks[: len(acks)]
          except grpc.RpcError as e:
            # A heartbeat sent while the dispatcher is stopped, restarts or
            # its connection was just cut may time out rather than fail
            # fast: all are an outage, which the read outlives.
            if e.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
              raise rpc.ServiceError(
                f"Heartbeat for job {self.job_id} failed: {e.code().name}: {e.details()}"
              ) from e
            self.dispatcher_away = True
            if self._outlive_dispatcher(last_ok, f"{e.code().name}: {e.details()}"):
              return
            self.stop.wait(0.2)
            continue
        self.goodbye_via_worker = response.goodbye_via_worker
        self.goodbye_ticket = response.goodbye_ticket
        if response.job_error:  # before the job's end: a failed job ends too
          raise split_failures.PoisonSplitError(response.job_error)
        if response.lost_ranges:
          self.lost_positions = [(r.start, r.stop) for r in response.lost_ranges]
        if response.tasks_unchanged:
          response.tasks.extend(tasks)
        else:
          tasks, tasks_version = list(response.tasks), response.tasks_version
        self._update_tasks(response)
        if self.finished:
          return
        self.wake.wait(
          max(heartbeat_pacing.CLIENT_DEFAULT_INTERVAL_S, response.heartbeat_interval_s)
        )
    except BaseException as e:  # pylint: disable=broad-except
      self.fail(e)

  def _outlive_dispatcher(self, last_ok: float, error: str) -> bool:
    """What the read does while its dispatcher does not answer: it reads on
    from the workers it knows, however long, and keeps what it must tell
    the dispatcher (acknowledged splits) for its return. True once it ends
    without the dispatcher: every task it knows sent its whole stream (each
    worker of a parallel_epochs read its epoch; a DYNAMIC task ends only
    once the dispatcher said all splits were delivered) and the dispatcher
    has not answered since for _END_WITHOUT_DISPATCHER_S. Raises ServiceError
    when no worker is left to read from (its fetcher ended, or has not
    reached it for timeout_s) and the dispatcher has not answered for
    timeout_s."""
    node, now = self.node, time.monotonic()
    fetchers = list(self.fetchers.values())
    for fetcher in fetchers:
      fetcher.kick_if_stalled(now)
    if fetchers and all(f.done for f in fetchers):
      if now - max(last_ok, *(f.ended_at for f in fetchers)) < min(
        node.timeout_s, _END_WITHOUT_DISPATCHER_S
      ):
        return False  # a dispatcher restarting in place says so itself
      logging.warning(
        "The dispatcher at %s does not answer (%s), and every worker of "
        "job %d sent its whole stream: the read ends.",
        node.service,
        error,
        self.job_id,
      )
      self._end()
      return True
    if any(
      not f.ended and now - (f.failing_since or now) <= node.timeout_s for f in fetchers
    ):  # a worker it still reaches, or may yet
      if not self._away_logged:
        self._away_logged = True
        logging.warning(
          "The dispatcher at %s does not answer (%s): reading on from the "
          "workers of job %d until it is back.",
          node.service,
          error,
          self.job_id,
        )
      return False
    alone_since = max([last_ok] + [f.ended_at for f in fetchers])
    if now - alone_since > node.timeout_s:
      raise rpc.ServiceError(
        f"The dispatcher at {node.service} has not answered for {now - last_ok:.0f} s "
        f"and job {self.job_id} has no worker left to read from (for "
        f"timeout_s={node.timeout_s:g} s); last error: {error}"
      )
    return False

  def _update_tasks(self, response: pb.ClientHeartbeatResponse) -> None:
    # Only the tasks of workers this read targets (round-robin reads read
    # every worker of their job, as tf.data's coordinated reads do).
    listed = {
      t.task_id: t
      for t in response.tasks
      if self.node.num_consumers
      or target_workers.reads(
        self.node.target_workers, self.process, t.worker_process, t.worker_tags
      )
    }
    now = time.monotonic()
    # How long the dispatcher has listed the tasks since its last answer; an
    # answer after a longer silence (it was stopped or down) lists them now
    # only.
    since, self._answered_at = now - self._answered_at, now
    interval_s = response.heartbeat_interval_s or heartbeat_pacing.CLIENT_DEFAULT_INTERVAL_S
    if since > self._interval_s + _AWAY_AFTER_S:
      self._back_at = now
    self._interval_s = interval_s
    listed_s = 0.0 if since > min(interval_s + _ANSWER_SLACK_S, self.node.timeout_s / 2) else since
    if self.streams is not None:
      self._check_stream_count(len(listed), now, response.job_finished)
    for task_id, task in sorted(listed.items()):
      old = self.fetchers.get(task_id)
      if old is not None:
        if task.data_address != old.task.data_address:
          # Its worker registered again (after a restart: at a new data
          # address, and perhaps without the task): the next connection
          # goes there and learns which.
          old.task = task
        old.kick_if_stalled(now)
        error = old.unreachable_listed(listed_s)
        if error is not None:
          raise error
      else:
        out = self.buffer if not self.node.num_consumers else queue.Queue(self.capacity)
        stream = self.streams.assign(task.worker_index) if self.streams is not None else None
        fetcher = self.fetchers[task_id] = Fetcher(self, task, out, stream)
        if stream is not None:
          self.streams.reading(*stream, fetcher)
    for task_id, fetcher in self.fetchers.items():
      if task_id not in listed and not fetcher.ended:
        fetcher.cancel()  # the dispatcher declared its worker dead
    if response.job_finished and all(f.ended for f in self.fetchers.values()):
      self._end()

  def _end(self) -> None:
    self.finished = True
    if not self.node.num_consumers:
      try:  # wakes a consumer waiting on an empty buffer
        self.buffer.put_nowait(END)
      except queue.Full:
        pass  # it is not waiting

  def _check_stream_count(self, listed: int, now: float, job_finished: bool) -> None:
    """A restored parallel_epochs read needs one worker per open stream
    (see `jaxfeed.service.protocol.stream_state`): it fails when its job started
    with more, or lacks some after timeout_s or at its end."""
    if not self.streams.resumed:
      return
    wanted = self.streams.unassigned
    if self._first_tasks and listed:
      self._first_tasks = False
      if listed > wanted:
        raise read_state.ResumeStateError(
          f"This parallel_epochs read was saved with {wanted} open worker "
          f"streams, but its new job started with {listed} workers: it cannot "
          "resume exactly, since each worker continues one stream and the "
          "others would each add a whole epoch. Resume with as many workers "
          "as the read had, or start a new read (restore_checkpoint(..., "
          "restore_loader=False))."
        )
    elif wanted and (job_finished or now - self.job_started > self.node.timeout_s):
      raise read_state.ResumeStateError(
        f"{wanted} of the open worker streams this parallel_epochs read was "
        f"saved with have no worker in its new job (at its end, or after "
        f"timeout_s={self.node.timeout_s:g} s): it cannot resume exactly. Resume with as "
        "many workers as the read had, or start a new read "
        "(restore_checkpoint(..., restore_loader=False))."
      )

  def round_fetchers(self) -> tuple[dict[int, Fetcher], int]:
    """Round-robin reads: the fetcher of each worker index, and the number
    of workers (the latest task of an index wins)."""
    fetchers = sorted(list(self.fetchers.values()), key=lambda f: f.task.task_id)
    if not fetchers:
      return {}, 0
    return {f.task.worker_index: f for f in fetchers}, fetchers[-1].task.num_workers

  def check_progress(self, waiting_since: float) -> None:
    """Raises ServiceError when the consumer has waited `timeout_s` since
    `waiting_since` and no worker made progress on the read meanwhile (a
    pipeline stuck on a record, or a job without live workers): a read
    never waits silently longer than its timeout. Time the dispatcher was
    away does not count (workers may wait for it, for splits): while it is,
    `_outlive_dispatcher` bounds the read, and back, it has timeout_s."""
    now = time.monotonic()
    if self.job_id and now - self._answered_at > self._interval_s + _AWAY_AFTER_S:
      return
    fetchers = list(self.fetchers.values())
    last = max([waiting_since, self.job_started, self._back_at] + [f.progress_at for f in fetchers])
    timeout_s = self.node.timeout_s
    if now - last <= timeout_s:
      return
    live = [f for f in fetchers if not f.ended]
    if not self.job_id:
      state = f"it has no job yet: the dispatcher at {self.node.service} did not create one"
    elif not live:
      state = "its job has no live worker (none registered, or all were lost)"
    else:
      state = "its workers: " + "; ".join(_fetcher_state(f, now) for f in live)
    raise rpc.ServiceError(
      f"No element of dataset {self.dataset_id or '?'} (job {self.job_id}) came for "
      f"{now - last:.0f} s, and no worker made progress on it (timeout_s="
      f"{timeout_s:g}); {state}. A UDF that never returns on some record looks "
      "like this: its worker lives, so the records it holds are not read "
      "elsewhere. Raise timeout_s if the pipeline's first element may take longer."
    )

  def close(self) -> None:
    """Stops the read's threads and leaves the job, within CLOSE_TIMEOUT_S
    (or timeout_s, if shorter) plus the goodbye's deadline."""
    self.stop.set()
    self.wake.set()
    fetchers = list(self.fetchers.values())
    # The workers this read streams from over their data sockets now: one
    # of them can take its goodbye.
    streaming = sorted((f.task for f in fetchers if f.on_socket), key=lambda t: t.task_id)
    for fetcher in fetchers:
      fetcher.cancel()
    deadline = time.monotonic() + min(CLOSE_TIMEOUT_S, self.node.timeout_s)
    if self.manager is not threading.current_thread():
      self.manager.join(timeout=max(0.0, deadline - time.monotonic()))
    for fetcher in list(self.fetchers.values()):
      fetcher.thread.join(timeout=max(0.0, deadline - time.monotonic()))
    if self.client_id:
      job_calls.leave_job(
        self.channel,
        self.node,
        self.job_id,
        self.client_id,
        streaming if self.goodbye_via_worker else [],
        self.goodbye_ticket,
        self.ssl_context,
        self.consumed,
        self.wait_s,
      )
    self.channel.close()


def _fetcher_state(fetcher: Fetcher, now: float) -> str:
  """How one live worker of a stuck read stands, for its error: silent,
  or unreachable from here while the dispatcher lists it as alive."""
  where = f"{fetcher.task.worker_address} (task {fetcher.task.task_id})"
  if fetcher.failing_since is not None:
    return (
      f"{where}: cannot reach it for {now - fetcher.failing_since:.0f} s although "
      f"the dispatcher lists it as alive; last error: {fetcher.last_error}"
    )
  return f"{where}: nothing new for {now - fetcher.progress_at:.0f} s"
