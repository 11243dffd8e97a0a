"""Bad input gets a clear status and the servers go on serving."""

from __future__ import annotations

import json
import socket
import struct
import threading
import time

import grpc
import numpy as np
import pytest

import jaxfeed
import service_udfs
from jaxfeed import service
from jaxfeed.service.client import job_calls
from jaxfeed.service.protocol import import_paths, rpc, spec
from jaxfeed.service.protocol.protos import service_pb2 as pb
from service_cluster import free_port, release_port

pytestmark = pytest.mark.timeout(60)

TOKEN = "s3cret-token"
WORKER_TOKEN = "w0rker-token"
SECRET = b"shared-udf-secret"


@pytest.fixture
def servers():
  """A dispatcher and a worker in this process, with a token and a UDF secret."""
  threads_before = set(threading.enumerate())
  dispatcher = service.DispatchServer(
    service.DispatcherConfig(
      auth_token=TOKEN,
      worker_token=WORKER_TOKEN,
      pickled_udf_secret=SECRET,
      max_message_bytes=256 << 10,
      heartbeat_timeout_s=2,
    )
  )
  worker = service.WorkerServer(
    service.WorkerConfig(
      dispatcher_address=dispatcher.target,
      worker_token=WORKER_TOKEN,
      pickled_udf_secret=SECRET,
      heartbeat_interval_s=0.1,
      chunk_bytes=64 << 10,
      max_message_bytes=256 << 10,
    )
  )
  yield dispatcher, worker
  worker.stop()
  dispatcher.stop()
  deadline = time.monotonic() + 10
  while time.monotonic() < deadline:
    leaked = [t for t in set(threading.enumerate()) - threads_before if t.is_alive()]
    if not leaked:
      break
    time.sleep(0.05)
  assert not leaked, leaked


def small_dataset():
  return jaxfeed.Dataset.range(20).map(service_udfs.add_one).batch(5)


def read(dataset) -> list:
  with dataset.make_iterator() as iterator:
    return list(iterator)


def still_serves(dispatcher) -> None:
  batches = read(small_dataset().distribute(dispatcher.target, auth_token=TOKEN))
  assert np.concatenate(batches).tolist() == list(range(1, 21))


def raw_call(target: str, method: str, payload: bytes, token: str | None = TOKEN):
  with grpc.insecure_channel(target) as channel:
    call = channel.unary_unary(
      method, request_serializer=lambda b: b, response_deserializer=lambda b: b
    )
    metadata = ((rpc.TOKEN_METADATA_KEY, token),) if token else None
    return call(payload, timeout=10, metadata=metadata)


REGISTER = "/jaxfeed.service.Dispatcher/RegisterDataset"


@pytest.mark.parametrize("token", [None, "wrong-token"])
def test_dispatcher_rejects_missing_or_wrong_token(servers, token):
  dispatcher, _ = servers
  request = pb.GetDatasetDefRequest(dataset_id="1").SerializeToString()
  with pytest.raises(grpc.RpcError) as info:
    raw_call(dispatcher.target, "/jaxfeed.service.Dispatcher/GetDatasetDef", request, token)
  assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
  assert rpc.TOKEN_METADATA_KEY in info.value.details()
  still_serves(dispatcher)


@pytest.mark.parametrize("payload", [b"\xff\xff\xff\xff", b"\x0a\x80\x80\x80", b"\x0a\x05abc"])
def test_garbage_request_bytes_get_invalid_argument(servers, payload):
  dispatcher, _ = servers
  with pytest.raises(grpc.RpcError) as info:
    raw_call(dispatcher.target, REGISTER, payload)
  assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
  assert "RegisterDatasetRequest" in info.value.details()
  still_serves(dispatcher)


def test_truncated_request_gets_invalid_argument(servers):
  dispatcher, _ = servers
  dataset_def = spec.to_dataset_def(small_dataset().node)
  full = pb.RegisterDatasetRequest(dataset=dataset_def).SerializeToString()
  with pytest.raises(grpc.RpcError) as info:
    raw_call(dispatcher.target, REGISTER, full[: len(full) // 2])
  assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
  still_serves(dispatcher)


def test_oversized_message_gets_resource_exhausted(servers):
  dispatcher, _ = servers
  big = pb.RegisterDatasetRequest(dataset=pb.DatasetDef(graph_json=b"x" * (512 << 10)))
  with pytest.raises(grpc.RpcError) as info:
    raw_call(dispatcher.target, REGISTER, big.SerializeToString())
  assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
  still_serves(dispatcher)


def test_unknown_dataset_id_gets_not_found(servers):
  dispatcher, _ = servers
  request = pb.GetOrCreateJobRequest(dataset_id="no-such-id", sharding_policy="OFF")
  with pytest.raises(grpc.RpcError) as info:
    raw_call(
      dispatcher.target, "/jaxfeed.service.Dispatcher/GetOrCreateJob", request.SerializeToString()
    )
  assert info.value.code() == grpc.StatusCode.NOT_FOUND
  assert "no-such-id" in info.value.details()
  dataset = service.from_dataset_id(
    "parallel_epochs", dispatcher.target, "no-such-id", auth_token=TOKEN
  )
  with pytest.raises(service.ServiceError, match="NOT_FOUND.*no-such-id"):
    read(dataset)
  still_serves(dispatcher)


def test_lambda_udf_is_refused_with_advice_to_move_it_to_module_level(servers):
  dispatcher, _ = servers
  offset = 3
  with pytest.raises(service.SpecError, match="module level"):
    jaxfeed.Dataset.range(4).map(lambda x: x + offset).distribute(
      dispatcher.target, auth_token=TOKEN
    )


@pytest.mark.parametrize("client_secret", [b"wrong-secret", None])
def test_unsigned_or_badly_signed_pickled_udf_is_refused(servers, client_secret):
  dispatcher, _ = servers
  offset = 3
  node = jaxfeed.Dataset.range(4).map(lambda x: x + offset).node
  dataset_def = spec.to_dataset_def(node, udf_secret=b"wrong-secret")
  if client_secret is None:
    dataset_def.ClearField("signature")
  with pytest.raises(grpc.RpcError) as info:
    raw_call(
      dispatcher.target,
      REGISTER,
      pb.RegisterDatasetRequest(dataset=dataset_def).SerializeToString(),
    )
  assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
  assert "signature" in info.value.details()
  still_serves(dispatcher)


def test_signed_pickled_udf_runs_on_the_worker(servers):
  dispatcher, _ = servers
  offset = 3
  dataset = jaxfeed.Dataset.range(6).map(lambda x: x + offset).batch(3)
  batches = read(dataset.distribute(dispatcher.target, auth_token=TOKEN, udf_secret=SECRET))
  assert np.concatenate(batches).tolist() == [3, 4, 5, 6, 7, 8]


def test_worker_refuses_pickled_udfs_it_cannot_verify():
  dataset_def = spec.to_dataset_def(
    jaxfeed.Dataset.range(4).map(lambda x: x * 2).node, udf_secret=SECRET
  )
  with pytest.raises(spec.SpecError, match="does not accept pickled UDFs"):
    spec.from_dataset_def(dataset_def, udf_secret=None)
  with pytest.raises(spec.SpecError, match="HMAC"):
    spec.from_dataset_def(dataset_def, udf_secret=b"other")


def test_udf_import_path_missing_on_the_worker_names_the_path(servers, monkeypatch):
  dispatcher, _ = servers
  monkeypatch.setattr(
    import_paths, "DEFAULT_UDF_MODULES", (*import_paths.DEFAULT_UDF_MODULES, "no_such_module_here")
  )
  dataset_def = spec.to_dataset_def(small_dataset().node)
  graph = dataset_def.graph_json.decode().replace(
    "service_udfs:add_one", "no_such_module_here:add_one"
  )
  dataset_def.graph_json = graph.encode()
  dataset_def.fingerprint = "missing-udf"
  response = pb.RegisterDatasetResponse.FromString(
    raw_call(
      dispatcher.target,
      REGISTER,
      pb.RegisterDatasetRequest(dataset=dataset_def).SerializeToString(),
    )
  )
  dataset = service.from_dataset_id(
    "parallel_epochs", dispatcher.target, response.dataset_id, auth_token=TOKEN
  )
  with pytest.raises(
    service.ServiceError, match="FAILED_PRECONDITION.*no_such_module_here:add_one"
  ):
    read(dataset)
  still_serves(dispatcher)


@pytest.mark.parametrize(
  "hello", [b"\xff" * 8, struct.pack("<I", 5) + b"{nope", struct.pack("<I", 1 << 30)]
)
def test_garbage_on_the_data_socket_closes_only_that_connection(servers, hello):
  dispatcher, worker = servers
  host, port = worker.data_address.rsplit(":", 1)
  with socket.create_connection((host, int(port)), timeout=10) as conn:
    conn.sendall(hello)
    reply = b""
    while chunk := conn.recv(4096):
      reply += chunk
  kind, length, _, _ = struct.unpack("<BQqq", reply[:25])
  assert kind == 2
  assert json.loads(reply[25 : 25 + length])["status"] == "INVALID_ARGUMENT"
  still_serves(dispatcher)


def test_num_consumers_without_job_name_is_refused():
  with pytest.raises(ValueError, match="job_name"):
    small_dataset().distribute("127.0.0.1:1", num_consumers=2, consumer_index=0)


@pytest.mark.parametrize(
  "kwargs",
  [
    {"consumer_index": 2, "num_consumers": 2, "job_name": "j"},
    {"compression": "gzip"},
    {"max_outstanding_requests": 0},
    {"data_transfer": "carrier-pigeon"},
  ],
)
def test_bad_read_options_are_refused(kwargs):
  with pytest.raises(ValueError):
    small_dataset().distribute("127.0.0.1:1", **kwargs)


def test_unknown_processing_mode_is_refused():
  with pytest.raises(ValueError, match="distributed_epoch"):
    small_dataset().distribute("127.0.0.1:1", "sometimes")


@pytest.mark.parametrize(
  "kwargs, message",
  [
    ({"visitation": "twice"}, "visitation must be one of"),
    ({"visitation": "exactly_once"}, "needs processing_mode='distributed_epoch'"),
    (
      {
        "visitation": "exactly_once",
        "processing_mode": "distributed_epoch",
        "job_name": "j",
        "num_consumers": 2,
        "consumer_index": 0,
      },
      "no num_consumers",
    ),
  ],
)
def test_bad_visitation_is_refused_with_what_it_needs(kwargs, message):
  with pytest.raises(ValueError, match=message):
    small_dataset().distribute("127.0.0.1:1", **kwargs)


@pytest.mark.parametrize(
  "read, name",
  [
    (
      lambda **kw: small_dataset().distribute("127.0.0.1:1", "distributed_epoch", **kw),
      "distribute",
    ),
    (lambda **kw: service.distribute(small_dataset(), "127.0.0.1:1", **kw), "distribute"),
    (
      lambda **kw: service.from_dataset_id("parallel_epochs", "127.0.0.1:1", "id", **kw),
      "from_dataset_id",
    ),
  ],
)
def test_a_misspelled_keyword_names_the_function_and_the_close_match(read, name):
  with pytest.raises(TypeError) as refused:
    read(visitaton="exactly_once")
  message = str(refused.value)
  assert message.startswith(
    f"{name}() got an unexpected keyword argument 'visitaton'; "
    "did you mean 'visitation'? It takes: "
  )
  assert "DistributedNode" not in message and "max_frame_bytes" in message
  with pytest.raises(TypeError, match=r"'timeout'; did you mean 'timeout_s'\?"):
    read(timeout=5)
  with pytest.raises(TypeError, match=r"'frobnicate'\. It takes: auth_token, "):
    read(frobnicate=True)


def nothing_listens() -> str:
  """An address on loopback where nothing listens (the port stays reserved
  for this test process, see free_port)."""
  return f"127.0.0.1:{free_port()}"


@pytest.mark.parametrize("read_from", ["distribute", "from_dataset_id", "register_dataset"])
def test_a_dispatcher_address_where_nothing_answers_fails_in_seconds_naming_it(read_from):
  address = nothing_listens()
  start = time.monotonic()
  with pytest.raises(service.ServiceError) as failed:
    if read_from == "distribute":
      read(small_dataset().distribute(address))
    elif read_from == "from_dataset_id":
      read(service.from_dataset_id("parallel_epochs", address, "some-id"))
    else:
      service.register_dataset(address, small_dataset())
  took = time.monotonic() - start
  # The 5 s are a gRPC deadline on gRPC's own clock, which may end a moment
  # before this test's clock says 5 s.
  assert job_calls.UNANSWERED_S - 0.5 <= took < job_calls.UNANSWERED_S + 10
  message = str(failed.value)
  assert f"no answer within 5 s from {address}: nothing answers there" in message
  assert "Connection refused" in message and "wait_for_dispatcher=True" in message


def test_wait_for_dispatcher_keeps_trying_until_one_starts_there():
  address = nothing_listens()
  port = int(address.rsplit(":", 1)[1])
  got, errors = [], []

  def read_when_it_starts():
    try:
      got.extend(read(small_dataset().distribute(address, wait_for_dispatcher=True)))
    except Exception as e:  # noqa: BLE001 -- asserted below
      errors.append(e)

  reader = threading.Thread(target=read_when_it_starts)
  reader.start()
  time.sleep(job_calls.UNANSWERED_S + 1)
  assert reader.is_alive() and not errors, errors
  release_port(port)
  dispatcher = service.DispatchServer(service.DispatcherConfig(port=port))
  worker = service.WorkerServer(
    service.WorkerConfig(dispatcher_address=dispatcher.target, heartbeat_interval_s=0.1)
  )
  try:
    reader.join(timeout=40)
  finally:
    worker.stop()
    dispatcher.stop()
  assert not reader.is_alive() and not errors, errors
  assert np.concatenate(got).tolist() == list(range(1, 21))


def test_a_shared_job_refuses_a_consumer_with_another_visitation(servers):
  dispatcher, _ = servers
  dataset = jaxfeed.Dataset.from_source(jaxfeed.ArraySource({"x": np.arange(20)})).batch(5)
  with dataset.distribute(
    dispatcher.target, "distributed_epoch", job_name="shared", auth_token=TOKEN
  ).make_iterator() as first:
    next(first)
    other = dataset.distribute(
      dispatcher.target,
      "distributed_epoch",
      job_name="shared",
      auth_token=TOKEN,
      visitation="exactly_once",
    )
    with pytest.raises(ValueError, match="at-most-once visitation.*exactly-once"):
      read(other)
  still_serves(dispatcher)
