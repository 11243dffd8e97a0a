"""gRPC plumbing shared by the dispatcher, workers and clients: TLS, tokens
and tickets, channels and calls, and the errors methods raise (the servers'
side is `rpc_server`)."""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import ipaddress
import logging
import math
import os
import signal
import ssl
import sys
import tempfile
import time
from typing import Any, Callable, NoReturn

import grpc
from google.protobuf import message as pb_message

from jaxfeed.service.protocol import rpc_errors

TOKEN_METADATA_KEY = "x-jaxfeed-token"
DEFAULT_MAX_MESSAGE_BYTES = 64 << 20
# Metadata is read before a call is authenticated: keep it small.
MAX_METADATA_BYTES = 16 << 10
CLIENT, WORKER = "client", "worker"  # the roles of a dispatcher's callers


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
  """PEM bytes for TLS.

  Servers need key + certificate, and with client_ca they require every
  caller to present a certificate it signed (mutual TLS). Clients need the
  root CA, and a key + certificate of their own where servers require one.
  """

  private_key: bytes | None = None
  certificate_chain: bytes | None = None
  root_certificates: bytes | None = None
  client_ca: bytes | None = None

  @classmethod
  def from_files(
    cls,
    private_key: str = "",
    certificate_chain: str = "",
    root_certificates: str = "",
    client_ca: str = "",
  ) -> "TLSConfig | None":
    """Reads the PEM files given (empty names are left out); None if none is."""
    if not (private_key or certificate_chain or root_certificates or client_ca):
      return None
    if bool(private_key) != bool(certificate_chain):
      raise ValueError(
        "TLS: give both the private key and the certificate chain file, got "
        f"key={private_key!r}, certificate={certificate_chain!r}."
      )

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

    return cls(read(private_key), read(certificate_chain), read(root_certificates), read(client_ca))

  @property
  def verifies_clients(self) -> bool:
    return bool(self.client_ca)

  def server_credentials(self) -> grpc.ServerCredentials:
    if not self.private_key or not self.certificate_chain:
      raise ValueError("TLS on a server needs private_key and certificate_chain PEM bytes.")
    return grpc.ssl_server_credentials(
      [(self.private_key, self.certificate_chain)],
      root_certificates=self.client_ca,
      require_client_auth=self.verifies_clients,
    )

  def channel_credentials(self) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(
      root_certificates=self.root_certificates,
      private_key=self.private_key,
      certificate_chain=self.certificate_chain,
    )

  def _load_own_certificate(self, context: ssl.SSLContext) -> None:
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

  def server_ssl_context(self) -> ssl.SSLContext:
    """The same key and certificate (and client CA) for the raw data socket."""
    if not self.private_key or not self.certificate_chain:
      raise ValueError("TLS on a server needs private_key and certificate_chain PEM bytes.")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    self._load_own_certificate(context)
    if self.verifies_clients:
      context.verify_mode = ssl.CERT_REQUIRED
      context.load_verify_locations(cadata=self.client_ca.decode("ascii"))
    return context

  def client_ssl_context(self) -> ssl.SSLContext:
    """Verifies servers against root_certificates (the system's when None)."""
    roots = self.root_certificates.decode("ascii") if self.root_certificates else None
    context = ssl.create_default_context(cadata=roots)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    if self.private_key and self.certificate_chain:
      self._load_own_certificate(context)  # for servers that verify clients
    return context


def read_secret(value: str, path: str, flag: str) -> str | None:
  """A secret from the flag `--flag` or, better (`ps` shows no file
  contents), from the file of `--flag_file`; None when neither is given."""
  if value and path:
    raise ValueError(f"Give --{flag} or --{flag}_file, not both.")
  if not path:
    return value or None
  try:
    with open(path) as f:
      text = f.read().strip()
    mode = os.stat(path).st_mode
  except OSError as e:
    raise ValueError(f"Cannot read --{flag}_file {path!r}: {e.strerror}.") from e
  if not text:
    raise ValueError(f"--{flag}_file {path!r} is empty.")
  if mode & 0o077:
    logging.warning(
      "--%s_file %s can be read by other users (mode %o): chmod 600 it.", flag, path, mode & 0o777
    )
  return text


def is_loopback_host(host: str) -> bool:
  """Whether binding `host` is reachable from this machine only."""
  if host == "localhost":
    return True
  try:
    return ipaddress.ip_address(host.strip("[]")).is_loopback
  except ValueError:
    return False  # a host name: it may resolve beyond this machine


def check_bind_is_safe(who: str, host: str, authenticated: bool, insecure: bool, how: str) -> None:
  """Raises ValueError when a server would bind beyond loopback unauthenticated."""
  if is_loopback_host(host) or authenticated or insecure:
    return
  raise ValueError(
    f"{who}: refusing to bind {host!r} (reachable from other machines) "
    f"without authentication: anyone who reaches it could {how}. Set "
    "the tokens (or TLS with a client CA that verifies callers), or pass "
    "insecure=True (--insecure) on a network you trust."
  )


def define_auth_flags(flags: Any) -> None:
  """The flags of credentials and trust that dispatcher and workers share."""
  flags.DEFINE_string(
    "worker_token", "", "Token of the workers (tests; prefer --worker_token_file)."
  )
  flags.DEFINE_string("worker_token_file", "", "File holding the workers' token.")
  flags.DEFINE_string(
    "pickled_udf_secret",
    "",
    "Shared secret of signed pickled UDFs (tests; prefer --pickled_udf_secret_file).",
  )
  flags.DEFINE_string(
    "pickled_udf_secret_file", "", "File holding the secret of signed pickled UDFs."
  )
  flags.DEFINE_string(
    "udf_modules",
    "",
    "Comma-separated modules (or package "
    "prefixes ending in '.') pipelines may import UDFs and classes "
    "from, beyond jaxfeed's and numpy's; e.g. mypkg.,examples.",
  )
  flags.DEFINE_bool(
    "insecure",
    False,
    "Allow binding beyond loopback without authentication (a trusted network only).",
  )
  flags.DEFINE_string(
    "tls_client_ca",
    "",
    "PEM CA file: require TLS callers to present "
    "a certificate it signed (mutual TLS; with --tls_key).",
  )


def read_ticket(key: bytes, task_id: int) -> str:
  """The credential that lets a client read task `task_id` on the worker
  holding `key`: the dispatcher hands it to the task's clients, so workers
  never see (and cannot replay) a client's token."""
  return hmac.new(key, b"jaxfeed read ticket %d" % task_id, hashlib.sha256).hexdigest()


def goodbye_ticket(master_key: bytes, job_id: int, client_id: int) -> str:
  """What a client hands a worker with its goodbye, and the dispatcher
  checks when the worker forwards it: only the dispatcher holds the key, so
  a peer that reads the same task cannot release another client."""
  return hmac.new(
    master_key, b"jaxfeed goodbye %d %d" % (job_id, client_id), hashlib.sha256
  ).hexdigest()


def worker_ticket_key(master_key: bytes, worker_address: str) -> bytes:
  """A worker's own ticket key: it verifies tickets for its tasks only."""
  return hmac.new(
    master_key, b"jaxfeed worker ticket key\0" + worker_address.encode(), hashlib.sha256
  ).digest()


def hex_digest_matches(expected: str, sent: Any) -> bool:
  """Whether a peer sent the hex digest `expected` (a ticket), compared in
  constant time. Anything not a str is no match, and neither is a str that
  is not UTF-8 (a lone surrogate from a JSON hello) rather than an error."""
  return isinstance(sent, str) and hmac.compare_digest(
    expected.encode(), sent.encode(errors="replace")
  )


def ticket_matches(key: bytes, task_id: int, sent: Any) -> bool:
  return hex_digest_matches(read_ticket(key, task_id), sent)


def metadata_token(metadata: Any) -> str | None:
  """The credential a call carries in its metadata, if any."""
  for key, value in metadata or ():
    if key == TOKEN_METADATA_KEY:
      return value if isinstance(value, str) else None
  return None


# How often a call that may be cancelled checks whether it is, and how long
# its first attempt waits before it becomes one (call_with_retry).
_CANCEL_POLL_S = 0.1
_QUICK_ATTEMPT_S = 2.0

# The first and the longest wait before a channel reconnects, in milliseconds.
RECONNECT_BACKOFF_MS = (200, 2000)


def channel_options(
  max_message_bytes: int, max_receive_bytes: int | None = None
) -> list[tuple[str, Any]]:
  return [
    ("grpc.max_send_message_length", max_message_bytes),
    ("grpc.max_receive_message_length", max_receive_bytes or max_message_bytes),
    ("grpc.max_metadata_size", MAX_METADATA_BYTES),
    ("grpc.so_reuseport", 0),
    # gRPC's default reconnect backoff grows to 120 s: a dispatcher or
    # worker that is back after a few seconds would go unnoticed for
    # minutes.
    ("grpc.initial_reconnect_backoff_ms", RECONNECT_BACKOFF_MS[0]),
    ("grpc.min_reconnect_backoff_ms", RECONNECT_BACKOFF_MS[0]),
    ("grpc.max_reconnect_backoff_ms", RECONNECT_BACKOFF_MS[1]),
  ]


_WILDCARD_HOSTS = frozenset({"0.0.0.0", "::", "[::]", ""})


def is_wildcard_host(host: str) -> bool:
  """Whether `host` binds every interface (and so names no reachable host)."""
  return host in _WILDCARD_HOSTS


def make_channel(
  target: str, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, tls: TLSConfig | None = None
) -> grpc.Channel:
  """A channel to `target` whose failed calls count in `rpc_errors.CLIENT_ERRORS`."""
  if tls is not None:
    channel = grpc.secure_channel(
      target, tls.channel_credentials(), options=channel_options(max_message_bytes)
    )
  else:
    channel = grpc.insecure_channel(target, options=channel_options(max_message_bytes))
  return grpc.intercept_channel(
    channel, rpc_errors.ClientErrorInterceptor(rpc_errors.CLIENT_ERRORS)
  )


class Caller:
  """Calls one method of a channel with token metadata and a deadline."""

  def __init__(
    self,
    channel: grpc.Channel,
    method: str,
    response_cls: type | None,
    token: str | None,
    streams: bool = False,
  ):
    """response_cls None: responses arrive as their raw bytes."""
    make = channel.unary_stream if streams else channel.unary_unary
    self._call = make(
      method,
      request_serializer=lambda m: m.SerializeToString(),
      response_deserializer=response_cls.FromString if response_cls else None,
    )
    self._metadata = ((TOKEN_METADATA_KEY, token),) if token else None
    self.method = method

  def __call__(
    self, request: pb_message.Message, timeout: float | None, wait_for_ready: bool = False
  ) -> Any:
    return self._call(
      request, timeout=timeout, metadata=self._metadata, wait_for_ready=wait_for_ready
    )

  def future(
    self, request: pb_message.Message, timeout: float | None, wait_for_ready: bool = False
  ) -> Any:
    """The call, made without waiting: a `grpc.Future` of its response."""
    return self._call.future(
      request, timeout=timeout, metadata=self._metadata, wait_for_ready=wait_for_ready
    )


def call_with_retry(
  caller: Caller,
  request: pb_message.Message,
  timeout_s: float | None,
  what: str,
  attempt_s: float | None = None,
  cancelled: Callable[[], bool] | None = None,
  *,
  target: str = "",
  answer_within_s: float | None = None,
  unanswered_hint: str = "",
) -> Any:
  """Calls until success, retrying while the server is unreachable.

  Args:
    caller: the method to call.
    request: its request.
    timeout_s: how long to retry; None: for as long as it takes.
    what: what the call does, for the error ("Fetching dataset 7").
    attempt_s: the deadline of each call (None: what is left of timeout_s):
      a call hung on a connection that broke without a reset, or on a
      stopped server, is made again.
    cancelled: polled while a call waits (past a first plain attempt of
      _QUICK_ATTEMPT_S); once true, the call is cancelled and ServiceError
      raised (whoever needed the answer is gone).
    target: the server's address, for the error of `answer_within_s`.
    answer_within_s: the calls of its first seconds fail fast, and if all
      of those found nothing that answers at `target` (the connection
      refused, an unknown host, a handshake that fails: no server there, or
      another TLS setting), the error comes after `answer_within_s` rather
      than `timeout_s`, with `unanswered_hint` added. A server that
      answers, or is slow to (a deadline passes), gets the whole timeout_s.
    unanswered_hint: see `answer_within_s`.

  Returns:
    The response.

  Raises:
    ServiceError: the server refused the call, timeout_s passed, or it was
      cancelled; its message names the status and `what`.
  """
  start = time.monotonic()
  deadline = None if timeout_s is None else start + timeout_s
  answer_by = (
    None
    if answer_within_s is None
    else start + min(answer_within_s, math.inf if timeout_s is None else timeout_s)
  )
  retried = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
  first = True
  while True:
    until = deadline if answer_by is None else answer_by
    left = math.inf if until is None else until - time.monotonic()
    limit = min(left, attempt_s if attempt_s is not None else math.inf)
    if cancelled is not None and first:
      # Most calls are answered at once: a plain call, without a future's
      # thread hops (a few ms each), and cancellable calls only after it.
      limit = min(limit, _QUICK_ATTEMPT_S)
    timeout = None if limit == math.inf else max(limit, 0.05)
    wait_for_ready = answer_by is None
    try:
      if cancelled is None or first:
        first = False
        return caller(request, timeout=timeout, wait_for_ready=wait_for_ready)
      future = caller.future(request, timeout=timeout, wait_for_ready=wait_for_ready)
      while True:
        try:
          return future.result(timeout=_CANCEL_POLL_S)
        except grpc.FutureTimeoutError:
          if cancelled():
            future.cancel()
            raise ServiceError(f"{what} was given up: whoever needed it is gone.") from None
    except grpc.RpcError as e:
      code = e.code()
      if answer_by is not None and code == grpc.StatusCode.UNAVAILABLE:
        unanswered_left = answer_by - time.monotonic()
        if unanswered_left > 0:  # the error comes after answer_within_s, not before
          time.sleep(min(0.1, unanswered_left))
          continue
        raise ServiceError(
          f"{what} failed: no answer within {answer_by - start:g} s from {target}: "
          f"nothing answers there ({code.name}: {e.details()}). Check that the server "
          "is up at that address and that client and server agree on TLS and its "
          f"certificates{unanswered_hint}."
        ) from e
      answer_by = None  # it answered, or is slow to: the whole timeout_s
      if code in retried and (deadline is None or deadline - time.monotonic() > 0.05):
        if cancelled is not None and cancelled():
          raise ServiceError(f"{what} was given up: whoever needed it is gone.") from e
        time.sleep(0.05)
        continue
      hint = ""
      if code in retried:
        hint = (
          f" (no answer within {timeout_s:g} s: check that the server is up at "
          "that address and that client and server agree on TLS and its "
          "certificates)"
        )
      raise ServiceError(f"{what} failed: {code.name}: {e.details()}{hint}") from e


def exit_for_bad_flags(program: str, error: Exception | str) -> NoReturn:
  """Ends a server's command line that it cannot act on (a flag's value, a
  port it cannot listen on, a folder it cannot use): the reason in one line,
  no traceback, exit status 2 as for a usage error."""
  print(f"{program}: {error}", file=sys.stderr, flush=True)
  raise SystemExit(2)


def stop_on_sigterm() -> None:
  """Makes SIGTERM end the main thread with SystemExit(0), so a server's
  command-line main stops it (and what it started) in its `finally`."""

  def exit_cleanly(signum, frame):
    del signum, frame
    raise SystemExit(0)

  signal.signal(signal.SIGTERM, exit_cleanly)
