"""The chaos tests' fault-injecting TCP proxy does what they rely on."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from tcp_proxy import TcpProxy

pytestmark = pytest.mark.timeout(60)


class _EchoServer:
  def __init__(self):
    self.sock = socket.socket()
    self.sock.bind(("127.0.0.1", 0))
    self.sock.listen()
    self.address = "127.0.0.1:%d" % self.sock.getsockname()[1]
    self._conns = []
    self._thread = threading.Thread(target=self._serve, daemon=True)
    self._thread.start()

  def _serve(self):
    while True:
      try:
        conn, _ = self.sock.accept()
      except OSError:
        return
      self._conns.append(conn)
      threading.Thread(target=self._echo, args=(conn,), daemon=True).start()

  @staticmethod
  def _echo(conn):
    try:
      while data := conn.recv(4096):
        conn.sendall(data)
      conn.shutdown(socket.SHUT_WR)
    except OSError:
      pass

  def close(self):
    try:
      self.sock.shutdown(socket.SHUT_RDWR)  # wakes the accept; close alone does not
    except OSError:
      pass
    self.sock.close()
    for conn in self._conns:
      conn.close()
    self._thread.join(timeout=5)


@pytest.fixture
def echo():
  server = _EchoServer()
  yield server
  server.close()


def _connect(proxy: TcpProxy) -> socket.socket:
  host, port = proxy.address.rsplit(":", 1)
  conn = socket.create_connection((host, int(port)), timeout=10)
  return conn


def test_forwards_both_ways_and_passes_a_clean_close_on(echo):
  with TcpProxy(echo.address) as proxy, _connect(proxy) as conn:
    conn.sendall(b"hello")
    assert conn.recv(5) == b"hello"
    conn.shutdown(socket.SHUT_WR)
    assert conn.recv(5) == b""  # the server's close came through


def test_cut_resets_open_connections_and_later_ones_work(echo):
  with TcpProxy(echo.address) as proxy:
    with _connect(proxy) as conn:
      conn.sendall(b"a")
      assert conn.recv(1) == b"a"
      assert proxy.cut() == 1
      with pytest.raises(OSError):
        for _ in range(100):  # the reset may take a round trip to show
          conn.sendall(b"b")
          if not conn.recv(1):
            raise ConnectionResetError("closed")
          time.sleep(0.01)
    with _connect(proxy) as conn:
      conn.sendall(b"c")
      assert conn.recv(1) == b"c"


def test_stall_holds_bytes_and_resume_delivers_them(echo):
  with TcpProxy(echo.address) as proxy, _connect(proxy) as conn:
    proxy.stall()
    conn.sendall(b"held")
    conn.settimeout(0.5)
    with pytest.raises(socket.timeout):
      conn.recv(4)
    proxy.resume()
    conn.settimeout(10)
    got = b""
    while len(got) < 4:
      got += conn.recv(4)
    assert got == b"held"


def test_a_refused_target_resets_the_client():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    dead = "127.0.0.1:%d" % s.getsockname()[1]
  with TcpProxy(dead) as proxy:
    with pytest.raises(OSError):  # the reset may come while connecting
      with _connect(proxy) as conn:
        conn.settimeout(10)
        conn.sendall(b"x")
        if not conn.recv(1):
          raise ConnectionResetError("closed")


def test_cut_resets_a_client_that_waits_for_a_reply(echo):
  # Nothing flows when the cut comes: each pump waits in recv on its socket.
  with TcpProxy(echo.address) as proxy, _connect(proxy) as conn:
    conn.sendall(b"a")
    assert conn.recv(1) == b"a"
    assert proxy.cut() == 1
    conn.settimeout(5)
    with pytest.raises(ConnectionResetError):
      if not conn.recv(1):
        raise AssertionError("a clean close, not a reset")


def test_forget_leaves_the_client_unanswered_until_it_sends(echo):
  with TcpProxy(echo.address) as proxy:
    with _connect(proxy) as conn:
      conn.sendall(b"a")
      assert conn.recv(1) == b"a"
      assert proxy.forget() == 1
      conn.settimeout(0.5)
      with pytest.raises(socket.timeout):
        conn.recv(1)
      conn.settimeout(5)
      with pytest.raises(OSError):
        for _ in range(100):  # the reset may take a round trip to show
          conn.sendall(b"b")
          if not conn.recv(1):
            raise AssertionError("a clean close, not a reset")
    with _connect(proxy) as conn:
      conn.sendall(b"c")
      assert conn.recv(1) == b"c"
