"""The worker: registers with the dispatcher, runs tasks, serves their batches.

Run it from the command line:

  python -m jaxfeed.service.worker --dispatcher_address=HOST:PORT

It prints `jaxfeed worker listening on HOST:PORT data HOST:PORT` once it serves.
Workers keep no durable state: a restarted worker registers like a new one.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import os
import secrets
import socket
import threading
import time
import weakref
from typing import Any, Callable, Generator, Iterator

import grpc

from jaxfeed.service import metrics as metrics_lib
from jaxfeed.service.protocol import data_socket
from jaxfeed.service.protocol import element_chunks
from jaxfeed.service.protocol import import_paths
from jaxfeed.service.protocol import rpc
from jaxfeed.service.protocol import rpc_server
from jaxfeed.service.protocol import wire
from jaxfeed.service.protocol.protos import service_pb2 as pb
from jaxfeed.service.protocol.sharding import ShardingPolicy
from jaxfeed.service.worker import data_server
from jaxfeed.service.worker import delivery
from jaxfeed.service.worker import round_assembly
from jaxfeed.service.worker import shared_stream
from jaxfeed.service.worker import task_pipeline
from jaxfeed.service.worker import task_runner as task_runner_lib

SERVICE_NAME = "jaxfeed.service.Worker"
_DRAIN_IDLE_S = 2.0  # draining: a task unread this long has no consumer left
_DISPATCHER = "/jaxfeed.service.Dispatcher/"
_MAX_REQUEST_BYTES = 64 << 10  # a worker's requests are all small
# A heartbeat call's deadline: this until the dispatcher told its heartbeat
# timeout, then that fraction of it, so that a call hung on a connection that
# broke without a reset is given up (and the next one made) before the
# dispatcher takes this worker for dead.
_HEARTBEAT_DEADLINE_S = 10.0
_HEARTBEAT_DEADLINE_FRACTION = 1 / 3
# The longest a finished task's end waits for the dispatcher to hear of it.
_FINISH_REPORT_TIMEOUT_S = 2.0
# Clients' goodbyes kept for the next heartbeat, at most (a pod's worth many times).
_MAX_GOODBYES = 1 << 16
_MAX_GOODBYE_TICKET = 128  # characters; the dispatcher's tickets have 64
_HEX_DIGITS = "0123456789abcdef"


@dataclasses.dataclass(frozen=True)
class WorkerConfig:
  """Options of a worker.

  Attributes:
    dispatcher_address: host:port of the dispatcher.
    port: gRPC port; 0 lets the OS pick one.
    host: Interface to bind ("0.0.0.0" for all of them).
    advertise_host: The host part of the addresses clients are given; None:
      `host`, or this machine's host name when `host` is a wildcard.
    heartbeat_interval_s: Seconds between heartbeats to the dispatcher.
    buffer_size: Ready batches buffered per task (rounds for round-robin jobs).
    worker_token: The workers' token, sent to the dispatcher. Clients do not
      send it: they read a task with the ticket the dispatcher gave them,
      which this worker checks with a key the dispatcher gives it.
    pickled_udf_secret: Shared secret that signs pickled UDFs; None refuses them.
    udf_modules: Modules (or package prefixes ending in ".") whose UDFs and
      classes pipelines may use beyond `import_paths.DEFAULT_UDF_MODULES`; no other
      module is ever imported for a pipeline.
    insecure: Allow binding beyond loopback without authentication.
    max_message_bytes: Largest gRPC message accepted or sent.
    chunk_bytes: Largest piece of a batch per streamed gRPC message.
    data_socket: Also serve batches on a raw TCP port (fast path).
    splits_per_request: DYNAMIC split ranges fetched per dispatcher call.
    tls: Key and certificate for serving TLS (gRPC and the data socket),
      and the root CA for the dispatcher; with a client CA, clients must
      present certificates it signed.
    autocache_dir: Where `autocache` ops of parallel_epochs and static
      tasks keep their input's output, keyed by its fingerprint, for later
      tasks of any job (see `jaxfeed.ops.autocache`); None: they pass
      through. Workers may share the folder.
    sharing_window_bytes: Ephemeral sharing: most bytes of frames a shared
      pipeline keeps for its slower readers (see
      `jaxfeed.service.worker.shared_stream`).
    max_window_batches: Round-robin jobs: most batches a task holds in
      partial bucket windows; past it the oldest window is dropped (see
      `jaxfeed.service.worker.round_assembly`). A job's worker memory is bounded by
      this plus buffer_size rounds of num_consumers batches.
  """

  dispatcher_address: str
  port: int = 0
  host: str = "127.0.0.1"
  advertise_host: str | None = None
  heartbeat_interval_s: float = 0.5
  buffer_size: int = 8
  worker_token: str | None = None
  pickled_udf_secret: bytes | None = None
  udf_modules: tuple[str, ...] = ()
  insecure: bool = False
  max_message_bytes: int = rpc.DEFAULT_MAX_MESSAGE_BYTES
  chunk_bytes: int = 4 << 20
  data_socket: bool = True
  splits_per_request: int = 2
  tls: rpc.TLSConfig | None = None
  max_window_batches: int = round_assembly.DEFAULT_MAX_WINDOW_BATCHES
  sharing_window_bytes: int = 256 << 20
  autocache_dir: str | None = None

  def __post_init__(self):
    if not isinstance(self.dispatcher_address, str) or ":" not in self.dispatcher_address:
      raise ValueError("WorkerConfig: dispatcher_address must be 'host:port', "
                       f"got {self.dispatcher_address!r}.")
    if not isinstance(self.port, int) or not 0 <= self.port < 65536:
      raise ValueError(f"WorkerConfig: port must be in [0, 65535], got {self.port!r}.")
    if not isinstance(self.heartbeat_interval_s, (int, float)) or self.heartbeat_interval_s <= 0:
      raise ValueError("WorkerConfig: heartbeat_interval_s must be > 0, got "
                       f"{self.heartbeat_interval_s!r}.")
    for name in ("buffer_size", "splits_per_request", "max_window_batches",
                 "sharing_window_bytes"):
      value = getattr(self, name)
      if not isinstance(value, int) or value < 1:
        raise ValueError(f"WorkerConfig: {name} must be an integer >= 1, got {value!r}.")
    if not isinstance(self.chunk_bytes, int) or not 1024 <= self.chunk_bytes <= self.max_message_bytes - 1024:
      raise ValueError(f"WorkerConfig: chunk_bytes must be in [1024, max_message_bytes - 1024], "
                       f"got {self.chunk_bytes!r}.")
    if self.worker_token is not None and (
        not isinstance(self.worker_token, str) or not self.worker_token):
      raise ValueError("WorkerConfig: worker_token must be a non-empty string or None.")
    object.__setattr__(self, "udf_modules", import_paths.check_udf_modules(self.udf_modules))
    rpc.check_bind_is_safe(
        "Worker", self.host,
        bool(self.worker_token) or bool(self.tls is not None and self.tls.verifies_clients),
        self.insecure, "read every task's batches")


class _Worker:
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
    self.dataset_defs: dict[str, pb.DatasetDef] = {}
    self.streams = delivery.Registry()  # what each client of a task gets
    self._held: list[tuple[int, int, list[int]]] = []  # not yet reported
    # Goodbyes of clients, not yet forwarded: (job id, client id) -> ticket.
    self._goodbyes: dict[tuple[int, int], str] = {}
    self.served = metrics_lib.ServedCounts()  # for --metrics_port
    # Told to the dispatcher with every heartbeat: a process restarted on this
    # address has a new one, so its predecessor's tasks count as lost.
    self.incarnation = secrets.token_hex(8)
    # Task id -> the number of its next GetSplits request (see GetSplitsRequest).
    self._split_requests: dict[int, int] = collections.defaultdict(lambda: 1)
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
    # The heartbeat interval the dispatcher asks for (0: the configured one).
    self.paced_interval_s = 0.0
    self.heartbeat_deadline_s = _HEARTBEAT_DEADLINE_S
    # The last clients the dispatcher listed: (clients_version, the tasks
    # it listed them for, task id -> client ids).
    self._listed: tuple[int, frozenset[int], dict[int, set[int]]] = (0, frozenset(), {})
    self.heartbeat_call = rpc.Caller(channel, _DISPATCHER + "WorkerHeartbeat",
                                     pb.WorkerHeartbeatResponse, token)
    self.dataset_call = rpc.Caller(channel, _DISPATCHER + "GetDatasetDef",
                                   pb.GetDatasetDefResponse, token)
    self.splits_call = rpc.Caller(channel, _DISPATCHER + "GetSplits",
                                  pb.GetSplitsResponse, token)

  # -- heartbeats and tasks ----------------------------------------------------
  def heartbeat(self, timeout_s: float = _HEARTBEAT_DEADLINE_S) -> None:
    sent_at = time.monotonic()
    held = self.streams.take_held()
    with self.lock:
      current = list(self.tasks)
      finished = list(self.finished)
      held, self._held = self._held + held, []
      goodbyes, self._goodbyes = self._goodbyes, {}
    listed_version, listed_tasks, listed = self._listed
    # Draining or stopping, it starts no new task: splits sent with one would
    # wait unread until it leaves (at-most-once: lost).
    starts_tasks = not (self.draining.is_set() or self.stop.is_set())
    try:
      response = self.heartbeat_call(
          pb.WorkerHeartbeatRequest(
              worker_address=self.address, data_address=self.data_address,
              incarnation=self.incarnation, current_tasks=current, finished_tasks=finished,
              splits_per_request=self.config.splits_per_request if starts_tasks else -1,
              # The lists held cover exactly these tasks: they may stay.
              known_clients_version=(listed_version if listed_tasks == frozenset(current)
                                     else 0),
              held_splits=[pb.HeldSplits(task_id=t, client_id=c, starts=s)
                           for t, c, s in held],
              client_goodbyes=_goodbye_messages(goodbyes)),
          timeout=min(timeout_s, self.heartbeat_deadline_s))
    except BaseException:
      with self.lock:  # reported with the next heartbeat
        self._held = held + self._held
        self._goodbyes = {**goodbyes, **self._goodbyes}
      raise
    self.ticket_key = response.ticket_key
    self.paced_interval_s = response.heartbeat_interval_s
    if response.heartbeat_timeout_s > 0:
      self.heartbeat_deadline_s = response.heartbeat_timeout_s * _HEARTBEAT_DEADLINE_FRACTION
    for task in response.new_tasks:
      self.start_task(task)
    for task_id in response.tasks_to_delete:
      with self.lock:
        runner = self.tasks.pop(task_id, None)
        self.finished.discard(task_id)
        self._first_splits.pop(task_id, None)
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
    self.streams.drop(lambda task_id, client_id, stream: task_id in tasks and (
        task_id not in clients or client_id in clients[task_id]
        or stream.created > listed_at))

  def start_task(self, task: pb.TaskInfo) -> None:
    self.served.track(task)
    make_iterator = lambda: self._make_iterator(task)
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
              task.first_splits.end_of_splits)
      self.tasks[task.task_id] = task_runner_lib.TaskRunner(
          task.task_id, make_iterator, self.config.buffer_size, task.num_consumers,
          on_finished=self._on_finished,
          round_timeout_s=task.round_timeout_s or round_assembly.DEFAULT_ROUND_TIMEOUT_S,
          max_window_batches=self.config.max_window_batches,
          exactly_once=task.exactly_once)
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
          lambda: self._make_iterator(task), self.config.sharing_window_bytes,
          self.config.buffer_size, on_finished=self._on_finished, on_empty=forget)
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
    dataset_def = self.dataset_defs.get(task.dataset_id)
    if dataset_def is None:
      dataset_def = rpc.call_with_retry(
          self.dataset_call, pb.GetDatasetDefRequest(dataset_id=task.dataset_id),
          30, f"Fetching dataset {task.dataset_id}").dataset
      self.dataset_defs[task.dataset_id] = dataset_def

    fetching = threading.Lock()  # one request of the task at a time: they are numbered

    def fetch_ranges() -> tuple[list, bool]:
      if self.draining.is_set():
        return [], True
      with fetching:
        return fetch_numbered()

    def fetch_numbered() -> tuple[list, bool]:
      with self.lock:
        request_seq = self._split_requests[task.task_id]
        first = self._first_splits.pop(task.task_id, None) if request_seq == 1 else None
        if first is not None:  # request 1 was answered with the task
          self._split_requests[task.task_id] = 2
          return first
      try:
        response = rpc.call_with_retry(
            self.splits_call,
            pb.GetSplitsRequest(job_id=task.job_id, task_id=task.task_id,
                                max_ranges=self.config.splits_per_request,
                                request_seq=request_seq),
            30, f"Fetching splits of job {task.job_id}")
      except rpc.ServiceError as e:
        cause = e.__cause__
        if isinstance(cause, grpc.RpcError) and cause.code() == grpc.StatusCode.NOT_FOUND:
          # The dispatcher gave the task up (it took this worker for dead):
          # the task is lost, as if this worker had died, not failed.
          e.grpc_status = "NOT_FOUND"
        raise
      with self.lock:
        self._split_requests[task.task_id] = request_seq + 1
      return [(r.start, r.stop) for r in response.ranges], response.end_of_splits

    if task.exactly_once:
      return task_pipeline.split_by_split(dataset_def, task, self.config.pickled_udf_secret,
                                          fetch_ranges, udf_modules=self.config.udf_modules)
    return task_pipeline.task_iterator(dataset_def, task, self.config.pickled_udf_secret,
                                       fetch_ranges, self.config.autocache_dir,
                                       self.config.udf_modules)

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

  def open_stream(self, request: pb.GetElementsRequest, kick: Callable[[], None]
                  ) -> tuple[delivery.ClientStream, object]:
    """The client's stream of the task, attached to a new connection that
    `kick` ends; returns it and the connection's token (see
    `delivery.ClientStream.attach`)."""
    runner = self.find_task(request.task_id)
    window = min(request.window or delivery.DEFAULT_WINDOW, delivery.MAX_WINDOW)
    stream = self.streams.get_or_add(
        request.task_id, request.client_id,
        lambda: delivery.ClientStream(self.served.counting(request.task_id, runner),
                                      runner.exactly_once, request.consumer_index,
                                      request.round, window, request.received,
                                      resumable=bool(request.client_id),
                                      skip=request.skip))
    return stream, stream.attach(request.received, kick)

  def AckElements(self, request: pb.AckElementsRequest,
                  context: grpc.ServicerContext) -> pb.AckElementsResponse:
    self.check_ticket(request.task_id, rpc.metadata_token(context.invocation_metadata()))
    stream = self.streams.find(request.task_id, request.client_id)
    if stream is not None:
      stream.ack(request.received)
    return pb.AckElementsResponse()

  def GetTaskStats(self, request: pb.GetTaskStatsRequest,
                   context: grpc.ServicerContext) -> pb.GetTaskStatsResponse:
    self.check_ticket(request.task_id, rpc.metadata_token(context.invocation_metadata()))
    with self.lock:
      runner = self.tasks.get(request.task_id)
    if runner is None:
      raise rpc.NotFoundError(f"Worker {self.address} has no task {request.task_id}.")
    return pb.GetTaskStatsResponse(stats_json=json.dumps({"ops": runner.op_rows()},
                                                         default=str))

  # -- serving --------------------------------------------------------------------
  def check_ticket(self, task_id: Any, sent: Any) -> None:
    """Raises StatusError unless `sent` is the read ticket of the task (when
    the deployment authenticates)."""
    key = self.ticket_key
    if not key:
      if not self.config.worker_token:
        return  # an unauthenticated deployment (loopback or --insecure)
      if key is None:
        raise rpc.StatusError("UNAVAILABLE", f"Worker {self.address} is not "
                              "registered with the dispatcher yet: retry.")
      raise rpc.StatusError(
          "FAILED_PRECONDITION",
          f"Worker {self.address} has a worker token, but its dispatcher issues "
          "no read tickets (it has no tokens): give the dispatcher "
          "--auth_token_file and --worker_token_file.")
    if not isinstance(task_id, int) or not rpc.ticket_matches(key, task_id, sent):
      raise rpc.StatusError(
          "UNAUTHENTICATED",
          f"Worker {self.address}: missing or wrong read ticket for task "
          f"{task_id!r}: clients read a task with the ticket the dispatcher "
          "gives them for it.")

  def check_hello(self, hello: dict) -> None:
    """The data socket's check of a client's hello, before anything is served."""
    try:
      self.check_ticket(hello.get("task_id"), hello.get("token"))
    except rpc.StatusError as e:
      raise data_socket.DataConnectionError(str(e), e.status) from e

  def take_goodbye(self, hello: dict) -> None:
    """A client's goodbye on the data socket (a hello whose read ticket
    check_hello accepted, with "goodbye": the client's goodbye ticket),
    forwarded in the next heartbeat. Only a client this worker serves the
    task to may say it, for its own job; the dispatcher checks the ticket.
    Raises DataConnectionError to refuse it (the client then calls
    ReleaseJobClient)."""
    task_id, client_id, ticket = (hello.get("task_id"), hello.get("client_id"),
                                  hello.get("goodbye"))
    # Hex digits only: a ticket that protobuf cannot encode (a lone
    # surrogate) would fail every later heartbeat of this worker.
    if not (_is_id(task_id) and _is_id(client_id) and client_id > 0
            and isinstance(ticket, str) and len(ticket) <= _MAX_GOODBYE_TICKET
            and not ticket.strip(_HEX_DIGITS)):
      raise data_socket.DataConnectionError(
          "Malformed goodbye: task_id and client_id must be integers (client_id > 0) "
          f"and goodbye at most {_MAX_GOODBYE_TICKET} hex digits; got "
          f"{str(task_id)[:40]!r}, {str(client_id)[:40]!r}, {str(ticket)[:40]!r}.",
          "INVALID_ARGUMENT")
    job = self.served.job_of(task_id)
    if not job or self.streams.find(task_id, client_id) is None:
      raise data_socket.DataConnectionError(
          f"Worker {self.address} serves no stream of task {task_id} to client "
          f"{client_id}: a client says goodbye to a worker it reads from.", "NOT_FOUND")
    with self.lock:
      if len(self._goodbyes) >= _MAX_GOODBYES:
        raise data_socket.DataConnectionError(
            f"Worker {self.address} already holds {_MAX_GOODBYES} goodbyes.",
            "RESOURCE_EXHAUSTED")
      self._goodbyes[(int(job), client_id)] = ticket

  def GetElements(self, request: pb.GetElementsRequest,
                  context: grpc.ServicerContext) -> Iterator[bytes | pb.ElementChunk]:
    self.check_ticket(request.task_id, rpc.metadata_token(context.invocation_metadata()))
    chunk = min(request.max_chunk_bytes or self.config.chunk_bytes, self.config.chunk_bytes)
    compression = request.compression
    wire.check_compression(compression)
    try:
      stream, token = self.open_stream(request, context.cancel)
      items = stream.items(token, request.received, context.is_active, stream.wait_for_ack)
      last_sent = time.monotonic()
      while True:
        try:
          item = next(items)
        except StopIteration as end:
          stats = end.value
          break
        if item is delivery.IDLE:
          if time.monotonic() - last_sent >= delivery.KEEPALIVE_S:
            last_sent = time.monotonic()
            yield pb.ElementChunk(keepalive=True)
          continue
        last_sent = time.monotonic()
        if item.frame is None:  # exactly-once: the split `item.round` ended
          yield pb.ElementChunk(split_end=True, round=item.round, seq=item.seq,
                                split_stop=item.split_stop)
          continue
        frame = item.frame.encoded(compression)
        for i, views in enumerate(frame.chunks(chunk)):
          if i:
            yield element_chunks.encode(views)
          else:
            yield element_chunks.encode(views, frame.nbytes, item.round, item.seq)
      if stats is None:  # superseded by a newer connection of the client
        return
      yield pb.ElementChunk(end_of_sequence=True,
                            stats_json=json.dumps(stats) if stats else "")
    except task_runner_lib.TaskFailed as e:
      raise rpc.StatusError(e.status, str(e)) from e

  def serve_socket(self, hello: dict, link: data_server.ServerLink
                   ) -> Generator[delivery.Item | None, None, dict | None]:
    try:
      request = pb.GetElementsRequest(
          task_id=int(hello["task_id"]), consumer_index=int(hello.get("consumer_index", 0)),
          round=int(hello.get("round", 0)), client_id=int(hello.get("client_id", 0)),
          received=int(hello.get("received", 0)), window=int(hello.get("window", 0)),
          skip=int(hello.get("skip", 0)))
    except (KeyError, TypeError, ValueError, OverflowError) as e:  # int(inf): Overflow
      raise data_socket.DataConnectionError(f"Malformed hello: {e}", "INVALID_ARGUMENT") from e
    try:
      stream, token = self.open_stream(request, link.kick)
      link.on_ack = stream.ack
      return (yield from stream.items(token, request.received, link.is_active,
                                      link.wait_for_ack))
    except rpc.NotFoundError as e:
      raise data_socket.DataConnectionError(str(e), "NOT_FOUND") from e
    except task_runner_lib.TaskFailed as e:
      raise data_socket.DataConnectionError(str(e), e.status) from e

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
          runner.num_consumers or task_id not in self.dynamic_tasks):
        with self.lock:
          self.tasks.pop(task_id, None)
        runner.stop()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
      with self.lock:
        # A task nobody has read for a while has no consumer left to wait for.
        left = [r for r in self.tasks.values()
                if not r.drained and r.idle_s < _DRAIN_IDLE_S]
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
      self.heartbeat_call(pb.WorkerHeartbeatRequest(
          worker_address=self.address, incarnation=self.incarnation,
          finished_tasks=finished, leaving=True,
          client_goodbyes=_goodbye_messages(goodbyes)), timeout=2)
    except grpc.RpcError:
      pass

  def shutdown(self) -> None:
    self.stop.set()
    with self.lock:
      runners = list(self.tasks.values())
      self.tasks.clear()
      self.task_added.notify_all()
    for runner in runners:
      runner.stop()
    self.channel.close()


def _is_id(value: Any) -> bool:
  """An id a protobuf int64 field holds."""
  return wire.is_int(value) and 0 <= value < 1 << 63


def _goodbye_messages(goodbyes: dict[tuple[int, int], str]) -> list[pb.ClientGoodbye]:
  return [pb.ClientGoodbye(job_id=job_id, client_id=client_id, ticket=ticket)
          for (job_id, client_id), ticket in goodbyes.items()]


def _heartbeat_loop(worker_ref: weakref.ref, stop: threading.Event, interval: float) -> None:
  failures = 0
  while not stop.is_set():
    worker = worker_ref()
    if worker is None:
      return
    try:
      worker.heartbeat()
      failures = 0
    except grpc.RpcError as e:
      if e.code() in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
        worker.rejected = (
            f"the dispatcher at {worker.config.dispatcher_address} refused worker "
            f"{worker.address}: {e.code().name}: {e.details()} (give the worker the "
            "dispatcher's --worker_token_file, or the certificates it trusts)")
        logging.error("Worker stops: %s", worker.rejected)
        stop.set()
        return
      failures += 1
      if failures in (1, 20) or failures % 200 == 0:
        logging.warning("Worker %s: heartbeat to dispatcher failed (%s); retrying.",
                        worker.address, e.code().name)
    except Exception:  # pylint: disable=broad-except
      logging.exception("Worker heartbeat failed")
    paced_s = worker.paced_interval_s
    del worker
    stop.wait(max(interval, paced_s))


class WorkerServer:
  """A worker gRPC server plus its heartbeat thread (and raw data socket)."""

  def __init__(self, config: WorkerConfig, start: bool = True):
    self.config = config
    handler_holder: list = []
    self._server, self.port = rpc_server.make_server(
        f"{config.host}:{config.port}",
        _LazyHandler(handler_holder), config.max_message_bytes, config.tls,
        max_receive_bytes=_MAX_REQUEST_BYTES)
    advertised = _advertised_host(config)
    self._worker = _Worker(config, f"{advertised}:{self.port}")
    # Clients are let in by read tickets, checked per task in GetElements.
    handler_holder.append(rpc_server.method_handlers(
        SERVICE_NAME, {},
        {"GetElements": (self._worker.GetElements, pb.GetElementsRequest, True,
                         (rpc.CLIENT,)),
         "AckElements": (self._worker.AckElements, pb.AckElementsRequest, False,
                         (rpc.CLIENT,)),
         "GetTaskStats": (self._worker.GetTaskStats, pb.GetTaskStatsRequest, False,
                          (rpc.CLIENT,))}))
    self._data_server = None
    if config.data_socket:
      self._data_server = data_server.DataServer(
          config.host, self._worker.check_hello, self._worker.serve_socket,
          config.tls.server_ssl_context() if config.tls is not None else None,
          goodbye=self._worker.take_goodbye)
      self._worker.data_address = f"{advertised}:{self._data_server.port}"
    self._heartbeat = threading.Thread(
        target=_heartbeat_loop, name="jaxfeed-worker-heartbeat", daemon=True,
        args=(weakref.ref(self._worker), self._worker.stop, config.heartbeat_interval_s))
    self._started = False
    self._finalizer = weakref.finalize(self, _shutdown, self._server, self._worker,
                                       self._data_server)
    if start:
      self.start()

  @property
  def target(self) -> str:
    return self._worker.address

  @property
  def data_address(self) -> str:
    return self._worker.data_address

  def drain(self, timeout_s: float = 30.0) -> bool:
    """Finishes the splits this worker holds and waits (up to timeout_s) for
    its consumers to take every batch; stops its other tasks. Call `stop()`
    after it. True if everything was taken in time."""
    return self._worker.drain(timeout_s)

  def start(self) -> "WorkerServer":
    if not self._started:
      self._started = True
      self._server.start()
      self._heartbeat.start()
    return self

  def join(self, timeout: float | None = None) -> None:
    """Blocks until the server stops, or the dispatcher refused this worker."""
    deadline = None if timeout is None else time.monotonic() + timeout
    while not self._worker.stop.is_set():
      wait = 0.2 if deadline is None else min(0.2, deadline - time.monotonic())
      if wait <= 0 or not self._server.wait_for_termination(wait):
        return

  @property
  def rejected(self) -> str | None:
    """Why the dispatcher refused this worker (it then stops serving), or None."""
    return self._worker.rejected

  def stop(self) -> None:
    """Stops serving, its tasks and its threads. Idempotent."""
    self._finalizer()
    if self._heartbeat.is_alive():
      self._heartbeat.join(timeout=10)

  close = stop

  def __enter__(self) -> "WorkerServer":
    return self.start()

  def __exit__(self, *exc) -> None:
    self.stop()


def _advertised_host(config: WorkerConfig) -> str:
  if config.advertise_host:
    return config.advertise_host
  if rpc.is_wildcard_host(config.host):
    return socket.gethostname()  # a wildcard cannot be connected to from elsewhere
  return config.host


class _LazyHandler(grpc.GenericRpcHandler):
  """Forwards to a handler made after the port (and so the address) is known."""

  def __init__(self, holder: list):
    self._holder = holder

  def service(self, handler_call_details):
    return self._holder[0].service(handler_call_details) if self._holder else None


def _shutdown(server: rpc_server.ServerHandle, worker: _Worker, data_server: Any) -> None:
  worker.stop.set()
  worker.leave()
  if data_server is not None:
    data_server.close()
  server.stop()
  worker.shutdown()


def main(argv: Any) -> None:
  """Runs a worker from flags; a bad flag value ends it with the reason."""
  del argv
  from absl import flags  # pylint: disable=g-import-not-at-top
  f = flags.FLAGS
  try:
    udf_secret = rpc.read_secret(f.pickled_udf_secret, f.pickled_udf_secret_file,
                                 "pickled_udf_secret")
    config = WorkerConfig(
        dispatcher_address=f.dispatcher_address, port=f.port, host=f.host,
        advertise_host=f.advertise_host or None,
        heartbeat_interval_s=f.heartbeat_interval_s, buffer_size=f.buffer_size,
        worker_token=rpc.read_secret(f.worker_token, f.worker_token_file, "worker_token"),
        udf_modules=import_paths.parse_udf_modules(f.udf_modules), insecure=f.insecure,
        data_socket=f.data_socket,
        max_window_batches=f.max_window_batches,
        sharing_window_bytes=f.sharing_window_bytes,
        autocache_dir=f.autocache_dir or None,
        pickled_udf_secret=udf_secret.encode() if udf_secret else None,
        tls=rpc.TLSConfig.from_files(f.tls_key, f.tls_cert, f.tls_root_certs,
                                     f.tls_client_ca))
  except ValueError as e:  # a flag's value: say which, without a traceback
    raise SystemExit(f"jaxfeed worker: {e}") from e
  # SIGTERM stops the worker cleanly from here on, before it registers and
  # says it listens: a pool (or a test) may stop it as soon as it is up.
  rpc.stop_on_sigterm()
  server = metrics = None
  try:
    server = WorkerServer(config)
    data = f" data {server.data_address}" if server.data_address else ""
    print(f"jaxfeed worker listening on {server.target}{data}", flush=True)
    metrics = metrics_lib.serve_worker(server, f.host, f.metrics_port)
    if metrics is not None:
      print(f"jaxfeed worker metrics on {metrics.url}", flush=True)
    if f.parent_pid:  # a pool's worker: goes when the process that started it does
      threading.Thread(target=_stop_with_parent, args=(f.parent_pid, server),
                       name="jaxfeed-worker-parent-watch", daemon=True).start()
    server.join()
  except SystemExit:  # SIGTERM: hand over what it holds, then stop
    if (server is not None and f.drain_timeout_s > 0
        and not server.drain(f.drain_timeout_s)):
      logging.warning("Stopping with batches not taken after %.0fs.", f.drain_timeout_s)
    raise
  finally:
    if server is not None:
      server.stop()
    if metrics is not None:
      metrics.close()
  if server.rejected:
    raise SystemExit(f"jaxfeed worker: {server.rejected}")


def _stop_with_parent(parent_pid: int, server: WorkerServer) -> None:
  while os.getppid() == parent_pid:
    time.sleep(1.0)
  logging.warning("The process that started this worker (%d) is gone: stopping.", parent_pid)
  server.stop()


def define_flags() -> None:
  from absl import flags  # pylint: disable=g-import-not-at-top
  flags.DEFINE_string("dispatcher_address", None, "host:port of the dispatcher.")
  flags.DEFINE_integer("port", 0, "Port to serve on; 0 picks a free one.")
  flags.DEFINE_string("host", "127.0.0.1", "Interface to bind; 0.0.0.0 for all.")
  flags.DEFINE_string("advertise_host", "", "Host name or IP clients reach this worker "
                      "at (default: --host, or the host name when --host is 0.0.0.0).")
  flags.DEFINE_float("heartbeat_interval_s", 0.5, "Seconds between heartbeats.")
  flags.DEFINE_integer("buffer_size", 8, "Ready batches buffered per task.")
  rpc.define_auth_flags(flags)
  flags.DEFINE_bool("data_socket", True, "Serve batches on a raw TCP port too.")
  flags.DEFINE_float("drain_timeout_s", 30.0, "On SIGTERM, seconds to finish the splits "
                     "held and let consumers take the batches before stopping.")
  flags.DEFINE_integer("parent_pid", 0, "Stop when this parent process is gone (set by "
                       "the dispatcher for the workers of its pool).")
  flags.DEFINE_string("autocache_dir", "", "Folder where autocache ops keep and reuse "
                      "their input's output across jobs (may be shared by workers).")
  flags.DEFINE_integer("sharing_window_bytes", 256 << 20,
                       "Ephemeral sharing: bytes a shared pipeline keeps for slower jobs.")
  flags.DEFINE_integer("max_window_batches", round_assembly.DEFAULT_MAX_WINDOW_BATCHES,
                       "Round-robin jobs: batches held in partial bucket windows.")
  flags.DEFINE_string("tls_key", "", "PEM private key file: serve TLS on gRPC and the "
                      "data socket (with --tls_cert).")
  flags.DEFINE_string("tls_cert", "", "PEM certificate chain file of --tls_key.")
  flags.DEFINE_string("tls_root_certs", "", "PEM root certificates that verify a TLS "
                      "dispatcher.")
  flags.DEFINE_integer("metrics_port", metrics_lib.OFF, "Serve Prometheus metrics on "
                       "this port (0: a free one, printed; -1: off).")
  flags.mark_flag_as_required("dispatcher_address")

