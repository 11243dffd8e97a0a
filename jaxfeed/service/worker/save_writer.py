"""A worker's part of distributed saves (`jaxfeed.service.distributed_save`).

For each save the dispatcher lists in its heartbeat answers
(`active_saves`), a thread asks for chunks (`SaveChunks`), runs the
pipeline over each chunk's positions, writes the chunk
(`jaxfeed.ops.save_format.write_chunk`) and reports it with its next
request, until the dispatcher says the save is finished. A dispatcher that
is away is asked again until it answers: the chunks written meanwhile are
committed on disk already and reported once it is back.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable, Iterator, Sequence

import grpc

from etils import epath

from jaxfeed.ops import optimize
from jaxfeed.ops import save_format
from jaxfeed.service.protocol import rpc
from jaxfeed.service.protocol.protos import service_pb2 as pb
from jaxfeed.service.protocol.sharding import ShardingPolicy
from jaxfeed.service.worker import task_pipeline

__all__ = ["SaveWriters", "chunk_elements"]

_POLL_S = 0.2  # no chunk free yet: ask again after this
_RETRY_S = 1.0  # the dispatcher did not answer, or a chunk failed
_CALL_TIMEOUT_S = 10.0


class _Stopped(Exception):
  """The worker is stopping: the chunk being written is dropped."""


def chunk_elements(
  dataset_def: pb.DatasetDef,
  chunk: pb.SaveChunk,
  udf_secret: bytes | None,
  udf_modules: Sequence[str],
  stop: threading.Event,
) -> Iterator[Any]:
  """The pipeline's elements at the chunk's positions (all of them when
  `chunk.stop` is -1), as a local run gives them."""
  ranges = [(chunk.start, chunk.stop)]

  def fetch_once() -> tuple[list, bool]:
    taken = list(ranges)
    ranges.clear()
    return taken, True

  policy = ShardingPolicy.OFF if chunk.stop < 0 else ShardingPolicy.DYNAMIC
  task = pb.TaskInfo(dataset_id=f"save chunk {chunk.index}", sharding_policy=policy.value)
  node, options = task_pipeline.build_task_node(
    dataset_def, task, udf_secret, fetch_once, udf_modules
  )
  iterator = task_pipeline.run(optimize.optimize(node, options), options)
  try:
    for element in iterator:
      if stop.is_set():
        raise _Stopped()
      yield element
  finally:
    iterator.close()


class SaveWriters:
  """One writer thread per active save; `update` starts them, `close` ends them."""

  def __init__(
    self,
    channel: grpc.Channel,
    token: str | None,
    address: Callable[[], str],
    incarnation: str,
    udf_secret: bytes | None,
    udf_modules: Sequence[str],
  ):
    self._call = rpc.Caller(
      channel, "/jaxfeed.service.Dispatcher/SaveChunks", pb.SaveChunksResponse, token
    )
    self._address = address
    self._incarnation = incarnation
    self._udf_secret = udf_secret
    self._udf_modules = tuple(udf_modules)
    self._stop = threading.Event()
    self._lock = threading.Lock()
    self._threads: dict[str, threading.Thread] = {}

  def update(self, paths: Sequence[str]) -> None:
    """Starts a writer for each listed save this worker does not write yet."""
    with self._lock:
      for path in paths:
        running = self._threads.get(path)
        if self._stop.is_set() or (running is not None and running.is_alive()):
          continue
        thread = threading.Thread(
          target=self._write,
          args=(path,),
          daemon=True,
          name=f"jaxfeed-save-writer-{len(self._threads)}",
        )
        self._threads[path] = thread
        thread.start()

  def close(self, timeout_s: float = 5.0) -> None:
    self._stop.set()
    with self._lock:
      threads = list(self._threads.values())
    for thread in threads:
      thread.join(timeout_s)

  def _ask(self, request: pb.SaveChunksRequest) -> pb.SaveChunksResponse | None:
    try:
      return self._call(request, timeout=_CALL_TIMEOUT_S)
    except grpc.RpcError as e:
      logging.warning("SaveChunks for %s failed (asking again): %s", request.path, e.code())
      return None

  def _write(self, path: str) -> None:
    committed: list[int] = []
    failed: list[pb.SaveChunkFailure] = []
    dataset_def, compression = None, None
    folder = epath.Path(path)
    while not self._stop.is_set():
      response = self._ask(
        pb.SaveChunksRequest(
          path=path,
          worker_address=self._address(),
          incarnation=self._incarnation,
          committed=committed,
          failed=failed,
          max_chunks=1,
          want_dataset=dataset_def is None,
        )
      )
      if response is None:
        self._stop.wait(_RETRY_S)
        continue
      committed, failed = [], []
      if response.finished:
        return
      if dataset_def is None:
        dataset_def, compression = response.dataset, response.compression or None
      if not response.chunks:
        self._stop.wait(_POLL_S)
        continue
      for chunk in response.chunks:
        try:
          save_format.write_chunk(
            folder,
            chunk.index,
            chunk_elements(dataset_def, chunk, self._udf_secret, self._udf_modules, self._stop),
            compression,
          )
        except _Stopped:
          return
        except Exception as e:  # pylint: disable=broad-except
          # Reported: the dispatcher hands the chunk out again, or fails the
          # save once it failed max_split_attempts times.
          logging.exception("Writing chunk %d of the save at %s failed", chunk.index, path)
          failed.append(
            pb.SaveChunkFailure(index=chunk.index, error=f"{type(e).__name__}: {e}"[:2000])
          )
          break
        committed.append(chunk.index)
