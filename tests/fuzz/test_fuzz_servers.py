"""Real dispatcher and worker processes fed garbage on every port stay up,
answer within bounded time, do not grow without bound and keep serving."""

from __future__ import annotations

import json
import socket
import struct
import time

import grpc
import numpy as np
import psutil
import pytest

import jaxfeed
from jaxfeed.service.protocol import data_socket
from jaxfeed.service.protocol.protos import service_pb2 as pb
from fuzz_targets import SOCKET_PREFIX
from server_fuzz import ServerFuzzer
from service_cluster import ServiceProcess

pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def servers():
  dispatcher = ServiceProcess("dispatcher", "--heartbeat_timeout_s=3")
  worker = None
  try:
    worker = ServiceProcess(
      "worker", f"--dispatcher_address={dispatcher.address}", "--heartbeat_interval_s=0.2"
    )
    yield dispatcher, worker
  finally:
    if worker is not None:
      worker.stop()
    dispatcher.stop()


def rss_mb(process: ServiceProcess) -> float:
  return psutil.Process(process.proc.pid).memory_info().rss / (1 << 20)


def read_one_epoch(dispatcher: ServiceProcess) -> None:
  dataset = jaxfeed.Dataset.range(20).batch(5)
  with dataset.distribute(dispatcher.address, timeout_s=60).make_iterator() as iterator:
    batches = list(iterator)
  assert np.concatenate(batches).tolist() == list(range(20))


def test_fuzzed_servers_stay_up_answer_in_bounded_time_and_keep_serving(servers):
  dispatcher, worker = servers
  read_one_epoch(dispatcher)  # warm: what serving allocates anyway
  rss_before = {p: rss_mb(p) for p in servers}
  alive = lambda: all(p.proc.poll() is None for p in servers)
  fuzzer = ServerFuzzer(dispatcher.address, worker.address, worker.data_address, seed=11)
  try:
    fuzzer.run(250, alive)
  finally:
    fuzzer.close()
  assert alive(), fuzzer.outcomes
  answers = " ".join(fuzzer.outcomes)
  assert "INTERNAL" not in answers, fuzzer.outcomes  # every refusal says what was wrong
  assert "INVALID_ARGUMENT" in answers and "data socket error INVALID_ARGUMENT" in answers
  # Specs the decoder refuses here were refused by the worker too.
  assert "spec on worker" in answers and "spec on worker OK" not in answers, fuzzer.outcomes
  assert fuzzer.slowest_s < 30, fuzzer.outcomes
  for process, before in rss_before.items():
    assert rss_mb(process) - before < 256, (process.proc.args, before, rss_mb(process))
  read_one_epoch(dispatcher)


def test_a_get_elements_with_a_negative_chunk_size_is_refused_not_looped_on(servers):
  dispatcher, worker = servers
  fuzzer = ServerFuzzer(dispatcher.address, worker.address, worker.data_address)
  fuzzer.close()
  request = pb.GetElementsRequest(task_id=fuzzer.hello["task_id"], max_chunk_bytes=-1)
  rss_before = rss_mb(worker)
  with grpc.insecure_channel(worker.address) as channel:
    call = channel.unary_stream("/jaxfeed.service.Worker/GetElements")
    with pytest.raises(grpc.RpcError) as info:
      list(call(request.SerializeToString(), timeout=20))
  assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value
  assert "chunk size" in info.value.details()
  time.sleep(1)  # a worker thread still looping would keep growing
  assert rss_mb(worker) - rss_before < 64
  read_one_epoch(dispatcher)


def test_a_hello_nested_too_deeply_gets_invalid_argument(servers):
  _, worker = servers
  body = b'{"task_id": ' + b"[" * 2000 + b"]" * 2000 + b"}"
  host, port = worker.data_address.rsplit(":", 1)
  with socket.create_connection((host, int(port)), timeout=10) as conn:
    conn.sendall(struct.pack("<I", len(body)) + body)
    reply = b""
    while chunk := conn.recv(4096):
      reply += chunk
  kind, length, _, _ = SOCKET_PREFIX.unpack_from(reply)
  assert kind == 2
  assert json.loads(reply[SOCKET_PREFIX.size : SOCKET_PREFIX.size + length])["status"] == (
    "INVALID_ARGUMENT"
  )


@pytest.mark.parametrize(
  "bad",
  [
    {"client_id": "7"},
    {"client_id": 0},
    {"client_id": -3},
    {"client_id": True},
    {"client_id": 1 << 70},
    {"goodbye": ["x"]},
    {"goodbye": None},
    {"goodbye": "a" * 129},
    {"goodbye": "\ud800"},
    {"goodbye": "g" * 64},
    {"task_id": "1"},
    {"elements": -1},
    {"elements": "5"},
    {"elements": 1 << 70},
    {"elements": True},
    {"wait_s": -0.5},
    {"wait_s": float("nan")},
    {"wait_s": "1"},
    {"wait_s": float("inf")},
  ],
)
def test_a_malformed_goodbye_is_refused_and_the_worker_keeps_serving(servers, bad):
  dispatcher, worker = servers
  fuzzer = ServerFuzzer(dispatcher.address, worker.address, worker.data_address)
  fuzzer.close()
  with pytest.raises(data_socket.DataConnectionError) as refused:
    data_socket.send_goodbye(worker.data_address, {**fuzzer.goodbye_hello, **bad}, 10.0)
  assert refused.value.status == "INVALID_ARGUMENT", refused.value
  read_one_epoch(dispatcher)
