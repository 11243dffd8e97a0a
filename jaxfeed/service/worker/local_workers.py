"""The workers of this process (tf.data service's LocalWorkers) and the
in-memory connection through which a client in the same process reads them.

A `WorkerServer` adds its state here when it starts and removes it when it
stops. A read with `target_workers="local"` (see
`jaxfeed.service.protocol.target_workers`) takes the batches of such a
worker's tasks with a `LocalConnection`: straight from the task's client
stream (`jaxfeed.service.worker.delivery`), as the arrays the pipeline made,
with no socket, no encoding and no copy. Everything else about the stream is
the same as over a socket: sequence numbers, acknowledgments, keepalives,
exactly-once split ends and the task's end statistics.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

from jaxfeed.service.protocol import data_socket
from jaxfeed.service.protocol import rpc
from jaxfeed.service.protocol.protos import service_pb2 as pb
from jaxfeed.service.worker import client_calls
from jaxfeed.service.worker import delivery
from jaxfeed.service.worker import task_runner

_lock = threading.Lock()
_workers: "weakref.WeakValueDictionary[str, Any]" = weakref.WeakValueDictionary()


def add(address: str, worker: Any) -> None:
  """Lists a started worker's `WorkerState` under its gRPC address."""
  with _lock:
    _workers[address] = worker


def remove(address: str, worker: Any) -> None:
  """Unlists a stopped worker (only if `worker` is the one listed)."""
  with _lock:
    if _workers.get(address) is worker:
      del _workers[address]


def get(address: str) -> Any:
  """The `WorkerState` of this process's worker at `address`, or None."""
  with _lock:
    worker = _workers.get(address)
  return None if worker is None or worker.stop.is_set() else worker


def empty() -> bool:
  """Whether this process runs no worker."""
  with _lock:
    return not any(not w.stop.is_set() for w in _workers.values())


class LocalConnection:
  """A client's connection to one task of a worker in its own process,
  with `data_socket.DataConnection`'s interface; its frames are
  `wire.Frame`s (their `value()` is the element)."""

  def __init__(self, worker: Any, hello: dict):
    client_calls.ClientCalls(worker).check_hello(hello)
    request = pb.GetElementsRequest(
      task_id=hello["task_id"],
      consumer_index=hello.get("consumer_index", 0),
      round=hello.get("round", 0),
      client_id=hello.get("client_id", 0),
      received=hello.get("received", 0),
      window=hello.get("window", 0),
      skip=hello.get("skip", 0),
    )
    self._closed = threading.Event()
    self.end_stats: dict = {}
    self.split_stop = 0
    try:
      self._stream, token = worker.open_stream(request, self._closed.set, "memory")
    except rpc.NotFoundError as e:
      raise data_socket.DataConnectionError(str(e), "NOT_FOUND") from e
    except task_runner.TaskFailed as e:
      raise data_socket.DataConnectionError(str(e), e.status) from e
    self._worker = worker
    self._items = self._stream.items(
      token, request.received, self._is_active, self._stream.wait_for_ack
    )

  def _is_active(self) -> bool:
    return not (self._closed.is_set() or self._worker.stop.is_set())

  def next_item(self) -> tuple[int, int, Any, int] | None:
    """As `DataConnection.next_item`; every idle turn of the stream is a
    keepalive. Raises DataConnectionError when closed or superseded."""
    try:
      item = next(self._items)
    except StopIteration as end:
      if end.value is None:
        raise data_socket.DataConnectionError(
          "The in-process connection was closed (or a newer one took over).",
          "CANCELLED" if self._closed.is_set() else "UNAVAILABLE",
        ) from None
      self.end_stats = end.value
      return None
    except task_runner.TaskFailed as e:
      raise data_socket.DataConnectionError(str(e), e.status) from e
    if isinstance(item, delivery.Idle):
      return data_socket.KIND_KEEPALIVE, 0, None, int(item)
    if item.frame is None:
      self.split_stop = item.split_stop
      return data_socket.KIND_SPLIT_END, item.seq, None, item.round
    return data_socket.KIND_FRAME, item.seq, item.frame, item.round

  def ack(self, received: int) -> None:
    self._stream.ack(received)

  def stop_receiving(self) -> None:
    self._closed.set()

  def close(self) -> None:
    self._closed.set()
