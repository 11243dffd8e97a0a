"""What a worker answers its clients (`ClientCalls`): over gRPC,
GetElements, AckElements and GetTaskStats; on the data socket, the hello's
read-ticket check, the stream of a task's batches and the client's goodbye.
Each call checks the client's read ticket for the task, then reads or
writes the worker's state (`jaxfeed.service.worker.state`)."""

from __future__ import annotations

import json
import time
from typing import Any, Generator, Iterator

import grpc

from jaxfeed.service.protocol import data_socket
from jaxfeed.service.protocol import element_chunks
from jaxfeed.service.protocol import rpc
from jaxfeed.service.protocol import wire
from jaxfeed.service.protocol.protos import service_pb2 as pb
from jaxfeed.service.worker import data_server
from jaxfeed.service.worker import delivery
from jaxfeed.service.worker import task_runner as task_runner_lib
from jaxfeed.service.worker.state import WorkerState

_MAX_GOODBYE_TICKET = 128  # characters; the dispatcher's tickets have 64
_HEX_DIGITS = "0123456789abcdef"


class ClientCalls:
  """The calls of a worker's clients, answered from its `WorkerState`."""

  def __init__(self, worker: WorkerState):
    self._worker = worker

  def check_ticket(self, task_id: Any, sent: Any) -> None:
    """Raises StatusError unless `sent` is the read ticket of the task (when
    the deployment authenticates)."""
    key = self._worker.ticket_key
    if not key:
      if not self._worker.config.worker_token:
        return  # an unauthenticated deployment (loopback or --insecure)
      if key is None:
        raise rpc.StatusError(
          "UNAVAILABLE",
          f"Worker {self._worker.address} is not registered with the dispatcher yet: retry.",
        )
      raise rpc.StatusError(
        "FAILED_PRECONDITION",
        f"Worker {self._worker.address} has a worker token, but its dispatcher issues "
        "no read tickets (it has no tokens): give the dispatcher "
        "--auth_token_file and --worker_token_file.",
      )
    if not isinstance(task_id, int) or not rpc.ticket_matches(key, task_id, sent):
      raise rpc.StatusError(
        "UNAUTHENTICATED",
        f"Worker {self._worker.address}: missing or wrong read ticket for task "
        f"{task_id!r}: clients read a task with the ticket the dispatcher "
        "gives them for it.",
      )

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
    task_id, client_id, ticket = (
      hello.get("task_id"),
      hello.get("client_id"),
      hello.get("goodbye"),
    )
    elements, wait_s = hello.get("elements", 0), hello.get("wait_s", 0.0)
    # Hex digits only: a ticket that protobuf cannot encode (a lone
    # surrogate) would fail every later heartbeat of this worker.
    if not (
      _is_id(task_id)
      and _is_id(client_id)
      and client_id > 0
      and isinstance(ticket, str)
      and len(ticket) <= _MAX_GOODBYE_TICKET
      and not ticket.strip(_HEX_DIGITS)
      and _is_id(elements)
      and isinstance(wait_s, (int, float))
      and not isinstance(wait_s, bool)
      and 0 <= wait_s < float("inf")
    ):
      raise data_socket.DataConnectionError(
        "Malformed goodbye: task_id and client_id must be integers (client_id > 0), "
        f"goodbye at most {_MAX_GOODBYE_TICKET} hex digits, elements an integer "
        f">= 0 and wait_s a finite number >= 0; got {str(task_id)[:40]!r}, "
        f"{str(client_id)[:40]!r}, {str(ticket)[:40]!r}, {str(elements)[:40]!r}, "
        f"{str(wait_s)[:40]!r}.",
        "INVALID_ARGUMENT",
      )
    job = self._worker.served.job_id_of(task_id)
    if job is None or self._worker.streams.find(task_id, client_id) is None:
      raise data_socket.DataConnectionError(
        f"Worker {self._worker.address} serves no stream of task {task_id} to client "
        f"{client_id}: a client says goodbye to a worker it reads from.",
        "NOT_FOUND",
      )
    self._worker.hold_goodbye(
      pb.ClientGoodbye(
        job_id=job,
        client_id=client_id,
        ticket=ticket,
        elements_consumed=elements,
        consumer_wait_s=wait_s,
      )
    )

  def GetElements(
    self, request: pb.GetElementsRequest, context: grpc.ServicerContext
  ) -> Iterator[bytes | pb.ElementChunk]:
    self.check_ticket(request.task_id, rpc.metadata_token(context.invocation_metadata()))
    max_chunk = self._worker.config.chunk_bytes
    chunk = min(request.max_chunk_bytes or max_chunk, max_chunk)
    compression = wire.check_compression(wire.resolve_compression(request.compression, "grpc"))
    try:
      stream, token = self._worker.open_stream(request, context.cancel, "grpc")
      items = stream.items(token, request.received, context.is_active, stream.wait_for_ack)
      last_sent = time.monotonic()
      while True:
        try:
          item = next(items)
        except StopIteration as end:
          stats = end.value
          break
        if isinstance(item, delivery.Idle):  # a keepalive's round: the task's progress
          if time.monotonic() - last_sent >= delivery.KEEPALIVE_S:
            last_sent = time.monotonic()
            yield pb.ElementChunk(keepalive=True, round=item)
          continue
        last_sent = time.monotonic()
        if item.frame is None:  # exactly-once: the split `item.round` ended
          yield pb.ElementChunk(
            split_end=True, round=item.round, seq=item.seq, split_stop=item.split_stop
          )
          continue
        frame = item.frame.encoded(compression)
        for i, views in enumerate(frame.chunks(chunk)):
          if i:
            yield element_chunks.encode(views)
          else:
            yield element_chunks.encode(views, frame.nbytes, item.round, item.seq)
      if stats is None:  # superseded by a newer connection of the client
        return
      yield pb.ElementChunk(end_of_sequence=True, stats_json=json.dumps(stats) if stats else "")
    except task_runner_lib.TaskFailed as e:
      raise rpc.StatusError(e.status, str(e)) from e

  def AckElements(
    self, request: pb.AckElementsRequest, context: grpc.ServicerContext
  ) -> pb.AckElementsResponse:
    self.check_ticket(request.task_id, rpc.metadata_token(context.invocation_metadata()))
    stream = self._worker.streams.find(request.task_id, request.client_id)
    if stream is not None:
      stream.ack(request.received)
    return pb.AckElementsResponse()

  def GetTaskStats(
    self, request: pb.GetTaskStatsRequest, context: grpc.ServicerContext
  ) -> pb.GetTaskStatsResponse:
    self.check_ticket(request.task_id, rpc.metadata_token(context.invocation_metadata()))
    with self._worker.lock:
      runner = self._worker.tasks.get(request.task_id)
    if runner is None:
      raise rpc.NotFoundError(f"Worker {self._worker.address} has no task {request.task_id}.")
    return pb.GetTaskStatsResponse(stats_json=json.dumps({"ops": runner.op_rows()}, default=str))

  def serve_socket(
    self, hello: dict, link: data_server.ServerLink
  ) -> Generator[delivery.Item | delivery.Idle, None, dict | None]:
    try:
      request = pb.GetElementsRequest(
        task_id=int(hello["task_id"]),
        consumer_index=int(hello.get("consumer_index", 0)),
        round=int(hello.get("round", 0)),
        client_id=int(hello.get("client_id", 0)),
        received=int(hello.get("received", 0)),
        window=int(hello.get("window", 0)),
        skip=int(hello.get("skip", 0)),
      )
    except (KeyError, TypeError, ValueError, OverflowError) as e:  # int(inf): Overflow
      raise data_socket.DataConnectionError(f"Malformed hello: {e}", "INVALID_ARGUMENT") from e
    try:
      stream, token = self._worker.open_stream(request, link.kick, "socket")
      link.on_ack = stream.ack
      return (yield from stream.items(token, request.received, link.is_active, link.wait_for_ack))
    except rpc.NotFoundError as e:
      raise data_socket.DataConnectionError(str(e), "NOT_FOUND") from e
    except task_runner_lib.TaskFailed as e:
      raise data_socket.DataConnectionError(str(e), e.status) from e


def _is_id(value: Any) -> bool:
  """An id a protobuf int64 field holds."""
  return wire.is_int(value) and 0 <= value < 1 << 63
