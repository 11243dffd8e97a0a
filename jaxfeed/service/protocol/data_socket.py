"""The raw-socket data path beside gRPC: frames straight over TCP.

Python gRPC streams move a few hundred MB/s here, each frame copied several
times; a plain socket moves frames at memcpy-like speed, and the worker sends
them scatter-gather from the batch arrays. With TLS the socket is wrapped in
the deployment's certificates. A worker listens on a second port (its
`data_address`);
a client opens one connection per task and sends a hello, and the worker
streams the task's frames:

  client -> worker:  uint32 length | JSON {"token", "task_id", "compression",
                                            "consumer_index", "round",
                                            "client_id", "received", "window",
                                            "skip"}
                     then repeated uint64 received (acknowledgments)
  worker -> client:  repeated  uint8 kind | uint64 length | int64 round |
                               int64 seq | bytes
                     kind 0: a frame, 1: end of sequence (bytes = JSON of
                     the task's round statistics, possibly empty), 2: error
                     (bytes = JSON {"status", "message"}), 3: exactly-once
                     jobs: the split starting at `round` ended (bytes =
                     int64 where its positions stop),
                     4: keepalive (no bytes)

A client that leaves its job may instead open a connection whose hello
carries "goodbye" (its goodbye ticket from the dispatcher) with "token",
"task_id" and "client_id": the worker keeps the goodbye for its next
heartbeat, answers kind 1 (no bytes) or an error, and closes the connection
(see `send_goodbye`).

Frames and split ends are numbered items of the client's stream (`seq`);
the client acknowledges what it received and a new connection resumes
after it (see `jaxfeed.service.worker.delivery`).

The hello's "token" is the task's read ticket from the dispatcher (empty when
the deployment does not authenticate). TCP flow control bounds what is in
flight. The hello is length-limited, must arrive within a deadline and is
read without a thread; only an authenticated hello gets one, and their
number is capped, so garbage or idle connections on the port cost a socket
each until they are dropped.
"""

from __future__ import annotations

import functools
import json
import logging
import select
import selectors
import socket
import ssl
import struct
import threading
import time
from typing import Any, Callable

import numpy as np

from jaxfeed.service.protocol import rpc_errors
from jaxfeed.service.protocol import wire
from jaxfeed.service.worker import delivery

_HELLO_LEN = struct.Struct("<I")
_FRAME_PREFIX = struct.Struct("<BQqq")
_ACK = struct.Struct("<Q")
_SPLIT_STOP = struct.Struct("<q")
KIND_FRAME, KIND_END, KIND_ERROR, KIND_SPLIT_END, KIND_KEEPALIVE = 0, 1, 2, 3, 4
# A send that makes no progress this long ends the connection (the client
# reconnects and resumes).
_SEND_TIMEOUT_S = 60.0
MAX_HELLO_BYTES = 4096
# The longest body a client accepts from a worker, by message kind; frames
# are bounded by the reader's max_frame_bytes.
_MAX_BODY_BYTES = {KIND_END: 1 << 20, KIND_ERROR: 1 << 20, KIND_SPLIT_END: _SPLIT_STOP.size,
                   KIND_KEEPALIVE: 0}
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


class _PendingHello:
  """A connection whose hello is still arriving: a few bytes, no thread."""

  def __init__(self, deadline: float, handshaking: bool):
    self.deadline = deadline
    self.handshaking = handshaking
    self.length: int | None = None
    self.data = bytearray()

  def wanted(self) -> int:
    if self.length is None:
      return _HELLO_LEN.size - len(self.data)
    return self.length - len(self.data)

  def add(self, chunk: bytes) -> bool:
    """Takes received bytes; True once the whole hello is here."""
    self.data += chunk
    if self.length is None and len(self.data) == _HELLO_LEN.size:
      (self.length,) = _HELLO_LEN.unpack(self.data)
      self.data = bytearray()
      if self.length > MAX_HELLO_BYTES:
        raise DataConnectionError(
            f"Hello of {self.length} bytes exceeds {MAX_HELLO_BYTES}.", "INVALID_ARGUMENT")
    return self.length is not None and len(self.data) == self.length


def _peer_closed(conn: socket.socket) -> bool:
  """Whether the other end closed `conn` (unread acknowledgments are dropped:
  the connection is ending)."""
  try:
    while select.select([conn], [], [], 0)[0]:
      if not conn.recv(65536):
        return True
  except (OSError, ValueError):
    return True
  return False


class ServerLink:
  """The worker's side of one data connection, as a client stream sees it:
  `wait_for_ack` reads the client's acknowledgments into `on_ack`, `kick`
  ends the connection from another thread."""

  def __init__(self, conn: socket.socket, stop: threading.Event):
    self._conn = conn
    self._stop = stop
    self._acks = bytearray()
    self.on_ack: Callable[[int], None] = lambda received: None

  def is_active(self) -> bool:
    return not self._stop.is_set()

  def wait_for_ack(self, timeout_s: float) -> None:
    """Reads the acknowledgments that arrive within timeout_s."""
    conn = self._conn
    if not (isinstance(conn, ssl.SSLSocket) and conn.pending()):
      readable, _, _ = select.select([conn], [], [], timeout_s)
      if not readable:
        return
    data = conn.recv(4096)
    if not data:
      raise ConnectionResetError("The client closed the data connection.")
    self._acks += data
    whole = len(self._acks) // _ACK.size * _ACK.size
    if whole:
      (received,) = _ACK.unpack_from(self._acks, whole - _ACK.size)
      del self._acks[:whole]
      self.on_ack(received)

  def kick(self) -> None:
    try:
      self._conn.shutdown(socket.SHUT_RDWR)
    except OSError:
      pass


class DataServer:
  """Listens on a TCP port and streams task frames to connected clients.

  One thread accepts connections and reads their hellos without blocking
  (a connection costs no thread, and little memory, until its hello arrived
  within `hello_timeout_s` and passed `authenticate`); past
  `max_pending_hellos` the oldest waiting connection is dropped. At most
  `max_connections` connections stream at once, one thread each; a hello
  beyond that is answered RESOURCE_EXHAUSTED.
  """

  def __init__(self, host: str, authenticate: Callable[[dict], None] | None,
               serve: Callable[[dict, "ServerLink"], Any],
               ssl_context: ssl.SSLContext | None = None,
               max_connections: int = 512, max_pending_hellos: int = 256,
               hello_timeout_s: float = 5.0,
               goodbye: Callable[[dict], None] | None = None):
    # authenticate(hello) raises DataConnectionError to refuse a client.
    self._authenticate = authenticate
    # goodbye(hello) takes an authenticated goodbye hello, on the accepting
    # thread (it must not block); raises DataConnectionError to refuse it.
    self._goodbye = goodbye
    self._ssl_context = ssl_context
    # serve(hello, link) -> generator of `delivery.Item`s and IDLE (None)
    # that returns the statistics sent with the end of sequence (a dict or
    # None); `link` is the connection's ServerLink.
    self._serve = serve
    self._max_connections = max_connections
    self._max_pending = max_pending_hellos
    self._hello_timeout_s = hello_timeout_s
    self.errors = rpc_errors.ErrorCounts()  # refusals and failures, by status
    self._listener = socket.create_server((host, 0), backlog=128)
    self._listener.setblocking(False)
    self.port = self._listener.getsockname()[1]
    self._stop = threading.Event()
    self._lock = threading.Lock()
    self._connections: dict[socket.socket, threading.Thread] = {}
    self._pending: dict[socket.socket, _PendingHello] = {}  # oldest first
    self._selector = selectors.DefaultSelector()
    self._selector.register(self._listener, selectors.EVENT_READ, None)
    self._wake_reader, self._wake_writer = socket.socketpair()
    self._selector.register(self._wake_reader, selectors.EVENT_READ, None)
    self._accept_thread = threading.Thread(
        target=self._accept_loop, name="jaxfeed-data-accept", daemon=True)
    self._accept_thread.start()

  def _accept_loop(self) -> None:
    try:
      while not self._stop.is_set():
        for key, _ in self._selector.select(timeout=0.2):
          if key.fileobj is self._listener:
            self._accept_ready()
          elif key.data is not None:
            self._advance(key.fileobj, key.data)
        now = time.monotonic()
        for conn, pending in list(self._pending.items()):
          if pending.deadline < now:
            self._drop(conn)
    finally:
      for conn in list(self._pending):
        self._drop(conn)
      self._selector.close()

  def _accept_ready(self) -> None:
    for _ in range(64):  # then let the hellos already here advance
      try:
        conn, _ = self._listener.accept()
      except (BlockingIOError, InterruptedError):
        return
      except OSError:  # out of file descriptors: the oldest hello makes room
        if self._pending:
          self._drop(next(iter(self._pending)))
        else:
          self._stop.wait(0.05)  # the listener stays readable: do not spin
        return
      conn.setblocking(False)
      conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
      if len(self._pending) >= self._max_pending:
        self._drop(next(iter(self._pending)))
      handshaking = self._ssl_context is not None
      if handshaking:
        conn = self._ssl_context.wrap_socket(conn, server_side=True,
                                             do_handshake_on_connect=False)
      pending = _PendingHello(time.monotonic() + self._hello_timeout_s, handshaking)
      self._pending[conn] = pending
      self._selector.register(conn, selectors.EVENT_READ, pending)
      self._advance(conn, pending)  # TLS data may already wait in the socket

  def _drop(self, conn: socket.socket) -> None:
    self._pending.pop(conn, None)
    try:
      self._selector.unregister(conn)
    except (KeyError, ValueError, OSError):
      pass
    conn.close()

  def _advance(self, conn: socket.socket, pending: _PendingHello) -> None:
    """Reads what has arrived of a hello; hands the connection on when complete."""
    try:
      if pending.handshaking:
        try:
          conn.do_handshake()
        except ssl.SSLWantReadError:
          return
        except ssl.SSLWantWriteError:
          self._selector.modify(conn, selectors.EVENT_WRITE, pending)
          return
        pending.handshaking = False
        self._selector.modify(conn, selectors.EVENT_READ, pending)
      while True:
        try:
          chunk = conn.recv(pending.wanted())
        except (ssl.SSLWantReadError, BlockingIOError, InterruptedError):
          return
        if not chunk:
          raise DataConnectionError("Closed before its hello.")
        if pending.add(chunk):
          break
    except (OSError, ValueError) as e:  # not TLS, a refused certificate, garbage
      if isinstance(e, DataConnectionError) and e.status == "INVALID_ARGUMENT":
        self._refuse(conn, e)
      else:
        logging.debug("Data connection dropped before its hello: %s", e)
      self._drop(conn)
      return
    self._pending.pop(conn)
    self._selector.unregister(conn)
    try:
      hello = wire.decode_json_object(bytes(pending.data), "Hello")
    except ValueError as e:
      self._refuse(conn, DataConnectionError(f"Malformed hello: {e}", "INVALID_ARGUMENT"))
      conn.close()
      return
    try:
      if self._authenticate is not None:
        self._authenticate(hello)
      if "goodbye" in hello:
        if self._goodbye is None:
          raise DataConnectionError("This data socket takes no goodbyes.", "UNIMPLEMENTED")
        self._goodbye(hello)
        self._answer(conn, KIND_END, b"")
        conn.close()
        return
      with self._lock:
        if len(self._connections) >= self._max_connections:
          raise DataConnectionError(
              f"The worker's data socket already streams {self._max_connections} "
              "connections, its most.", "RESOURCE_EXHAUSTED")
        if self._stop.is_set():
          raise DataConnectionError("The worker is stopping.", "UNAVAILABLE")
        thread = threading.Thread(target=self._handle, args=(conn, hello),
                                  name="jaxfeed-data-conn", daemon=True)
        self._connections[conn] = thread
    except DataConnectionError as e:
      self._refuse(conn, e)
      conn.close()
      return
    except Exception as e:  # pylint: disable=broad-except
      # A check that failed on one peer's hello must not end the accept
      # loop: every later connection would hang.
      logging.exception("Checking a data connection's hello failed")
      self._refuse(conn, DataConnectionError(f"The hello could not be checked: {e}",
                                             "INTERNAL"))
      conn.close()
      return
    conn.setblocking(True)
    thread.start()

  def _refuse(self, conn: socket.socket, error: DataConnectionError) -> None:
    """Sends the error without blocking the accept loop (best effort)."""
    self.errors.add(rpc_errors.DATA_SOCKET, error.status)
    payload = json.dumps({"status": error.status, "message": str(error)}).encode()
    self._answer(conn, KIND_ERROR, payload)

  def _answer(self, conn: socket.socket, kind: int, payload: bytes) -> None:
    """Sends one message without blocking the accept loop (best effort)."""
    try:
      conn.send(_FRAME_PREFIX.pack(kind, len(payload), 0, 0) + payload)
      # Closing with unread input would reset the connection before the
      # peer reads the error: take what has arrived first.
      for _ in range(16):
        if not conn.recv(65536):
          break
    except (OSError, ValueError):
      pass

  def _handle(self, conn: socket.socket, hello: dict) -> None:
    try:
      conn.settimeout(_SEND_TIMEOUT_S)
      compression = hello.get("compression") or ""
      if compression not in wire.COMPRESSIONS:
        raise DataConnectionError(f"Unknown compression {compression!r}.", "INVALID_ARGUMENT")
      link = ServerLink(conn, self._stop)
      items = self._serve(hello, link)
      last_sent = time.monotonic()
      while True:
        link.wait_for_ack(0)
        try:
          item = next(items)
        except StopIteration as end:
          if end.value is None:  # superseded by a newer connection, or stopping
            return
          stats = json.dumps(end.value).encode() if end.value else b""
          break
        if item is delivery.IDLE:
          if time.monotonic() - last_sent >= delivery.KEEPALIVE_S:
            conn.sendall(_FRAME_PREFIX.pack(KIND_KEEPALIVE, 0, 0, 0))
            last_sent = time.monotonic()
          continue
        if item.frame is None:  # exactly-once: the split `item.round` ended
          conn.sendall(_FRAME_PREFIX.pack(KIND_SPLIT_END, _SPLIT_STOP.size, item.round,
                                          item.seq) + _SPLIT_STOP.pack(item.split_stop))
        else:
          frame = item.frame.encoded(compression)
          _send_all(conn, [_FRAME_PREFIX.pack(KIND_FRAME, frame.nbytes, item.round,
                                              item.seq), *frame.parts])
        last_sent = time.monotonic()
      conn.sendall(_FRAME_PREFIX.pack(KIND_END, len(stats), 0, 0) + stats)
    except (DataConnectionError, Exception) as e:  # pylint: disable=broad-except
      status = getattr(e, "status", "INTERNAL")
      if isinstance(e, OSError) and not isinstance(e, DataConnectionError):
        return  # the connection broke (or a newer one of its client took over)
      if _peer_closed(conn):
        return  # the client left first (say, its task stopped after it closed)
      self.errors.add(rpc_errors.DATA_SOCKET, status)
      payload = json.dumps({"status": status, "message": str(e)}).encode()
      try:
        conn.sendall(_FRAME_PREFIX.pack(KIND_ERROR, len(payload), 0, 0) + payload)
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

  def close(self) -> None:
    if self._stop.is_set():
      return
    self._stop.set()
    self._wake_writer.send(b"x")
    self._accept_thread.join(timeout=5)
    self._listener.close()
    self._wake_reader.close()
    self._wake_writer.close()
    with self._lock:
      connections = dict(self._connections)
    for conn in connections:
      try:
        conn.shutdown(socket.SHUT_RDWR)
      except OSError:
        pass
    for thread in connections.values():
      thread.join(timeout=5)


def _counting_failures(next_item: Callable) -> Callable:
  """`DataConnection.next_item` with its failures counted in
  `rpc_errors.CLIENT_ERRORS`, unless the connection was closed here."""

  @functools.wraps(next_item)
  def counted(self: "DataConnection") -> Any:
    try:
      return next_item(self)
    except DataConnectionError as e:
      if not (self._closed or self._stopped):  # pylint: disable=protected-access
        rpc_errors.CLIENT_ERRORS.add(rpc_errors.DATA_SOCKET, e.status)
      raise
  return counted


class DataConnection:
  """A client's connection to one task on a worker's data port.

  What the worker sends is bounded before it is allocated: a frame by
  `max_frame_bytes`, other messages by a small fixed size.
  """

  def __init__(self, address: str, hello: dict, timeout_s: float = 10.0,
               ssl_context: ssl.SSLContext | None = None,
               max_frame_bytes: int = wire.DEFAULT_MAX_FRAME_BYTES,
               read_timeout_s: float | None = None):
    self._max_frame_bytes = max_frame_bytes
    self._closed = False  # by close(): what fails after it was cancelled
    self._stopped = False  # by stop_receiving(): the reads that end after it were cancelled
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
    self._sock.settimeout(read_timeout_s)
    self._prefix = bytearray(_FRAME_PREFIX.size)
    self.end_stats: dict = {}
    self.split_stop = 0  # where the split of the last KIND_SPLIT_END stops

  @_counting_failures
  def next_item(self) -> tuple[int, int, np.ndarray | None, int] | None:
    """The next (kind, seq, frame, round): KIND_FRAME, KIND_SPLIT_END
    (exactly-once: the split starting at `round` ended; no frame) or
    KIND_KEEPALIVE; None at the end (then `end_stats` holds the task's
    statistics). After a KIND_SPLIT_END, `split_stop` is where the split's
    positions stop (0 if the worker did not say). Raises DataConnectionError."""
    try:
      kind, length, round_index, seq = _FRAME_PREFIX.unpack(
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
    if kind == KIND_ERROR:
      error = wire.decode_json_object(body, "Worker error message")
      raise DataConnectionError(str(error.get("message", "worker error")),
                                str(error.get("status", "INTERNAL")))
    if kind not in (KIND_FRAME, KIND_SPLIT_END, KIND_KEEPALIVE):
      raise DataConnectionError(f"Unknown data connection message kind {kind}.", "INTERNAL")
    if kind == KIND_SPLIT_END:
      self.split_stop = _SPLIT_STOP.unpack(body)[0] if len(body) == _SPLIT_STOP.size else 0
    return kind, seq, body if kind == KIND_FRAME else None, round_index

  def ack(self, received: int) -> None:
    """Tells the worker the items before `received` arrived."""
    try:
      self._sock.sendall(_ACK.pack(received))
    except OSError as e:
      raise DataConnectionError(f"Data connection failed: {e}") from e

  def stop_receiving(self) -> None:
    """What has arrived is still read, then `next_item` sees the end of the
    connection (DataConnectionError). Over TLS the connection closes now."""
    self._stopped = True  # the end it sees is this client's, not an error
    if isinstance(self._sock, ssl.SSLSocket):  # its shutdown drops the TLS layer
      self.close()
      return
    try:
      self._sock.shutdown(socket.SHUT_RD)
    except OSError:
      pass

  def close(self) -> None:
    self._closed = True
    try:
      self._sock.shutdown(socket.SHUT_RDWR)
    except OSError:
      pass
    self._sock.close()


def send_goodbye(address: str, hello: dict, timeout_s: float,
                 ssl_context: ssl.SSLContext | None = None) -> None:
  """Says a client's goodbye to the worker at `address` (`hello` holds
  "token", "task_id", "client_id" and "goodbye") and waits up to about
  2 x timeout_s for its answer. Raises DataConnectionError if the worker
  refused it, did not answer, or could not be reached."""
  try:
    conn = DataConnection(address, hello, timeout_s, ssl_context, max_frame_bytes=0,
                          read_timeout_s=timeout_s)
  except DataConnectionError:
    raise
  except OSError as e:  # could not connect: say so as the worker's refusals do
    raise DataConnectionError(f"Goodbye to {address} failed: {e}") from e
  try:
    if conn.next_item() is not None:
      raise DataConnectionError(f"Worker {address} answered a goodbye with data.", "INTERNAL")
  finally:
    conn.close()


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
