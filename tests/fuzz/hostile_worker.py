"""A worker that registers with a real dispatcher and answers every read with
bytes the test chose: for checking what a client does with a hostile or
broken worker. Around those bytes it speaks the current protocol: it takes
acknowledgments (AckElements, 8-byte acks on the data socket) and keeps a held
gRPC stream alive with keepalive chunks, so a client fails on what the worker
sent, not on a missing method or a stall."""

from __future__ import annotations

import socket
import struct
import threading

from jaxfeed.service.protocol import rpc
from jaxfeed.service.protocol import rpc_server
from jaxfeed.service.protocol.protos import service_pb2 as pb
from jaxfeed.service.worker import delivery


class HostileWorker:
  """Heartbeats to `dispatcher_address` as a worker; GetElements streams
  `grpc_messages` (raw ElementChunk bytes) and then only keepalives, and every
  data socket connection gets `socket_bytes` after its hello and then is held
  open, reading acks (so a client waiting for more bytes than were announced
  would wait forever)."""

  def __init__(self, dispatcher_address: str, grpc_messages: list[bytes], socket_bytes: bytes):
    self._grpc_messages = grpc_messages
    self._socket_bytes = socket_bytes
    self._stop = threading.Event()
    handler = rpc_server.method_handlers(
      "jaxfeed.service.Worker",
      {},
      {
        "GetElements": (self._get_elements, pb.GetElementsRequest, True, (rpc.CLIENT,)),
        "AckElements": (self._ack_elements, pb.AckElementsRequest, False, (rpc.CLIENT,)),
      },
    )
    self._server, port = rpc_server.make_server("127.0.0.1:0", handler, 64 << 20, None)
    self._server.start()
    self.address = f"127.0.0.1:{port}"
    self._listener = socket.create_server(("127.0.0.1", 0))
    self._listener.settimeout(0.2)
    self.data_address = f"127.0.0.1:{self._listener.getsockname()[1]}"
    self._connections: list[socket.socket] = []
    self._connection_threads: list[threading.Thread] = []
    self._channel = rpc.make_channel(dispatcher_address)
    self._heartbeat = rpc.Caller(
      self._channel, "/jaxfeed.service.Dispatcher/WorkerHeartbeat", pb.WorkerHeartbeatResponse, None
    )
    self._heartbeat(self._request(), timeout=30, wait_for_ready=True)
    self._threads = [
      threading.Thread(target=self._heartbeat_loop, daemon=True),
      threading.Thread(target=self._accept_loop, daemon=True),
    ]
    for thread in self._threads:
      thread.start()

  def _request(self) -> pb.WorkerHeartbeatRequest:
    return pb.WorkerHeartbeatRequest(worker_address=self.address, data_address=self.data_address)

  def _heartbeat_loop(self) -> None:
    while not self._stop.wait(0.2):
      try:
        self._heartbeat(self._request(), timeout=5)
      except Exception:  # pylint: disable=broad-except  # the dispatcher may be stopping
        pass

  def _get_elements(self, request, context):
    del request
    yield from self._grpc_messages
    keepalive = pb.ElementChunk(keepalive=True).SerializeToString()
    while not self._stop.wait(delivery.KEEPALIVE_S) and context.is_active():
      yield keepalive  # held open, like a worker whose pipeline is slow

  def _ack_elements(self, request, context):
    del request, context
    return pb.AckElementsResponse()

  def _accept_loop(self) -> None:
    while not self._stop.is_set():
      try:
        conn, _ = self._listener.accept()
      except socket.timeout:
        continue
      except OSError:
        return
      self._connections.append(conn)
      thread = threading.Thread(target=self._serve_connection, args=(conn,), daemon=True)
      self._connection_threads.append(thread)
      thread.start()

  def _serve_connection(self, conn: socket.socket) -> None:
    try:
      conn.settimeout(10)
      (length,) = struct.unpack("<I", conn.recv(4, socket.MSG_WAITALL))
      conn.recv(length, socket.MSG_WAITALL)
      conn.sendall(self._socket_bytes)
      conn.settimeout(0.2)
      while not self._stop.is_set():  # held open; acks are read and dropped
        try:
          if not conn.recv(4096):
            return
        except socket.timeout:
          continue
    except OSError:
      pass

  def close(self) -> None:
    self._stop.set()
    self._listener.close()
    for thread in self._threads + self._connection_threads:
      thread.join(timeout=10)
    for conn in self._connections:
      conn.close()
    try:  # leave at once instead of after the dispatcher's heartbeat timeout
      self._heartbeat(
        pb.WorkerHeartbeatRequest(worker_address=self.address, leaving=True), timeout=5
      )
    except Exception:  # pylint: disable=broad-except
      pass
    self._channel.close()
    self._server.stop(timeout_s=1)

  def __enter__(self) -> "HostileWorker":
    return self

  def __exit__(self, *exc) -> None:
    self.close()
