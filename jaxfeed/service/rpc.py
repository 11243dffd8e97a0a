"""gRPC plumbing shared by the dispatcher, workers and clients.

Servers register their methods through `method_handlers`, which receives raw
request bytes so that malformed messages get INVALID_ARGUMENT (gRPC's own
deserializer would answer a bare INTERNAL), checks the auth token on every
call, and maps the service's exceptions to clear status codes.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hmac
import logging
import os
import signal
import ssl
import tempfile
import time
from typing import Any, Callable

import grpc
from google.protobuf import message as pb_message

from jaxfeed.service import spec as spec_lib

TOKEN_METADATA_KEY = "x-jaxfeed-token"
DEFAULT_MAX_MESSAGE_BYTES = 64 << 20


class NotFoundError(KeyError):
  """An id (dataset, job, task) the server does not know."""

  def __str__(self) -> str:
    return str(self.args[0]) if self.args else ""


class StatusError(RuntimeError):
  """Raised inside a method to answer with a given gRPC status name."""

  def __init__(self, status: str, message: str):
    super().__init__(message)
    self.status = status


class ServiceError(RuntimeError):
  """A service RPC failed; the message carries the gRPC status and details."""


@dataclasses.dataclass(frozen=True)
class TLSConfig:
  """PEM bytes for TLS. Servers need key + certificate, clients the root CA."""

  private_key: bytes | None = None
  certificate_chain: bytes | None = None
  root_certificates: bytes | None = None

  @classmethod
  def from_files(cls, private_key: str = "", certificate_chain: str = "",
                 root_certificates: str = "") -> "TLSConfig | None":
    """Reads the PEM files given (empty names are left out); None if none is."""
    if not (private_key or certificate_chain or root_certificates):
      return None
    if bool(private_key) != bool(certificate_chain):
      raise ValueError(
          "TLS: give both the private key and the certificate chain file, got "
          f"key={private_key!r}, certificate={certificate_chain!r}.")

    def read(path: str) -> bytes | None:
      if not path:
        return None
      try:
        with open(path, "rb") as f:
          data = f.read()
      except OSError as e:
        raise ValueError(f"TLS: cannot read PEM file {path!r}: {e.strerror}.") from e
      if b"-----BEGIN" not in data:
        raise ValueError(f"TLS: {path!r} is not a PEM file (no '-----BEGIN' line).")
      return data

    return cls(read(private_key), read(certificate_chain), read(root_certificates))

  def server_credentials(self) -> grpc.ServerCredentials:
    if not self.private_key or not self.certificate_chain:
      raise ValueError("TLS on a server needs private_key and certificate_chain PEM bytes.")
    return grpc.ssl_server_credentials([(self.private_key, self.certificate_chain)])

  def channel_credentials(self) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(root_certificates=self.root_certificates)

  def server_ssl_context(self) -> ssl.SSLContext:
    """The same key and certificate for the raw data socket."""
    if not self.private_key or not self.certificate_chain:
      raise ValueError("TLS on a server needs private_key and certificate_chain PEM bytes.")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    # load_cert_chain reads only files: write them to a private folder briefly.
    with tempfile.TemporaryDirectory(prefix="jaxfeed-tls-") as folder:
      key_path = os.path.join(folder, "key.pem")
      cert_path = os.path.join(folder, "cert.pem")
      with open(os.open(key_path, os.O_WRONLY | os.O_CREAT, 0o600), "wb") as f:
        f.write(self.private_key)
      with open(cert_path, "wb") as f:
        f.write(self.certificate_chain)
      try:
        context.load_cert_chain(cert_path, key_path)
      except ssl.SSLError as e:
        raise ValueError(f"TLS key and certificate chain do not load: {e}") from e
    return context

  def client_ssl_context(self) -> ssl.SSLContext:
    """Verifies servers against root_certificates (the system's when None)."""
    roots = self.root_certificates.decode("ascii") if self.root_certificates else None
    context = ssl.create_default_context(cadata=roots)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    return context


def channel_options(max_message_bytes: int) -> list[tuple[str, Any]]:
  return [("grpc.max_send_message_length", max_message_bytes),
          ("grpc.max_receive_message_length", max_message_bytes),
          ("grpc.so_reuseport", 0)]


_STATUS_BY_ERROR = (
    (spec_lib.UDFImportError, grpc.StatusCode.FAILED_PRECONDITION),
    (spec_lib.SpecError, grpc.StatusCode.INVALID_ARGUMENT),
    (NotFoundError, grpc.StatusCode.NOT_FOUND),
    (ValueError, grpc.StatusCode.INVALID_ARGUMENT),
)


def _status_for(error: Exception) -> grpc.StatusCode:
  for error_type, code in _STATUS_BY_ERROR:
    if isinstance(error, error_type):
      return code
  return grpc.StatusCode.INTERNAL


def _check_token(context: grpc.ServicerContext, token: str | None) -> None:
  if not token:
    return
  sent = dict(context.invocation_metadata()).get(TOKEN_METADATA_KEY)
  if sent is None or not hmac.compare_digest(str(sent).encode(), token.encode()):
    context.abort(grpc.StatusCode.UNAUTHENTICATED,
                  "Missing or wrong auth token: send the deployment's token in "
                  f"gRPC metadata {TOKEN_METADATA_KEY!r}.")


def _parse(request_cls: type, data: bytes, method: str,
           context: grpc.ServicerContext) -> pb_message.Message:
  request = request_cls()
  try:
    request.ParseFromString(data)
  except (pb_message.DecodeError, RuntimeError, ValueError) as e:
    context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                  f"{method}: request is not a valid {request_cls.__name__} "
                  f"({len(data)} bytes): {e}")
  return request


def method_handlers(service_name: str, token: str | None,
                    methods: dict[str, tuple[Callable, type, bool]]
                    ) -> grpc.GenericRpcHandler:
  """A generic handler for methods name -> (fn(request, context), request type, streams)."""
  handlers = {}
  for name, (fn, request_cls, streams) in methods.items():
    full = f"{service_name}.{name}"
    if streams:
      def stream(data, context, fn=fn, request_cls=request_cls, full=full):
        _check_token(context, token)
        request = _parse(request_cls, data, full, context)
        try:
          for response in fn(request, context):  # a message, or its bytes
            yield response if isinstance(response, bytes) else response.SerializeToString()
        except Exception as e:  # pylint: disable=broad-except
          _abort_for(e, full, context)
      handlers[name] = grpc.unary_stream_rpc_method_handler(stream)
    else:
      def unary(data, context, fn=fn, request_cls=request_cls, full=full):
        _check_token(context, token)
        request = _parse(request_cls, data, full, context)
        try:
          return fn(request, context).SerializeToString()
        except Exception as e:  # pylint: disable=broad-except
          _abort_for(e, full, context)
      handlers[name] = grpc.unary_unary_rpc_method_handler(unary)
  return grpc.method_handlers_generic_handler(service_name, handlers)


def _abort_for(error: Exception, method: str, context: grpc.ServicerContext) -> None:
  if type(error) is Exception:  # pylint: disable=unidiomatic-typecheck
    raise error  # what context.abort() raises: the status is already set
  if isinstance(error, StatusError):
    code = getattr(grpc.StatusCode, error.status, grpc.StatusCode.INTERNAL)
  else:
    code = _status_for(error)
  if code == grpc.StatusCode.INTERNAL:
    logging.exception("%s failed", method)
  context.abort(code, f"{method}: {error}")


def make_server(address: str, methods_handler: grpc.GenericRpcHandler,
                max_message_bytes: int, tls: TLSConfig | None,
                max_workers: int = 32) -> tuple["ServerHandle", int]:
  """A bound, not yet started server; returns (handle, port)."""
  executor = concurrent.futures.ThreadPoolExecutor(
      max_workers=max_workers, thread_name_prefix="jaxfeed-rpc")
  server = grpc.server(
      executor,
      options=channel_options(max_message_bytes),
      maximum_concurrent_rpcs=None)
  server.add_generic_rpc_handlers((methods_handler,))
  if tls is not None:
    port = server.add_secure_port(address, tls.server_credentials())
  else:
    port = server.add_insecure_port(address)
  if port == 0:
    executor.shutdown(wait=False)
    raise OSError(f"Cannot bind a gRPC server to {address!r}.")
  return ServerHandle(server, executor), port


class ServerHandle:
  """A gRPC server and the thread pool it runs on (grpc does not stop it)."""

  def __init__(self, server: grpc.Server,
               executor: concurrent.futures.ThreadPoolExecutor):
    self.server = server
    self.executor = executor

  def start(self) -> None:
    self.server.start()

  def wait_for_termination(self, timeout: float | None = None) -> bool:
    return self.server.wait_for_termination(timeout)

  def stop(self, timeout_s: float = 5.0) -> None:
    self.server.stop(grace=None).wait(timeout_s)
    self.executor.shutdown(wait=True, cancel_futures=True)


_WILDCARD_HOSTS = frozenset({"0.0.0.0", "::", "[::]", ""})


def is_wildcard_host(host: str) -> bool:
  """Whether `host` binds every interface (and so names no reachable host)."""
  return host in _WILDCARD_HOSTS


def make_channel(target: str, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                 tls: TLSConfig | None = None) -> grpc.Channel:
  if tls is not None:
    return grpc.secure_channel(target, tls.channel_credentials(),
                               options=channel_options(max_message_bytes))
  return grpc.insecure_channel(target, options=channel_options(max_message_bytes))


class Caller:
  """Calls one method of a channel with token metadata and a deadline."""

  def __init__(self, channel: grpc.Channel, method: str, response_cls: type | None,
               token: str | None, streams: bool = False):
    """response_cls None: responses arrive as their raw bytes."""
    make = channel.unary_stream if streams else channel.unary_unary
    self._call = make(method, request_serializer=lambda m: m.SerializeToString(),
                      response_deserializer=response_cls.FromString if response_cls else None)
    self._metadata = ((TOKEN_METADATA_KEY, token),) if token else None
    self.method = method

  def __call__(self, request: pb_message.Message, timeout: float,
               wait_for_ready: bool = False) -> Any:
    return self._call(request, timeout=timeout, metadata=self._metadata,
                      wait_for_ready=wait_for_ready)


def call_with_retry(caller: Caller, request: pb_message.Message,
                    timeout_s: float, what: str) -> Any:
  """Calls until success or timeout_s, retrying while the server is unreachable."""
  deadline = time.monotonic() + timeout_s
  while True:
    left = deadline - time.monotonic()
    try:
      return caller(request, timeout=max(left, 0.05), wait_for_ready=True)
    except grpc.RpcError as e:
      code = e.code()
      if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED) and (
          deadline - time.monotonic() > 0.05):
        time.sleep(0.05)
        continue
      hint = ""
      if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        hint = (f" (no answer within {timeout_s:g} s: check that the server is up at "
                "that address and that client and server agree on TLS and its "
                "certificates)")
      raise ServiceError(f"{what} failed: {code.name}: {e.details()}{hint}") from e



def stop_on_sigterm() -> None:
  """Makes SIGTERM end the main thread with SystemExit(0), so a server's
  command-line main stops it (and what it started) in its `finally`."""
  def exit_cleanly(signum, frame):
    del signum, frame
    raise SystemExit(0)
  signal.signal(signal.SIGTERM, exit_cleanly)
