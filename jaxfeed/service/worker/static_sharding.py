"""Static sharding of a task's pipeline (FILE, DATA, FILE_OR_DATA, HINT):
worker i of n reads its own part of the input, fixed when the job starts.

- FILE: files i, i + n, i + 2n, ... of the pipeline's file input: the files
  of `from_tfrecord`, or the elements of the input an `interleave` /
  `flat_map` opens a dataset for (`jaxfeed.ops.index_ranges.reads_files`).
  A worker with no file (more workers than files) reads nothing.
- DATA: the pipeline's `from_source` sampler gets ShardOptions(i, n), so a
  worker reads only its own records; a pipeline without one runs whole on
  every worker, which keeps elements i, i + n, ... of its output (tf.data's
  DATA).
- FILE_OR_DATA: FILE where the pipeline reads files, else DATA.
- HINT: every `shard(SHARD_HINT, SHARD_HINT)` becomes `shard(n, i)`.
"""

from __future__ import annotations

from typing import Any, Callable

from jaxfeed.ops import base
from jaxfeed.ops import index_ranges
from jaxfeed.ops import shard
from jaxfeed.sampler import IndexSampler
from jaxfeed.service.protocol import spec as spec_lib
from jaxfeed.service.protocol.protos import service_pb2 as pb
from jaxfeed.service.protocol.sharding import ShardingPolicy

SOURCE_OP = "from_source"

Decode = Callable[[Any], base.Node]
"""Rebuilds the task's pipeline with a `spec.NodeRewrite` (or None)."""


def check_pipeline(node: base.Node, policy: ShardingPolicy | None) -> None:
  """Refuses, on the client, a pipeline its static policy cannot shard.

  Raises:
    ValueError: FILE without a file input; HINT without a
      `shard(SHARD_HINT, SHARD_HINT)`, or such a placeholder under another
      policy.
  """
  hinted = shard.has_shard_hint(node)
  if policy == ShardingPolicy.HINT and not hinted:
    raise ValueError(
      "processing_mode HINT shards where the pipeline says so, but it has no "
      "shard(jaxfeed.service.SHARD_HINT, jaxfeed.service.SHARD_HINT): add one "
      "where each worker should keep its share (after the file names, "
      "before reading them), or use FILE / DATA / FILE_OR_DATA."
    )
  if hinted and policy != ShardingPolicy.HINT:
    name = "none (a local run)" if policy is None else policy.name
    raise ValueError(
      f"The pipeline holds shard(SHARD_HINT, SHARD_HINT), a placeholder only "
      f"processing_mode HINT fills in; the processing mode is {name}. Use "
      "processing_mode='HINT' or give shard() numbers."
    )
  if policy == ShardingPolicy.FILE and not index_ranges.reads_files(node):
    raise ValueError(file_error("the pipeline"))


def file_error(what: str) -> str:
  return (
    f"FILE sharding gives each worker its own files, but {what} reads "
    "no files it could split: FILE shards from_tfrecord([files]) or the "
    "file names an interleave / flat_map opens (from_tensor_slices(files)"
    ".interleave(read_one_file), list_files(...).interleave(...)). Use "
    "DATA (a from_source sampler's records) or FILE_OR_DATA."
  )


def resolve(policy: ShardingPolicy, node: base.Node) -> ShardingPolicy:
  """FILE_OR_DATA as FILE or DATA for this pipeline; other policies as they are."""
  if policy != ShardingPolicy.FILE_OR_DATA:
    return policy
  return ShardingPolicy.FILE if index_ranges.reads_files(node) else ShardingPolicy.DATA


def shard_task(policy: ShardingPolicy, task: pb.TaskInfo, decode: Decode) -> base.Node:
  """The task's pipeline (its Options root included) with worker
  `task.worker_index` of `task.num_workers`'s share of a static policy.

  Raises:
    SpecError: the pipeline cannot be sharded that way (the message says
      how it can).
  """
  if policy in (ShardingPolicy.FILE, ShardingPolicy.FILE_OR_DATA):
    node = decode(None)
    policy = resolve(policy, node)
  if policy == ShardingPolicy.FILE:
    if not index_ranges.reads_files(node):
      raise spec_lib.SpecError(file_error(f"dataset {task.dataset_id!r}"))
    try:
      return index_ranges.over_positions(node, task.worker_index, task.num_workers)
    except index_ranges.NotIndexAddressableError as e:
      raise spec_lib.SpecError(f"Dataset {task.dataset_id!r}: {e}") from e
  if policy == ShardingPolicy.HINT:
    return decode(_fill_hints(task))
  touched: list = []
  node = decode(_shard_sampler(task, policy, touched))
  if not touched:  # tf.data's DATA: run it all, keep every n-th element
    return _shard_output(node, task)
  if len(touched) > 1:
    raise spec_lib.SpecError(
      f"{policy.name} sharding shards the pipeline's from_source sampler, but "
      f"dataset {task.dataset_id!r} has {len(touched)}: it cannot tell which "
      "to shard. Mix them into one source (Dataset.mix), or use "
      "processing_mode 'parallel_epochs' (OFF) or 'distributed_epoch' (DYNAMIC)."
    )
  return node


def _shard_output(node: base.Node, task: pb.TaskInfo) -> base.Node:
  """`node` (under its Options root, if any) followed by shard(n, i)."""
  if node.op_name == "with_options":
    inner = shard.ShardNode(node.parents[0], task.num_workers, task.worker_index)
    return type(node)(inner, **node.spec_params())
  return shard.ShardNode(node, task.num_workers, task.worker_index)


def _fill_hints(task: pb.TaskInfo) -> spec_lib.NodeRewrite:
  def rewrite(cls: type, params: dict) -> tuple[type, dict]:
    if getattr(cls, "op_name", None) == "shard" and params.get("num_shards") == shard.SHARD_HINT:
      return cls, {**params, "num_shards": task.num_workers, "index": task.worker_index}
    return cls, params

  return rewrite


def _is_sampler(value: Any) -> bool:
  return hasattr(value, "get_many") and hasattr(value, "num_positions")


def _shard_sampler(
  task: pb.TaskInfo, policy: ShardingPolicy, touched: list
) -> spec_lib.NodeRewrite:
  """Gives the `from_source` sampler ShardOptions(worker_index, num_workers)."""

  def rewrite(cls: type, params: dict) -> tuple[type, dict]:
    if getattr(cls, "op_name", None) != SOURCE_OP:
      return cls, params
    sampler = params.get("sampler")
    source = params.get("source")
    if sampler is None and source is not None:
      sampler = IndexSampler(len(source))
    if not _is_sampler(sampler):
      return cls, params
    touched.append(sampler)
    sampler_params = dict(sampler.spec_params())
    current = dict(sampler_params.get("shard_options") or {})
    if current.get("shard_count", 1) != 1:
      raise spec_lib.SpecError(
        f"{policy.name} sharding shards the pipeline's sampler itself, but it "
        f"is already sharded ({current}); give the pipeline an unsharded sampler."
      )
    sampler_params["shard_options"] = {
      "shard_index": task.worker_index,
      "shard_count": task.num_workers,
      "drop_remainder": False,
    }
    return cls, {**params, "sampler": type(sampler)(**sampler_params)}

  return rewrite
