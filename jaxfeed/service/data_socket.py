"""The raw-socket data path beside gRPC: frames straight over TCP.

Python gRPC streams move a few hundred MB/s here, each frame copied several
times; a plain socket moves frames at memcpy-like speed, and the worker sends
them scatter-gather from the batch arrays. With TLS the socket is wrapped in
the deployment's certificates. A worker listens on a second port (its
`data_address`);
a client opens one connection per task and sends a hello, and the worker
streams the task's frames:

  client -> worker:  uint32 length | JSON {"token", "task_id", "compression",
                                            "consumer_index", "round"}
  worker -> client:  repeated  uint8 kind | uint64 length | int64 round | bytes
                     kind 0: a frame, 1: end of sequence (bytes = JSON of
                     the task's round statistics, possibly empty), 2: error
                     (bytes = JSON {"status", "message"}), 3: exactly-once
                     jobs: the split starting at `round` ended (no bytes)

TCP flow control bounds what is in flight. The hello is length-limited and
validated, so garbage on the port only closes that connection.
"""

from __future__ import annotations

import hmac
import json
import logging
import socket
import ssl
import struct
import threading
from typing import Any, Callable

import numpy as np

from jaxfeed.service import wire

_HELLO_LEN = struct.Struct("<I")
_FRAME_PREFIX = struct.Struct("<BQq")
KIND_FRAME, KIND_END, KIND_ERROR, KIND_SPLIT_END = 0, 1, 2, 3
MAX_HELLO_BYTES = 4096
# The longest body a client accepts from a worker, by message kind; frames
# are bounded by the reader's max_frame_bytes.
_MAX_BODY_BYTES = {KIND_END: 1 << 20, KIND_ERROR: 1 << 20, KIND_SPLIT_END: 0}
_MAX_IOV = 512  # buffers per sendmsg; Linux allows 1024


class DataConnectionError(ConnectionError):
  """The data connection broke or the worker reported an error."""

  def __init__(self, message: str, status: str = "UNAVAILABLE"):
    super().__init__(message)
    self.status = status


def _recv_exact(sock: socket.socket, size: int,
                into: bytearray | None = None) -> bytearray | np.ndarray:
  # np.empty, not bytearray(size): a frame is megabytes that the socket
  # overwrites at once, so zero-filling it first is wasted memory traffic.
  buf = into if into is not None else np.empty(size, np.uint8)
  view = memoryview(buf)
  got = 0
  while got < size:
    n = sock.recv_into(view[got:], size - got)
    if n == 0:
      raise DataConnectionError(f"Data connection closed after {got} of {size} bytes.")
    got += n
  return buf


def _send_all(sock: socket.socket, buffers: list) -> None:
  """Sends the buffers in order with scatter-gather writes (no joining copy)."""
  views = [memoryview(b).cast("B") for b in buffers]
  if isinstance(sock, ssl.SSLSocket):  # TLS encrypts record by record anyway
    for view in views:
      sock.sendall(view)
    return
  first = 0
  while first < len(views):
    sent = sock.sendmsg(views[first:first + _MAX_IOV])
    while sent:
      head = views[first]
      if sent < head.nbytes:
        views[first] = head[sent:]
        break
      sent -= head.nbytes
      first += 1
    while first < len(views) and not views[first].nbytes:
      first += 1


class DataServer:
  """Listens on a TCP port and streams task frames to connected clients."""

  def __init__(self, host: str, token: str | None,
               serve: Callable[[dict, Callable[[], bool]], Any],
               ssl_context: ssl.SSLContext | None = None):
    self._token = token
    self._ssl_context = ssl_context
    # serve(hello, is_active) -> generator of (wire.Frame, round) that returns
    # the statistics sent with the end of sequence (a dict or None).
    self._serve = serve
    self._listener = socket.create_server((host, 0))
    self._listener.settimeout(0.2)
    self.port = self._listener.getsockname()[1]
    self._stop = threading.Event()
    self._lock = threading.Lock()
    self._connections: dict[socket.socket, threading.Thread] = {}
    self._accept_thread = threading.Thread(
        target=self._accept_loop, name="jaxfeed-data-accept", daemon=True)
    self._accept_thread.start()

  def _accept_loop(self) -> None:
    while not self._stop.is_set():
      try:
        conn, _ = self._listener.accept()
      except socket.timeout:
        continue
      except OSError:
        return
      conn.settimeout(None)
      conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
      thread = threading.Thread(target=self._handle, args=(conn,),
                                name="jaxfeed-data-conn", daemon=True)
      with self._lock:
        if self._stop.is_set():
          conn.close()
          return
        self._connections[conn] = thread
      thread.start()

  def _handle(self, conn: socket.socket) -> None:
    try:
      conn.settimeout(10)
      if self._ssl_context is not None:
        try:
          conn = self._wrap(conn)
        except (OSError, ValueError) as e:  # not TLS, a refused certificate, a timeout
          logging.info("TLS handshake on the data socket failed: %s", e)
          return
      (length,) = _HELLO_LEN.unpack(_recv_exact(conn, _HELLO_LEN.size))
      if length > MAX_HELLO_BYTES:
        raise DataConnectionError(f"Hello of {length} bytes exceeds {MAX_HELLO_BYTES}.",
                                  "INVALID_ARGUMENT")
      try:
        hello = wire.decode_json_object(_recv_exact(conn, length), "Hello")
      except ValueError as e:
        raise DataConnectionError(f"Malformed hello: {e}", "INVALID_ARGUMENT") from e
      conn.settimeout(None)
      if self._token and not hmac.compare_digest(
          str(hello.get("token", "")).encode(), self._token.encode()):
        raise DataConnectionError("Missing or wrong auth token.", "UNAUTHENTICATED")
      compression = hello.get("compression") or ""
      if compression not in wire.COMPRESSIONS:
        raise DataConnectionError(f"Unknown compression {compression!r}.", "INVALID_ARGUMENT")
      is_active = lambda: not self._stop.is_set()
      frames = self._serve(hello, is_active)
      while True:
        try:
          frame, round_index = next(frames)
        except StopIteration as end:
          stats = json.dumps(end.value).encode() if end.value else b""
          break
        if frame is None:  # exactly-once: the split `round_index` ended
          conn.sendall(_FRAME_PREFIX.pack(KIND_SPLIT_END, 0, round_index))
          continue
        frame = frame.encoded(compression)
        _send_all(conn, [_FRAME_PREFIX.pack(KIND_FRAME, frame.nbytes, round_index),
                         *frame.parts])
      conn.sendall(_FRAME_PREFIX.pack(KIND_END, len(stats), 0) + stats)
    except (DataConnectionError, Exception) as e:  # pylint: disable=broad-except
      status = getattr(e, "status", "INTERNAL")
      if isinstance(e, (BrokenPipeError, ConnectionResetError)):
        return
      payload = json.dumps({"status": status, "message": str(e)}).encode()
      try:
        conn.sendall(_FRAME_PREFIX.pack(KIND_ERROR, len(payload), 0) + payload)
        # Closing with unread input would reset the connection before the
        # peer reads the error: half-close, then drain briefly.
        conn.shutdown(socket.SHUT_WR)
        conn.settimeout(1.0)
        for _ in range(64):
          if not conn.recv(65536):
            break
      except OSError:
        pass
      if status == "INTERNAL":
        logging.warning("Data connection failed: %s", e)
    finally:
      with self._lock:
        self._connections.pop(conn, None)
      conn.close()

  def _wrap(self, conn: socket.socket) -> ssl.SSLSocket:
    tls_conn = self._ssl_context.wrap_socket(conn, server_side=True)
    with self._lock:  # close() must shut the wrapped socket down
      thread = self._connections.pop(conn, None)
      if thread is not None:
        self._connections[tls_conn] = thread
    return tls_conn

  def close(self) -> None:
    if self._stop.is_set():
      return
    self._stop.set()
    self._listener.close()
    self._accept_thread.join(timeout=5)
    with self._lock:
      connections = dict(self._connections)
    for conn in connections:
      try:
        conn.shutdown(socket.SHUT_RDWR)
      except OSError:
        pass
    for thread in connections.values():
      thread.join(timeout=5)


class DataConnection:
  """A client's connection to one task on a worker's data port.

  What the worker sends is bounded before it is allocated: a frame by
  `max_frame_bytes`, other messages by a small fixed size.
  """

  def __init__(self, address: str, hello: dict, timeout_s: float = 10.0,
               ssl_context: ssl.SSLContext | None = None,
               max_frame_bytes: int = wire.DEFAULT_MAX_FRAME_BYTES):
    self._max_frame_bytes = max_frame_bytes
    host, port = address.rsplit(":", 1)
    self._sock = socket.create_connection((host, int(port)), timeout=timeout_s)
    self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if ssl_context is not None:
      try:
        self._sock = ssl_context.wrap_socket(self._sock, server_hostname=host)
      except (OSError, ValueError) as e:
        self._sock.close()
        raise DataConnectionError(
            f"TLS handshake with the data socket {address} failed: {e}") from e
    payload = json.dumps(hello).encode()
    self._sock.sendall(_HELLO_LEN.pack(len(payload)) + payload)
    self._sock.settimeout(None)
    self._prefix = bytearray(_FRAME_PREFIX.size)
    self.end_stats: dict = {}

  def next_frame(self) -> tuple[np.ndarray | None, int] | None:
    """The next (frame, round); None at the end (then `end_stats` holds the
    task's statistics). Exactly-once jobs: (None, split start) when a split
    ended. Raises DataConnectionError."""
    try:
      kind, length, round_index = _FRAME_PREFIX.unpack(
          _recv_exact(self._sock, _FRAME_PREFIX.size, self._prefix))
      _check_length(kind, length, self._max_frame_bytes)
      body = _recv_exact(self._sock, length)
      if kind == KIND_END:
        self.end_stats = _stats_of(bytes(body))
        return None
    except OSError as e:
      if isinstance(e, DataConnectionError):
        raise
      raise DataConnectionError(f"Data connection failed: {e}") from e
    if kind == KIND_SPLIT_END:
      return None, round_index
    if kind == KIND_ERROR:
      error = wire.decode_json_object(body, "Worker error message")
      raise DataConnectionError(str(error.get("message", "worker error")),
                                str(error.get("status", "INTERNAL")))
    return body, round_index

  def close(self) -> None:
    try:
      self._sock.shutdown(socket.SHUT_RDWR)
    except OSError:
      pass
    self._sock.close()


def _check_length(kind: int, length: int, max_frame_bytes: int) -> None:
  """Checks a message's kind and length before its body is allocated."""
  limit = max_frame_bytes if kind == KIND_FRAME else _MAX_BODY_BYTES.get(kind)
  if limit is None:
    raise wire.WireFormatError(f"Data connection sent a message of unknown kind {kind}.")
  if length > limit:
    raise wire.WireFormatError(
        f"Data connection sent a message of kind {kind} with {length} bytes; "
        f"allowed are at most {limit}"
        f"{' (max_frame_bytes)' if kind == KIND_FRAME else ''}.")


def _stats_of(body: bytes) -> dict:
  if not body:
    return {}
  try:
    return wire.decode_json_object(body, "End-of-sequence statistics")
  except wire.WireFormatError as e:
    raise DataConnectionError(str(e), "INTERNAL") from e
