"""`distributed_save`: the service's workers write a pipeline's output to a folder.

tf.data's `tf.data.experimental.distributed_save(dataset, path,
data_service_address, wait=False)`. The dispatcher registers the save and
its workers write it in parallel, in chunks of the positions of the
pipeline's input handed out first come first served (see
`jaxfeed.service.dispatcher.saves`); `Dataset.load(path)` reads the result
(the format of `Dataset.save`). A worker killed mid-save loses nothing (its
chunk goes to another worker), a dispatcher restarted with its `--work_dir`
goes on with the save, and a chunk is committed once.

What is written is the pipeline's output as a multiset: chunk k holds the
elements of positions [k * C, (k + 1) * C), so a pipeline whose ops after
its input act element by element (map, filter, shuffle, unbatch,
interleave, ...) is saved in parallel and loads in the order a local run
gives (up to `shuffle`). A pipeline with an op whose output depends on where
it starts (`batch`, `take`, `enumerate`, `repeat`, ...) or with an input
that cannot be split (`from_generator`) is written whole, as one chunk, by
one worker: batch after loading instead to spread such a save.
"""

from __future__ import annotations

import os
from typing import Any

from jaxfeed.ops import base
from jaxfeed.ops import index_ranges
from jaxfeed.ops import load as load_lib
from jaxfeed.ops import save_format
from jaxfeed.service.client.job_calls import call_dispatcher, dispatcher_caller
from jaxfeed.service.protocol import rpc
from jaxfeed.service.protocol import spec as spec_lib
from jaxfeed.service.protocol.protos import service_pb2 as pb
from jaxfeed.service.worker import task_pipeline

__all__ = ["distributed_save", "splittable_positions"]

# Ops that turn each input element into elements of their own whatever
# elements came before: chunks of positions give the pipeline's multiset.
_PER_ELEMENT_OPS = frozenset(
  {
    "map",
    "random_map",
    "filter",
    "map_and_filter",
    "prefetch",
    "shuffle",
    "unbatch",
    "flat_map",
    "interleave",
    "ignore_errors",
    "autocache",
    "with_options",
  }
)


def splittable_positions(node: base.Node) -> int:
  """Positions `distributed_save` splits into chunks: those of the pipeline's
  input when only per-element ops follow it; -1 (one chunk) otherwise."""
  try:
    split = index_ranges.split_input(node)
  except index_ranges.NotIndexAddressableError:
    return -1
  current = node
  while current is not split:
    if current.op_name not in _PER_ELEMENT_OPS or len(current.parents) != 1:
      return -1
    current = current.parents[0]
  count = index_ranges.num_positions(split)
  return -1 if count is None else int(count)


def _absolute(path: Any) -> str:
  if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
    raise TypeError(f"distributed_save: path must be a non-empty str or path, got {path!r}.")
  path = os.fspath(path)
  return path if "://" in path else os.path.abspath(path)


def distributed_save(
  dataset: Any,
  path: Any,
  service: str,
  wait: bool = False,
  *,
  compression: str | None = None,
  chunk_positions: int = 0,
  auth_token: str | None = None,
  udf_secret: bytes | None = None,
  tls: rpc.TLSConfig | None = None,
  timeout_s: float = 60.0,
  wait_for_dispatcher: bool = False,
  wait_timeout_s: float | None = None,
) -> None:
  """Has the service's workers write `dataset`'s output to the folder `path`.

  Args:
    dataset: a jaxfeed Dataset; its functions must be importable by the
      workers (or pickled with `udf_secret`), as for `distribute`.
    path: the folder, as the workers see it (made absolute here; shared
      storage when workers run on other hosts). A folder with an incomplete
      save of the same pipeline is resumed; any other saved dataset there is
      an error.
    service: the dispatcher's "host:port".
    wait: block until the save is complete (tf.data's `wait`); False
      returns once the dispatcher registered it.
    compression: None, "SNAPPY" or "ZSTD".
    chunk_positions: positions of the pipeline's input per chunk; 0: about
      64 chunks.
    auth_token: as for `register_dataset`.
    udf_secret: as for `register_dataset`.
    tls: as for `register_dataset`.
    timeout_s: as for `register_dataset`.
    wait_for_dispatcher: as for `register_dataset`.
    wait_timeout_s: with `wait`, raise TimeoutError after this long (None:
      wait however long the save takes).

  Raises:
    ServiceError: the dispatcher refused the save (ALREADY_EXISTS: `path`
      holds another saved dataset) or could not be reached.
  """
  node = task_pipeline.pipeline_node(dataset, "distributed_save")
  if chunk_positions < 0:
    raise ValueError(f"distributed_save: chunk_positions must be >= 0, got {chunk_positions}.")
  save_format.array_record_options(compression)  # a ValueError here, before any call
  path = _absolute(path)
  pipeline, _ = task_pipeline.unwrap_options(node)
  dataset_def = spec_lib.to_dataset_def(
    node, udf_secret, num_positions=splittable_positions(pipeline)
  )
  target = service[len("grpc://") :] if service.startswith("grpc://") else service
  channel = rpc.make_channel(target, tls=tls)
  try:
    caller = dispatcher_caller(channel, "StartSave", pb.StartSaveResponse, auth_token)
    call_dispatcher(
      caller,
      pb.StartSaveRequest(
        dataset=dataset_def,
        path=path,
        chunk_positions=chunk_positions,
        compression=compression or "",
      ),
      target,
      timeout_s,
      wait_for_dispatcher,
      f"Starting the distributed save to {path} at {service}",
    )
  finally:
    channel.close()
  if wait:
    load_lib.wait_until_complete(path, wait_timeout_s)
