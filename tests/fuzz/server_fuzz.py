"""Sends mutated, garbage, truncated and oversized messages to every port of
running dispatcher and worker processes.

`ServerFuzzer.run` makes one case at a time against one of: each gRPC method
of the dispatcher and the worker (mutations of valid requests, random bytes,
truncations, a message over the size limit), the gRPC ports as raw TCP
(garbage instead of HTTP/2), the worker's data socket (mutated hellos,
absurd hello lengths, truncated and stalled hellos), and the worker's spec
decoder (mutated dataset specs registered and run as jobs). Every case has a bounded
time; what the servers answered is counted by port and answer.
"""

from __future__ import annotations

import collections
import json
import random
import socket
import struct
import time
from typing import Callable

import grpc

import jaxfeed
from jaxfeed.service.protocol import spec
from jaxfeed.service.protocol.protos import service_pb2 as pb
from jaxfeed.service.worker import delivery

import fuzz_targets
from fuzz_targets import json_dumps, mutate_bytes, mutate_json

_DISPATCHER = "/jaxfeed.service.Dispatcher/"
_WORKER = "/jaxfeed.service.Worker/"
CALL_TIMEOUT_S = 10.0
_HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"


class ServerFuzzer:
  """Fuzzes a dispatcher at `dispatcher` and a worker at `worker` /
  `worker_data` (host:port each), which must serve without auth token."""

  def __init__(
    self,
    dispatcher: str,
    worker: str,
    worker_data: str,
    seed: int = 0,
    max_message_bytes: int = 64 << 20,
  ):
    self.dispatcher, self.worker, self.worker_data = dispatcher, worker, worker_data
    self.rng = random.Random(seed)
    self.max_message_bytes = max_message_bytes
    options = [
      ("grpc.max_send_message_length", 2 * max_message_bytes),
      ("grpc.max_receive_message_length", 2 * max_message_bytes),
    ]
    self._channels = {
      address: grpc.insecure_channel(address, options=options) for address in (dispatcher, worker)
    }
    self.outcomes: collections.Counter = collections.Counter()
    self.slowest_s = 0.0
    self.cases = 0
    self._seeds = self._make_seeds()
    self._spec_seeds = fuzz_targets.spec_corpus()
    self._specs_sent = 0

  def close(self) -> None:
    for channel in self._channels.values():
      channel.close()

  # -- seeds: valid requests for a live job ----------------------------------
  def _unary(self, method: str, request) -> bytes:
    call = self._channels[self.dispatcher].unary_unary(_DISPATCHER + method)
    return call(request.SerializeToString(), timeout=CALL_TIMEOUT_S, wait_for_ready=True)

  def _make_seeds(self) -> dict[tuple[str, str], list[bytes]]:
    dataset_def = spec.to_dataset_def(jaxfeed.Dataset.range(400).batch(4).node)
    dataset_id = pb.RegisterDatasetResponse.FromString(
      self._unary("RegisterDataset", pb.RegisterDatasetRequest(dataset=dataset_def))
    ).dataset_id
    job_request = pb.GetOrCreateJobRequest(
      dataset_id=dataset_id, sharding_policy="OFF", job_name="fuzz"
    )
    job = pb.GetOrCreateJobResponse.FromString(self._unary("GetOrCreateJob", job_request))
    heartbeat = pb.ClientHeartbeatRequest(job_id=job.job_id, client_id=job.client_id)
    deadline = time.monotonic() + 60
    tasks = []
    while not tasks and time.monotonic() < deadline:
      tasks = pb.ClientHeartbeatResponse.FromString(self._unary("ClientHeartbeat", heartbeat)).tasks
      time.sleep(0.1)
    if not tasks:
      raise TimeoutError("The worker got no task of the fuzzer's job.")
    task_id = tasks[0].task_id
    self.hello = {
      "token": "",
      "task_id": task_id,
      "compression": "",
      "consumer_index": 0,
      "round": 0,
      "client_id": job.client_id,
      "received": 0,
      "window": delivery.DEFAULT_WINDOW,
    }
    # A client's goodbye on the data socket (see data_socket.send_goodbye).
    self.goodbye_hello = {
      "token": "",
      "task_id": task_id,
      "client_id": job.client_id,
      "goodbye": "0" * 64,
    }
    d = lambda method, *requests: (
      (self.dispatcher, _DISPATCHER + method),
      [r.SerializeToString() for r in requests],
    )
    return dict(
      [
        d("RegisterDataset", pb.RegisterDatasetRequest(dataset=dataset_def)),
        d("GetDatasetDef", pb.GetDatasetDefRequest(dataset_id=dataset_id)),
        d(
          "GetOrCreateJob",
          job_request,
          pb.GetOrCreateJobRequest(
            dataset_id=dataset_id, sharding_policy="DYNAMIC", exactly_once=True
          ),
        ),
        d(
          "ClientHeartbeat",
          pb.ClientHeartbeatRequest(
            job_id=job.job_id,
            client_id=job.client_id,
            acked_splits=[0, 4],
            elements_consumed=3,
            consumer_wait_s=0.5,
            read_elapsed_s=1.0,
            buffer_fill=0.5,
          ),
        ),
        d("ReleaseJobClient", pb.ReleaseJobClientRequest(job_id=job.job_id, client_id=987654)),
        # A worker that is not there, so the real one keeps its tasks.
        d(
          "WorkerHeartbeat",
          pb.WorkerHeartbeatRequest(
            worker_address="127.0.0.1:9",
            data_address="127.0.0.1:9",
            current_tasks=[1],
            finished_tasks=[2],
            client_goodbyes=[
              pb.ClientGoodbye(job_id=job.job_id, client_id=987654, ticket="0" * 64)
            ],
          ),
        ),
        d("GetSplits", pb.GetSplitsRequest(job_id=job.job_id, task_id=task_id, max_ranges=2)),
        (
          (self.worker, _WORKER + "GetElements"),
          [
            pb.GetElementsRequest(
              task_id=task_id,
              max_chunk_bytes=4096,
              client_id=job.client_id,
              window=delivery.DEFAULT_WINDOW,
            ).SerializeToString()
          ],
        ),
        (
          (self.worker, _WORKER + "AckElements"),
          [
            pb.AckElementsRequest(
              task_id=task_id, client_id=job.client_id, received=2
            ).SerializeToString()
          ],
        ),
      ]
    )

  # -- cases -----------------------------------------------------------------------
  def _grpc_case(self) -> str:
    (address, method), seeds = self.rng.choice(list(self._seeds.items()))
    seed = self.rng.choice(seeds)
    kind = self.rng.random()
    if kind < 0.7:
      payload = mutate_bytes(seed, self.rng)
    elif kind < 0.8:
      payload = self.rng.randbytes(self.rng.choice((1, 16, 1000)))
    elif kind < 0.9:
      payload = seed[: self.rng.randrange(len(seed) + 1)]
    elif kind < 0.99:
      payload = seed + self.rng.randbytes(self.rng.choice((1, 8, 100)))
    else:
      payload = bytes(self.max_message_bytes + 1)
    channel = self._channels[address]
    try:
      if method.endswith("GetElements"):
        call = channel.unary_stream(method)(payload, timeout=CALL_TIMEOUT_S)
        for i, _ in enumerate(call):  # a few messages are enough
          if i == 3:
            call.cancel()
            break
        answer = "OK"
      else:
        channel.unary_unary(method)(payload, timeout=CALL_TIMEOUT_S)
        answer = "OK"
    except grpc.RpcError as e:
      answer = e.code().name
    return f"{method.rsplit('/', 1)[1]} {answer}"

  def _tcp_exchange(
    self, address: str, data: bytes, linger_s: float = 2.0, read_limit: int = 1 << 20
  ) -> str:
    """Sends `data`, reads until the server closes, `linger_s` passes or
    `read_limit` bytes came; says which."""
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=CALL_TIMEOUT_S) as conn:
      try:
        conn.sendall(data)
      except OSError:
        return "reset"
      conn.settimeout(linger_s)
      got, first = 0, b""
      try:
        while got < read_limit:
          chunk = conn.recv(65536)
          if not chunk:
            break
          first = first or chunk
          got += len(chunk)
        else:
          return "streamed"
      except socket.timeout:
        return "held open"
      except OSError:
        return "reset"
    prefix = fuzz_targets.SOCKET_PREFIX
    if address == self.worker_data and len(first) >= prefix.size:
      kind, length, _, _ = prefix.unpack_from(first)
      if kind == 2:
        try:
          error = json.loads(first[prefix.size : prefix.size + length])
        except ValueError:
          return "error (unreadable)"
        if error.get("status") == "INTERNAL":  # a bug: say which
          return f"error INTERNAL: {error.get('message', '')[:80]}"
        return f"error {error.get('status')}"
      return f"kind {kind}"
    return "closed"

  def _raw_grpc_port_case(self) -> str:
    address = self.rng.choice((self.dispatcher, self.worker))
    kind = self.rng.randrange(3)
    if kind == 0:
      data = self.rng.randbytes(self.rng.choice((1, 100, 10000)))
    elif kind == 1:
      data = _HTTP2_PREFACE[: self.rng.randrange(len(_HTTP2_PREFACE))]
    else:  # the preface, then a frame header announcing 16 MiB, with few bytes
      data = (
        _HTTP2_PREFACE
        + b"\xff\xff\xff"
        + bytes([self.rng.randrange(10)])
        + bytes(4)
        + (self.rng.randbytes(100))
      )
    return f"raw tcp {self._tcp_exchange(address, data, linger_s=0.2)}"

  def _data_socket_case(self) -> str:
    kind = self.rng.randrange(6)
    if kind <= 1:  # a mutated hello (1: of a goodbye)
      hello = json.loads(json.dumps(self.goodbye_hello if kind else self.hello))
      body = json_dumps(mutate_json(hello, self.rng))[:8192]
      data = struct.pack("<I", len(body)) + body
    elif kind == 2:
      body = json.dumps(self.hello).encode()
      data = mutate_bytes(struct.pack("<I", len(body)) + body, self.rng)
    elif kind == 3:  # an absurd hello length, then a few bytes
      data = struct.pack("<I", self.rng.choice((4097, 1 << 20, (1 << 32) - 1))) + b"{}"
    elif kind == 4 and self.rng.random() < 0.5:  # nested deeper than a parser recurses
      depth = self.rng.choice((500, 1000, 2000))
      body = b'{"task_id": ' + b"[" * depth + b"]" * depth + b"}"
      data = struct.pack("<I", len(body)) + body
    elif kind == 4:  # a hello cut short
      body = json.dumps(self.hello).encode()
      data = (struct.pack("<I", len(body)) + body)[: self.rng.randrange(len(body) + 4)]
    else:
      data = self.rng.randbytes(self.rng.choice((1, 8, 5000)))
    return f"data socket {self._tcp_exchange(self.worker_data, data, linger_s=0.2)}"

  def _spec_case(self) -> str:
    """A mutated spec the decoder here refuses, run as a job: the worker must
    refuse it too, with a clear status. (Specs that do decode are not sent:
    what a valid pipeline may compute is not this fuzzer's business.)"""
    for _ in range(20):
      try:
        dataset_def = pb.DatasetDef.FromString(
          fuzz_targets.mutate_spec(self.rng.choice(self._spec_seeds), self.rng)
        )
        spec.from_dataset_def(dataset_def)
      except spec.SpecError:
        break
      except Exception:  # pylint: disable=broad-except  # not even a DatasetDef
        continue
    else:
      return "spec none refused"
    self._specs_sent += 1
    dataset_def.fingerprint = f"fuzz-{self._specs_sent}"  # no reuse of a registered one
    try:
      dataset_id = pb.RegisterDatasetResponse.FromString(
        self._unary("RegisterDataset", pb.RegisterDatasetRequest(dataset=dataset_def))
      ).dataset_id
      job = pb.GetOrCreateJobResponse.FromString(
        self._unary(
          "GetOrCreateJob", pb.GetOrCreateJobRequest(dataset_id=dataset_id, sharding_policy="OFF")
        )
      )
    except grpc.RpcError as e:
      return f"spec on dispatcher {e.code().name}"
    try:
      heartbeat = pb.ClientHeartbeatRequest(job_id=job.job_id, client_id=job.client_id)
      deadline = time.monotonic() + CALL_TIMEOUT_S
      task_id = None
      while task_id is None and time.monotonic() < deadline:
        tasks = pb.ClientHeartbeatResponse.FromString(
          self._unary("ClientHeartbeat", heartbeat)
        ).tasks
        task_id = next((t.task_id for t in tasks if t.worker_address == self.worker), None)
        time.sleep(0.05)
      if task_id is None:
        return "spec no task"
      call = self._channels[self.worker].unary_stream(_WORKER + "GetElements")
      try:
        list(
          call(pb.GetElementsRequest(task_id=task_id).SerializeToString(), timeout=CALL_TIMEOUT_S)
        )
        return "spec on worker OK"
      except grpc.RpcError as e:
        return f"spec on worker {e.code().name}"
    finally:
      self._unary(
        "ReleaseJobClient", pb.ReleaseJobClientRequest(job_id=job.job_id, client_id=job.client_id)
      )

  def run(self, cases: int, alive: Callable[[], bool] = lambda: True) -> None:
    """Runs `cases` cases, checking `alive()` (the servers) every few."""
    makers = (
      [self._grpc_case] * 12
      + [self._data_socket_case] * 6
      + [self._raw_grpc_port_case] * 2
      + [self._spec_case]
    )
    for i in range(cases):
      started = time.monotonic()
      self.outcomes[self.rng.choice(makers)()] += 1
      self.slowest_s = max(self.slowest_s, time.monotonic() - started)
      self.cases += 1
      if i % 20 == 0 and not alive():
        raise AssertionError(f"A server died during case {i}: {dict(self.outcomes)}")
