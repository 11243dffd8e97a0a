"""A client reading from a hostile or broken worker fails with a clear error,
without allocating what the worker claims or waiting for bytes that never
come."""

from __future__ import annotations

import json
import resource
import struct
import time

import numpy as np
import pytest
import zstandard

import jaxfeed
from jaxfeed.service.protocol import element_chunks
from jaxfeed.service.protocol import wire
from fuzz_targets import socket_message as socket_message_of
from hostile_worker import HostileWorker
from service_cluster import ServiceProcess

pytestmark = pytest.mark.timeout(120)

ABSURD = 1 << 40  # a TiB: no client may allocate it on a peer's word


@pytest.fixture
def dispatcher():
  process = ServiceProcess("dispatcher", "--heartbeat_timeout_s=5")
  yield process
  process.stop()


def read_from(dispatcher, **options) -> None:
  dataset = (
    jaxfeed.Dataset.range(10).batch(2).distribute(dispatcher.address, timeout_s=30, **options)
  )
  with dataset.make_iterator() as iterator:
    list(iterator)


@pytest.mark.parametrize("data_transfer", ["grpc", "socket"])
def test_a_frame_longer_than_max_frame_bytes_fails_the_read_before_allocating(
  dispatcher, data_transfer
):
  chunk = element_chunks.encode([b"JFB1" + bytes(60)], frame_bytes=ABSURD)
  socket_message = socket_message_of(0, bytes(64), length=ABSURD)
  with HostileWorker(dispatcher.address, [chunk], socket_message):
    started = time.monotonic()
    with pytest.raises(wire.WireFormatError, match=f"{ABSURD}.*max_frame_bytes"):
      read_from(dispatcher, data_transfer=data_transfer)
    assert time.monotonic() - started < 60


@pytest.mark.parametrize("data_transfer", ["grpc", "socket"])
def test_a_frame_over_a_configured_max_frame_bytes_fails_the_read(dispatcher, data_transfer):
  frame = wire.encode({"x": np.zeros(4096)})
  chunk = element_chunks.encode([frame], frame_bytes=len(frame))
  socket_message = socket_message_of(0, frame)
  with HostileWorker(dispatcher.address, [chunk], socket_message):
    with pytest.raises(wire.WireFormatError, match="max_frame_bytes"):
      read_from(dispatcher, data_transfer=data_transfer, max_frame_bytes=16 << 10)


def zstd_bomb(size: int) -> bytes:
  """`size` zero bytes, zstd-compressed a MiB at a time (never all in memory)."""
  compressor = zstandard.ZstdCompressor(level=1).compressobj(size=size)
  zeros = bytes(1 << 20)
  parts = [compressor.compress(zeros) for _ in range(size >> 20)]
  return b"".join(parts) + compressor.flush()


def peak_rss_mb() -> float:
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def test_a_zstd_bomb_is_not_decompressed_past_the_declared_size(dispatcher):
  header = json.dumps(
    {
      "structure": None,
      "paths": [""],
      "leaves": [["<f8", [1], 0, 8]],
      "payload_bytes": 8,
      "compression": "zstd",
    }
  ).encode()
  frame = wire.MAGIC + struct.pack("<I", len(header)) + header + zstd_bomb(1 << 30)
  socket_message = socket_message_of(0, frame)
  with HostileWorker(dispatcher.address, [], socket_message):
    before = peak_rss_mb()
    with pytest.raises(wire.WireFormatError, match="more than 8 bytes"):
      read_from(dispatcher, data_transfer="socket", compression="zstd")
    assert peak_rss_mb() - before < 256
