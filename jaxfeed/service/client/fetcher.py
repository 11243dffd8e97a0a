"""The fetcher of a service read: one thread reading one task's stream from
its worker, over the worker's data socket or gRPC, reconnecting as needed."""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any, Iterator

import grpc

from jaxfeed.service.protocol import data_socket
from jaxfeed.service.protocol import element_chunks
from jaxfeed.service.protocol import rpc
from jaxfeed.service.protocol import stream_state
from jaxfeed.service.protocol import target_workers
from jaxfeed.service.protocol import wire
from jaxfeed.service.protocol.protos import service_pb2 as pb
from jaxfeed.service.worker import delivery
from jaxfeed.service.worker import local_workers

_WORKER = "/jaxfeed.service.Worker/"
# A fetcher's connection that brings nothing, not even a keepalive (see
# `jaxfeed.service.worker.delivery`), this long while it waits is replaced.
_STALL_S = 10.0
_BACKOFF_S = (0.05, 2.0)  # first and longest wait between reconnects
_ACK_EVERY = delivery.DEFAULT_WINDOW // 4  # items between acknowledgments
# Statuses after which a fetcher connects to its worker again (NOT_FOUND: the
# worker lost the task, it is given up); any other status is an error of the
# pipeline and reaches the consumer.
_WORKER_LOST = frozenset(
  {"UNAVAILABLE", "CANCELLED", "DEADLINE_EXCEEDED", "NOT_FOUND", "ABORTED", "OUT_OF_RANGE"}
)


class Keepalive(int):
  """A keepalive from the worker: its task's progress counter (see
  `jaxfeed.service.worker.delivery.Idle`)."""


class Fetcher:
  """One thread reading one task's stream into the read's buffer.

  When a connection breaks or stalls (nothing, not even a keepalive, for
  _STALL_S while it waits for data), the fetcher connects again with
  backoff and the worker goes on after the last item received (see
  `jaxfeed.service.worker.delivery`), so nothing is lost or repeated. It stops at
  the stream's end, or when cancelled (the dispatcher dropped the worker);
  while no connection works it tries on, and the read fails once the
  dispatcher listed the worker as alive for its `timeout_s` meanwhile (time
  the dispatcher was away does not count: only it can say the worker died).
  """

  def __init__(
    self, read: Any, task: pb.TaskInfo, out: queue.Queue, stream: tuple[int, int] | None = None
  ):
    """`read` is the `jaxfeed.service.client.read.ReadState` it reads for;
    `stream`, for a read that follows its streams (`jaxfeed.service.
    stream_state`): (the stream's slot, the elements of it the worker drops
    first)."""
    self.task = task
    self.out = out
    self.stream = stream
    self.handed_on = 0  # elements put into `out`
    self.done = False
    self.failed = False
    self.end_stats: dict = {}  # the task's round statistics and final op rows, at its end
    self.received = 0  # items of the stream received, over all connections
    self.reconnects = 0
    self._acked = 0
    self._send_ack: Any = None  # the current connection's acknowledgment
    # Why the current connection's last acknowledgment failed (see _acknowledge).
    self._ack_error: Exception | None = None
    # When the current connection last brought something; None while the
    # fetcher waits for room in the buffer rather than for data.
    self.heard_at: float | None = None
    # When the worker last made progress on the task: an item arrived, or a
    # keepalive with a new progress counter (the last one seen).
    self.progress_at = time.monotonic()
    self._worker_progress: int | None = None
    self._read = read
    self._connection: Any = None
    self._cancelled = False
    self._ended = False
    self.ended_at = 0.0  # when the thread ended (monotonic)
    self.failing_since: float | None = None  # since when no connection worked
    self.last_error = ""  # of the last connection that failed
    # Seconds the dispatcher listed the task while no connection worked.
    self._unreachable_listed_s = 0.0
    self.thread = threading.Thread(
      target=self._run, daemon=True, name=f"jaxfeed-fetch-{task.task_id}"
    )
    self.thread.start()

  def _request(self, transport: str) -> dict:
    """The request of a connection over `transport` ("socket", "grpc" or
    "memory"; see `wire.resolve_compression`)."""
    node = self._read.node
    # A read of a registered dataset that names no compression uses the dataset's.
    compression = node.compression or ("" if node.dataset is not None else self.task.compression)
    return {
      "task_id": self.task.task_id,
      "compression": wire.resolve_compression(compression, transport),
      "consumer_index": node.consumer_index or 0,
      "round": 0,
      "client_id": self._read.client_id,
      "received": self.received,
      "window": 1 if self._one_split_at_a_time else delivery.DEFAULT_WINDOW,
      "skip": self.stream[1] if self.stream else 0,
    }

  @property
  def _one_split_at_a_time(self) -> bool:
    """Exactly-once reads of a shared job take one split at a time from a
    worker, the next only once this client handed the last one on: a split
    taken for a client whose buffer is full could reach neither it nor the
    job's other consumers, and the job cannot end while it is out. Hosts in
    lockstep (a collective per step) would wait for each other for ever."""
    node = self._read.node
    return node.visitation == "exactly_once" and bool(node.job_name)

  def _items(self):
    """One connection's items: (seq, frame, round, 0), (seq, None, split
    start, split stop) at an exactly-once split's end, a `Keepalive`."""
    read = self._read
    local = self._local_worker()
    if local is not None:
      yield from self._connection_items(
        local_workers.LocalConnection(
          local, {"token": self.task.read_ticket, **self._request("memory")}
        )
      )
      return
    use_socket = read.node.data_transfer != "grpc" and self.task.data_address
    if read.node.data_transfer == "socket" and not self.task.data_address:
      # Retried: after a restart, the dispatcher lists the tasks of a worker
      # that has not registered again without its data address.
      raise data_socket.DataConnectionError(
        f"The dispatcher lists no data socket of worker {self.task.worker_address} "
        "(data_transfer='socket'): it serves none, or has not registered again "
        "since the dispatcher restarted.",
        "UNAVAILABLE",
      )
    if use_socket:
      yield from self._connection_items(
        data_socket.DataConnection(
          self.task.data_address,
          {"token": self.task.read_ticket, **self._request("socket")},
          min(_STALL_S, read.node.timeout_s),
          ssl_context=read.ssl_context,
          max_frame_bytes=read.node.max_frame_bytes,
        )
      )
      return
    channel = rpc.make_channel(self.task.worker_address, tls=read.node.tls)
    try:
      # Workers are given the task's read ticket, never the client's token.
      caller = rpc.Caller(
        channel, _WORKER + "GetElements", None, self.task.read_ticket or None, streams=True
      )
      call = caller(pb.GetElementsRequest(**self._request("grpc")), timeout=None)
      self._connection = call
      ack_call = rpc.Caller(
        channel, _WORKER + "AckElements", pb.AckElementsResponse, self.task.read_ticket or None
      )
      self._send_ack = lambda received: ack_call(
        pb.AckElementsRequest(
          task_id=self.task.task_id, client_id=read.client_id, received=received
        ),
        timeout=min(_STALL_S, read.node.timeout_s),
      )
      if self._cancelled:
        call.cancel()
      frames = element_chunks.FrameAssembler(read.node.max_frame_bytes)
      for raw in call:
        chunk = element_chunks.parse(raw)
        if chunk.keepalive:
          yield Keepalive(chunk.round)
          continue
        if chunk.end_of_sequence:
          frames.check_ended()
          self.end_stats = chunk.end_stats()
          return
        if chunk.split_end:
          yield chunk.seq, None, chunk.round, chunk.split_stop
          continue
        frame = frames.add(chunk)
        if frame is not None:
          data, round_index, seq = frame
          yield seq, data, round_index, 0
    finally:
      channel.close()

  def _local_worker(self) -> Any:
    """The task's worker when this read takes it through memory: a
    target_workers="local" read (data_transfer "auto") of a worker in this
    process (see `jaxfeed.service.worker.local_workers`); else None."""
    node = self._read.node
    if node.target_workers != target_workers.LOCAL or node.data_transfer != "auto":
      return None
    return local_workers.get(self.task.worker_address)

  def _connection_items(self, conn: Any) -> Iterator[Any]:
    """The items of a data-socket or in-process connection (see `_items`)."""
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
        yield (
          Keepalive(round_index)
          if kind == data_socket.KIND_KEEPALIVE
          else (seq, frame, round_index, conn.split_stop if frame is None else 0)
        )
    finally:
      conn.close()

  def _element(self, frame: Any) -> Any:
    """A received frame's element: bytes are decoded, an in-process
    `wire.Frame` is taken as it is."""
    if isinstance(frame, wire.Frame):
      return frame.value()
    return wire.decode(frame, self._read.node.max_frame_bytes)

  def _run(self) -> None:
    read = self._read
    split: list = []  # exactly-once: the elements of the split arriving now
    backoff = _BACKOFF_S[0]
    try:
      while True:
        self.heard_at = time.monotonic()
        try:
          for item in self._items():
            self.heard_at = time.monotonic()
            self.failing_since, backoff = None, _BACKOFF_S[0]  # the connection works
            self._unreachable_listed_s = 0.0
            if isinstance(item, Keepalive):
              if item != self._worker_progress:
                self._worker_progress, self.progress_at = item, self.heard_at
              if self._ack_error is not None:  # the worker may wait for the ack
                raise self._ack_error
              continue
            self.progress_at = self.heard_at
            if not self._take(item, split):
              return
          self.done = True
          return
        except (grpc.RpcError, data_socket.DataConnectionError, OSError) as e:
          status = (
            e.code().name if isinstance(e, grpc.RpcError) else getattr(e, "status", "UNAVAILABLE")
          )
          details = e.details() if isinstance(e, grpc.RpcError) else str(e)
          where = (
            f"worker {self.task.worker_address} (task {self.task.task_id} of "
            f"job {self.task.job_id})"
          )
          if self._cancelled or read.stop.is_set() or status == "NOT_FOUND":
            if not read.stop.is_set():
              logging.warning(
                "Lost %s (%s: %s); reading on from the others.", where, status, details
              )
            self.failed = True
            return
          if status not in _WORKER_LOST:
            self.failed = True
            read.fail(
              rpc.ServiceError(
                f"Worker {self.task.worker_address} failed task {self.task.task_id} of "
                f"dataset {self.task.dataset_id}: {status}: {details}"
              )
            )
            return
          # Tried on until the dispatcher drops the task: only it can say
          # the worker died (the read fails when it lists it as alive for
          # timeout_s, see `unreachable_listed`).
          self.failing_since = self.failing_since or time.monotonic()
          self.last_error = f"{status}: {details}"
          logging.info("Connection to %s broke (%s: %s); connecting again.", where, status, details)
        finally:
          self.heard_at = None
          self._connection = self._send_ack = self._ack_error = None
        self.reconnects += 1
        if read.stop.wait(backoff):
          return
        backoff = min(2 * backoff, _BACKOFF_S[1])
    except Exception as e:  # pylint: disable=broad-except
      self.failed = True
      read.fail(e)
    finally:
      self.ended_at = time.monotonic()
      self._ended = True  # after its last put
      read.wake.set()  # the read may be over: ask the dispatcher now

  def _take(self, item: tuple, split: list) -> bool:
    """Hands one received item on (exactly-once: each split once whole) and
    acknowledges it to the worker now and then; False once the read stops."""
    read = self._read
    seq, frame, round_index, split_stop = item
    if seq != self.received:
      if seq < self.received:  # already had it
        return True
      raise rpc.ServiceError(
        f"Worker {self.task.worker_address} sent item {seq} of task "
        f"{self.task.task_id}'s stream after item {self.received - 1}: items were lost."
      )
    self.received += 1
    taken = True
    if read.node.visitation != "exactly_once":
      tag = round_index if self.stream is None else stream_state.StreamTag(self.stream[0])
      taken = self._put((self._element(frame), tag))
    elif frame is not None:
      split.append((self._element(frame), round_index))
    else:
      if any(r != round_index for _, r in split):
        raise rpc.ServiceError(
          f"Worker {self.task.worker_address} ended split {round_index} "
          "after elements of another split."
        )
      whole, split[:] = list(split), []
      if read.ack(round_index):  # else sent again: this read already had it
        for element in read.progress.arrived(round_index, split_stop, whole):
          taken = taken and self._put(element)
      if self._one_split_at_a_time and self._send_ack is not None and not self._cancelled:
        self._acknowledge()  # handed on: the worker may send the next
    if (
      self.received - self._acked >= _ACK_EVERY
      and self._send_ack is not None
      and not self._cancelled
    ):
      self._acknowledge()
    return taken

  def _acknowledge(self) -> None:
    """Acknowledges what was received. A failed acknowledgment does not end
    the connection at once: what it already brought is read and handed on
    first (a dead worker's items that reached this host are all that is
    left of them), and the next connection's request acknowledges; the
    connection ends at its next keepalive, when the worker may be waiting
    for the acknowledgment."""
    self._acked = self.received
    try:
      self._send_ack(self.received)
    except (grpc.RpcError, OSError) as e:
      self._ack_error = self._ack_error or e

  def _put(self, item: tuple) -> bool:
    self.heard_at = None  # waiting for the consumer, not for the worker
    try:
      if not self._read.put(self.out, item):
        return False
    finally:
      self.heard_at = time.monotonic()
    self.handed_on += 1
    self._read.count(self.task.worker_address)
    return True

  def unreachable_listed(self, listed_s: float) -> rpc.ServiceError | None:
    """The dispatcher listed the task as alive again, `listed_s` seconds
    after it last did (0: it was away in between): the read's error once
    the fetcher has not reached the worker for timeout_s of such time."""
    if self.failing_since is None or self._cancelled:
      return None
    self._unreachable_listed_s += listed_s
    timeout_s = self._read.node.timeout_s
    if self._unreachable_listed_s <= timeout_s:
      return None
    return rpc.ServiceError(
      f"Cannot reach worker {self.task.worker_address} (task {self.task.task_id} of "
      f"job {self.task.job_id}) for {self._unreachable_listed_s:.0f} s although the "
      f"dispatcher lists it as alive (timeout_s={timeout_s:g}); last error: "
      f"{self.last_error}"
    )

  @property
  def on_socket(self) -> bool:
    """Whether the fetcher streams over its worker's data socket now."""
    return isinstance(self._connection, data_socket.DataConnection)

  def kick_if_stalled(self, now: float) -> None:
    """Ends the current connection (the fetcher connects again) when it
    brought nothing for _STALL_S while the fetcher waited for it."""
    heard_at = self.heard_at
    if heard_at is not None and now - heard_at > _STALL_S and not self._cancelled:
      logging.warning(
        "No data or keepalive from worker %s for %.0f s: connecting again.",
        self.task.worker_address,
        now - heard_at,
      )
      self.heard_at = None
      self._close_connection()

  def cancel(self) -> None:
    """Stops the fetcher: the dispatcher dropped the task, or the read ends.
    Batches a data socket already brought are still handed on (if the
    worker died, they are all that is left of them); nothing more is
    acknowledged, so a live worker sends at most a window more."""
    self._cancelled = True
    connection = self._connection
    if isinstance(connection, (data_socket.DataConnection, local_workers.LocalConnection)):
      connection.stop_receiving()
    else:
      self._close_connection()

  def _close_connection(self) -> None:
    connection = self._connection
    if connection is not None:
      if isinstance(connection, (data_socket.DataConnection, local_workers.LocalConnection)):
        connection.close()
      else:
        connection.cancel()

  @property
  def ended(self) -> bool:
    return self._ended
