"""Reading a pipeline through the service: `distribute`, `from_dataset_id`.

The returned `Dataset` wraps a `DistributedNode`; ops chained after it run
locally on the client. Iterating it joins (or creates) a job at the
dispatcher, then fetches batches from all of the job's workers at once into
a bounded buffer. A worker that dies is dropped and the others go on. A
connection to a live worker that breaks or stalls is made again, and the
worker goes on after the last batch the client received: nothing is lost or
repeated (see `jaxfeed.service.delivery`).

Round-robin reads (`num_consumers=K`, `consumer_index=i`, a shared
`job_name`): coordinated reads, one batch per consumer per step, all K from
the same bucket. The job's workers are fixed when it starts (W of them).
Global round r is served by worker r mod W (its local round r // W);
consumer i receives batch i of that round. A worker builds each round from K
batches that share a bucket key, the shapes of their leaves without the batch
dimension, so the K consumers' batches of one round have the same padded
length; partial windows are dropped at the end of the input or when too many
batches wait (`WorkerConfig.max_window_batches`), as
`jaxfeed.service.round_assembly` describes. Every consumer of a job must pass
the same `num_consumers` (and `round_timeout_s`, if any).

Late consumers: once the first consumer took its batch of a round, the
others have `round_timeout_s` (default 60 s) to take theirs. Then the round
closes and the late consumers' batches are dropped; later rounds do not wait
for a consumer that missed one until it reads again. When it does, it goes on
at the oldest round still open on each worker: its iterator skips the rounds
it missed (`DistributedIterator.stats["rounds_skipped"]`) and reports each
batch's global round (`last_round`). "Took" is seen from the worker: a batch
is taken once the worker queued it for the consumer's connection, so what
already sits in the client's buffer (`max_outstanding_requests` per worker)
or on its way (up to `delivery.DEFAULT_WINDOW` batches not yet acknowledged,
sent again over a new connection if one breaks) stays the consumer's; a
consumer that stops reading becomes late when those are full, a killed one
at once. The timeout must exceed the longest pause of
a training loop (a checkpoint save, say). Rounds of a worker that ended or
died are skipped by every consumer alike, so the consumers stay aligned; a
read ends when every worker's stream ended.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import weakref
from typing import Any

import grpc

from jaxfeed.ops import base
from jaxfeed.service import data_socket
from jaxfeed.service import delivery
from jaxfeed.service import element_chunks
from jaxfeed.service import heartbeat_pacing
from jaxfeed.service import rpc
from jaxfeed.service import spec as spec_lib
from jaxfeed.service import task_pipeline
from jaxfeed.service import wire
from jaxfeed.service.protos import service_pb2 as pb
from jaxfeed.service.sharding import ShardingPolicy, to_sharding_policy

_DISPATCHER = "/jaxfeed.service.Dispatcher/"
_WORKER = "/jaxfeed.service.Worker/"
_POLL_S = 0.05
# Statuses after which a fetcher connects to its worker again (NOT_FOUND: the
# worker lost the task, it is given up); any other status is an error of the
# pipeline and reaches the consumer.
# A fetcher's connection that brings nothing, not even a keepalive (see
# `jaxfeed.service.delivery`), this long while it waits is replaced.
_STALL_S = 10.0
_BACKOFF_S = (0.05, 2.0)  # first and longest wait between reconnects
_ACK_EVERY = delivery.DEFAULT_WINDOW // 4  # items between acknowledgments
_WORKER_LOST = frozenset({"UNAVAILABLE", "CANCELLED", "DEADLINE_EXCEEDED", "NOT_FOUND",
                          "ABORTED", "OUT_OF_RANGE"})
DATA_TRANSFERS = ("auto", "socket", "grpc")
VISITATIONS = ("at_most_once", "exactly_once")


def _target(service: str) -> str:
  if not isinstance(service, str) or not service:
    raise ValueError(f"service must be a 'host:port' string, got {service!r}.")
  for prefix in ("grpc://", "grpcs://"):
    if service.startswith(prefix):
      return service[len(prefix):]
  return service


def _dispatcher_caller(channel: grpc.Channel, method: str, response_cls: type,
                       token: str | None) -> rpc.Caller:
  return rpc.Caller(channel, _DISPATCHER + method, response_cls, token)


def register_dataset(service: str, dataset: Any, *, auth_token: str | None = None,
                     udf_secret: bytes | None = None, tls: rpc.TLSConfig | None = None,
                     timeout_s: float = 60.0) -> str:
  """Registers a pipeline with the dispatcher and returns its dataset id.

  Equal pipelines (same fingerprint) get the same id.

  Args:
    service: the dispatcher's "host:port" (a "grpc://" prefix is accepted).
    dataset: a jaxfeed Dataset (or op node).
    auth_token: the clients' token, if the deployment requires one (workers
      are read with per-task tickets from the dispatcher, never with it).
    udf_secret: the deployment's shared secret; UDFs without an import path
      are then shipped pickled and signed. None refuses such UDFs.
    tls: root certificates for a TLS dispatcher.
    timeout_s: how long to wait for (and retry reaching) the dispatcher.

  Returns:
    The dataset id.
  """
  node = task_pipeline.pipeline_node(dataset, "register_dataset")
  dataset_def = spec_lib.to_dataset_def(node, udf_secret,
                                        num_positions=task_pipeline.num_positions(node))
  channel = rpc.make_channel(_target(service), tls=tls)
  try:
    caller = _dispatcher_caller(channel, "RegisterDataset", pb.RegisterDatasetResponse,
                                auth_token)
    response = rpc.call_with_retry(caller, pb.RegisterDatasetRequest(dataset=dataset_def),
                                   timeout_s, f"Registering dataset with {service}")
    return response.dataset_id
  finally:
    channel.close()


def _check_read_options(policy: ShardingPolicy, job_name: str | None,
                        num_consumers: int | None, consumer_index: int | None,
                        compression: str | None, max_outstanding_requests: int | None,
                        data_transfer: str, round_timeout_s: float | None,
                        visitation: str, ephemeral_sharing: bool) -> None:
  if job_name is not None and (not isinstance(job_name, str) or not job_name):
    raise ValueError(f"job_name must be a non-empty string or None, got {job_name!r}.")
  if num_consumers is not None:
    if job_name is None:
      raise ValueError(
          f"num_consumers={num_consumers} needs a job_name: the consumers of a "
          "round-robin read share one job.")
    if not isinstance(num_consumers, int) or num_consumers < 1:
      raise ValueError(f"num_consumers must be an integer >= 1, got {num_consumers!r}.")
    if consumer_index is None:
      raise ValueError("num_consumers needs consumer_index in [0, num_consumers).")
  if consumer_index is not None and (
      num_consumers is None or not isinstance(consumer_index, int)
      or not 0 <= consumer_index < num_consumers):
    raise ValueError(f"consumer_index must be an integer in [0, num_consumers="
                     f"{num_consumers}), got {consumer_index!r}.")
  if round_timeout_s is not None:
    if num_consumers is None:
      raise ValueError(f"round_timeout_s={round_timeout_s!r} applies to round-robin "
                       "reads only: pass num_consumers and consumer_index too.")
    if (isinstance(round_timeout_s, bool) or not isinstance(round_timeout_s, (int, float))
        or not round_timeout_s > 0):
      raise ValueError(f"round_timeout_s must be a number of seconds > 0, got "
                       f"{round_timeout_s!r}.")
  wire.check_compression(compression)
  if max_outstanding_requests is not None and (
      not isinstance(max_outstanding_requests, int) or max_outstanding_requests < 1):
    raise ValueError("max_outstanding_requests must be an integer >= 1 or None, got "
                     f"{max_outstanding_requests!r}.")
  if data_transfer not in DATA_TRANSFERS:
    raise ValueError(f"data_transfer must be one of {DATA_TRANSFERS}, got {data_transfer!r}.")
  if visitation not in VISITATIONS:
    raise ValueError(f"visitation must be one of {VISITATIONS}, got {visitation!r}.")
  if visitation == "exactly_once" and (
      policy != ShardingPolicy.DYNAMIC or num_consumers is not None):
    raise ValueError(
        "visitation='exactly_once' needs processing_mode='distributed_epoch' "
        f"(DYNAMIC) and no num_consumers; got {policy.name} and "
        f"num_consumers={num_consumers}.")
  if not isinstance(ephemeral_sharing, bool):
    raise ValueError(f"ephemeral_sharing must be True or False, got {ephemeral_sharing!r}.")
  if ephemeral_sharing and (policy != ShardingPolicy.OFF or num_consumers is not None):
    raise ValueError(
        "ephemeral_sharing=True needs processing_mode='parallel_epochs' (OFF) and "
        f"no num_consumers; got {policy.name} and num_consumers={num_consumers}.")


class DistributedNode(base.Node):
  """Reads the output of a pipeline that runs on service workers."""

  op_name = "distribute"

  def __init__(self, *, service: str, processing_mode: Any = "parallel_epochs",
               dataset: Any = None, dataset_id: str | None = None,
               job_name: str | None = None, num_consumers: int | None = None,
               consumer_index: int | None = None, compression: str | None = None,
               max_outstanding_requests: int | None = None,
               auth_token: str | None = None, udf_secret: bytes | None = None,
               tls: rpc.TLSConfig | None = None, data_transfer: str = "auto",
               timeout_s: float = 60.0, round_timeout_s: float | None = None,
               visitation: str = "at_most_once", ephemeral_sharing: bool = False,
               max_frame_bytes: int = wire.DEFAULT_MAX_FRAME_BYTES):
    super().__init__(())
    if (dataset is None) == (dataset_id is None):
      raise ValueError("DistributedNode needs exactly one of dataset and dataset_id.")
    self.service = _target(service)
    self.policy = to_sharding_policy(processing_mode)
    _check_read_options(self.policy, job_name, num_consumers, consumer_index, compression,
                        max_outstanding_requests, data_transfer, round_timeout_s,
                        visitation, ephemeral_sharing)
    self.visitation = visitation
    self.ephemeral_sharing = ephemeral_sharing
    self.max_frame_bytes = wire.check_max_frame_bytes(max_frame_bytes)
    self.dataset = None if dataset is None else task_pipeline.pipeline_node(
        dataset, "distribute", self.policy)
    if self.dataset is not None:
      spec_lib.to_dataset_def(self.dataset, udf_secret)  # fail early on bad UDFs
    self.dataset_id = dataset_id
    self.job_name = job_name
    self.num_consumers = num_consumers
    self.consumer_index = consumer_index
    self.compression = compression or None
    self.max_outstanding_requests = max_outstanding_requests
    self.auth_token = auth_token
    self.udf_secret = udf_secret
    self.tls = tls
    self.data_transfer = data_transfer
    self.timeout_s = timeout_s
    self.round_timeout_s = None if round_timeout_s is None else float(round_timeout_s)
    self._lock = threading.Lock()

  def spec_params(self) -> dict:
    return {"service": self.service, "processing_mode": self.policy.value,
            "dataset": self.dataset, "dataset_id": self.dataset_id,
            "job_name": self.job_name, "num_consumers": self.num_consumers,
            "consumer_index": self.consumer_index, "compression": self.compression,
            "max_outstanding_requests": self.max_outstanding_requests,
            "data_transfer": self.data_transfer, "timeout_s": self.timeout_s,
            "round_timeout_s": self.round_timeout_s, "visitation": self.visitation,
            "ephemeral_sharing": self.ephemeral_sharing,
            "max_frame_bytes": self.max_frame_bytes}

  def resolve_dataset_id(self) -> str:
    """Registers the pipeline on each read (so the dispatcher may start later,
    and a dataset it collected in between is registered again)."""
    with self._lock:
      if self.dataset is not None:
        self.dataset_id = register_dataset(
            self.service, self.dataset, auth_token=self.auth_token,
            udf_secret=self.udf_secret, tls=self.tls, timeout_s=self.timeout_s)
      return self.dataset_id

  def make_iterator(self) -> "DistributedIterator":
    return DistributedIterator(self)


class _Fetcher:
  """One thread reading one task's stream into the read's buffer.

  When a connection breaks or stalls (nothing, not even a keepalive, for
  _STALL_S while it waits for data), the fetcher connects again with
  backoff and the worker goes on after the last item received (see
  `jaxfeed.service.delivery`), so nothing is lost or repeated. It stops at
  the stream's end, when cancelled (the dispatcher dropped the worker), and
  fails the read when no connection worked for the read's `timeout_s`.
  """

  def __init__(self, read: "_ReadState", task: pb.TaskInfo, out: queue.Queue):
    self.task = task
    self.out = out
    self.done = False
    self.failed = False
    self.end_stats: dict = {}  # the task's round statistics, at its end
    self.received = 0  # items of the stream received, over all connections
    self.reconnects = 0
    self._acked = 0
    self._send_ack: Any = None  # the current connection's acknowledgment
    # When the current connection last brought something; None while the
    # fetcher waits for room in the buffer rather than for data.
    self.heard_at: float | None = None
    self._read = read
    self._connection: Any = None
    self._cancelled = False
    self._ended = False
    self.thread = threading.Thread(target=self._run, daemon=True,
                                   name=f"jaxfeed-fetch-{task.task_id}")
    self.thread.start()

  def _request(self) -> dict:
    node = self._read.node
    return {"task_id": self.task.task_id, "compression": node.compression or "",
            "consumer_index": node.consumer_index or 0, "round": 0,
            "client_id": self._read.client_id, "received": self.received,
            "window": delivery.DEFAULT_WINDOW}

  def _items(self):
    """One connection's items: (seq, frame, round), (seq, None, split start)
    at an exactly-once split's end, None for a keepalive."""
    read = self._read
    use_socket = read.node.data_transfer != "grpc" and self.task.data_address
    if read.node.data_transfer == "socket" and not self.task.data_address:
      raise data_socket.DataConnectionError(
          f"Worker {self.task.worker_address} has no data socket "
          "(data_transfer='socket').", "FAILED_PRECONDITION")
    if use_socket:
      conn = data_socket.DataConnection(
          self.task.data_address, {"token": self.task.read_ticket, **self._request()},
          ssl_context=read.ssl_context, max_frame_bytes=read.node.max_frame_bytes)
      self._connection = conn
      self._send_ack = conn.ack
      try:
        if self._cancelled:
          return
        while True:
          item = conn.next_item()
          if item is None:
            self.end_stats = conn.end_stats
            return
          kind, seq, frame, round_index = item
          yield None if kind == data_socket.KIND_KEEPALIVE else (seq, frame, round_index)
      finally:
        conn.close()
    channel = rpc.make_channel(self.task.worker_address, tls=read.node.tls)
    try:
      # Workers are given the task's read ticket, never the client's token.
      caller = rpc.Caller(channel, _WORKER + "GetElements", None,
                          self.task.read_ticket or None, streams=True)
      call = caller(pb.GetElementsRequest(**self._request()), timeout=None)
      self._connection = call
      ack_call = rpc.Caller(channel, _WORKER + "AckElements", pb.AckElementsResponse,
                            self.task.read_ticket or None)
      self._send_ack = lambda received: ack_call(pb.AckElementsRequest(
          task_id=self.task.task_id, client_id=read.client_id, received=received),
          timeout=_STALL_S)
      if self._cancelled:
        call.cancel()
      frames = element_chunks.FrameAssembler(read.node.max_frame_bytes)
      for raw in call:
        chunk = element_chunks.parse(raw)
        if chunk.keepalive:
          yield None
          continue
        if chunk.end_of_sequence:
          frames.check_ended()
          self.end_stats = chunk.end_stats()
          return
        if chunk.split_end:
          yield chunk.seq, None, chunk.round
          continue
        frame = frames.add(chunk)
        if frame is not None:
          data, round_index, seq = frame
          yield seq, data, round_index
    finally:
      channel.close()

  def _run(self) -> None:
    read = self._read
    split: list = []  # exactly-once: the elements of the split arriving now
    failing_since = None
    backoff = _BACKOFF_S[0]
    try:
      while True:
        self.heard_at = time.monotonic()
        try:
          for item in self._items():
            self.heard_at = time.monotonic()
            failing_since, backoff = None, _BACKOFF_S[0]  # the connection works
            if item is None:  # a keepalive
              continue
            if not self._take(item, split):
              return
          self.done = True
          return
        except (grpc.RpcError, data_socket.DataConnectionError, OSError) as e:
          status = e.code().name if isinstance(e, grpc.RpcError) else getattr(e, "status", "UNAVAILABLE")
          details = e.details() if isinstance(e, grpc.RpcError) else str(e)
          where = (f"worker {self.task.worker_address} (task {self.task.task_id} of "
                   f"job {self.task.job_id})")
          if self._cancelled or read.stop.is_set() or status == "NOT_FOUND":
            if not read.stop.is_set():
              logging.warning("Lost %s (%s: %s); reading on from the others.",
                              where, status, details)
            self.failed = True
            return
          if status not in _WORKER_LOST:
            self.failed = True
            read.fail(rpc.ServiceError(
                f"Worker {self.task.worker_address} failed task {self.task.task_id} of "
                f"dataset {self.task.dataset_id}: {status}: {details}"))
            return
          now = time.monotonic()
          failing_since = failing_since or now
          if now - failing_since > read.node.timeout_s:
            self.failed = True
            read.fail(rpc.ServiceError(
                f"Cannot reach {where} for {now - failing_since:.0f} s although the "
                f"dispatcher lists it as alive (timeout_s={read.node.timeout_s:g}); "
                f"last error: {status}: {details}"))
            return
          logging.info("Connection to %s broke (%s: %s); connecting again.",
                       where, status, details)
        finally:
          self.heard_at = None
          self._connection = self._send_ack = None
        self.reconnects += 1
        if read.stop.wait(backoff):
          return
        backoff = min(2 * backoff, _BACKOFF_S[1])
    except Exception as e:  # pylint: disable=broad-except
      self.failed = True
      read.fail(e)
    finally:
      self._ended = True  # after its last put
      read.wake.set()  # the read may be over: ask the dispatcher now

  def _take(self, item: tuple, split: list) -> bool:
    """Hands one received item on (exactly-once: each split once whole) and
    acknowledges it to the worker now and then; False once the read stops."""
    read = self._read
    seq, frame, round_index = item
    if seq != self.received:
      if seq < self.received:  # already had it
        return True
      raise rpc.ServiceError(
          f"Worker {self.task.worker_address} sent item {seq} of task "
          f"{self.task.task_id}'s stream after item {self.received - 1}: items were lost.")
    self.received += 1
    taken = True
    if read.node.visitation != "exactly_once":
      taken = self._put((wire.decode(frame, self._read.node.max_frame_bytes), round_index))
    elif frame is not None:
      split.append((wire.decode(frame, self._read.node.max_frame_bytes), round_index))
    else:
      if any(r != round_index for _, r in split):
        raise rpc.ServiceError(
            f"Worker {self.task.worker_address} ended split {round_index} "
            "after elements of another split.")
      whole, split[:] = list(split), []
      if read.ack(round_index):  # else sent again: this read already had it
        for element in whole:
          taken = taken and self._put(element)
    if self.received - self._acked >= _ACK_EVERY and self._send_ack is not None:
      self._send_ack(self.received)
      self._acked = self.received
    return taken

  def _put(self, item: tuple) -> bool:
    self.heard_at = None  # waiting for the consumer, not for the worker
    try:
      if not self._read.put(self.out, item):
        return False
    finally:
      self.heard_at = time.monotonic()
    self._read.count(self.task.worker_address)
    return True

  def kick_if_stalled(self, now: float) -> None:
    """Ends the current connection (the fetcher connects again) when it
    brought nothing for _STALL_S while the fetcher waited for it."""
    heard_at = self.heard_at
    if heard_at is not None and now - heard_at > _STALL_S and not self._cancelled:
      logging.warning("No data or keepalive from worker %s for %.0f s: connecting again.",
                      self.task.worker_address, now - heard_at)
      self.heard_at = None
      self._close_connection()

  def cancel(self) -> None:
    self._cancelled = True
    self._close_connection()

  def _close_connection(self) -> None:
    connection = self._connection
    if connection is not None:
      if isinstance(connection, data_socket.DataConnection):
        connection.close()
      else:
        connection.cancel()

  @property
  def ended(self) -> bool:
    return self._ended


_END = object()


class _ReadState:
  """Everything a read's threads share; the iterator owns and closes it."""

  def __init__(self, node: DistributedNode):
    self.node = node
    self.stop = threading.Event()
    self.wake = threading.Event()  # heartbeat now rather than at the interval
    self.lock = threading.Lock()
    self.error: BaseException | None = None
    self.elements_by_worker: dict[str, int] = {}
    self.acks: list[int] = []  # exactly-once: splits to acknowledge
    self.handed_on: set[int] = set()  # exactly-once: splits this read has had
    # Reported to the dispatcher for autoscaling.
    self.consumed = 0
    self.wait_s = 0.0
    self.started = time.monotonic()
    capacity = node.max_outstanding_requests or 8
    self.buffer: queue.Queue = queue.Queue(maxsize=capacity)
    self.capacity = capacity
    self.fetchers: dict[int, _Fetcher] = {}
    self.finished = False
    self.job_id = 0
    self.client_id = 0
    self.channel = rpc.make_channel(node.service, tls=node.tls)
    self.ssl_context = node.tls.client_ssl_context() if node.tls is not None else None
    self.manager = threading.Thread(target=self._manage, daemon=True,
                                    name="jaxfeed-distribute-manager")
    self.manager.start()

  # -- shared helpers -----------------------------------------------------------
  def put(self, out: queue.Queue, item: Any) -> bool:
    while not self.stop.is_set():
      try:
        out.put(item, timeout=_POLL_S)
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
      dataset_id = node.resolve_dataset_id()
      job_call = _dispatcher_caller(self.channel, "GetOrCreateJob",
                                    pb.GetOrCreateJobResponse, node.auth_token)
      try:
        job = rpc.call_with_retry(job_call, pb.GetOrCreateJobRequest(
            dataset_id=dataset_id, sharding_policy=node.policy.value,
            job_name=node.job_name or "", num_consumers=node.num_consumers or 0,
            consumer_index=node.consumer_index or 0,
            round_timeout_s=node.round_timeout_s or 0.0,
            exactly_once=node.visitation == "exactly_once",
            ephemeral_sharing=node.ephemeral_sharing),
            node.timeout_s, f"Creating a job for dataset {dataset_id}")
      except rpc.ServiceError as e:
        cause = e.__cause__
        if (isinstance(cause, grpc.RpcError)
            and cause.code() == grpc.StatusCode.INVALID_ARGUMENT):
          raise ValueError(
              f"distribute(job_name={node.job_name!r}, num_consumers="
              f"{node.num_consumers}, consumer_index={node.consumer_index}): the "
              f"dispatcher refused the read: {cause.details()}") from e
        raise
      self.job_id, self.client_id = job.job_id, job.client_id
      heartbeat = _dispatcher_caller(self.channel, "ClientHeartbeat",
                                     pb.ClientHeartbeatResponse, node.auth_token)
      last_ok = time.monotonic()
      # The last task list and its version: the dispatcher leaves the tasks
      # out of its answer while they stay the same.
      tasks, tasks_version = [], 0
      while not self.stop.is_set():
        self.wake.clear()
        with self.lock:
          acks = list(self.acks)
        try:
          response = heartbeat(pb.ClientHeartbeatRequest(
              job_id=self.job_id, client_id=self.client_id, acked_splits=acks,
              elements_consumed=self.consumed, consumer_wait_s=self.wait_s,
              read_elapsed_s=time.monotonic() - self.started,
              buffer_fill=self.buffer.qsize() / self.capacity,
              known_tasks_version=tasks_version), timeout=10)
          last_ok = time.monotonic()
          with self.lock:
            del self.acks[:len(acks)]
        except grpc.RpcError as e:
          # A heartbeat sent while the dispatcher restarts or its connection
          # was just cut may time out rather than fail fast: both are an
          # outage, retried until the read's timeout.
          if e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED) and (
              time.monotonic() - last_ok < node.timeout_s):
            self.stop.wait(0.2)
            continue
          raise rpc.ServiceError(f"Heartbeat for job {self.job_id} failed: "
                                 f"{e.code().name}: {e.details()}") from e
        if response.tasks_unchanged:
          response.tasks.extend(tasks)
        else:
          tasks, tasks_version = list(response.tasks), response.tasks_version
        self._update_tasks(response)
        if self.finished:
          return
        self.wake.wait(max(heartbeat_pacing.CLIENT_DEFAULT_INTERVAL_S,
                           response.heartbeat_interval_s))
    except BaseException as e:  # pylint: disable=broad-except
      self.fail(e)

  def _update_tasks(self, response: pb.ClientHeartbeatResponse) -> None:
    listed = {t.task_id: t for t in response.tasks}
    now = time.monotonic()
    for task_id, task in listed.items():
      old = self.fetchers.get(task_id)
      if old is not None:
        old.kick_if_stalled(now)
      else:
        out = self.buffer if not self.node.num_consumers else queue.Queue(self.capacity)
        self.fetchers[task_id] = _Fetcher(self, task, out)
    for task_id, fetcher in self.fetchers.items():
      if task_id not in listed and not fetcher.ended:
        fetcher.cancel()  # the dispatcher declared its worker dead
    if response.job_finished and all(f.ended for f in self.fetchers.values()):
      self.finished = True
      if not self.node.num_consumers:
        try:  # wakes a consumer waiting on an empty buffer
          self.buffer.put_nowait(_END)
        except queue.Full:
          pass  # it is not waiting

  def round_fetchers(self) -> tuple[dict[int, _Fetcher], int]:
    """Round-robin reads: the fetcher of each worker index, and the number
    of workers (the latest task of an index wins)."""
    fetchers = sorted(list(self.fetchers.values()), key=lambda f: f.task.task_id)
    if not fetchers:
      return {}, 0
    return {f.task.worker_index: f for f in fetchers}, fetchers[-1].task.num_workers

  def close(self) -> None:
    self.stop.set()
    self.wake.set()
    for fetcher in list(self.fetchers.values()):
      fetcher.cancel()
    if self.manager is not threading.current_thread():
      self.manager.join(timeout=15)
    for fetcher in list(self.fetchers.values()):
      fetcher.thread.join(timeout=15)
    if self.client_id:
      try:
        _dispatcher_caller(self.channel, "ReleaseJobClient", pb.ReleaseJobClientResponse,
                           self.node.auth_token)(
            pb.ReleaseJobClientRequest(job_id=self.job_id, client_id=self.client_id),
            timeout=2)
      except grpc.RpcError:
        pass  # the dispatcher times the client out instead
    self.channel.close()


class DistributedIterator(base.OpIterator):
  """Iterator over a service read; `close()` leaves the job."""

  op_name = DistributedNode.op_name

  def __init__(self, node: DistributedNode):
    super().__init__(())
    self._read = _ReadState(node)
    self._elements = 0
    self._round = 0  # round-robin: the next global round wanted
    self._last_round = -1
    self._heads: dict[int, tuple] = {}  # task id -> (element, local round) not yet due
    self._skipped = {"rounds_skipped": 0, "rounds_of_ended_workers": 0}
    self._ended_pending = 0
    self._finalizer = weakref.finalize(self, self._read.close)

  @property
  def elements_by_worker(self) -> dict[str, int]:
    """Elements received so far from each worker address."""
    with self._read.lock:
      return dict(self._read.elements_by_worker)

  @property
  def job_id(self) -> int:
    return self._read.job_id

  @property
  def last_round(self) -> int:
    """Round-robin reads: the global round of the last batch returned (-1
    before the first); consumers' batches of one round share a bucket."""
    return self._last_round

  @property
  def stats(self) -> dict:
    """Round-robin reads: what this consumer received and missed.

    `rounds_received`: batches returned; `rounds_skipped`: rounds that closed
    before this consumer took its batch (it was late, see the module
    docstring), including, at the end, those after its last batch;
    `rounds_of_ended_workers`: rounds without a batch because their worker
    had ended or died while another worker still served later rounds (the
    same for every consumer). `workers` maps each worker address
    whose stream ended to that task's counters (`jaxfeed.service.
    round_assembly`: rounds, windows and batches dropped), and the counters'
    totals over those workers are given at the top level too.
    """
    stats = {"rounds_received": self._elements if self._read.node.num_consumers else 0,
             **self._skipped, "workers": {}}
    for fetcher in list(self._read.fetchers.values()):
      if fetcher.end_stats:
        stats["workers"][fetcher.task.worker_address] = dict(fetcher.end_stats)
        for key, value in fetcher.end_stats.items():
          if isinstance(value, (int, float)):
            stats[key] = stats.get(key, 0) + value
    return stats

  def _raise_error(self) -> None:
    error = self._read.error
    if error is not None:
      if isinstance(error, (rpc.ServiceError, spec_lib.SpecError, ValueError)):
        raise error
      raise rpc.ServiceError(f"Reading from the service failed: {error}") from error

  def __next__(self) -> Any:
    read = self._read
    start = time.monotonic()
    try:
      element = self._next_round() if read.node.num_consumers else self._next_element()
    finally:
      read.wait_s += time.monotonic() - start
    read.consumed += 1
    return element

  def _next_element(self) -> Any:
    read = self._read
    while True:
      try:
        item = read.buffer.get(timeout=_POLL_S)
      except queue.Empty:
        item = None
      if item is _END:
        raise StopIteration
      if item is not None:
        self._elements += 1
        return item[0]
      self._raise_error()
      if read.finished and read.buffer.empty():
        raise StopIteration
      if read.stop.is_set():
        raise StopIteration

  # -- round-robin reads ---------------------------------------------------------
  def _head(self, fetcher: _Fetcher) -> tuple | None:
    """The fetcher's next (element, local round), kept until its round is due."""
    task_id = fetcher.task.task_id
    head = self._heads.get(task_id)
    if head is None:
      try:
        head = self._heads[task_id] = fetcher.out.get(timeout=_POLL_S)
      except queue.Empty:
        return None
    return head

  def _drained(self, fetcher: _Fetcher) -> bool:
    # `ended` first: once the thread ended, nothing more is put.
    return (fetcher.ended and fetcher.out.empty()
            and fetcher.task.task_id not in self._heads)

  def _next_round(self) -> Any:
    read = self._read
    while True:
      self._raise_error()
      if read.stop.is_set():
        raise StopIteration
      by_index, num_workers = read.round_fetchers()
      if all(self._drained(f) for f in by_index.values()) and (
          read.finished or (by_index and len(by_index) >= num_workers)):
        self._count_rounds_never_reached(by_index, num_workers)
        raise StopIteration
      index = self._round % num_workers if num_workers else 0
      fetcher = by_index.get(index)
      if fetcher is None:
        if read.finished:  # this worker never served the job
          self._skip("rounds_of_ended_workers")
        else:
          time.sleep(_POLL_S)
        continue
      head = self._head(fetcher)
      if head is None:
        if self._drained(fetcher):
          # The worker says how many rounds it made: the ones we did not get
          # closed before we came.
          made = fetcher.end_stats.get("rounds", 0)
          late = self._round // num_workers < made
          self._skip("rounds_skipped" if late else "rounds_of_ended_workers")
        continue
      element, local_round = head
      got = local_round * num_workers + index
      if got > self._round:  # the rounds up to `got` closed before we came
        self._skip("rounds_skipped")
        continue
      del self._heads[fetcher.task.task_id]
      if got < self._round:  # a replaced task starting over; already past it
        continue
      self._round += 1
      self._last_round = got
      self._elements += 1
      self._skipped["rounds_of_ended_workers"] += self._ended_pending
      self._ended_pending = 0
      return element

  def _skip(self, why: str) -> None:
    if why == "rounds_of_ended_workers":
      # Counted once a later round arrives: after the last one, they are
      # just the end of the read.
      self._ended_pending += 1
    else:
      self._skipped[why] += 1
    self._round += 1

  def _count_rounds_never_reached(self, by_index: dict, num_workers: int) -> None:
    """At the end: rounds the workers made past our position closed unseen."""
    for index, fetcher in by_index.items():
      made = fetcher.end_stats.get("rounds", 0)
      first = max(0, -(-(self._round - index) // num_workers))
      self._skipped["rounds_skipped"] += max(0, made - first)
    self._round = max(self._round, max(
        (f.end_stats.get("rounds", 0) * num_workers for f in by_index.values()), default=0))
    self._ended_pending = 0

  def _get_own_state(self) -> dict:
    return {"elements_read": self._elements}

  def _set_own_state(self, state: dict) -> None:
    if state.get("elements_read", 0) != self._elements:
      raise base.PipelineStateError(
          "A service read cannot resume at a position: the workers' output "
          f"order is not reproducible (state {state}); start a new read.")

  def _close_own(self) -> None:
    self._finalizer()


def distribute(dataset: Any, service: str, processing_mode: Any = "parallel_epochs",
               job_name: str | None = None, num_consumers: int | None = None,
               consumer_index: int | None = None, compression: str | None = None,
               max_outstanding_requests: int | None = None,
               round_timeout_s: float | None = None, **options: Any) -> Any:
  """Runs `dataset` on the service's workers; returns a Dataset reading its output.

  Args:
    dataset: the pipeline to run remotely.
    service: the dispatcher's "host:port".
    processing_mode: "parallel_epochs" / "distributed_epoch" or a ShardingPolicy.
    job_name: readers with the same job name share one job (each element goes
      to one of them).
    num_consumers: coordinated round-robin reads by this many consumers
      (needs job_name): at every round, one worker serves all of them one
      batch each, all with the same bucket key (padded shapes); see the
      module docstring.
    consumer_index: this consumer's index in [0, num_consumers).
    compression: None, "lz4" or "zstd" for batches on the wire.
    max_outstanding_requests: batches buffered on the client (default 8;
      per worker for round-robin reads).
    round_timeout_s: round-robin reads: once the first consumer took its
      batch of a round, the others have this long to take theirs; then the
      round closes without them and a late consumer later goes on at the
      current round, counting what it skipped in its iterator's `stats`.
      None: the job's value, 60 s for a new job. Every consumer of a job
      passes the same value or None.
    **options: auth_token, udf_secret, tls, data_transfer ("auto", "socket",
      "grpc"), timeout_s (how long to retry reaching the dispatcher, or a
      listed worker whose connection broke, before the read fails),
      visitation: "at_most_once" (default: what a lost worker had buffered
      or in flight is lost) or "exactly_once" (distributed_epoch without
      num_consumers: the pipeline runs split by split on the workers, so a
      batch never spans two splits; the client hands a split's elements on
      only once all of them arrived and acknowledges it; a lost worker's
      unacknowledged splits are read again by the others, and so are those
      of a client of a shared job that left or was silent for the
      dispatcher's client_timeout_s, so every record arrives once per epoch),
      ephemeral_sharing: parallel_epochs jobs of one dataset that all pass
      True share each worker's pipeline through a byte-bounded window, each
      job at its own position; a job that falls behind the window skips
      ahead (see `jaxfeed.service.shared_stream`),
      max_frame_bytes: the largest batch (its frame, after decompression)
      accepted from a worker, 2 GiB by default; a bigger one fails the read.

  Returns:
    A jaxfeed Dataset.
  """
  from jaxfeed.dataset import Dataset  # pylint: disable=g-import-not-at-top
  node = DistributedNode(
      service=service, processing_mode=processing_mode, dataset=dataset,
      job_name=job_name, num_consumers=num_consumers, consumer_index=consumer_index,
      compression=compression, max_outstanding_requests=max_outstanding_requests,
      round_timeout_s=round_timeout_s, **options)
  return Dataset(node, getattr(dataset, "options", None))


def from_dataset_id(processing_mode: Any, service: str, dataset_id: str,
                    job_name: str | None = None, num_consumers: int | None = None,
                    consumer_index: int | None = None, compression: str | None = None,
                    max_outstanding_requests: int | None = None,
                    round_timeout_s: float | None = None, **options: Any) -> Any:
  """Reads a dataset registered with `register_dataset` (see `distribute`)."""
  from jaxfeed.dataset import Dataset  # pylint: disable=g-import-not-at-top
  if not isinstance(dataset_id, str) or not dataset_id:
    raise ValueError(f"dataset_id must be a non-empty string, got {dataset_id!r}.")
  return Dataset(DistributedNode(
      service=service, processing_mode=processing_mode, dataset_id=dataset_id,
      job_name=job_name, num_consumers=num_consumers, consumer_index=consumer_index,
      compression=compression, max_outstanding_requests=max_outstanding_requests,
      round_timeout_s=round_timeout_s, **options))
