"""`Loader`: what a training loop iterates — global jax.Array batches on a mesh.

Checkpointing with orbax, next to the model state::

  manager = ocp.CheckpointManager(workdir)
  jaxfeed.save_checkpoint(manager, step, loader, model_state=state)
  ...
  state = jaxfeed.restore_checkpoint(manager, step, loader, model_state=state)

or, composing the items yourself::

  manager.save(step, args=ocp.args.Composite(
      model=ocp.args.StandardSave(state), loader=jaxfeed.LoaderSave(loader)))
  restored = manager.restore(step, args=ocp.args.Composite(
      model=ocp.args.StandardRestore(state), loader=jaxfeed.LoaderRestore(loader)))

The loader item is written by `LoaderCheckpointHandler`: one JSON file per JAX
process (`process_<i>-of-<n>.json`), since every process reads its own shard.
Restoring with another number of processes works for pipelines that read an
`IndexSampler` sharded by process through `map`, `random_map`, `filter`,
`pack` and `batch` (see `reshard_loader_states`); others fail with an error
naming the op.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import time
from typing import Any

from etils import epath
import jax
import orbax.checkpoint as ocp

from jaxfeed.dataset import Dataset
from jaxfeed.device import DevicePrefetcher
from jaxfeed.device.agreement import distributed_client
from jaxfeed.device.step_verdict import resolve_policy
from jaxfeed.ops import op_report
from jaxfeed.ops import op_stats
from jaxfeed.ops.batch_rows import full_batch_rows
from jaxfeed.ops.reshard import reshard_states
from jaxfeed.ops.prefetch import PrefetchNode
from jaxfeed.device.placement import ShardingLike
from jaxfeed.service.protocol import read_state

_MODEL_ITEM = "model"
_LOADER_ITEM = "loader"
_STATE_KEYS = {"pipeline", "batches", "end_of_epoch"}


class Loader:
  """Iterates a pipeline's batches as global `jax.Array`s on a device mesh.

  Usage::

    loader = jaxfeed.Loader(dataset.batch(per_host_batch), prefetch=2)
    with loader:
      for batch in loader:          # dicts (pytrees) of jax.Array
        state = train_step(state, batch)

  Args:
    dataset: a `jaxfeed.Dataset` whose elements are this process's batches
      (pytrees of numpy arrays, leading dim = per-process batch size), or any
      iterable of such batches (checkpointable only if its iterator has
      `get_state` / `set_state`).
    sharding: the batches' sharding: a `jax.sharding.Sharding`, a pytree of
      them matching the batch, or a callable leaf -> Sharding. Default: the
      batch dimension split over all devices (`jaxfeed.device.batch_sharding()`).
      0-d leaves are replicated.
    prefetch: batches kept ready on device ahead of the training loop. When
      the pipeline ends in `prefetch` (it reads ahead itself), batches go to
      CPU devices only and no other process takes part, each batch is placed
      in `next()` instead, with no thread (see `DevicePrefetcher`).
    partial_batch: what a *partial* batch becomes: one with fewer rows than
      a complete batch, such as the last batch of an epoch without
      `drop_remainder` (on any number of processes), or a process's batch
      with fewer rows than another process's at the same step. A complete
      batch has the `batch_size` of the pipeline's last `batch` /
      `padded_batch` / `rebatch` (seen through `take`, `skip`, `repeat`,
      `shuffle`, `filter`, `prefetch`, `cache`, ...; see
      `jaxfeed.ops.batch_rows`), or, when the pipeline does not say (a `map`
      after the batch, a service read, a plain iterable), as many rows as
      the largest batch of the step.
      `"drop"` (default): the step is dropped on every process, as
      `batch(..., drop_remainder=True)` drops it. `"pad"`: the missing rows
      are zeros, and every batch, which must be a dict, gets a bool leaf
      `"mask"` of shape `[global_batch]` that is True for real rows (weigh the
      loss with it; tf.distribute's handling of a partial batch); steps then
      go on until every process's input ended (see `end_of_input`), so every
      real row comes once. `"error"`: a ValueError naming the step and each
      process's shape.
      Why "drop" by default: a jitted step compiles again for every new
      shape, and in a multi-process job a partial batch cannot even form one
      global array, so the default keeps every step's shapes and leaves as
      they are and never raises at the end of an epoch; what it loses is
      less than one global batch per epoch, as `drop_remainder=True` (what
      JAX training loops use) does. Evaluation, where every example must
      count, wants "pad" and a masked metric.
    end_of_input: what happens in a multi-process job when the processes'
      inputs end at different steps (uneven shards, a `filter` keeping
      different numbers of records per process, a shared service job).
      `"stop_at_shortest"`: every process stops at the first step some
      process has no batch for; the others' batches of that step are
      dropped. `"pad"`: steps go on until every process's input ended; a
      process out of input yields zero rows, masked. None (default):
      `"pad"` with `partial_batch="pad"`, else `"stop_at_shortest"`.
      `end_of_input="pad"` without `partial_batch` pads partial batches too
      and names the mask leaf `"valid"` (as before `partial_batch` existed);
      with `partial_batch="drop"` it is refused. Either way the processes
      check each step that their local shapes can form one global array
      (else every process raises a ValueError naming the leaf and each
      process's shape), through a small host-side exchange in the
      `jax.distributed` key-value store on the prefetch thread (see
      `jaxfeed.device.agreement`). With one process, or shardings on this
      process's devices only, nothing is exchanged and this option has no
      effect. Every process must create its Loaders in the same order.
    pad_to_common_shape: in a multi-process job, zero-pad each leaf's
      dimensions after the first to the largest size any process has at that
      step, so that e.g. `padded_batch` without fixed `padded_shapes` or
      per-process `bucket_by_sequence_length` (which pad to each process's own
      longest element) form one global array. Without it such batches fail
      with the ValueError above; fixed `padded_shapes` (or coordinated reads,
      `Dataset.from_bucket_plan`) avoid both the error and this padding.

  Epochs: a Loader is an iterator, like tf.data's `iter(dataset)` and the
  iterator of a PyTorch DataLoader, that goes on to the next epoch once one
  has ended::

    for epoch in range(num_epochs):
      for batch in loader:           # one whole epoch each time
        ...

  Iterating it again (`for`, `iter()`, `zip`, `islice`) where a loop left
  off continues the current epoch: `zip(range(n), loader)` twice yields
  batches 0..n-1, then n..2n-1, and over an endless pipeline it never
  repeats data. Once an epoch has ended (`next()` raised StopIteration),
  iterating again starts the next one: a fresh iterator of the `Dataset`,
  whose shuffled `IndexSampler` gives it its own order (see
  `Dataset.make_iterator`); `next()` alone keeps raising StopIteration. A
  plain iterable input starts the next epoch with `iter(dataset)`; a
  one-shot iterator (a generator) cannot, and iterating the Loader again
  then raises a RuntimeError that says so.

  State: `get_state()` is `{"pipeline": <pipeline state as of the last batch
  the loop received>, "batches": <batches received>}` (JSON-able), plus
  `"end_of_epoch": True` once the epoch has ended; `set_state()` restores it
  before or during iteration. The pipeline state records its epoch (the
  sampler's iteration): a Loader restored in a fresh process finishes that
  epoch and then goes on with the next one in the order the uninterrupted
  run gives it. To checkpoint with orbax next to the model state use
  `jaxfeed.save_checkpoint` / `jaxfeed.restore_checkpoint`, or the
  `jaxfeed.LoaderSave` / `jaxfeed.LoaderRestore` items inside
  `ocp.args.Composite` (see the module docstring).

  `stats()` tells whether training is input bound: the seconds the loop waited
  for batches versus the seconds it spent between batches (model time), and
  the pipeline's per-op statistics (`ops`, see `OpIterator.stats`);
  `report()` prints them as one table with a verdict: input bound or not,
  and which op to fix.
  """

  def __init__(self, dataset: Any, *, sharding: ShardingLike = None,
               prefetch: int = 2, partial_batch: str | None = None,
               end_of_input: str | None = None,
               pad_to_common_shape: bool = False):
    if not isinstance(dataset, Dataset) and not hasattr(dataset, "__iter__"):
      raise TypeError(
          "Loader: dataset must be a jaxfeed.Dataset or an iterable of numpy "
          f"batch pytrees, got {type(dataset).__name__}.")
    resolve_policy(partial_batch, end_of_input, "Loader")
    self._dataset = dataset
    self._sharding = sharding
    self._prefetch = prefetch
    self._partial_batch = partial_batch
    self._end_of_input = end_of_input
    self._pad_to_common_shape = pad_to_common_shape
    self._full_batch_rows = (full_batch_rows(dataset.node)
                             if isinstance(dataset, Dataset) else None)
    self._host_iterator = self._new_host_iterator()
    self._prefetcher = self._new_prefetcher(self._host_iterator)
    self._end_of_epoch = False  # next() raised StopIteration this epoch
    self._batches = 0
    self._wait_s = 0.0
    self._model_s = 0.0
    self._returned_at: float | None = None

  def _new_prefetcher(self, host_iterator: Any) -> DevicePrefetcher:
    return DevicePrefetcher(host_iterator, self._sharding,
                            prefetch=self._prefetch,
                            partial_batch=self._partial_batch,
                            end_of_input=self._end_of_input,
                            pad_to_common_shape=self._pad_to_common_shape,
                            full_batch_rows=self._full_batch_rows,
                            host_reads_ahead=_reads_ahead(self._dataset))

  def _new_host_iterator(self) -> Any:
    if isinstance(self._dataset, Dataset):
      return self._dataset.make_iterator()
    return iter(self._dataset)

  # -- iteration ----------------------------------------------------------
  def __iter__(self) -> "Loader":
    """This Loader: the current epoch, or the next once it has ended."""
    if self._end_of_epoch:
      self._start_next_epoch()
    return self

  def __next__(self) -> Any:
    if self._end_of_epoch:
      raise StopIteration
    start = time.perf_counter()
    if self._returned_at is not None:
      self._model_s += start - self._returned_at
    try:
      batch = next(self._prefetcher)
    except StopIteration:
      self._end_of_epoch = True
      self._returned_at = None
      raise
    finally:
      end = time.perf_counter()
      self._wait_s += end - start
    self._batches += 1
    self._returned_at = end
    return batch

  def _start_next_epoch(self) -> None:
    if isinstance(self._dataset, Dataset):
      host_iterator = self._dataset.make_iterator()
    else:
      host_iterator = iter(self._dataset)
      if host_iterator is self._dataset or host_iterator is self._host_iterator:
        raise RuntimeError(
            f"Loader: the epoch has ended and the input "
            f"{type(self._dataset).__name__} is a one-shot iterator, which "
            "cannot start another. Give the Loader a jaxfeed.Dataset (or an "
            "iterable whose __iter__ returns a new iterator, like a list) to "
            "iterate it for several epochs, or make a new Loader per epoch.")
    self._prefetcher.close()
    self._host_iterator = host_iterator
    self._prefetcher = self._new_prefetcher(host_iterator)
    self._end_of_epoch = False

  def stats(self) -> dict[str, Any]:
    """Batches received, seconds waiting for input and between batches, and
    the pipeline's per-op rows (`ops`; empty for a plain iterable)."""
    busy = self._wait_s + self._model_s
    return {
        "batches": self._batches,
        "wait_seconds": self._wait_s,
        "model_seconds": self._model_s,
        "input_bound_fraction": self._wait_s / busy if busy else 0.0,
        "ops": op_stats.rows_of(self._host_iterator),
    }

  def report(self, file: Any = None) -> str:
    """Prints (to `file`, default stdout) and returns one table of the
    pipeline's ops, whether the loop is input bound, and the op to fix."""
    stats = self.stats()
    text = op_report.report(stats["ops"], stats)
    print(text, file=file)
    return text

  # -- state ----------------------------------------------------------------
  def get_state(self) -> dict[str, Any]:
    """`{"pipeline": ..., "batches": n}` as of the last batch received, with
    `"end_of_epoch": True` once the epoch has ended."""
    state = {"pipeline": self._prefetcher.get_state(), "batches": self._batches}
    if self._end_of_epoch:
      state["end_of_epoch"] = True
    return state

  def set_state(self, state: dict[str, Any]) -> None:
    """Resumes from a `get_state()` result; read-ahead restarts from there.

    Raises:
      PipelineStateError (a ValueError): the state was saved from another
        pipeline; the message names what differs (e.g. the sampler's seed,
        its shard, the source's length or files, an op). New mixture weights
        (`jaxfeed.align_mixture_states`) and another number of processes
        (`reshard_loader_states`) are allowed. A state saved by a jaxfeed
        that did not record its pipeline restores with a warning.
    """
    if (not isinstance(state, dict)
        or not {"pipeline", "batches"} <= set(state) <= _STATE_KEYS
        or not isinstance(state["batches"], int)
        or not isinstance(state.get("end_of_epoch", False), bool)):
      raise ValueError(
          "Loader.set_state: expected the dict returned by Loader.get_state() "
          "with keys 'pipeline', 'batches' (int) and optionally "
          f"'end_of_epoch' (bool), got {str(state):.200}.")
    if isinstance(self._dataset, Dataset):
      # A fresh iterator: the old one may have failed or been exhausted.
      host_iterator = self._dataset.make_iterator()
      try:
        host_iterator.set_state(state["pipeline"])
      except BaseException:
        host_iterator.close()
        raise
      self._prefetcher.close()
      self._host_iterator = host_iterator
      self._prefetcher = self._new_prefetcher(host_iterator)
    else:
      self._prefetcher.set_state(state["pipeline"])
    self._batches = state["batches"]
    self._end_of_epoch = state.get("end_of_epoch", False)
    self._returned_at = None

  # -- lifetime -------------------------------------------------------------
  def close(self) -> None:
    """Stops read-ahead and closes the pipeline iterator. Idempotent."""
    self._prefetcher.close()

  def __enter__(self) -> "Loader":
    return self

  def __exit__(self, *exc: Any) -> None:
    self.close()


def _reads_ahead(dataset: Any) -> bool:
  """Whether the pipeline's iterator produces batches ahead on its own thread
  (it ends in a non-zero `prefetch`)."""
  if not isinstance(dataset, Dataset):
    return False
  node = dataset.node
  if isinstance(node, PrefetchNode):
    return node.buffer_size != 0
  options = dataset.options
  return bool(options is not None and options.optimize
              and options.inject_prefetch)


def reshard_loader_states(states: list[dict[str, Any]]) -> dict[str, Any]:
  """A Loader state that resumes, on any number of JAX processes, the run whose
  process `h` of `len(states)` saved `states[h]` (`Loader.get_state()`).

  Every new process restores the same state (`Loader.set_state`); its pipeline
  must be the old one, with the sampler sharded by the new process count (e.g.
  `ShardByJaxProcess()`) and, for the same global batch, a per-process batch
  size of `global_batch // jax.process_count()`. The records the old processes
  had not read are dealt out to the new ones, each read once over all of them;
  later epochs are read as usual. Pipelines: `from_source` with an
  `IndexSampler` (or `Dataset.mix`), then `map`, `random_map`, `filter`, at
  most one `pack`, `batch` / `padded_batch`; the elements `pack` held count
  as unread (a partly emitted `overflow="split"` element as its missing
  pieces). Anything else holding elements of one process's shard (a
  `shuffle` buffer, ...) raises a ValueError naming it.
  """
  batches = {state.get("batches") for state in states}
  if len(batches) != 1:
    raise ValueError(
        f"reshard: the processes' Loader states have received different "
        f"numbers of batches {sorted(map(str, batches))}; they must be "
        "taken at the same step.")
  merged = {"pipeline": reshard_states([state["pipeline"] for state in states]),
            "batches": batches.pop()}
  if all(state.get("end_of_epoch") for state in states):
    merged["end_of_epoch"] = True
  return merged


# -- orbax ------------------------------------------------------------------
def _state_file(directory: epath.Path) -> epath.Path:
  return epath.Path(directory) / (
      f"process_{jax.process_index()}-of-{jax.process_count()}.json")


_restores = itertools.count()  # this process's restores of shared reads


def _agreed_restore_id() -> str:
  """A new random id, the same on every JAX process: process 0 draws it
  and hands it on through the coordination service. Every process restores
  in the same order, so the n-th restore of each shares a key."""
  key = f"jaxfeed/loader_restore/{next(_restores)}"
  client = distributed_client()
  if client is None:
    raise RuntimeError(
        "Restoring a shared service read in a multi-process job needs "
        "jax.distributed.initialize(): its processes agree on the new job "
        "through it.")
  if jax.process_index() == 0:
    restore_id = read_state.new_restore_id()
    client.key_value_set(key, restore_id)
    return restore_id
  return str(client.blocking_key_value_get(key, 300_000))


def _read_state(directory: epath.Path) -> dict[str, Any]:
  """This process's state, or one resharded from another process count's.

  An exactly-once read of a shared service job resumes what all processes
  took together (`read_state.merge_process_states`), so it reads every
  process's file, on one new job per restore (`_agreed_restore_id`).
  """
  path = _state_file(directory)
  if path.exists():
    state: dict[str, Any] = json.loads(path.read_text())
    if jax.process_count() > 1 and read_state.has_shared_read(state["pipeline"]):
      states = [json.loads((epath.Path(directory) / (
          f"process_{i}-of-{jax.process_count()}.json")).read_text())
                for i in range(jax.process_count())]
      merged = read_state.merge_process_states([s["pipeline"] for s in states],
                                               _agreed_restore_id())
      state["pipeline"] = merged[jax.process_index()]
    return state
  found = sorted(p.name for p in epath.Path(directory).glob("process_*.json"))
  counts = {name.rsplit("-of-", 1)[-1].removesuffix(".json") for name in found}
  if len(counts) != 1 or not next(iter(counts)).isdigit():
    raise FileNotFoundError(
        f"Loader checkpoint: {path} does not exist and the files there "
        f"({found}) are not one set written by one number of JAX processes.")
  count = int(counts.pop())
  files = [epath.Path(directory) / f"process_{i}-of-{count}.json"
           for i in range(count)]
  missing = [f.name for f in files if not f.exists()]
  if missing:
    raise FileNotFoundError(
        f"Loader checkpoint: written by {count} JAX processes, restoring with "
        f"{jax.process_count()}; resharding needs every process's file but "
        f"{missing} are missing in {directory}.")
  return reshard_loader_states([json.loads(f.read_text()) for f in files])


class LoaderCheckpointHandler(ocp.CheckpointHandler):  # type: ignore[misc]  # Orbax: no hints
  """Orbax handler for a `Loader`'s state: one JSON file per JAX process.

  Restoring with another number of JAX processes than saved reads every
  process's file and reshards them (`reshard_loader_states`).

  Use through its args, `LoaderSave(loader)` / `LoaderRestore(loader)`, inside
  `ocp.args.Composite` (see `save_checkpoint`).
  """

  def save(self, directory: epath.Path, args: "LoaderSave") -> None:
    _state_file(directory).write_text(json.dumps(args.state))

  def restore(self, directory: epath.Path, args: "LoaderRestore") -> Any:
    state = _read_state(directory)
    if args.loader is None:
      return state
    args.loader.set_state(state)
    return args.loader

  def metadata(self, directory: epath.Path) -> None:
    del directory
    return None


@ocp.args.register_with_handler(LoaderCheckpointHandler, for_save=True)
@dataclasses.dataclass
class LoaderSave(ocp.args.CheckpointArgs):  # type: ignore[misc]  # Orbax: no hints
  """Saves `loader`'s state as of now (the state is taken at construction)."""

  loader: Any
  state: dict[str, Any] = dataclasses.field(init=False)

  def __post_init__(self) -> None:
    self.state = self.loader.get_state()


@ocp.args.register_with_handler(LoaderCheckpointHandler, for_restore=True)
@dataclasses.dataclass
class LoaderRestore(ocp.args.CheckpointArgs):  # type: ignore[misc]  # Orbax: no hints
  """Restores into `loader` (restore returns it), or returns the state dict
  when `loader` is None."""

  loader: Any = None


def save_checkpoint(manager: ocp.CheckpointManager, step: int, loader: Loader,
                    *, model_state: Any, force: bool = False) -> bool:
  """Saves `model_state` (item "model") and the loader state (item "loader").

  Returns whether the manager saved (see `ocp.CheckpointManager.save`).
  """
  return bool(manager.save(step, args=ocp.args.Composite(**{
      _MODEL_ITEM: ocp.args.StandardSave(model_state),
      _LOADER_ITEM: LoaderSave(loader)}), force=force))


def restore_checkpoint(manager: ocp.CheckpointManager, step: int | None,
                       loader: Loader, *, model_state: Any,
                       restore_loader: bool = True) -> Any:
  """Restores the loader in place and returns the model state of `step`.

  Args:
    manager: the manager `save_checkpoint` wrote with.
    step: the step to restore; None for the latest.
    loader: restored in place (`loader.set_state`).
    model_state: a pytree like the saved one (arrays or
      `jax.ShapeDtypeStruct`s) giving the shapes, dtypes and shardings.
    restore_loader: False leaves the loader where it is and restores only
      the model (e.g. a service read that cannot resume at a position: one
      neither `distributed_epoch` with `visitation="exactly_once"` nor an
      unshared `parallel_epochs` read of an index-based pipeline, see
      docs/service.md, "Resuming a read").

  Returns:
    The restored model state.
  """
  if step is None:
    step = manager.latest_step()
    if step is None:
      raise FileNotFoundError(
          f"restore_checkpoint: no checkpoint in {manager.directory}.")
  items = {_MODEL_ITEM: ocp.args.StandardRestore(model_state)}
  if restore_loader:
    items[_LOADER_ITEM] = LoaderRestore(loader)
  restored = manager.restore(step, args=ocp.args.Composite(**items))
  return restored[_MODEL_ITEM]
