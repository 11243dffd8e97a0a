"""The service lets no one in: allowlisted UDFs, separate client and worker
credentials, safe binds, signed specs and bounded resources, checked against
real dispatcher and worker processes on loopback."""

from __future__ import annotations

import collections
import os
import pathlib
import socket
import subprocess
import sys
import time

import grpc
import numpy as np
import psutil
import pytest

import jaxfeed
import service_udfs
from jaxfeed import service
from jaxfeed.service.protocol import data_socket, import_paths, rpc, spec, spec_signature
from jaxfeed.service.protocol.protos import service_pb2 as pb
from service_cluster import REPO_ROOT, TESTS_DIR

pytestmark = pytest.mark.timeout(120)

CLIENT_TOKEN = "client-token-for-tests"
WORKER_TOKEN = "worker-token-for-tests"
SECRET = b"udf-secret-for-tests"
DISPATCHER = "/jaxfeed.service.Dispatcher/"
TLS_DIR = pathlib.Path(__file__).resolve().parent / "tls"


def secret_file(tmp_path: pathlib.Path, name: str, value: str) -> str:
  path = tmp_path / name
  path.write_text(value)
  path.chmod(0o600)
  return str(path)


@pytest.fixture
def secured(cluster, tmp_path):
  """A dispatcher and a worker with client and worker tokens (passed by file)."""
  client_file = secret_file(tmp_path, "client.token", CLIENT_TOKEN)
  worker_file = secret_file(tmp_path, "worker.token", WORKER_TOKEN)
  udf_file = secret_file(tmp_path, "udf.secret", SECRET.decode())
  dispatcher = cluster(
    "dispatcher",
    "--port=0",
    "--heartbeat_timeout_s=3",
    f"--auth_token_file={client_file}",
    f"--worker_token_file={worker_file}",
    f"--pickled_udf_secret_file={udf_file}",
    "--max_jobs_per_host=3",
  )
  worker = cluster(
    "worker",
    f"--dispatcher_address={dispatcher.address}",
    "--heartbeat_interval_s=0.2",
    f"--worker_token_file={worker_file}",
    f"--pickled_udf_secret_file={udf_file}",
  )
  for process in (dispatcher, worker):  # secrets never show on a command line
    assert CLIENT_TOKEN not in " ".join(process.proc.args)
    assert WORKER_TOKEN not in " ".join(process.proc.args)
  return dispatcher, worker


def raw_call(
  target: str, method: str, request, token: str | None, response_cls: type | None = None
):
  with grpc.insecure_channel(target) as channel:
    call = channel.unary_unary(
      method, request_serializer=lambda b: b, response_deserializer=lambda b: b
    )
    metadata = ((rpc.TOKEN_METADATA_KEY, token),) if token else None
    data = request if isinstance(request, bytes) else request.SerializeToString()
    reply = call(data, timeout=20, metadata=metadata)
  return response_cls.FromString(reply) if response_cls else reply


def refused_code(target: str, method: str, request, token: str | None) -> grpc.StatusCode:
  with pytest.raises(grpc.RpcError) as info:
    raw_call(target, method, request, token)
  return info.value.code()


def records(n: int = 64) -> jaxfeed.Dataset:
  return jaxfeed.Dataset.from_source(
    jaxfeed.ArraySource({"x": np.arange(n, dtype=np.int64)})
  ).batch(8)


def read_all(dataset) -> list:
  with dataset.make_iterator() as iterator:
    return list(iterator)


def register(target: str, dataset_def: pb.DatasetDef, token: str | None = CLIENT_TOKEN) -> str:
  return raw_call(
    target,
    DISPATCHER + "RegisterDataset",
    pb.RegisterDatasetRequest(dataset=dataset_def),
    token,
    pb.RegisterDatasetResponse,
  ).dataset_id


def a_task(dispatcher: str, dataset_id: str) -> pb.TaskInfo:
  """A task of a new job of the dataset, as its client learns it."""
  job = raw_call(
    dispatcher,
    DISPATCHER + "GetOrCreateJob",
    pb.GetOrCreateJobRequest(dataset_id=dataset_id, sharding_policy="OFF"),
    CLIENT_TOKEN,
    pb.GetOrCreateJobResponse,
  )
  deadline = time.monotonic() + 30
  while time.monotonic() < deadline:
    response = raw_call(
      dispatcher,
      DISPATCHER + "ClientHeartbeat",
      pb.ClientHeartbeatRequest(job_id=job.job_id, client_id=job.client_id),
      CLIENT_TOKEN,
      pb.ClientHeartbeatResponse,
    )
    if response.tasks:
      return response.tasks[0]
    time.sleep(0.1)
  raise TimeoutError("The job got no task.")


def with_path(path: str, data) -> pb.DatasetDef:
  """A spec that maps `path` over `data` (built as a harmless one, then edited,
  as a hostile client would send it)."""
  node = jaxfeed.Dataset.from_tensor_slices(data).map(service_udfs.add_one).node
  dataset_def = spec.to_dataset_def(node)
  dataset_def.graph_json = dataset_def.graph_json.replace(b"service_udfs:add_one", path.encode())
  dataset_def.fingerprint = f"hostile {path}"
  return dataset_def


# -- 1. UDF allowlist --------------------------------------------------------------
def hostile_udfs(marker: pathlib.Path) -> dict[str, object]:
  """path -> an element that makes the path create `marker` if it ever runs."""
  import pickle  # pylint: disable=g-import-not-at-top

  class Touch:
    def __reduce__(self):
      return (os.system, (f"touch {marker}",))

  return {
    "builtins:exec": np.array([f"open({str(marker)!r}, 'w').close()"]),
    "os:system": np.array([f"touch {marker}"]),
    "subprocess:run": np.array([["touch", str(marker)]]),
    "importlib:import_module": np.array(["jaxfeed_test_marker_module"]),
    "pickle:loads": np.array([pickle.dumps(Touch(), protocol=0)]),
    "jaxfeed.service.protocol.import_paths:resolve_path": np.array(
      ["jaxfeed_test_marker_module:x"]
    ),
  }


@pytest.fixture
def marker(tmp_path, monkeypatch):
  """A file that hostile UDFs would create; and a module on the servers'
  path that creates it when imported."""
  marker = tmp_path / "ran"
  modules = tmp_path / "modules"
  modules.mkdir()
  (modules / "jaxfeed_test_marker_module.py").write_text(
    f"open({str(marker)!r}, 'w').close()\nx = 1\n"
  )
  monkeypatch.setenv(
    "PYTHONPATH", os.pathsep.join([str(modules), os.environ.get("PYTHONPATH", "")])
  )
  return marker


HOSTILE_PATHS = (
  "builtins:exec",
  "os:system",
  "subprocess:run",
  "importlib:import_module",
  "pickle:loads",
  "jaxfeed.service.protocol.import_paths:resolve_path",
  "jaxfeed_test_marker_module:x",
  "service_udfs:__builtins__",
)


def test_code_running_udfs_are_refused_at_registration_and_never_run(marker, secured):
  dispatcher, _ = secured
  elements = hostile_udfs(marker)
  for path in HOSTILE_PATHS:
    with pytest.raises(grpc.RpcError) as info:
      register(dispatcher.address, with_path(path, elements.get(path, np.array([1]))))
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED, path
    assert path in info.value.details() and "--udf_modules" in info.value.details()
  # The servers still serve, and nothing ran.
  assert len(read_all(records().distribute(dispatcher.address, auth_token=CLIENT_TOKEN))) == 8
  time.sleep(0.5)
  assert not marker.exists()


@pytest.mark.parametrize(
  "path, why",
  [
    # The dispatcher allows the module, the worker does not: the worker
    # refuses the pipeline without importing the module.
    ("jaxfeed_test_marker_module:x", "not allowlisted"),
    # An allowed module's import of another module leads nowhere.
    ("service_udfs:np.load", "is a module imported by"),
  ],
)
def test_a_worker_imports_nothing_its_own_allowlist_lacks(marker, cluster, path, why):
  dispatcher = cluster(
    "dispatcher", "--port=0", "--udf_modules=service_udfs,jaxfeed_test_marker_module"
  )
  cluster("worker", f"--dispatcher_address={dispatcher.address}", "--heartbeat_interval_s=0.2")
  dataset_id = register(dispatcher.address, with_path(path, np.array([1])), None)
  dataset = service.from_dataset_id("parallel_epochs", dispatcher.address, dataset_id)
  with pytest.raises(service.ServiceError, match=f"{path}.*{why}.*--udf_modules"):
    read_all(dataset)
  assert not marker.exists()


def test_the_worker_check_refuses_before_importing_in_this_process(marker):
  dataset_def = with_path("jaxfeed_test_marker_module:x", np.array([1]))
  with pytest.raises(import_paths.UDFNotAllowedError, match="not allowlisted"):
    spec.from_dataset_def(dataset_def)
  assert "jaxfeed_test_marker_module" not in sys.modules and not marker.exists()


@pytest.mark.parametrize("entry", ["os", "os.", "importlib.", "builtins", "", "jaxfeed.", "a b"])
def test_udf_module_entries_that_would_allow_running_code_are_refused(entry):
  with pytest.raises(ValueError, match="udf_modules"):
    service.WorkerConfig(dispatcher_address="127.0.0.1:1", udf_modules=(entry,))


def test_pickled_udfs_are_refused_without_a_secret(cluster):
  dispatcher = cluster("dispatcher", "--port=0")
  offset = 3
  dataset_def = spec.to_dataset_def(
    jaxfeed.Dataset.range(4).map(lambda x: x + offset).node, udf_secret=SECRET
  )
  with pytest.raises(grpc.RpcError) as info:
    register(dispatcher.address, dataset_def, None)
  assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
  assert "does not accept pickled UDFs" in info.value.details()


# -- 2. safe defaults ------------------------------------------------------------
def non_loopback_host() -> str:
  for addresses in psutil.net_if_addrs().values():
    for address in addresses:
      if address.family == socket.AF_INET and not address.address.startswith("127."):
        return address.address
  return "0.0.0.0"


def run_role(role: str, *flags: str, timeout_s: float = 60) -> subprocess.CompletedProcess:
  env = dict(
    os.environ,
    PYTHONPATH=os.pathsep.join([str(REPO_ROOT), str(TESTS_DIR)]),
    GRPC_VERBOSITY="ERROR",
    JAX_PLATFORMS="cpu",
  )
  return subprocess.run(
    [sys.executable, "-m", f"jaxfeed.service.{role}", *flags],
    capture_output=True,
    text=True,
    env=env,
    timeout=timeout_s,
  )


@pytest.mark.parametrize(
  "role, flags",
  [
    ("dispatcher", ()),
    ("dispatcher", (f"--auth_token={CLIENT_TOKEN}",)),
    ("worker", ("--dispatcher_address=127.0.0.1:1",)),
  ],
)
def test_a_server_bound_beyond_loopback_without_auth_refuses_to_start(role, flags):
  done = run_role(role, "--port=0", f"--host={non_loopback_host()}", *flags)
  assert done.returncode != 0
  assert "listening" not in done.stdout
  message = done.stderr
  assert ("refusing to bind" in message and "--insecure" in message) or (
    "worker_token" in message
  ), message


def test_insecure_lets_a_server_bind_beyond_loopback(cluster):
  # Started and stopped at once: no traffic goes to that address.
  host = non_loopback_host()
  dispatcher = cluster("dispatcher", "--port=0", f"--host={host}", "--insecure")
  assert dispatcher.address.startswith(f"{host}:")


# -- 3. separate roles -------------------------------------------------------------
def test_a_client_token_cannot_act_as_a_worker(secured, cluster):
  dispatcher, worker = secured
  for request in (
    pb.WorkerHeartbeatRequest(worker_address="127.0.0.1:9", data_address="x"),
    pb.WorkerHeartbeatRequest(worker_address=worker.address, leaving=True),
  ):
    assert (
      refused_code(dispatcher.address, DISPATCHER + "WorkerHeartbeat", request, CLIENT_TOKEN)
      == grpc.StatusCode.UNAUTHENTICATED
    )
  assert (
    refused_code(
      dispatcher.address,
      DISPATCHER + "GetSplits",
      pb.GetSplitsRequest(job_id=1, task_id=1),
      CLIENT_TOKEN,
    )
    == grpc.StatusCode.UNAUTHENTICATED
  )
  assert (
    refused_code(
      dispatcher.address,
      DISPATCHER + "GetDatasetDef",
      pb.GetDatasetDefRequest(dataset_id="1"),
      CLIENT_TOKEN,
    )
    == grpc.StatusCode.UNAUTHENTICATED
  )
  # A save's chunks (and its pipeline, with any pickled UDFs) are the workers'.
  assert (
    refused_code(
      dispatcher.address,
      DISPATCHER + "SaveChunks",
      pb.SaveChunksRequest(path="/x", want_dataset=True),
      CLIENT_TOKEN,
    )
    == grpc.StatusCode.UNAUTHENTICATED
  )
  # A worker process holding the client token is refused and exits saying so.
  impostor = cluster(
    "worker", f"--dispatcher_address={dispatcher.address}", f"--worker_token={CLIENT_TOKEN}"
  )
  impostor.proc.wait(timeout=60)
  assert impostor.proc.returncode != 0
  # The real worker still serves every record.
  got = read_all(records().distribute(dispatcher.address, auth_token=CLIENT_TOKEN))
  assert np.concatenate([b["x"] for b in got]).tolist() == list(range(64))


def test_a_refused_worker_names_the_reason(secured):
  dispatcher, _ = secured
  done = run_role(
    "worker", f"--dispatcher_address={dispatcher.address}", "--worker_token=not-the-token"
  )
  assert done.returncode != 0
  assert "refused worker" in done.stderr and "UNAUTHENTICATED" in done.stderr, done.stderr


def test_a_worker_token_cannot_register_or_read(secured):
  dispatcher, worker = secured
  dataset_def = spec.to_dataset_def(records().node)
  assert (
    refused_code(
      dispatcher.address,
      DISPATCHER + "RegisterDataset",
      pb.RegisterDatasetRequest(dataset=dataset_def),
      WORKER_TOKEN,
    )
    == grpc.StatusCode.UNAUTHENTICATED
  )
  dataset_id = register(dispatcher.address, dataset_def)
  assert (
    refused_code(
      dispatcher.address,
      DISPATCHER + "GetOrCreateJob",
      pb.GetOrCreateJobRequest(dataset_id=dataset_id, sharding_policy="OFF"),
      WORKER_TOKEN,
    )
    == grpc.StatusCode.UNAUTHENTICATED
  )
  task = a_task(dispatcher.address, dataset_id)
  assert task.read_ticket
  # On the worker, neither token reads a task: only the task's ticket does.
  for credential in (WORKER_TOKEN, CLIENT_TOKEN, ""):
    assert read_task_grpc(worker.address, task, credential) == "UNAUTHENTICATED"
    assert read_task_socket(worker.data_address, task, credential) == "UNAUTHENTICATED"
  # A lone surrogate, which JSON can carry and UTF-8 cannot: refused like any
  # wrong ticket, and the data socket goes on accepting (the reads below).
  assert read_task_socket(worker.data_address, task, "\ud800") == "UNAUTHENTICATED"
  assert read_task_grpc(worker.address, task, task.read_ticket) == "OK"
  assert read_task_socket(worker.data_address, task, task.read_ticket) == "OK"


def read_task_grpc(address: str, task: pb.TaskInfo, credential: str) -> str:
  with grpc.insecure_channel(address) as channel:
    call = channel.unary_stream(
      "/jaxfeed.service.Worker/GetElements",
      request_serializer=lambda m: m.SerializeToString(),
      response_deserializer=pb.ElementChunk.FromString,
    )
    metadata = ((rpc.TOKEN_METADATA_KEY, credential),) if credential else None
    try:
      for _ in call(pb.GetElementsRequest(task_id=task.task_id), timeout=30, metadata=metadata):
        return "OK"
    except grpc.RpcError as e:
      return e.code().name
  return "EMPTY"


def read_task_socket(address: str, task: pb.TaskInfo, credential: str) -> str:
  connection = data_socket.DataConnection(address, {"token": credential, "task_id": task.task_id})
  try:
    connection.next_item()
    return "OK"
  except data_socket.DataConnectionError as e:
    return e.status
  finally:
    connection.close()


def test_mutual_tls_refuses_clients_without_a_certificate(cluster):
  ca = TLS_DIR / "ca.pem"
  key, cert = TLS_DIR / "server.key", TLS_DIR / "server.pem"
  tls = (f"--tls_key={key}", f"--tls_cert={cert}", f"--tls_client_ca={ca}")
  dispatcher = cluster("dispatcher", "--port=0", *tls)
  cluster(
    "worker",
    f"--dispatcher_address={dispatcher.address}",
    f"--tls_root_certs={ca}",
    "--heartbeat_interval_s=0.2",
    *tls,
  )
  without = service.TLSConfig(root_certificates=ca.read_bytes())
  with pytest.raises(service.ServiceError):
    service.register_dataset(dispatcher.address, records(), tls=without, timeout_s=3)
  # The test server certificate has no usage limits: it serves as a client's too.
  with_cert = service.TLSConfig(key.read_bytes(), cert.read_bytes(), ca.read_bytes())
  for data_transfer in ("socket", "grpc"):
    got = read_all(
      records().distribute(dispatcher.address, tls=with_cert, data_transfer=data_transfer)
    )
    assert len(got) == 8


# -- 4. signed specs ---------------------------------------------------------------
def signed_def(**sign_args) -> pb.DatasetDef:
  offset = 3
  node = jaxfeed.Dataset.range(6).map(lambda x: x + offset).batch(3).node
  dataset_def = spec.to_dataset_def(node, udf_secret=SECRET, num_positions=-1)
  dataset_def.signature = spec_signature.sign(dataset_def, SECRET, **sign_args)
  return dataset_def


def test_an_expired_or_altered_signed_spec_is_refused(secured):
  dispatcher, _ = secured
  expired = signed_def(now=time.time() - 2 * spec_signature.SPEC_TTL_S)
  other_key = signed_def()
  other_key.signature = spec_signature.sign(other_key, b"another secret")
  altered = {"expired": expired, "key id": other_key}
  for field, value in [
    ("num_positions", 1 << 40),
    ("fingerprint", "someone else's"),
    ("arrays", spec.to_dataset_def(records().node).arrays),
    ("graph_json", signed_def().graph_json.replace(b"6", b"7")),
  ]:
    dataset_def = signed_def()
    assert getattr(dataset_def, field) != value
    setattr(dataset_def, field, value)
    altered[field] = dataset_def
  for what, dataset_def in altered.items():
    with pytest.raises(grpc.RpcError) as info:
      register(dispatcher.address, dataset_def)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, what
    message = what if what in ("expired", "key id") else "does not match"
    assert message in info.value.details(), (what, info.value.details())
  register(dispatcher.address, signed_def())  # a fresh one is accepted
  offset = 3
  dataset = jaxfeed.Dataset.range(6).map(lambda x: x + offset).batch(3)
  got = read_all(dataset.distribute(dispatcher.address, auth_token=CLIENT_TOKEN, udf_secret=SECRET))
  assert np.concatenate(got).tolist() == [3, 4, 5, 6, 7, 8]


# -- 5. resource limits ----------------------------------------------------------
def test_idle_connections_to_every_port_do_not_stop_a_read(secured):
  dispatcher, worker = secured
  addresses = [dispatcher.address, worker.address, worker.data_address]
  idle = []
  try:
    for address in addresses:
      host, port = address.rsplit(":", 1)
      for _ in range(500):
        idle.append(socket.create_connection((host, int(port)), timeout=10))
    time.sleep(1.0)
    threads = psutil.Process(worker.proc.pid).num_threads()
    for data_transfer in ("socket", "grpc"):
      got = read_all(
        records().distribute(
          dispatcher.address, auth_token=CLIENT_TOKEN, data_transfer=data_transfer
        )
      )
      assert np.concatenate([b["x"] for b in got]).tolist() == list(range(64))
    # No thread per idle connection (500 of them).
    assert threads < 150, threads
  finally:
    for conn in idle:
      conn.close()


def test_a_worker_refuses_large_requests_and_slow_hellos(secured):
  _, worker = secured
  huge = pb.GetElementsRequest(task_id=1, compression="x" * (1 << 20))
  assert read_code(worker.address, huge) == "RESOURCE_EXHAUSTED"
  host, port = worker.data_address.rsplit(":", 1)
  with socket.create_connection((host, int(port)), timeout=30) as slow:
    slow.sendall(b"\x10\x00")  # half of a hello's length, then nothing
    started = time.monotonic()
    assert slow.recv(1) == b""  # dropped after the hello deadline
    assert time.monotonic() - started < 20


def read_code(address: str, request: pb.GetElementsRequest) -> str:
  with grpc.insecure_channel(address) as channel:
    call = channel.unary_stream(
      "/jaxfeed.service.Worker/GetElements", request_serializer=lambda m: m.SerializeToString()
    )
    try:
      list(call(request, timeout=30))
    except grpc.RpcError as e:
      return e.code().name
  return "OK"


def test_a_client_host_cannot_open_more_jobs_than_its_cap(secured):
  dispatcher, _ = secured
  dataset_id = register(dispatcher.address, spec.to_dataset_def(records().node))
  request = pb.GetOrCreateJobRequest(dataset_id=dataset_id, sharding_policy="OFF")
  jobs = [
    raw_call(
      dispatcher.address,
      DISPATCHER + "GetOrCreateJob",
      request,
      CLIENT_TOKEN,
      pb.GetOrCreateJobResponse,
    )
    for _ in range(3)
  ]
  with pytest.raises(grpc.RpcError) as info:
    raw_call(dispatcher.address, DISPATCHER + "GetOrCreateJob", request, CLIENT_TOKEN)
  assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
  assert "--max_jobs_per_host" in info.value.details()
  raw_call(
    dispatcher.address,
    DISPATCHER + "ReleaseJobClient",
    pb.ReleaseJobClientRequest(job_id=jobs[0].job_id, client_id=jobs[0].client_id),
    CLIENT_TOKEN,
  )
  raw_call(dispatcher.address, DISPATCHER + "GetOrCreateJob", request, CLIENT_TOKEN)


def test_secret_files_are_read_and_checked(tmp_path):
  path = secret_file(tmp_path, "token", "abc\n")
  assert rpc.read_secret("", path, "auth_token") == "abc"
  assert rpc.read_secret("xyz", "", "auth_token") == "xyz"
  assert rpc.read_secret("", "", "auth_token") is None
  with pytest.raises(ValueError, match="not both"):
    rpc.read_secret("xyz", path, "auth_token")
  with pytest.raises(ValueError, match="missing"):
    rpc.read_secret("", str(tmp_path / "missing"), "auth_token")


def test_one_token_or_equal_tokens_are_refused():
  with pytest.raises(ValueError, match="both auth_token"):
    service.DispatcherConfig(auth_token="a")
  with pytest.raises(ValueError, match="must differ"):
    service.DispatcherConfig(auth_token="a", worker_token="a")


def test_an_autoscaled_pool_gets_the_worker_token_by_file(monkeypatch):
  monkeypatch.setenv(
    "PYTHONPATH",
    os.pathsep.join([str(REPO_ROOT), str(TESTS_DIR), os.environ.get("PYTHONPATH", "")]),
  )
  config = service.DispatcherConfig(
    auth_token=CLIENT_TOKEN,
    worker_token=WORKER_TOKEN,
    heartbeat_timeout_s=3,
    autoscale=service.AutoscaleConfig(
      min_workers=1, max_workers=1, interval_s=0.5, worker_flags=("--heartbeat_interval_s=0.2",)
    ),
  )
  with service.DispatchServer(config) as dispatcher:
    got = read_all(records().distribute(dispatcher.target, auth_token=CLIENT_TOKEN))
    assert collections.Counter(np.concatenate([b["x"] for b in got]).tolist()) == (
      collections.Counter(range(64))
    )


def test_an_unauthenticated_request_body_is_never_received(secured):
  dispatcher, _ = secured
  status = psutil.Process(dispatcher.proc.pid)

  def peak_rss() -> int:
    with open(f"/proc/{status.pid}/status") as f:
      return next(int(line.split()[1]) << 10 for line in f if line.startswith("VmHWM:"))

  before = peak_rss()
  body = pb.RegisterDatasetRequest(dataset=pb.DatasetDef(graph_json=b"x" * (48 << 20)))
  for token in (None, WORKER_TOKEN):
    assert (
      refused_code(dispatcher.address, DISPATCHER + "RegisterDataset", body, token)
      == grpc.StatusCode.UNAUTHENTICATED
    )
  assert peak_rss() - before < 16 << 20


def test_an_allowed_module_does_not_lend_out_what_it_imports(tmp_path, monkeypatch):
  (tmp_path / "reexporting_udfs.py").write_text(
    "import os\nfrom os import system\nfrom importlib import import_module\n"
  )
  monkeypatch.syspath_prepend(str(tmp_path))
  allowed = ("reexporting_udfs",)
  for path, why in [
    ("reexporting_udfs:system", "never allowed"),
    ("reexporting_udfs:import_module", "never allowed"),
    ("reexporting_udfs:os.system", "is a module imported by"),
    ("reexporting_udfs:os", "is a module imported by"),
  ]:
    with pytest.raises(import_paths.UDFNotAllowedError, match=why):
      import_paths.resolve_path(path, allowed)


def test_read_tickets_stay_valid_across_a_restart_from_a_snapshot(tmp_path):
  from jaxfeed.service.dispatcher import server as dispatcher_lib  # pylint: disable=g-import-not-at-top

  config = service.DispatcherConfig(
    work_dir=str(tmp_path),
    auth_token=CLIENT_TOKEN,
    worker_token=WORKER_TOKEN,
    snapshot_every_records=2,
  )
  keys = []
  for restart in range(2):
    state = dispatcher_lib.DispatcherState(config)
    try:
      for i in range(4):  # enough changes for snapshots to compact the journal
        dataset_def = spec.to_dataset_def(records(8 + i).node)
        state.register_dataset(dataset_def)
      response = state.worker_heartbeat(pb.WorkerHeartbeatRequest(worker_address="h:1"))
      keys.append(response.ticket_key)
    finally:
      state.close()
    assert restart or list(tmp_path.glob("*snapshot*")), list(tmp_path.iterdir())
  assert len(keys[0]) == 32 and keys[0] == keys[1]
