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
"task_id", "client_id" and optionally its last counts, "elements" and
"wait_s" (see ReleaseJobClientRequest): the worker keeps the goodbye for its next
heartbeat, answers kind 1 (no bytes) or an error, and closes the connection
(see `send_goodbye`).

Frames and split ends are numbered items of the client's stream (`seq`);
the client acknowledges what it received and a new connection resumes
after it (see `jaxfeed.service.worker.delivery`). This module is the client's
end (`DataConnection`); the worker's is `jaxfeed.service.worker.data_server`.

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
import socket
import ssl
import struct
from typing import Any, Callable

import numpy as np

from jaxfeed.service.protocol import rpc_errors
from jaxfeed.service.protocol import wire

HELLO_LEN = struct.Struct("<I")
FRAME_PREFIX = struct.Struct("<BQqq")
ACK = struct.Struct("<Q")
SPLIT_STOP = struct.Struct("<q")
KIND_FRAME, KIND_END, KIND_ERROR, KIND_SPLIT_END, KIND_KEEPALIVE = 0, 1, 2, 3, 4
MAX_HELLO_BYTES = 4096
# The longest body a client accepts from a worker, by message kind; frames
# are bounded by the reader's max_frame_bytes.
_MAX_BODY_BYTES = {
  KIND_END: 1 << 20,
  KIND_ERROR: 1 << 20,
  KIND_SPLIT_END: SPLIT_STOP.size,
  KIND_KEEPALIVE: 0,
}


class DataConnectionError(ConnectionError):
  """The data connection broke or the worker reported an error."""

  def __init__(self, message: str, status: str = "UNAVAILABLE"):
    super().__init__(message)
    self.status = status


def _recv_exact(
  sock: socket.socket, size: int, into: bytearray | None = None
) -> bytearray | np.ndarray:
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

  def __init__(
    self,
    address: str,
    hello: dict,
    timeout_s: float = 10.0,
    ssl_context: ssl.SSLContext | None = None,
    max_frame_bytes: int = wire.DEFAULT_MAX_FRAME_BYTES,
    read_timeout_s: float | None = None,
  ):
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
          f"TLS handshake with the data socket {address} failed: {e}"
        ) from e
    payload = json.dumps(hello).encode()
    self._sock.sendall(HELLO_LEN.pack(len(payload)) + payload)
    self._sock.settimeout(read_timeout_s)
    self._prefix = bytearray(FRAME_PREFIX.size)
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
      kind, length, round_index, seq = FRAME_PREFIX.unpack(
        _recv_exact(self._sock, FRAME_PREFIX.size, self._prefix)
      )
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
      raise DataConnectionError(
        str(error.get("message", "worker error")), str(error.get("status", "INTERNAL"))
      )
    if kind not in (KIND_FRAME, KIND_SPLIT_END, KIND_KEEPALIVE):
      raise DataConnectionError(f"Unknown data connection message kind {kind}.", "INTERNAL")
    if kind == KIND_SPLIT_END:
      self.split_stop = SPLIT_STOP.unpack(body)[0] if len(body) == SPLIT_STOP.size else 0
    return kind, seq, body if kind == KIND_FRAME else None, round_index

  def ack(self, received: int) -> None:
    """Tells the worker the items before `received` arrived."""
    try:
      self._sock.sendall(ACK.pack(received))
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


def send_goodbye(
  address: str, hello: dict, timeout_s: float, ssl_context: ssl.SSLContext | None = None
) -> None:
  """Says a client's goodbye to the worker at `address` (`hello` holds
  "token", "task_id", "client_id" and "goodbye") and waits up to about
  2 x timeout_s for its answer. Raises DataConnectionError if the worker
  refused it, did not answer, or could not be reached."""
  try:
    conn = DataConnection(
      address, hello, timeout_s, ssl_context, max_frame_bytes=0, read_timeout_s=timeout_s
    )
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
      f"{' (max_frame_bytes)' if kind == KIND_FRAME else ''}."
    )


def _stats_of(body: bytes) -> dict:
  if not body:
    return {}
  try:
    return wire.decode_json_object(body, "End-of-sequence statistics")
  except wire.WireFormatError as e:
    raise DataConnectionError(str(e), "INTERNAL") from e
