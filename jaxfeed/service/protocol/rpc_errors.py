"""Failed calls, counted by method and status code, on both ends of a call.

Every gRPC server the service makes (`rpc_server.make_server`) counts the calls it
answered with a status other than OK in its `ServerHandle.errors`; the
worker's data socket counts its refusals and failures the same way, as method
"data_socket". Every channel it makes (`rpc.make_channel`) counts the calls of
this process that failed in the process-wide `CLIENT_ERRORS`, as does every
data connection. A call the caller cancelled itself is no error. The metrics
(`jaxfeed.service.metrics`) export both.
"""

from __future__ import annotations

import collections
import threading
from typing import Any, Callable

import grpc

DATA_SOCKET = "data_socket"
# A method that is not the service's: its name came from the network, so it is
# not a label (a caller could make the labels unbounded).
UNKNOWN_METHOD = "unknown"


class ErrorCounts:
  """Failed calls by (method, status code name); thread-safe."""

  def __init__(self):
    self._lock = threading.Lock()
    self._counts: collections.Counter = collections.Counter()

  def add(self, method: str, code: str) -> None:
    with self._lock:
      self._counts[(method, code)] += 1

  def snapshot(self) -> dict[tuple[str, str], int]:
    with self._lock:
      return dict(self._counts)


# The calls this process made that failed (clients, and workers calling the
# dispatcher).
CLIENT_ERRORS = ErrorCounts()


def _method_name(full_method: str) -> str:
  return full_method.rsplit("/", 1)[-1]


def _code_name(code: Any) -> str:
  return code.name if isinstance(code, grpc.StatusCode) else "UNKNOWN"


class ServerErrorInterceptor(grpc.ServerInterceptor):
  """Counts the calls a server ends with a status other than OK."""

  def __init__(self, counts: ErrorCounts):
    self._counts = counts

  def intercept_service(self, continuation: Callable, handler_call_details: Any) -> Any:
    handler = continuation(handler_call_details)
    if handler is None:  # grpc answers UNIMPLEMENTED
      self._counts.add(UNKNOWN_METHOD, "UNIMPLEMENTED")
      return None
    method = _method_name(handler_call_details.method)
    if handler.unary_unary is not None:
      return grpc.unary_unary_rpc_method_handler(
        self._counted(method, handler.unary_unary, streams=False),
        handler.request_deserializer,
        handler.response_serializer,
      )
    if handler.unary_stream is not None:
      return grpc.unary_stream_rpc_method_handler(
        self._counted(method, handler.unary_stream, streams=True),
        handler.request_deserializer,
        handler.response_serializer,
      )
    if handler.stream_stream is not None:
      return grpc.stream_stream_rpc_method_handler(
        self._counted(method, handler.stream_stream, streams=True),
        handler.request_deserializer,
        handler.response_serializer,
      )
    return handler  # the service has no client-streaming methods to count

  def _counted(self, method: str, behavior: Callable, streams: bool) -> Callable:
    counts = self._counts

    def count(context: Any) -> None:
      if not context.is_active():
        return  # the caller left first (cancelled, or gone): nobody gets this error
      code = context.code()
      if code != grpc.StatusCode.OK:  # None: an exception grpc answers UNKNOWN
        counts.add(method, _code_name(code))

    def ended(context: Any) -> None:  # returned normally: a status set or none
      code = context.code()
      if code is not None and code != grpc.StatusCode.OK:
        counts.add(method, _code_name(code))

    if not streams:

      def unary(request: Any, context: Any) -> Any:
        try:
          response = behavior(request, context)
        except Exception:
          count(context)
          raise
        ended(context)
        return response

      return unary

    def stream(request: Any, context: Any) -> Any:
      try:
        yield from behavior(request, context)
      except Exception:
        count(context)
        raise
      ended(context)

    return stream


class ClientErrorInterceptor(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
  """Counts the calls of a channel that end with a status other than OK."""

  def __init__(self, counts: ErrorCounts):
    self._counts = counts

  def _watch(self, details: Any, call: Any) -> Any:
    method = _method_name(details.method)

    def done(finished: Any) -> None:
      code = finished.code()
      if code not in (grpc.StatusCode.OK, grpc.StatusCode.CANCELLED):
        self._counts.add(method, _code_name(code))

    call.add_done_callback(done)
    return call

  def intercept_unary_unary(
    self, continuation: Callable, client_call_details: Any, request: Any
  ) -> Any:
    return self._watch(client_call_details, continuation(client_call_details, request))

  def intercept_unary_stream(
    self, continuation: Callable, client_call_details: Any, request: Any
  ) -> Any:
    return self._watch(client_call_details, continuation(client_call_details, request))
