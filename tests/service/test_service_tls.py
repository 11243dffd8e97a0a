"""TLS: dispatcher and worker processes serving gRPC over TLS on loopback.

The certificates in tls/ are test-only (tls/make_certs.sh remakes them): a
test CA, a server certificate for 127.0.0.1 signed by it, and an unrelated CA.
"""

from __future__ import annotations

import collections
import json
import pathlib
import socket
import struct

import numpy as np
import pytest

import jaxfeed
from jaxfeed import service
from jaxfeed.service.protocol import data_socket

pytestmark = pytest.mark.timeout(120)

TLS_DIR = pathlib.Path(__file__).resolve().parent / "tls"
CA = TLS_DIR / "ca.pem"
TOKEN = "tls-test-token"
WORKER_TOKEN = "tls-test-worker-token"
NUM_RECORDS = 300


def server_flags() -> tuple[str, ...]:
  return (
    f"--tls_key={TLS_DIR / 'server.key'}",
    f"--tls_cert={TLS_DIR / 'server.pem'}",
    f"--worker_token={WORKER_TOKEN}",
  )


@pytest.fixture
def tls_service(cluster):
  dispatcher = cluster(
    "dispatcher", "--port=0", "--heartbeat_timeout_s=2", *server_flags(), f"--auth_token={TOKEN}"
  )
  worker = cluster(
    "worker",
    f"--dispatcher_address={dispatcher.address}",
    "--heartbeat_interval_s=0.2",
    f"--tls_root_certs={CA}",
    *server_flags(),
  )
  return dispatcher, worker


def records() -> jaxfeed.Dataset:
  source = jaxfeed.ArraySource({"x": np.arange(NUM_RECORDS, dtype=np.int64)})
  return jaxfeed.Dataset.from_source(
    source, jaxfeed.IndexSampler(NUM_RECORDS, shuffle=True, seed=3)
  ).batch(16)


def read(address: str, tls: service.TLSConfig | None, **options) -> collections.Counter:
  dataset = records().distribute(address, "distributed_epoch", auth_token=TOKEN, tls=tls, **options)
  with dataset.make_iterator() as iterator:
    batches = list(iterator)
  return collections.Counter(np.concatenate([b["x"] for b in batches]).tolist())


@pytest.mark.parametrize("data_transfer", ["socket", "grpc"])
def test_a_tls_deployment_serves_one_exact_epoch(tls_service, data_transfer):
  dispatcher, worker = tls_service
  assert worker.data_address  # the raw data socket speaks TLS too
  tls = service.TLSConfig(root_certificates=CA.read_bytes())
  got = read(dispatcher.address, tls, data_transfer=data_transfer)
  assert got == collections.Counter(range(NUM_RECORDS))


def test_the_tls_data_socket_refuses_plaintext_and_unverified_peers(tls_service):
  dispatcher, worker = tls_service
  host, port = worker.data_address.rsplit(":", 1)
  hello = json.dumps({"token": TOKEN, "task_id": 1}).encode()
  with socket.create_connection((host, int(port)), timeout=10) as plain:
    plain.sendall(struct.pack("<I", len(hello)) + hello)
    try:
      answer = plain.recv(4096)
    except ConnectionResetError:
      answer = b""
    # Closed, at most after a TLS alert record (0x15): no frame in the clear.
    assert answer == b"" or answer[0] == 0x15, answer[:16]
  other = service.TLSConfig(root_certificates=(TLS_DIR / "other_ca.pem").read_bytes())
  with pytest.raises(data_socket.DataConnectionError, match="TLS handshake.*failed"):
    data_socket.DataConnection(
      worker.data_address, {"token": TOKEN, "task_id": 1}, ssl_context=other.client_ssl_context()
    )
  tls = service.TLSConfig(root_certificates=CA.read_bytes())
  assert read(dispatcher.address, tls) == collections.Counter(range(NUM_RECORDS))


@pytest.mark.parametrize("client_tls", ["plaintext", "unrelated CA"])
def test_a_client_that_cannot_verify_the_servers_is_refused_and_they_still_serve(
  tls_service, client_tls
):
  dispatcher, _ = tls_service
  tls = (
    None
    if client_tls == "plaintext"
    else service.TLSConfig(root_certificates=(TLS_DIR / "other_ca.pem").read_bytes())
  )
  with pytest.raises(service.ServiceError, match="no answer within 2 s.*agree on TLS"):
    service.register_dataset(dispatcher.address, records(), auth_token=TOKEN, tls=tls, timeout_s=2)
  good = service.TLSConfig(root_certificates=CA.read_bytes())
  assert read(dispatcher.address, good) == collections.Counter(range(NUM_RECORDS))


def test_tls_files_are_checked_with_messages_naming_them(tmp_path):
  assert service.TLSConfig.from_files() is None
  config = service.TLSConfig.from_files(
    str(TLS_DIR / "server.key"), str(TLS_DIR / "server.pem"), str(CA)
  )
  assert config.private_key.startswith(b"-----BEGIN") and config.root_certificates
  missing = tmp_path / "missing.pem"
  with pytest.raises(ValueError, match="cannot read PEM file.*missing.pem"):
    service.TLSConfig.from_files(root_certificates=str(missing))
  not_pem = tmp_path / "key.txt"
  not_pem.write_text("hello")
  with pytest.raises(ValueError, match="key.txt.*not a PEM file"):
    service.TLSConfig.from_files(str(not_pem), str(TLS_DIR / "server.pem"))
  with pytest.raises(ValueError, match="both the private key and the certificate"):
    service.TLSConfig.from_files(private_key=str(TLS_DIR / "server.key"))
  with pytest.raises(ValueError, match="needs private_key and certificate_chain"):
    service.DispatchServer(
      service.DispatcherConfig(port=0, tls=service.TLSConfig(root_certificates=CA.read_bytes()))
    )
