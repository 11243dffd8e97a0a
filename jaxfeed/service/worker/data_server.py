"""The worker's end of the raw-socket data path (`data_socket`): its port.

The worker listens on its `data_address`, reads each connection's hello
without a thread, and streams the task's items to every client whose hello
passed; `ServerLink` is one connection as a client's stream sees it, and
reads the client's acknowledgments.
"""

from __future__ import annotations

import json
import logging
import select
import selectors
import socket
import ssl
import threading
import time
from typing import Any, Callable

from jaxfeed.service.protocol import rpc_errors
from jaxfeed.service.protocol import wire
from jaxfeed.service.protocol.data_socket import (
  ACK,
  FRAME_PREFIX,
  HELLO_LEN,
  KIND_END,
  KIND_ERROR,
  KIND_FRAME,
  KIND_KEEPALIVE,
  KIND_SPLIT_END,
  MAX_HELLO_BYTES,
  SPLIT_STOP,
  DataConnectionError,
)
from jaxfeed.service.worker import delivery

# A send that makes no progress this long ends the connection (the client
# reconnects and resumes).
_SEND_TIMEOUT_S = 60.0
_MAX_IOV = 512  # buffers per sendmsg; Linux allows 1024


def _send_all(sock: socket.socket, buffers: list) -> None:
  """Sends the buffers in order with scatter-gather writes (no joining copy)."""
  views = [memoryview(b).cast("B") for b in buffers]
  if isinstance(sock, ssl.SSLSocket):  # TLS encrypts record by record anyway
    for view in views:
      sock.sendall(view)
    return
  first = 0
  while first < len(views):
    sent = sock.sendmsg(views[first : first + _MAX_IOV])
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
      return HELLO_LEN.size - len(self.data)
    return self.length - len(self.data)

  def add(self, chunk: bytes) -> bool:
    """Takes received bytes; True once the whole hello is here."""
    self.data += chunk
    if self.length is None and len(self.data) == HELLO_LEN.size:
      (self.length,) = HELLO_LEN.unpack(self.data)
      self.data = bytearray()
      if self.length > MAX_HELLO_BYTES:
        raise DataConnectionError(
          f"Hello of {self.length} bytes exceeds {MAX_HELLO_BYTES}.", "INVALID_ARGUMENT"
        )
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
    whole = len(self._acks) // ACK.size * ACK.size
    if whole:
      (received,) = ACK.unpack_from(self._acks, whole - ACK.size)
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

  def __init__(
    self,
    host: str,
    authenticate: Callable[[dict], None] | None,
    serve: Callable[[dict, "ServerLink"], Any],
    ssl_context: ssl.SSLContext | None = None,
    max_connections: int = 512,
    max_pending_hellos: int = 256,
    hello_timeout_s: float = 5.0,
    goodbye: Callable[[dict], None] | None = None,
    port: int = 0,
  ):
    # authenticate(hello) raises DataConnectionError to refuse a client.
    self._authenticate = authenticate
    # goodbye(hello) takes an authenticated goodbye hello, on the accepting
    # thread (it must not block); raises DataConnectionError to refuse it.
    self._goodbye = goodbye
    self._ssl_context = ssl_context
    # serve(hello, link) -> generator of `delivery.Item`s and `delivery.Idle`s
    # that returns the statistics sent with the end of sequence (a dict or
    # None); `link` is the connection's ServerLink.
    self._serve = serve
    self._max_connections = max_connections
    self._max_pending = max_pending_hellos
    self._hello_timeout_s = hello_timeout_s
    self.errors = rpc_errors.ErrorCounts()  # refusals and failures, by status
    self._listener = socket.create_server((host, port), backlog=128)
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
      target=self._accept_loop, name="jaxfeed-data-accept", daemon=True
    )
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
        conn = self._ssl_context.wrap_socket(conn, server_side=True, do_handshake_on_connect=False)
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
            "connections, its most.",
            "RESOURCE_EXHAUSTED",
          )
        if self._stop.is_set():
          raise DataConnectionError("The worker is stopping.", "UNAVAILABLE")
        thread = threading.Thread(
          target=self._handle, args=(conn, hello), name="jaxfeed-data-conn", daemon=True
        )
        self._connections[conn] = thread
    except DataConnectionError as e:
      self._refuse(conn, e)
      conn.close()
      return
    except Exception as e:  # pylint: disable=broad-except
      # A check that failed on one peer's hello must not end the accept
      # loop: every later connection would hang.
      logging.exception("Checking a data connection's hello failed")
      self._refuse(conn, DataConnectionError(f"The hello could not be checked: {e}", "INTERNAL"))
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
      conn.send(FRAME_PREFIX.pack(kind, len(payload), 0, 0) + payload)
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
      if compression == wire.COMPRESSION_AUTO:
        compression = wire.resolve_compression(compression, "socket")
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
        if isinstance(item, delivery.Idle):  # a keepalive's round: the task's progress
          if time.monotonic() - last_sent >= delivery.KEEPALIVE_S:
            conn.sendall(FRAME_PREFIX.pack(KIND_KEEPALIVE, 0, item, 0))
            last_sent = time.monotonic()
          continue
        if item.frame is None:  # exactly-once: the split `item.round` ended
          conn.sendall(
            FRAME_PREFIX.pack(KIND_SPLIT_END, SPLIT_STOP.size, item.round, item.seq)
            + SPLIT_STOP.pack(item.split_stop)
          )
        else:
          frame = item.frame.encoded(compression)
          _send_all(
            conn, [FRAME_PREFIX.pack(KIND_FRAME, frame.nbytes, item.round, item.seq), *frame.parts]
          )
        last_sent = time.monotonic()
      conn.sendall(FRAME_PREFIX.pack(KIND_END, len(stats), 0, 0) + stats)
    except (DataConnectionError, Exception) as e:  # pylint: disable=broad-except
      status = getattr(e, "status", "INTERNAL")
      if isinstance(e, OSError) and not isinstance(e, DataConnectionError):
        return  # the connection broke (or a newer one of its client took over)
      if _peer_closed(conn):
        return  # the client left first (say, its task stopped after it closed)
      self.errors.add(rpc_errors.DATA_SOCKET, status)
      payload = json.dumps({"status": status, "message": str(e)}).encode()
      try:
        conn.sendall(FRAME_PREFIX.pack(KIND_ERROR, len(payload), 0, 0) + payload)
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
