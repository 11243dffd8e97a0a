"""Builds and runs a task's pipeline on a worker: the spec, the task's
sharding and the client's `jaxfeed.Options`.

Static sharding (FILE, DATA, FILE_OR_DATA, HINT) gives worker i of n its own
files, sampler shard or `shard(n, i)` (`jaxfeed.service.worker.static_sharding`).
OFF (`parallel_epochs`) gives worker i its own order of the whole pipeline
(`jaxfeed.service.worker.worker_orders`).
DYNAMIC sharding splits the positions of the pipeline's one index-addressable
input (`range`, `from_tensor_slices`, `from_source`, `from_tfrecord`'s files,
or a `concatenate` / `zip` of those; see `jaxfeed.ops.index_ranges`): the
dispatcher hands out ranges of positions (one file per split where they are
files) and the worker's pipeline reads the elements at them.
Every element keeps the seed it has in a local run (the sampler's per-record
seed for sources), so a record is augmented the same way whichever worker
reads it. With nothing lost, an epoch's elements are each delivered once in
total across the workers, as by tf.data service; unlike tf.data service, a
`zip` pairs the elements a local run pairs (the inputs share one position
space). Ops after the split input run on each worker's share: a `repeat`
there ends with the distributed epoch (repeat epochs through the sampler's
`num_epochs` instead).

The pipeline then runs like a local `Dataset`'s: rewritten by the static
optimizer (`jaxfeed.ops.optimize`) and run under the autotuner
(`jaxfeed.ops.autotune`) with the Options of the client's dataset, which
travel in the spec as the root `WithOptionsNode`.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Iterator, NamedTuple, Sequence

from jaxfeed.ops import autocache
from jaxfeed.ops import autotune
from jaxfeed.ops import base
from jaxfeed.ops import index_ranges
from jaxfeed.ops import op_stats
from jaxfeed.ops import optimize
from jaxfeed.ops.options import Options
from jaxfeed.service import metrics
from jaxfeed.service.protocol import spec as spec_lib
from jaxfeed.service.protocol.protos import service_pb2 as pb
from jaxfeed.service.protocol.sharding import ShardingPolicy
from jaxfeed.service.worker import autocache_keeper
from jaxfeed.service.worker import static_sharding
from jaxfeed.service.worker import worker_orders

FetchRanges = index_ranges.FetchRanges


class SplitEnd(NamedTuple):
  """Exactly-once tasks: every element of the split [start, stop) came before."""

  start: int
  stop: int


class _Waiting:
  def __repr__(self) -> str:
    return "WAITING"


# Exactly-once tasks: no split to read yet, but the job has not ended either.
WAITING = _Waiting()


class WithOptionsNode(base.Node):
  """A pipeline and the `jaxfeed.Options` it runs with, as one spec root.

  Clients ship a Dataset's options this way; workers take them off again
  (`unwrap_options`). Iterated directly, it runs its input like a local
  Dataset with these options.
  """

  op_name = "with_options"

  def __init__(self, parent: Any, options: Options | dict):
    super().__init__([base.to_node(parent, self.op_name, "input")])
    if isinstance(options, dict):
      options = Options(**options)
    if not isinstance(options, Options):
      raise TypeError(
        f"{self.op_name}: options must be a jaxfeed.Options, got {type(options).__name__}."
      )
    self.options = options

  def spec_params(self) -> dict:
    return {"options": dataclasses.asdict(self.options)}

  def cardinality(self) -> int | None:
    return self.parents[0].cardinality()

  def make_iterator(self) -> base.OpIterator:
    return run(optimize.optimize(self.parents[0], self.options), self.options)


def pipeline_node(dataset: Any, what: str, policy: ShardingPolicy | None = None) -> base.Node:
  """The graph a client ships for `dataset`, with its Options if it has any.

  Raises:
    ValueError: `policy` is DYNAMIC and the pipeline has no single input
      whose positions can be split (the message names the ops involved).
  """
  node = base.to_node(dataset, what, "dataset")
  if policy == ShardingPolicy.DYNAMIC:
    _check_no_repeat_after(index_ranges.split_input(node), node)
  if policy is not None:
    static_sharding.check_pipeline(node, policy)
  # A node carries no options (a WithOptionsNode already holds its own).
  options = None if dataset is node else getattr(dataset, "options", None)
  return node if options is None else WithOptionsNode(node, options)


def _check_no_repeat_after(split: base.Node, node: base.Node) -> None:
  """Refuses a repeat between the split input and the pipeline's end: its
  second pass would find every split already handed out, so the read would
  silently end after one pass."""
  if node is split:
    return
  count = getattr(node, "count", 1) if node.op_name == "repeat" else 1
  if count != 1:
    times = "forever" if count < 0 else f"{count} times"
    raise ValueError(
      f"distribute(processing_mode='distributed_epoch') cannot read a "
      f"pipeline that repeats its split input (repeat {times}): each split "
      "of the input is handed out once per job, so only one pass would be "
      "read. Apply .repeat() to the distributed dataset instead, or use "
      "processing_mode='parallel_epochs'."
    )
  for parent in node.parents:
    _check_no_repeat_after(split, parent)


def unwrap_options(node: base.Node) -> tuple[base.Node, Options | None]:
  """A shipped graph's pipeline and Options (None: the defaults)."""
  if isinstance(node, WithOptionsNode):
    return node.parents[0], node.options
  return node, None


def num_positions(node: base.Node) -> int:
  """Positions DYNAMIC sharding splits: those of the pipeline's
  index-addressable input; -1 if unbounded or if it has none."""
  try:
    count = index_ranges.num_positions(index_ranges.split_input(node))
  except index_ranges.NotIndexAddressableError:
    return -1
  return -1 if count is None else int(count)


def build_task_node(
  dataset_def: pb.DatasetDef,
  task: pb.TaskInfo,
  udf_secret: bytes | None,
  fetch_ranges: FetchRanges | None,
  udf_modules: Sequence[str] = (),
) -> tuple[base.Node, Options | None]:
  """Rebuilds a task's pipeline with the task's sharding applied (importing
  only from the deployment's allowed UDF modules, see `spec.from_dataset_def`).

  Returns:
    The pipeline (not yet optimized) and the client's Options (None: the
    defaults).
  """
  policy = ShardingPolicy(task.sharding_policy)

  def decode(rewrite: spec_lib.NodeRewrite | None) -> base.Node:
    return spec_lib.from_dataset_def(dataset_def, udf_secret, rewrite, udf_modules)

  if policy.is_static:
    node = static_sharding.shard_task(policy, task, decode)
  elif policy == ShardingPolicy.OFF:  # each worker its own order
    node = decode(worker_orders.reorder(task.worker_index))
  else:
    node = decode(None)
  node, options = unwrap_options(node)
  if policy == ShardingPolicy.DYNAMIC:
    try:
      node = index_ranges.over_ranges(node, fetch_ranges)
    except index_ranges.NotIndexAddressableError as e:
      raise spec_lib.SpecError(f"Dataset {task.dataset_id!r}: {e}") from e
  return node, options


def run(node: base.Node, options: Options | None) -> base.OpIterator:
  """An iterator of an optimized pipeline under the autotuner, as a local
  Dataset runs it (see `jaxfeed.Dataset.make_iterator`)."""
  root = op_stats.instrument(node, node.make_iterator(), options)
  return autotune.autotuned(root, options)


def task_iterator(
  dataset_def: pb.DatasetDef,
  task: pb.TaskInfo,
  udf_secret: bytes | None,
  fetch_ranges: FetchRanges,
  autocache_dir: str | None = None,
  udf_modules: Sequence[str] = (),
  autocache_policy: str = "auto",
) -> base.OpIterator:
  """A (not exactly-once) task's pipeline, optimized and autotuned."""
  node, options = build_task_node(dataset_def, task, udf_secret, fetch_ranges, udf_modules)
  node = optimize.optimize(node, options)
  if autocache_dir:
    # After the optimizer: it rebuilds ops from their specs, which leave the
    # folder out. A task reading splits only uses stores kept by record.
    autocache.point_at(
      node,
      autocache_keeper.folder_at(autocache_dir),
      records_only=task.sharding_policy == ShardingPolicy.DYNAMIC.value,
      policy=autocache_policy,
      job=metrics.job_label(task.job_name, task.job_id),
    )
  return run(node, options)


def close_quietly(iterator: Any, what: str) -> None:
  """Closes a pipeline's iterator (if any), logging instead of raising."""
  if iterator is None or not hasattr(iterator, "close"):
    return
  try:
    iterator.close()
  except Exception:  # pylint: disable=broad-except
    logging.exception("Closing %s failed", what)


def split_by_split(
  dataset_def: pb.DatasetDef,
  task: pb.TaskInfo,
  udf_secret: bytes | None,
  fetch_ranges: FetchRanges,
  poll_s: float = 0.05,
  udf_modules: Sequence[str] = (),
) -> Iterator[Any]:
  """An exactly-once task's elements: the pipeline runs on one split at a
  time, so each element belongs to one split (a batch never spans two), and
  `SplitEnd(start, stop)` follows each split's elements. Yields `WAITING` while the
  dispatcher holds the end back: other workers' splits are not yet
  acknowledged and may come back to this task if their worker is lost.
  Each split's run starts from the values the autotuner reached in the one
  before.
  """
  current: list[tuple[int, int]] = []

  def this_split() -> tuple[list[tuple[int, int]], bool]:
    ranges = list(current)
    current.clear()
    return ranges, True

  node, options = build_task_node(dataset_def, task, udf_secret, this_split, udf_modules)
  node = optimize.optimize(node, options)
  tuned: list[int] = []
  while True:
    ranges, end = fetch_ranges()
    for start, stop in ranges:
      current[:] = [(start, stop)]
      iterator = run(node, options)
      knobs = autotune.collect_knobs(iterator)
      if len(knobs) == len(tuned):
        for knob, value in zip(knobs, tuned):
          knob.set(value)
      try:
        yield from iterator
      finally:
        tuned = [knob.get() for knob in knobs]
        iterator.close()
      yield SplitEnd(start, stop)
    if end:
      return
    if not ranges:
      yield WAITING
      time.sleep(poll_s)
