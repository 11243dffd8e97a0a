"""`Loader`: what a training loop iterates — global jax.Array batches on a mesh.

Its state checkpoints with orbax next to the model state, and reshards to
another number of JAX processes: see `jaxfeed.loader_checkpoint`.
"""

from __future__ import annotations

import time
from typing import Any

from jaxfeed.dataset import Dataset
from jaxfeed.device import DevicePrefetcher
from jaxfeed.device.step_verdict import resolve_policy
from jaxfeed.ops import op_report
from jaxfeed.ops import op_stats
from jaxfeed.ops.batch_rows import full_batch_rows
from jaxfeed.ops.prefetch import PrefetchNode
from jaxfeed.device.placement import ShardingLike

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
  `ocp.args.Composite` (see `jaxfeed.loader_checkpoint`).

  `stats()` tells whether training is input bound: the seconds the loop waited
  for batches versus the seconds it spent between batches (model time), and
  the pipeline's per-op statistics (`ops`, see `OpIterator.stats`);
  `report()` prints them as one table with a verdict: input bound or not,
  and which op to fix.
  """

  def __init__(
    self,
    dataset: Any,
    *,
    sharding: ShardingLike = None,
    prefetch: int = 2,
    partial_batch: str | None = None,
    end_of_input: str | None = None,
    pad_to_common_shape: bool = False,
  ):
    if not isinstance(dataset, Dataset) and not hasattr(dataset, "__iter__"):
      raise TypeError(
        "Loader: dataset must be a jaxfeed.Dataset or an iterable of numpy "
        f"batch pytrees, got {type(dataset).__name__}."
      )
    resolve_policy(partial_batch, end_of_input, "Loader")
    self._dataset = dataset
    self._sharding = sharding
    self._prefetch = prefetch
    self._partial_batch = partial_batch
    self._end_of_input = end_of_input
    self._pad_to_common_shape = pad_to_common_shape
    self._full_batch_rows = full_batch_rows(dataset.node) if isinstance(dataset, Dataset) else None
    self._host_iterator = self._new_host_iterator()
    self._prefetcher = self._new_prefetcher(self._host_iterator)
    self._end_of_epoch = False  # next() raised StopIteration this epoch
    self._batches = 0
    self._wait_s = 0.0
    self._model_s = 0.0
    self._returned_at: float | None = None

  def _new_prefetcher(self, host_iterator: Any) -> DevicePrefetcher:
    return DevicePrefetcher(
      host_iterator,
      self._sharding,
      prefetch=self._prefetch,
      partial_batch=self._partial_batch,
      end_of_input=self._end_of_input,
      pad_to_common_shape=self._pad_to_common_shape,
      full_batch_rows=self._full_batch_rows,
      host_reads_ahead=_reads_ahead(self._dataset),
    )

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
          "iterate it for several epochs, or make a new Loader per epoch."
        )
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
    if (
      not isinstance(state, dict)
      or not {"pipeline", "batches"} <= set(state) <= _STATE_KEYS
      or not isinstance(state["batches"], int)
      or not isinstance(state.get("end_of_epoch", False), bool)
    ):
      raise ValueError(
        "Loader.set_state: expected the dict returned by Loader.get_state() "
        "with keys 'pipeline', 'batches' (int) and optionally "
        f"'end_of_epoch' (bool), got {str(state):.200}."
      )
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
  return bool(options is not None and options.optimize and options.inject_prefetch)
