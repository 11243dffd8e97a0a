"""gRPC servers of the service: their methods, credentials and status codes.

Servers register their methods through `method_handlers`, which receives raw
request bytes so that malformed messages get INVALID_ARGUMENT (gRPC's own
deserializer would answer a bare INTERNAL), checks the caller's credential
for the method's role from the call's metadata before the request body is
read, and maps the service's exceptions to clear status codes.
"""

from __future__ import annotations

import concurrent.futures
import hmac
import logging
from typing import Any, Callable

import grpc
from google.protobuf import message as pb_message

from jaxfeed.service.protocol import import_paths
from jaxfeed.service.protocol import rpc_errors
from jaxfeed.service.protocol.rpc import (
  NotFoundError,
  StatusError,
  TLSConfig,
  TOKEN_METADATA_KEY,
  channel_options,
  metadata_token,
)

# Calls a server holds before its Python loop takes them. That loop takes one
# call at a time, and gRPC's default (1,000, then random refusals up to 3,000)
# answers the rest of a burst CANCELLED: every host of a pod saying goodbye
# at the end of a job is such a burst. A waiting call costs a few KB.
MAX_PENDING_CALLS = 1 << 16


_STATUS_BY_ERROR = (
  (import_paths.UDFNotAllowedError, grpc.StatusCode.PERMISSION_DENIED),
  (import_paths.UDFImportError, grpc.StatusCode.FAILED_PRECONDITION),
  (import_paths.SpecError, grpc.StatusCode.INVALID_ARGUMENT),
  (NotFoundError, grpc.StatusCode.NOT_FOUND),
  (ValueError, grpc.StatusCode.INVALID_ARGUMENT),
)


def _status_for(error: Exception) -> grpc.StatusCode:
  for error_type, code in _STATUS_BY_ERROR:
    if isinstance(error, error_type):
      return code
  return grpc.StatusCode.INTERNAL


def _parse(
  request_cls: type, data: bytes, method: str, context: grpc.ServicerContext
) -> pb_message.Message:
  request = request_cls()
  try:
    request.ParseFromString(data)
  except (pb_message.DecodeError, RuntimeError, ValueError) as e:
    context.abort(
      grpc.StatusCode.INVALID_ARGUMENT,
      f"{method}: request is not a valid {request_cls.__name__} ({len(data)} bytes): {e}",
    )
  return request


Method = tuple[Callable, type, bool, tuple[str, ...]]


def method_handlers(
  service_name: str, tokens: dict[str, str | None], methods: dict[str, Method]
) -> grpc.GenericRpcHandler:
  """A generic handler for methods name -> (fn(request, context), request
  type, streams, roles allowed to call it).

  tokens: role -> the token its callers must send; when no role has one,
  every caller is let in (loopback, or TLS that verifies client certificates).
  """
  handlers, refusals = {}, {}
  for name, (fn, request_cls, streams, roles) in methods.items():
    full = f"{service_name}.{name}"
    if streams:

      def stream(data, context, fn=fn, request_cls=request_cls, full=full):
        request = _parse(request_cls, data, full, context)
        try:
          for response in fn(request, context):  # a message, or its bytes
            yield response if isinstance(response, bytes) else response.SerializeToString()
        except Exception as e:  # pylint: disable=broad-except
          _abort_for(e, full, context)

      handlers[name] = grpc.unary_stream_rpc_method_handler(stream)
    else:

      def unary(data, context, fn=fn, request_cls=request_cls, full=full):
        request = _parse(request_cls, data, full, context)
        try:
          response = fn(request, context)  # a message, or its bytes
          return response if isinstance(response, bytes) else response.SerializeToString()
        except Exception as e:  # pylint: disable=broad-except
          _abort_for(e, full, context)

      handlers[name] = grpc.unary_unary_rpc_method_handler(unary)
    refusals[name] = _refusal(full, roles)
  return _AuthenticatingHandler(service_name, tokens, methods, handlers, refusals)


def _refusal(method: str, roles: tuple[str, ...]) -> grpc.RpcMethodHandler:
  message = (
    f"{method}: missing or wrong credential. This method is for "
    f"{' and '.join(roles)}s: send the {' or '.join(roles)} token in gRPC "
    f"metadata {TOKEN_METADATA_KEY!r}."
  )

  def refuse(requests, context):
    del requests  # never read: an unauthenticated body is not received
    context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

  return grpc.stream_stream_rpc_method_handler(refuse)


class _AuthenticatingHandler(grpc.GenericRpcHandler):
  """Picks a method's handler from the call's metadata alone: a caller
  without the credential of the method's roles gets a handler that answers
  UNAUTHENTICATED without receiving the request."""

  def __init__(
    self,
    service_name: str,
    tokens: dict[str, str | None],
    methods: dict[str, Method],
    handlers: dict,
    refusals: dict,
  ):
    self._prefix = f"/{service_name}/"
    self._tokens = {role: token.encode() for role, token in tokens.items() if token}
    self._roles = {name: method[3] for name, method in methods.items()}
    self._handlers = handlers
    self._refusals = refusals

  def _allows(self, roles: tuple[str, ...], metadata: Any) -> bool:
    if not self._tokens:
      return True
    sent = metadata_token(metadata)
    if sent is None:
      return False
    sent_bytes = sent.encode()
    # Every role's token is compared, so the time taken tells nothing.
    matches = [
      hmac.compare_digest(sent_bytes, self._tokens[role]) for role in roles if role in self._tokens
    ]
    return any(matches)

  def service(self, handler_call_details):
    method = handler_call_details.method
    if not method.startswith(self._prefix):
      return None
    name = method[len(self._prefix) :]
    if name not in self._handlers:
      return None
    if not self._allows(self._roles[name], handler_call_details.invocation_metadata):
      return self._refusals[name]
    return self._handlers[name]


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


def make_server(
  address: str,
  methods_handler: grpc.GenericRpcHandler,
  max_message_bytes: int,
  tls: TLSConfig | None,
  max_workers: int = 32,
  max_receive_bytes: int | None = None,
) -> tuple["ServerHandle", int]:
  """A bound, not yet started server; returns (handle, port).

  max_receive_bytes: largest request accepted (default max_message_bytes);
  a server whose requests are all small says so here.
  """
  executor = concurrent.futures.ThreadPoolExecutor(
    max_workers=max_workers, thread_name_prefix="jaxfeed-rpc"
  )
  errors = rpc_errors.ErrorCounts()
  server = grpc.server(
    executor,
    interceptors=(rpc_errors.ServerErrorInterceptor(errors),),
    options=[
      *channel_options(max_message_bytes, max_receive_bytes),
      ("grpc.server.max_pending_requests", MAX_PENDING_CALLS),
      ("grpc.server.max_pending_requests_hard_limit", 2 * MAX_PENDING_CALLS),
    ],
    maximum_concurrent_rpcs=None,
  )
  server.add_generic_rpc_handlers((methods_handler,))
  try:
    if tls is not None:
      port = server.add_secure_port(address, tls.server_credentials())
    else:
      port = server.add_insecure_port(address)
  except RuntimeError:  # what grpc raises where its older releases returned 0
    port = 0
  if port == 0:
    executor.shutdown(wait=False)
    raise OSError(
      f"Cannot listen on {address!r}: the port is in use, or the host is "
      "not an address of this machine."
    )
  return ServerHandle(server, executor, errors), port


class ServerHandle:
  """A gRPC server and the thread pool it runs on (grpc does not stop it);
  `errors` counts the calls it answered with a status other than OK."""

  def __init__(
    self,
    server: grpc.Server,
    executor: concurrent.futures.ThreadPoolExecutor,
    errors: rpc_errors.ErrorCounts | None = None,
  ):
    self.server = server
    self.executor = executor
    self.errors = errors if errors is not None else rpc_errors.ErrorCounts()

  def start(self) -> None:
    self.server.start()

  def wait_for_termination(self, timeout: float | None = None) -> bool:
    return self.server.wait_for_termination(timeout)

  def stop(self, timeout_s: float = 5.0) -> None:
    self.server.stop(grace=None).wait(timeout_s)
    self.executor.shutdown(wait=True, cancel_futures=True)
