"""A fault-injecting TCP proxy for the chaos tests.

`TcpProxy(target)` listens on a loopback address and forwards every
connection to `target`, byte for byte, in both directions. From outside the
code under test it can

* `cut()`: reset every open connection (both ends see ECONNRESET), as a
  broken network path would; later connections are forwarded again;
* `stall()`: stop forwarding (connections stay open, bytes wait in socket
  buffers, senders block once those fill), as a hung path or a full queue
  would; new connections are accepted but not connected on;
* `resume()`: forward again; nothing that waited is lost;
* `forget()`: drop every open connection without telling its client, as a
  middlebox that lost its connection state would: the server's end is
  reset, the client's end hears nothing more (what it sends is dropped)
  until it sends again, which is answered with a reset.

An end that closes cleanly is passed on as a half-close after everything it
sent, so a killed process's last bytes (which its kernel still sends) arrive.
"""

from __future__ import annotations

import socket
import struct
import threading

_CHUNK = 1 << 16
_CONNECT_TIMEOUT_S = 5.0
_POLL_S = 0.2


def _reset(sock: socket.socket) -> None:
  """Closes with an RST instead of a FIN (linger on, timeout 0).

  A pump blocked in `recv` on the socket keeps it open past `close()`
  (no RST goes out until that call returns), so the socket's read side is
  shut first, which wakes the pump.
  """
  try:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.shutdown(socket.SHUT_RD)
  except OSError:
    pass
  sock.close()


def _reset_once_it_sends(sock: socket.socket) -> None:
  """Drops what the peer sent so far, waits until it sends again (or closes),
  then resets it; at once if the socket was reset already."""
  try:
    sock.setblocking(False)
    while sock.recv(_CHUNK):
      pass
  except BlockingIOError:
    try:
      sock.setblocking(True)
      sock.recv(1)
    except OSError:
      pass
  except OSError:
    pass
  _reset(sock)


class _Link:
  """One proxied connection: a client socket, its upstream socket, two pumps."""

  def __init__(self, proxy: "TcpProxy", downstream: socket.socket):
    self._proxy = proxy
    self.downstream = downstream
    self.upstream: socket.socket | None = None
    self._lock = threading.Lock()
    self._open = 2  # directions still forwarding
    self.closed = False
    self.thread = threading.Thread(
      target=self._run, daemon=True, name=f"chaos-proxy-{proxy.address}"
    )
    self.thread.start()

  def _run(self) -> None:
    if not self._proxy.gate.wait_open(self):
      return
    try:
      host, port = self._proxy.target.rsplit(":", 1)
      upstream = socket.create_connection((host, int(port)), _CONNECT_TIMEOUT_S)
      upstream.settimeout(None)
    except OSError:  # as if the target refused: the client sees a reset
      self.abort()
      return
    with self._lock:
      if self.closed:  # cut while connecting
        _reset(upstream)
        return
      self.upstream = upstream
    back = threading.Thread(
      target=self._pump,
      args=(self.upstream, self.downstream),
      daemon=True,
      name=f"chaos-proxy-{self._proxy.address}-back",
    )
    back.start()
    self._pump(self.downstream, self.upstream)
    back.join()

  def _pump(self, source: socket.socket, sink: socket.socket) -> None:
    try:
      while True:
        data = source.recv(_CHUNK)
        if self.closed:  # cut or forgotten since: this end sent (or closed)
          _reset(source)
          return
        if not data:
          sink.shutdown(socket.SHUT_WR)  # pass the clean close on
          break
        if not self._proxy.gate.wait_open(self):
          _reset_once_it_sends(source)  # held, then cut or forgotten: dropped
          return
        sink.sendall(data)
    except OSError:
      if self.closed:  # cut or forgotten: this end goes too
        _reset(source)
      else:
        self.abort()  # one end broke: break the other one too
      return
    with self._lock:
      self._open -= 1
      done = self._open == 0
    if done:
      self.close()

  def abort(self) -> None:
    """Resets both ends (again, after `forget`: a reset socket stays closed)."""
    with self._lock:
      self.closed = True
    for sock in (self.downstream, self.upstream):
      if sock is not None:
        _reset(sock)

  def forget(self) -> None:
    """Resets the server's end; the client's end is reset once it sends."""
    with self._lock:
      if self.closed:
        return
      self.closed = True
    if self.upstream is not None:
      _reset(self.upstream)

  def close(self) -> None:
    with self._lock:
      if self.closed:
        return
      self.closed = True
    for sock in (self.downstream, self.upstream):
      if sock is not None:
        sock.close()


class _Gate:
  """Open: bytes flow. Shut: every pump waits (until opened, or its link ends)."""

  def __init__(self):
    self._open = threading.Event()
    self._open.set()

  def wait_open(self, link: _Link) -> bool:
    while not self._open.wait(_POLL_S):
      if link.closed:
        return False
    return not link.closed

  def shut(self) -> None:
    self._open.clear()

  def open(self) -> None:
    self._open.set()


class TcpProxy:
  """Forwards connections on `listen_host:listen_port` to `target` ("host:port").

  Use as a context manager or call `close()`; it ends every connection and
  thread it started.
  """

  def __init__(self, target: str, listen_host: str = "127.0.0.1", listen_port: int = 0):
    self.target = target
    self.gate = _Gate()
    self._lock = threading.Lock()
    self._links: list[_Link] = []
    self._stop = threading.Event()
    self.connections = 0  # accepted so far
    self._listener = socket.socket()
    self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    self._listener.bind((listen_host, listen_port))
    self._listener.listen(64)
    self._listener.settimeout(_POLL_S)
    host, port = self._listener.getsockname()[:2]
    self.address = f"{host}:{port}"
    self._acceptor = threading.Thread(
      target=self._accept, daemon=True, name=f"chaos-proxy-accept-{self.address}"
    )
    self._acceptor.start()

  def _accept(self) -> None:
    while not self._stop.is_set():
      try:
        conn, _ = self._listener.accept()
      except socket.timeout:
        continue
      except OSError:
        return
      conn.settimeout(None)
      conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
      with self._lock:
        if self._stop.is_set():
          _reset(conn)
          return
        # A forgotten link lives on until its client's end sends or closes.
        self._links = [link for link in self._links if link.thread.is_alive()]
        self._links.append(_Link(self, conn))
        self.connections += 1

  def _live_links(self) -> list[_Link]:
    with self._lock:
      return [link for link in self._links if not link.closed]

  def cut(self) -> int:
    """Resets every open connection; returns how many it cut."""
    links = self._live_links()
    for link in links:
      link.abort()
    return len(links)

  def forget(self) -> int:
    """Drops every open connection without telling its client (see the
    module docstring); returns how many it dropped."""
    links = self._live_links()
    for link in links:
      link.forget()
    return len(links)

  def stall(self) -> None:
    """Stops forwarding on every connection, open now or later."""
    self.gate.shut()

  def resume(self) -> None:
    self.gate.open()

  def close(self) -> None:
    self._stop.set()
    self.gate.open()
    self._listener.close()
    self._acceptor.join(timeout=10)
    with self._lock:
      links = list(self._links)
    for link in links:
      link.abort()
    for link in links:
      link.thread.join(timeout=10)

  def __enter__(self) -> "TcpProxy":
    return self

  def __exit__(self, *exc) -> None:
    self.close()
