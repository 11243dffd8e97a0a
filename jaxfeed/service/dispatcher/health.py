"""The dispatcher's health, as the standard gRPC health service tells it.

`grpc.health.v1.Health` (Check and Watch, what Kubernetes' gRPC probes and
`grpc_health_probe` ask) is served on the dispatcher's port without a token:
it tells a status, nothing else. The overall status ("") and the
dispatcher's service (`jaxfeed.service.Dispatcher`) are SERVING while its
journal takes writes, NOT_SERVING while a full disk refuses them (the
dispatcher retries and serves again on its own once space returns) and for
good once the journal failed (a failed fsync: the command-line dispatcher
then exits with `journal.FATAL_EXIT_STATUS` for its supervisor to restart
it). A dispatcher without a work_dir is always SERVING. Prometheus sees the
same in `jaxfeed_dispatcher_journal_healthy`.
"""

from __future__ import annotations

import threading

import grpc
from grpc_health.v1 import health
from grpc_health.v1 import health_pb2
from grpc_health.v1 import health_pb2_grpc

from jaxfeed.service.storage import journal as journal_lib

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class DispatcherHealth:
  """Serves a dispatcher's health on its gRPC server and follows its journal.

  Args:
    server: the dispatcher's gRPC server (not started yet).
    service_name: the dispatcher's gRPC service.
    journal: its journal; None: always healthy.
  """

  def __init__(self, server: grpc.Server, service_name: str, journal: journal_lib.Journal | None):
    self._servicer = health.HealthServicer()
    self._names = ("", service_name)
    self._journal = journal
    # Set once the journal failed for good: the process should end.
    self.failed = threading.Event()
    health_pb2_grpc.add_HealthServicer_to_server(self._servicer, server)
    if journal is not None:
      journal.add_listener(self._changed)
    self._changed(journal is None or journal.healthy)

  def _changed(self, healthy: bool) -> None:
    for name in self._names:
      self._servicer.set(name, SERVING if healthy else NOT_SERVING)
    if self._journal is not None and self._journal.failed:
      self.failed.set()

  def stopping(self) -> None:
    """NOT_SERVING from now on (the server is going away)."""
    self._servicer.enter_graceful_shutdown()
