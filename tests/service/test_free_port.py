"""The test clusters' fixed ports: none is handed out twice, none is ephemeral."""

from __future__ import annotations

import pathlib
import subprocess
import sys

from service_cluster import TESTS_DIR, _ephemeral_low, free_port, release_port


def test_ports_come_from_below_the_ephemeral_range_and_bind():
  ports = [free_port() for _ in range(20)]
  try:
    assert len(set(ports)) == len(ports)
    assert all(1024 <= p < _ephemeral_low() for p in ports), ports
  finally:
    for p in ports:
      release_port(p)


def test_another_process_never_gets_a_port_this_one_holds():
  held = [free_port() for _ in range(200)]
  try:
    code = (
      "import sys; sys.path.insert(0, %r)\n"
      "from service_cluster import free_port\n"
      "print(' '.join(str(free_port()) for _ in range(300)))" % str(TESTS_DIR)
    )
    out = subprocess.run(
      [sys.executable, "-c", code], check=True, capture_output=True, text=True, timeout=120
    ).stdout.split()
    assert len(out) == 300
    assert not set(map(int, out)) & set(held)
  finally:
    for p in held:
      release_port(p)


def test_a_released_port_can_be_handed_out_again(tmp_path: pathlib.Path):
  port = free_port()
  release_port(port)
  release_port(port)  # twice is harmless
  code = (
    "import sys; sys.path.insert(0, %r)\n"
    "import service_cluster as c\n"
    "c.random.SystemRandom.randrange = lambda self, a, b: %d\n"
    "print(c.free_port())" % (str(TESTS_DIR), port)
  )
  out = subprocess.run(
    [sys.executable, "-c", code], check=True, capture_output=True, text=True, timeout=60
  ).stdout.split()
  assert out == [str(port)]
