"""`Dataset`: the thin chaining facade over the op graph.

Each method builds one node from its op module in `jaxfeed/ops/` and wraps it;
the ops' logic lives there. Op modules never import this file. The
constructors are in `jaxfeed/dataset_sources.py`, which also says why the op
modules are imported in the methods that use them (import time), and the
batching transformations in `jaxfeed/dataset_batching.py`.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

# base (and numpy with it) first, before the facade's bases import it two
# levels deeper: numpy's typing module runs slower under a deeper stack, and
# `python -X importtime -c "import jaxfeed"` took about 5 ms more.
from jaxfeed.ops import base

# isort: split
from jaxfeed.dataset_batching import DatasetBatching


# What `Dataset.distribute` runs. The service sits right of the op graph and
# imports this facade, so the facade never imports it: the package root,
# above both, registers it (see jaxfeed/__init__.py).
_distribute: Callable[..., "Dataset"] | None = None


def register_distribute(implementation: Callable[..., "Dataset"]) -> None:
  """Called once by the package root: what `Dataset.distribute` runs."""
  global _distribute
  _distribute = implementation


class Dataset(DatasetBatching):
  """An immutable pipeline. Iterating it builds a fresh, stateful iterator.

  The constructors (`from_source`, `range`, `zip`, `mix`, ...) are
  `DatasetSources`'s, the batching transformations `DatasetBatching`'s; the
  other transformations are below.
  """

  __slots__ = ()

  # ---- element-wise --------------------------------------------------------
  def map(
    self,
    fn: Callable[..., Any],
    num_parallel_calls: int | None = None,
    deterministic: bool = True,
    batched: bool = False,
    backend: str = "auto",
    writes_out: bool = False,
  ) -> "Dataset":
    """Applies `fn` to each element.

    tf.data's `map`: a tuple element is unpacked into arguments
    (`fn(*element)`); any other element (an array, a dict) is passed as one
    argument. `fn` returns the new element (a pytree of numpy arrays or
    scalars).

    Args:
      fn: the function.
      num_parallel_calls: None or 1 runs `fn` in the consumer's thread; an
        int > 1 or `jaxfeed.AUTOTUNE` runs it on that many workers.
      deterministic: keep the input order with parallel calls (False returns
        each result as soon as it is ready).
      batched: declares `fn` vectorized over a leading batch dimension, so the
        optimizer may move it after a following `batch` and call it once per
        batch; the output is the same either way.
      backend: "auto" or "thread" runs `fn` on threads (numpy and most
        decoders release the GIL); "process" runs it in worker processes,
        for GIL-bound Python code (`fn` must then be picklable: defined at
        module level); results come back through shared memory.
      writes_out: `fn` takes a keyword argument `out` and may write its
        output there. When a `batch` follows a parallel map on threads,
        `out` is the element's row of the batch: the structure of `fn`'s
        outputs, with writable numpy arrays of their shapes and dtypes (from
        the first output on; None before, when `fn` returns another
        structure or shapes, or there is no batch). A returned leaf that is
        `out`'s own array is not copied again: for large outputs (an image
        normalized to float32) this saves a copy and fresh memory per
        element. A leaf `fn` returns from `out` must be written in full.
        With backend="process" (or AUTOTUNE picking processes) the same
        holds in the worker processes, whose rows are the shared memory the
        batch is handed out in.

    Example: `ds.map(decode, num_parallel_calls=jaxfeed.AUTOTUNE)`.
    Writing into the batch: `def fn(x, out=None): return {"y": np.multiply(
    x, 2, out=None if out is None else out["y"])}` then
    `ds.map(fn, num_parallel_calls=4, writes_out=True).batch(64)`.
    """
    from jaxfeed.ops import map

    return self._wrap(
      map.MapNode(
        self.node,
        fn,
        num_parallel_calls=num_parallel_calls,
        deterministic=deterministic,
        batched=batched,
        backend=backend,
        writes_out=writes_out,
      )
    )

  def random_map(
    self,
    fn: Callable[..., Any],
    num_parallel_calls: int | None = None,
    deterministic: bool = True,
    seed: int | None = None,
    backend: str = "auto",
    writes_out: bool = False,
  ) -> "Dataset":
    """Applies `fn(element, rng)` with a `np.random.Generator` per element.

    The generator is seeded from the element's own seed (for sampler
    pipelines a hash of (seed, epoch, record index), combined with `seed`),
    so augmentations are the same whatever the parallelism, backend, host
    count or resume point. Arguments as for `map`. tf.data has no
    equivalent (its random ops use stateful or op-level seeds).

    Example: `ds.random_map(lambda x, rng: x + rng.normal(size=x.shape))`.
    With `writes_out=True`, `fn(element, rng, out=...)` (see `map`).
    """
    from jaxfeed.ops import random_map

    return self._wrap(
      random_map.RandomMapNode(
        self.node,
        fn,
        num_parallel_calls=num_parallel_calls,
        deterministic=deterministic,
        seed=seed,
        backend=backend,
        writes_out=writes_out,
      )
    )

  def filter(self, predicate: Callable[..., Any]) -> "Dataset":
    """Keeps the elements for which `predicate(element)` is true.

    tf.data's `filter`: tuple elements are unpacked into arguments; the
    predicate returns a Python or numpy bool (scalar).

    Example: `Dataset.range(6).filter(lambda x: x % 2 == 0)` -> 0, 2, 4.
    """
    from jaxfeed.ops import filter

    return self._wrap(filter.FilterNode(self.node, predicate))

  def enumerate(self, start: int = 0) -> "Dataset":
    """`(index, element)` pairs, the index an int64 counting from `start`."""
    from jaxfeed.ops import enumerate

    return self._wrap(enumerate.EnumerateNode(self.node, start))

  def scan(self, initial_state: Any, scan_func: Callable[..., Any]) -> "Dataset":
    """`scan_func(state, element) -> (new_state, output)` through the elements.

    Like tf.data's `scan`. The running state is saved with the iterator's
    state, so it must be arrays, scalars, bytes, str or containers of them.
    """
    from jaxfeed.ops import scan

    return self._wrap(scan.ScanNode(self.node, initial_state, scan_func))

  def unique(self) -> "Dataset":
    """The first occurrence of each distinct element (integer or string
    scalars, as in tf.data); the values seen are kept in memory and state."""
    from jaxfeed.ops import unique

    return self._wrap(unique.UniqueNode(self.node))

  def shard(self, num_shards: int, index: int) -> "Dataset":
    """Every `num_shards`-th element starting at `index` (tf.data's `shard`).

    For sampler-based pipelines, sharding in the sampler
    (`ShardOptions`, `ShardByJaxProcess`) reads only this shard's records.
    """
    from jaxfeed.ops import shard

    return self._wrap(shard.ShardNode(self.node, num_shards, index))

  def take_while(self, predicate: Callable[..., Any]) -> "Dataset":
    """The elements up to the first for which `predicate(element)` is false
    (tf.data's `take_while`; tuple elements are unpacked)."""
    from jaxfeed.ops import take_while

    return self._wrap(take_while.TakeWhileNode(self.node, predicate))

  def rejection_resample(
    self,
    class_func: Callable[..., Any],
    target_dist: Sequence[float],
    initial_dist: Sequence[float] | None = None,
    seed: int | None = None,
  ) -> "Dataset":
    """`(class_func(element), element)` pairs resampled so that the classes
    follow `target_dist` (tf.data's `rejection_resample`: elements may be
    dropped or repeated). Deterministic from `seed`; see
    `jaxfeed.ops.rejection_resample`."""
    from jaxfeed.ops import rejection_resample

    return self._wrap(
      rejection_resample.RejectionResampleNode(
        self.node, class_func, target_dist, initial_dist, seed
      )
    )

  def apply(self, transformation_func: Callable[["Dataset"], "Dataset"]) -> "Dataset":
    """`transformation_func(self)`, which must return a Dataset (tf.data's
    `apply`, for chaining reusable transformations)."""
    dataset = transformation_func(self)
    if not isinstance(dataset, Dataset):
      raise TypeError(
        f"apply: transformation_func must return a jaxfeed Dataset, got {type(dataset).__name__}."
      )
    return dataset

  def ignore_errors(self, log_warning: bool = False) -> "Dataset":
    """Drops the elements whose computation raised (a failing UDF, a corrupt
    record) and goes on; the iterator's `stats()` counts them."""
    from jaxfeed.ops import ignore_errors

    return self._wrap(ignore_errors.IgnoreErrorsNode(self.node, log_warning))

  def get_single_element(self) -> Any:
    """The dataset's only element; a ValueError if it has none or more
    (tf.data's `get_single_element`)."""
    from jaxfeed.ops import single_element

    return single_element.single_element(self.make_iterator(), repr(self))

  def reduce(self, initial_state: Any, reduce_func: Callable[..., Any]) -> Any:
    """Runs the pipeline to its end: `reduce_func(state, element)` folded over
    the elements from `initial_state`; returns the final state (tf.data's
    `reduce`, with numpy values)."""
    state = initial_state
    with self.make_iterator() as iterator:
      for element in iterator:
        state = reduce_func(state, element)
    return state

  def save(
    self,
    path: Any,
    compression: str | None = None,
    shard_func: Callable[..., Any] | None = None,
    checkpoint_args: Any = None,
  ) -> None:
    """Runs the pipeline to its end and writes its elements to the folder
    `path` (tf.data's `save`), for `Dataset.load`: array_record chunks and a
    checksummed manifest written last. `compression`: None, "SNAPPY" or
    "ZSTD"; `shard_func(element) -> int` groups elements into chunks by
    shard. Replaces a saved dataset already at `path`. See `jaxfeed.ops.save`."""
    from jaxfeed.ops import save

    save.save(
      self.make_iterator(), path, self.fingerprint(), compression, shard_func, checkpoint_args
    )

  # ---- order and count -------------------------------------------------
  def shuffle(
    self, buffer_size: int, seed: int | None = None, reshuffle_each_iteration: bool = True
  ) -> "Dataset":
    """Shuffles the elements within windows of `buffer_size`, with exact,
    small state.

    How it differs from tf.data's sliding reservoir: the input is cut into
    consecutive windows of `buffer_size` elements and each window is emitted
    in a random order keyed by (seed, iteration, window), so an element
    moves at most `buffer_size - 1` positions and the saved state does not
    hold the buffer. With `buffer_size >=` the dataset size it is a uniform
    permutation, as in tf.data. `seed=None` draws one (saved in the state);
    `reshuffle_each_iteration` gives every pass its own order. For a global
    shuffle of records, shuffle in the sampler (`IndexSampler(shuffle=True)`).
    See `jaxfeed.ops.shuffle`.
    """
    from jaxfeed.ops import shuffle

    return self._wrap(
      shuffle.ShuffleNode(
        self.node, buffer_size, seed=seed, reshuffle_each_iteration=reshuffle_each_iteration
      )
    )

  def repeat(self, count: int | None = None) -> "Dataset":
    """Repeats the dataset `count` times (forever for None or -1).

    tf.data's `repeat`: each repetition is a new pass over the input (its
    next iteration, see `make_iterator`), so a shuffled `IndexSampler` or a
    `shuffle(..., reshuffle_each_iteration=True)` below it gives every
    repetition its own order. For sampler pipelines, `num_epochs` of the
    `IndexSampler` also gives epochs with their own global shuffle.
    """
    from jaxfeed.ops import repeat

    return self._wrap(repeat.RepeatNode(self.node, count))

  def take(self, count: int) -> "Dataset":
    """At most the first `count` elements (tf.data's `take`; a negative count
    takes them all)."""
    from jaxfeed.ops import take

    return self._wrap(take.TakeNode(self.node, count))

  def skip(self, count: int) -> "Dataset":
    """All but the first `count` elements (tf.data's `skip`; a negative count
    skips everything). Ops that can skip without computing do so."""
    from jaxfeed.ops import skip

    return self._wrap(skip.SkipNode(self.node, count))

  def concatenate(self, other: "Dataset") -> "Dataset":
    """The elements of this dataset, then those of `other` (tf.data's
    `concatenate`; structures and dtypes must match, shapes may differ)."""
    from jaxfeed.ops import concatenate

    return self._wrap(concatenate.ConcatenateNode(self.node, other))

  # ---- nesting -----------------------------------------------------------
  def interleave(
    self,
    fn: Callable[..., Any],
    cycle_length: int | None = None,
    block_length: int = 1,
    num_parallel_calls: int | None = None,
    deterministic: bool = True,
  ) -> "Dataset":
    """Reads the datasets `fn(element)` returns, cycling between them.

    tf.data's `interleave`, in tf.data's exact order: up to `cycle_length`
    nested datasets are open at once; `block_length` consecutive elements are
    taken from each in turn. With `num_parallel_calls` (an int or AUTOTUNE)
    the nested datasets are opened and read ahead on threads; with
    `deterministic=False` a slow one does not hold the others back. `fn` must
    be deterministic (resume calls it again). See `jaxfeed.ops.interleave`.

    Example: `Dataset.range(2).interleave(lambda x: Dataset.range(3).map(
    lambda y: 10 * x + y), cycle_length=2)` -> 0, 10, 1, 11, 2, 12.
    """
    from jaxfeed.ops import interleave

    return self._wrap(
      interleave.InterleaveNode(
        self.node,
        fn,
        cycle_length=cycle_length,
        block_length=block_length,
        num_parallel_calls=num_parallel_calls,
        deterministic=deterministic,
      )
    )

  def flat_map(self, fn: Callable[..., Any]) -> "Dataset":
    """The elements of the dataset `fn(element)` returns, for each element
    in turn (tf.data's `flat_map`: `interleave` with `cycle_length=1`)."""
    from jaxfeed.ops import flat_map

    return self._wrap(flat_map.FlatMapNode(self.node, fn))

  # ---- materialization and overlap ----------------------------------------
  def cache(self, filename: str = "") -> "Dataset":
    """Keeps the elements of the first complete pass; later passes read them.

    tf.data's `cache`: `filename=""` caches in memory (shared by every
    iterator of this dataset); a path caches on disk (a directory written
    under a temporary name and renamed into place when complete, so a partial
    cache is never read; `gs://` paths work through etils.epath). A pass that
    stops early or fails leaves the cache empty. Elements read from a cache
    must not be modified in place. Random ops above the cache see the cached
    values. See `jaxfeed.ops.cache`.
    """
    from jaxfeed.ops import cache

    return self._wrap(cache.CacheNode(self.node, filename))

  def snapshot(self, path: str) -> "Dataset":
    """Persists this pipeline's output under `path` on the first complete pass
    and reads it from there afterwards, in any process; a pass killed
    mid-write leaves nothing half-written. See `jaxfeed.ops.snapshot`."""
    from jaxfeed.ops import snapshot

    return self._wrap(snapshot.SnapshotNode(self.node, path))

  def autocache(self, directory: str | None = None, policy: str | None = None) -> "Dataset":
    """Marks where this pipeline's output may be kept and reused across jobs:
    by service workers with `--autocache_dir`, or here in `directory`.
    After `from_source` and per-record `map` / `filter` ops, the results are
    kept by record index, shared by pipelines with any sampler (other
    seeds, shards, epochs) and by processes given the same folder (see
    jaxfeed.ops.autocache). Without a folder, elements pass through.

    Whether a point caches is the autocache policy's call (`policy`, here;
    a worker's `--autocache_policy` on the service): "auto" (the default)
    measures what computing, writing and reading cost and caches only where
    reading is clearly faster (jaxfeed.ops.autocache_policy); "always"
    caches; "never" computes."""
    from jaxfeed.ops import autocache

    return self._wrap(autocache.AutocacheNode(self.node, directory, policy))

  def prefetch(self, buffer_size: int) -> "Dataset":
    """Produces up to `buffer_size` elements ahead on a background thread
    (`jaxfeed.AUTOTUNE` lets the autotuner size it). The thread's exceptions
    reach the consumer's next `next()`."""
    from jaxfeed.ops import prefetch

    return self._wrap(prefetch.PrefetchNode(self.node, buffer_size))

  # ---- service -------------------------------------------------------------
  def distribute(
    self, service: str, processing_mode: Any = "parallel_epochs", **kwargs: Any
  ) -> "Dataset":
    """Runs this pipeline on jaxfeed service workers (see jaxfeed.service)."""
    if _distribute is None:  # jaxfeed/__init__.py registers it when imported
      raise RuntimeError("Dataset.distribute: the service is not registered; import jaxfeed first.")
    return _distribute(self, service, processing_mode, **kwargs)

  # ---- running -----------------------------------------------------------
  def with_options(self, options: Any) -> "Dataset":
    """Returns this dataset with `jaxfeed.Options` (optimizer, autotune)."""
    return Dataset(self.node, options)

  def make_iterator(self) -> base.OpIterator:
    """A fresh iterator (with get_state / set_state / close): the next
    iteration over the data.

    Like iterating a tf.data dataset again, each iterator is a new pass from
    the start: a shuffled `IndexSampler` (and `shuffle`) gives every pass its
    own order, derived from its seed and the pass number, the same in every
    run and on every host (`IndexSampler(..., reshuffle_each_iteration=False)`
    repeats the first pass's order). The state of an iterator records its
    pass: restored into a fresh Dataset, it resumes that pass, and the next
    iterator of the Dataset is the pass after it, as in the run that saved
    it. Every process of a multi-process job must iterate its Dataset the
    same number of times.

    The graph is first rewritten by the static optimizer, then run under the
    autotuner when it has AUTOTUNE knobs (see `jaxfeed.Options`).
    """
    from jaxfeed.ops import optimize, op_stats, autotune

    # Optimized once per Dataset: nodes that keep something across iterations
    # (an in-memory cache, shuffle's pass counter, from_source's iteration)
    # then live on, as they do when the same Dataset is iterated again in
    # tf.data.
    if self._optimized is None:
      self._optimized = optimize.optimize(self.node, self.options)
    base.begin_iteration(self._optimized)
    root = op_stats.instrument(self._optimized, self._optimized.make_iterator(), self.options)
    return autotune.autotuned(root, self.options)

  def __iter__(self) -> base.OpIterator:
    return self.make_iterator()

  def close(self) -> None:
    """Stops what the dataset keeps from one pass to the next: the worker
    processes of maps that run in processes (kept warm for the next epoch,
    like PyTorch's `persistent_workers`) and their shared memory. Iterating
    again starts anew. Also happens when the dataset is garbage-collected,
    and to worker processes idle for a while (see `jaxfeed.ops.process_batch`).
    Iterators still open go on with what they hold and release it when they
    end.

    Example: `with ds: for epoch in range(4): for batch in ds: ...`.
    """
    if self._optimized is None:
      return
    for node in base.graph_nodes(self._optimized):
      node.close()

  def __enter__(self) -> "Dataset":
    return self

  def __exit__(self, *exc: Any) -> None:
    self.close()

  def as_numpy_iterator(self) -> base.OpIterator:
    """Same as `make_iterator()` (elements are numpy already); for code
    written against tf.data."""
    return self.make_iterator()

  @property
  def element_spec(self) -> Any:
    """The elements' structure with a `jaxfeed.TensorSpec` (shape, dtype)
    per leaf, None where a size varies (tf.data's `element_spec`). Derived
    from the op graph; below a `map` or another function the graph cannot
    see through, from that op's first element. See
    `jaxfeed.ops.element_spec`."""
    from jaxfeed.ops import element_spec

    return element_spec.element_spec(self.node)

  def cardinality(self) -> int | None:
    """The number of elements if known and finite, -1 if infinite, None if
    unknown (tf.data returns constants for the last two)."""
    return self.node.cardinality()

  def fingerprint(self) -> str:
    """A stable hash of what this pipeline computes (ops, parameters and
    the code of its functions); the service shares and caches by it."""
    return self.node.fingerprint()

  def __repr__(self) -> str:
    return f"Dataset({self.node!r})"


base.register_dataset_wrapper(Dataset)
