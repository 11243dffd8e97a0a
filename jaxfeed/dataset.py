"""`Dataset`: the thin chaining facade over the op graph.

Each method builds one node from its op module in `jaxfeed/ops/` and wraps it;
the ops' logic lives there. Op modules never import this file.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable, Mapping, Sequence

from jaxfeed.ops import base


def _op(module: str):
  return importlib.import_module(f"jaxfeed.ops.{module}")


# What `Dataset.distribute` runs. The service sits right of the op graph and
# imports this facade, so the facade never imports it: the package root,
# above both, registers it (see jaxfeed/__init__.py).
_distribute: Callable[..., "Dataset"] | None = None


def register_distribute(implementation: Callable[..., "Dataset"]) -> None:
  """Called once by the package root: what `Dataset.distribute` runs."""
  global _distribute
  _distribute = implementation


class Dataset:
  """An immutable pipeline. Iterating it builds a fresh, stateful iterator."""

  __slots__ = ("node", "options", "_optimized")

  def __init__(self, node: base.Node, options: Any = None):
    if not isinstance(node, base.Node):
      raise TypeError(f"Dataset wraps a jaxfeed op node, got {type(node).__name__}.")
    self.node = node
    self.options = options
    self._optimized: base.Node | None = None

  def _wrap(self, node: base.Node) -> "Dataset":
    return Dataset(node, self.options)

  # ---- sources -----------------------------------------------------------
  @staticmethod
  def from_source(source: Any, sampler: Any = None) -> "Dataset":
    """Records of a random-access source, in the order a sampler gives."""
    return Dataset(_op("from_source").SourceNode(source, sampler))

  @staticmethod
  def from_tfrecord(paths: Any, compression_type: str | None = None,
                    verify_crc: bool = True) -> "Dataset":
    """Like tf.data.TFRecordDataset: the records (bytes) of TFRecord files,
    files in order, records in order, read sequentially (compression_type
    None, "GZIP" or "ZLIB"); resumes at the saved (file, byte offset)."""
    return Dataset(_op("from_tfrecord").TFRecordNode(
        paths, compression_type, verify_crc))

  @staticmethod
  def range(*args: int, dtype: Any = None) -> "Dataset":
    """Like tf.data.Dataset.range: range(stop), range(start, stop[, step])."""
    return Dataset(_op("range").RangeNode(*args, dtype=dtype))

  @staticmethod
  def from_tensor_slices(tensors: Any) -> "Dataset":
    """Slices a pytree of arrays along its first dimension."""
    return Dataset(_op("from_tensor_slices").TensorSlicesNode(tensors))

  @staticmethod
  def from_tensors(tensors: Any) -> "Dataset":
    """One element: the pytree `tensors` whole (tf.data's `from_tensors`;
    leaves convert as in `from_tensor_slices`)."""
    return Dataset(_op("from_tensors").FromTensorsNode(tensors))

  @staticmethod
  def counter(start: Any = 0, step: Any = 1, dtype: Any = None) -> "Dataset":
    """Endless `start, start + step, ...` (tf.data's `counter`), scalars of
    `dtype` (int64 by default)."""
    return Dataset(_op("counter").CounterNode(start, step, dtype))

  @staticmethod
  def random(seed: int | None = None,
             rerandomize_each_iteration: bool | None = None) -> "Dataset":
    """Endless int64 values uniform in [0, 2**32) (tf.data's `random`): the
    same for the same `seed`, every iteration unless
    `rerandomize_each_iteration`. See `jaxfeed.ops.random_dataset`."""
    return Dataset(_op("random_dataset").RandomNode(
        seed, rerandomize_each_iteration))

  @staticmethod
  def list_files(file_pattern: Any, shuffle: bool | None = None,
                 seed: int | None = None) -> "Dataset":
    """The file names (bytes) matching glob patterns, matched now (tf.data's
    `list_files`): shuffled by default, sorted with `shuffle=False`. See
    `jaxfeed.ops.list_files` for how `seed=None` resumes."""
    return Dataset(_op("list_files").list_files_node(file_pattern, shuffle, seed))

  @staticmethod
  def from_generator(generator: Callable, output_signature: Any = None,
                     args: Sequence[Any] | None = None,
                     skip: Callable | None = None) -> "Dataset":
    """The elements of `generator(*args)`, leaves as numpy arrays.

    Like tf.data's `from_generator`; `output_signature`, if given, is a pytree
    of numpy dtypes the leaves are cast to. Resuming calls the generator
    again and skips the elements already returned (exact when it yields the
    same sequence each time), or calls `skip(count, *args)` for an iterator
    that starts at element `count`. See `jaxfeed.ops.from_generator`.
    """
    return Dataset(_op("from_generator").GeneratorNode(
        generator, output_signature=output_signature, args=args, skip=skip))

  @staticmethod
  def load(path: Any, element_spec: Any = None, compression: str | None = None,
           reader_func: Callable | None = None, wait: bool = False,
           sampler: Any = None) -> "Dataset":
    """The dataset saved at `path` by `save` or `jaxfeed.service.distributed_save`
    (tf.data's `load`), as a random-access source: elements in the order
    they were saved, or in `sampler`'s (an `IndexSampler` over them, to
    shuffle and shard). An incomplete save is refused, or waited for with
    `wait=True`. `element_spec`, if given, must match the saved one;
    `compression` is read from the save; `reader_func` has no counterpart
    (read order is the sampler's). See `jaxfeed.ops.load`."""
    if reader_func is not None:
      raise ValueError("load: reader_func has no jaxfeed counterpart; pass "
                       "sampler=jaxfeed.IndexSampler(...) to choose the order.")
    del compression  # the save records its own
    node = _op("load").load_node(path, wait, sampler)
    if element_spec is not None and element_spec != node.source.element_spec:
      raise ValueError(f"load: element_spec {element_spec} differs from the saved "
                       f"dataset's {node.source.element_spec} at {path}.")
    return Dataset(node)

  @staticmethod
  def zip(datasets: Any) -> "Dataset":
    """Zips a tuple or dict of datasets, like tf.data.Dataset.zip."""
    return Dataset(_op("zip").ZipNode(datasets))

  @staticmethod
  def sample_from_datasets(datasets: Sequence["Dataset"],
                           weights: Sequence[float] | None = None,
                           seed: int | None = None,
                           stop_on_empty_dataset: bool = False) -> "Dataset":
    """A random mixture: each element comes from a dataset drawn by weight.

    Like tf.data's `sample_from_datasets`. Draw `k` is a pure function of
    (seed, k) and of which datasets are exhausted, so the mixture is
    deterministic from the seed and resumes exactly. With
    `stop_on_empty_dataset=False` (the default) an exhausted dataset drops
    out and the others go on, so no element is lost; with True the output
    ends at the first draw of an exhausted dataset.

    Example: `Dataset.sample_from_datasets([code, prose], [0.7, 0.3], seed=0)`.
    """
    nodes = _op("mixing").check_datasets(datasets, "sample_from_datasets")
    return Dataset(_op("sample_from_datasets").SampleFromDatasetsNode(
        *nodes, weights=weights, seed=seed,
        stop_on_empty_dataset=stop_on_empty_dataset))

  @staticmethod
  def mix(datasets: Sequence["Dataset"], weights: Sequence[float] | None = None,
          *, seed: int = 0, shard_options: Any = None) -> "Dataset":
    """An index-level mixture of `from_source` datasets, like Grain's
    `MapDataset.mix`.

    Global position `q` of the mixture goes to a component chosen as a pure
    function of (seed, q, weights), with the weights' proportions held
    exactly at every prefix; each component reads its sampler's positions in
    order, so it keeps its global shuffle and repeats nothing within its
    epochs. Shard the mixture with `shard_options` (e.g.
    `ShardByJaxProcess()`), not its components. The result is a
    `from_source` dataset: checkpoints resume exactly, also on another
    number of processes (`reshard_loader_states`), and a restored pipeline
    may have new weights, which apply from the checkpoint on (restore the
    states through `jaxfeed.align_mixture_states`). See
    `jaxfeed.MixtureSampler`.

    Example: `Dataset.mix([Dataset.from_source(code, code_sampler),
    Dataset.from_source(prose, prose_sampler)], [0.7, 0.3])`.
    """
    return Dataset(_op("mix").mix_node(datasets, weights, seed=seed,
                                       shard_options=shard_options))

  @staticmethod
  def choose_from_datasets(datasets: Sequence["Dataset"], choice_dataset: "Dataset",
                           stop_on_empty_dataset: bool = True) -> "Dataset":
    """The next element of `datasets[c]` for each choice `c` of `choice_dataset`.

    Same output as tf.data's `choose_from_datasets`: with
    `stop_on_empty_dataset=True` the output ends at the first choice of an
    exhausted dataset; with False such choices are skipped and the output
    ends when the choices end or every dataset is exhausted. A choice outside
    `[0, len(datasets))` is an error.
    """
    nodes = _op("mixing").check_datasets(datasets, "choose_from_datasets")
    return Dataset(_op("choose_from_datasets").ChooseFromDatasetsNode(
        *nodes, choice_dataset, stop_on_empty_dataset=stop_on_empty_dataset))

  @staticmethod
  def from_bucket_plan(source: Any, plan: Any, padded_shapes: Any = None,
                       padding_values: Any = None,
                       pad_to_bucket_boundary: bool = False,
                       decode_fn: Callable | None = None) -> "Dataset":
    """This host's padded batches of a `jaxfeed.coord.BucketPlan`.

    Records must be pytrees of arrays, or bytes that `decode_fn` turns into
    one; every host pads a step's batch to the same sequence length.
    """
    from jaxfeed.coord import bucket_plan_dataset  # coord sits right of ops
    return Dataset(bucket_plan_dataset.BucketPlanNode(
        source, plan, padded_shapes=padded_shapes,
        padding_values=padding_values,
        pad_to_bucket_boundary=pad_to_bucket_boundary, decode_fn=decode_fn))

  # ---- element-wise --------------------------------------------------------
  def map(self, fn: Callable, num_parallel_calls: int | None = None,
          deterministic: bool = True, batched: bool = False,
          backend: str = "auto", writes_out: bool = False) -> "Dataset":
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
    return self._wrap(_op("map").MapNode(
        self.node, fn, num_parallel_calls=num_parallel_calls,
        deterministic=deterministic, batched=batched, backend=backend,
        writes_out=writes_out))

  def random_map(self, fn: Callable, num_parallel_calls: int | None = None,
                 deterministic: bool = True, seed: int | None = None,
                 backend: str = "auto", writes_out: bool = False) -> "Dataset":
    """Applies `fn(element, rng)` with a `np.random.Generator` per element.

    The generator is seeded from the element's own seed (for sampler
    pipelines a hash of (seed, epoch, record index), combined with `seed`),
    so augmentations are the same whatever the parallelism, backend, host
    count or resume point. Arguments as for `map`. tf.data has no
    equivalent (its random ops use stateful or op-level seeds).

    Example: `ds.random_map(lambda x, rng: x + rng.normal(size=x.shape))`.
    With `writes_out=True`, `fn(element, rng, out=...)` (see `map`).
    """
    return self._wrap(_op("random_map").RandomMapNode(
        self.node, fn, num_parallel_calls=num_parallel_calls,
        deterministic=deterministic, seed=seed, backend=backend,
        writes_out=writes_out))

  def filter(self, predicate: Callable) -> "Dataset":
    """Keeps the elements for which `predicate(element)` is true.

    tf.data's `filter`: tuple elements are unpacked into arguments; the
    predicate returns a Python or numpy bool (scalar).

    Example: `Dataset.range(6).filter(lambda x: x % 2 == 0)` -> 0, 2, 4.
    """
    return self._wrap(_op("filter").FilterNode(self.node, predicate))

  def enumerate(self, start: int = 0) -> "Dataset":
    """`(index, element)` pairs, the index an int64 counting from `start`."""
    return self._wrap(_op("enumerate").EnumerateNode(self.node, start))

  def scan(self, initial_state: Any, scan_func: Callable) -> "Dataset":
    """`scan_func(state, element) -> (new_state, output)` through the elements.

    Like tf.data's `scan`. The running state is saved with the iterator's
    state, so it must be arrays, scalars, bytes, str or containers of them.
    """
    return self._wrap(_op("scan").ScanNode(self.node, initial_state, scan_func))

  def unique(self) -> "Dataset":
    """The first occurrence of each distinct element (integer or string
    scalars, as in tf.data); the values seen are kept in memory and state."""
    return self._wrap(_op("unique").UniqueNode(self.node))

  def shard(self, num_shards: int, index: int) -> "Dataset":
    """Every `num_shards`-th element starting at `index` (tf.data's `shard`).

    For sampler-based pipelines, sharding in the sampler
    (`ShardOptions`, `ShardByJaxProcess`) reads only this shard's records.
    """
    return self._wrap(_op("shard").ShardNode(self.node, num_shards, index))

  def take_while(self, predicate: Callable) -> "Dataset":
    """The elements up to the first for which `predicate(element)` is false
    (tf.data's `take_while`; tuple elements are unpacked)."""
    return self._wrap(_op("take_while").TakeWhileNode(self.node, predicate))

  def rejection_resample(self, class_func: Callable,
                         target_dist: Sequence[float],
                         initial_dist: Sequence[float] | None = None,
                         seed: int | None = None) -> "Dataset":
    """`(class_func(element), element)` pairs resampled so that the classes
    follow `target_dist` (tf.data's `rejection_resample`: elements may be
    dropped or repeated). Deterministic from `seed`; see
    `jaxfeed.ops.rejection_resample`."""
    return self._wrap(_op("rejection_resample").RejectionResampleNode(
        self.node, class_func, target_dist, initial_dist, seed))

  def apply(self, transformation_func: Callable[["Dataset"], "Dataset"]) -> "Dataset":
    """`transformation_func(self)`, which must return a Dataset (tf.data's
    `apply`, for chaining reusable transformations)."""
    dataset = transformation_func(self)
    if not isinstance(dataset, Dataset):
      raise TypeError(f"apply: transformation_func must return a jaxfeed "
                      f"Dataset, got {type(dataset).__name__}.")
    return dataset

  def ignore_errors(self, log_warning: bool = False) -> "Dataset":
    """Drops the elements whose computation raised (a failing UDF, a corrupt
    record) and goes on; the iterator's `stats()` counts them."""
    return self._wrap(_op("ignore_errors").IgnoreErrorsNode(self.node, log_warning))

  def get_single_element(self) -> Any:
    """The dataset's only element; a ValueError if it has none or more
    (tf.data's `get_single_element`)."""
    return _op("single_element").single_element(self.make_iterator(), repr(self))

  def reduce(self, initial_state: Any, reduce_func: Callable) -> Any:
    """Runs the pipeline to its end: `reduce_func(state, element)` folded over
    the elements from `initial_state`; returns the final state (tf.data's
    `reduce`, with numpy values)."""
    state = initial_state
    with self.make_iterator() as iterator:
      for element in iterator:
        state = reduce_func(state, element)
    return state

  def save(self, path: Any, compression: str | None = None,
           shard_func: Callable | None = None, checkpoint_args: Any = None) -> None:
    """Runs the pipeline to its end and writes its elements to the folder
    `path` (tf.data's `save`), for `Dataset.load`: array_record chunks and a
    checksummed manifest written last. `compression`: None, "SNAPPY" or
    "ZSTD"; `shard_func(element) -> int` groups elements into chunks by
    shard. Replaces a saved dataset already at `path`. See `jaxfeed.ops.save`."""
    _op("save").save(self.make_iterator(), path, self.fingerprint(),
                     compression, shard_func, checkpoint_args)

  # ---- batching ----------------------------------------------------------
  def batch(self, batch_size: int, drop_remainder: bool = False) -> "Dataset":
    """Stacks `batch_size` consecutive elements along a new leading dimension.

    tf.data's `batch`: every leaf of the elements gets a leading batch
    dimension (elements must share structure, dtypes and shapes; use
    `padded_batch` or `ragged_batch` otherwise). The last batch holds the
    remaining elements unless `drop_remainder=True` drops it (what a jitted
    step with a fixed shape wants). Nothing is buffered between batches, so
    the iterator's state is its input's.

    Example: `Dataset.range(5).batch(2)` yields `[0, 1]`, `[2, 3]`, `[4]`.
    """
    return self._wrap(_op("batch").BatchNode(self.node, batch_size, drop_remainder))

  def padded_batch(self, batch_size: int, padded_shapes: Any = None,
                   padding_values: Any = None,
                   drop_remainder: bool = False) -> "Dataset":
    """Batches elements of different shapes by padding them.

    tf.data's `padded_batch`: each leaf is padded to its entry of
    `padded_shapes` (None or -1 dimensions, or no `padded_shapes`: to the
    longest element of the batch) with its entry of `padding_values` (0,
    False, b'' or '' by default). An element longer than an explicit size is
    an error. In a multi-process job, give fixed `padded_shapes` so every
    process builds the same global shape.

    Example: `ds.padded_batch(32, padded_shapes={"tokens": [128]})`.
    """
    return self._wrap(_op("padded_batch").PaddedBatchNode(
        self.node, batch_size, padded_shapes=padded_shapes,
        padding_values=padding_values, drop_remainder=drop_remainder))

  def ragged_batch(self, batch_size: int, drop_remainder: bool = False) -> "Dataset":
    """Batches elements of different lengths: each leaf of rank >= 1 becomes
    `{"values", "row_lengths"}` (tf.data's ragged batch, flattened); scalar
    leaves are stacked. See `jaxfeed.ops.ragged_batch`."""
    return self._wrap(_op("ragged_batch").RaggedBatchNode(
        self.node, batch_size, drop_remainder))

  def sparse_batch(self, batch_size: int,
                   row_shape: Sequence[int | None]) -> "Dataset":
    """Batches array elements of different shapes as sparse batches (tf.data's
    `sparse_batch`): dicts of `indices`, `values` and `dense_shape`, the parts
    of a `tf.sparse.SparseTensor`. See `jaxfeed.ops.sparse_batch`."""
    return self._wrap(_op("sparse_batch").SparseBatchNode(
        self.node, batch_size, row_shape))

  def window(self, size: int, shift: int | None = None, stride: int = 1,
             drop_remainder: bool = False, stack: bool = True) -> "Dataset":
    """Windows of `size` elements every `shift` (default `size`), taking every
    `stride`-th, with tf.data's rules; each window is one element: stacked
    like `batch` (`stack=True`) or a list. See `jaxfeed.ops.window`."""
    return self._wrap(_op("window").WindowNode(
        self.node, size, shift=shift, stride=stride,
        drop_remainder=drop_remainder, stack=stack))

  def unbatch(self) -> "Dataset":
    """Splits every batch into its rows (tf.data's `unbatch`): every leaf
    needs the same leading dimension; rows are views of the batch."""
    return self._wrap(_op("unbatch").UnbatchNode(self.node))

  def rebatch(self, batch_size: int, drop_remainder: bool = False) -> "Dataset":
    """Re-splits batches into batches of `batch_size` rows (tf.data's
    `rebatch`): what `unbatch().batch(batch_size)` gives, without splitting
    into elements. `batch_size` may be a list of sizes used in turn."""
    return self._wrap(_op("rebatch").RebatchNode(self.node, batch_size, drop_remainder))

  def bucket_by_sequence_length(
      self, element_length_func: Callable, bucket_boundaries: Sequence[int],
      bucket_batch_sizes: Sequence[int], padded_shapes: Any = None,
      padding_values: Any = None, pad_to_bucket_boundary: bool = False,
      no_padding: bool = False, drop_remainder: bool = False) -> "Dataset":
    """Batches elements of similar length together, padded per bucket.

    tf.data's `bucket_by_sequence_length`, output for output: bucket `i`
    holds lengths in `[bucket_boundaries[i-1], bucket_boundaries[i])` and is
    emitted as a batch of `bucket_batch_sizes[i]` once full (padded like
    `padded_batch`, or stacked with `no_padding=True`); partial buckets are
    emitted at the end unless `drop_remainder`. `pad_to_bucket_boundary` pads
    to `boundary - 1`. `element_length_func` must be deterministic (resume
    re-reads the pending elements). For shapes every JAX process agrees on,
    give `padded_shapes` or pad to the bucket boundary. See
    `jaxfeed.ops.bucket_by_sequence_length`.
    """
    return self._wrap(_op("bucket_by_sequence_length").BucketBySequenceLengthNode(
        self.node, element_length_func, bucket_boundaries, bucket_batch_sizes,
        padded_shapes=padded_shapes, padding_values=padding_values,
        pad_to_bucket_boundary=pad_to_bucket_boundary, no_padding=no_padding,
        drop_remainder=drop_remainder))

  def group_by_window(self, key_func: Callable, reduce_func: Callable,
                      window_size: int | None = None,
                      window_size_func: Callable | None = None) -> "Dataset":
    """Groups elements by `key_func` into windows, each reduced to a dataset.

    tf.data's `group_by_window`, output for output: an element goes to the
    group of `key_func(element)` (an integer); a group of `window_size`
    (or `window_size_func(key)`) elements becomes a window, and
    `reduce_func(key, window_dataset)` returns the dataset whose elements are
    output. Partial groups are reduced at the end in key order. Both
    functions must be deterministic (resume re-reads the pending elements).
    """
    return self._wrap(_op("group_by_window").GroupByWindowNode(
        self.node, key_func, reduce_func, window_size=window_size,
        window_size_func=window_size_func))

  def pack(self, length_struct: Any, *, num_packing_bins: int,
           algorithm: str = "first_fit",
           max_sequences_per_bin: int | None = None,
           overflow: str = "error") -> "Dataset":
    """Packs sequences into fixed-length rows with segment ids and positions.

    `overflow` says what happens to a sequence longer than its row:
    "error", "truncate" (cut to the row length) or "split" (cut into
    row-length pieces packed in order, each with positions from 0; nothing is
    lost). See `jaxfeed.ops.pack` for the packing rules. Over an
    `IndexSampler` (or `mix`) through `map` / `random_map` / `filter`, a
    checkpoint resumes on another number of processes: the tokens are the
    uninterrupted run's, the rows may differ (see docs/multihost.md).
    """
    return self._wrap(_op("pack").PackNode(
        self.node, length_struct, num_packing_bins=num_packing_bins,
        algorithm=algorithm, max_sequences_per_bin=max_sequences_per_bin,
        overflow=overflow))

  # ---- order and count -------------------------------------------------
  def shuffle(self, buffer_size: int, seed: int | None = None,
              reshuffle_each_iteration: bool = True) -> "Dataset":
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
    return self._wrap(_op("shuffle").ShuffleNode(
        self.node, buffer_size, seed=seed,
        reshuffle_each_iteration=reshuffle_each_iteration))

  def repeat(self, count: int | None = None) -> "Dataset":
    """Repeats the dataset `count` times (forever for None or -1).

    tf.data's `repeat`: each repetition is a new pass over the input (its
    next iteration, see `make_iterator`), so a shuffled `IndexSampler` or a
    `shuffle(..., reshuffle_each_iteration=True)` below it gives every
    repetition its own order. For sampler pipelines, `num_epochs` of the
    `IndexSampler` also gives epochs with their own global shuffle.
    """
    return self._wrap(_op("repeat").RepeatNode(self.node, count))

  def take(self, count: int) -> "Dataset":
    """At most the first `count` elements (tf.data's `take`; a negative count
    takes them all)."""
    return self._wrap(_op("take").TakeNode(self.node, count))

  def skip(self, count: int) -> "Dataset":
    """All but the first `count` elements (tf.data's `skip`; a negative count
    skips everything). Ops that can skip without computing do so."""
    return self._wrap(_op("skip").SkipNode(self.node, count))

  def concatenate(self, other: "Dataset") -> "Dataset":
    """The elements of this dataset, then those of `other` (tf.data's
    `concatenate`; structures and dtypes must match, shapes may differ)."""
    return self._wrap(_op("concatenate").ConcatenateNode(self.node, other))

  # ---- nesting -----------------------------------------------------------
  def interleave(self, fn: Callable, cycle_length: int | None = None,
                 block_length: int = 1, num_parallel_calls: int | None = None,
                 deterministic: bool = True) -> "Dataset":
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
    return self._wrap(_op("interleave").InterleaveNode(
        self.node, fn, cycle_length=cycle_length, block_length=block_length,
        num_parallel_calls=num_parallel_calls, deterministic=deterministic))

  def flat_map(self, fn: Callable) -> "Dataset":
    """The elements of the dataset `fn(element)` returns, for each element
    in turn (tf.data's `flat_map`: `interleave` with `cycle_length=1`)."""
    return self._wrap(_op("flat_map").FlatMapNode(self.node, fn))

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
    return self._wrap(_op("cache").CacheNode(self.node, filename))

  def snapshot(self, path: str) -> "Dataset":
    """Persists this pipeline's output under `path` on the first complete pass
    and reads it from there afterwards, in any process; a pass killed
    mid-write leaves nothing half-written. See `jaxfeed.ops.snapshot`."""
    return self._wrap(_op("snapshot").SnapshotNode(self.node, path))

  def autocache(self) -> "Dataset":
    """Marks where service workers with `--autocache_dir` may keep this
    pipeline's output and reuse it across jobs (see jaxfeed.ops.autocache);
    passes elements through elsewhere."""
    return self._wrap(_op("autocache").AutocacheNode(self.node))

  def prefetch(self, buffer_size: int) -> "Dataset":
    """Produces up to `buffer_size` elements ahead on a background thread
    (`jaxfeed.AUTOTUNE` lets the autotuner size it). The thread's exceptions
    reach the consumer's next `next()`."""
    return self._wrap(_op("prefetch").PrefetchNode(self.node, buffer_size))

  # ---- service -------------------------------------------------------------
  def distribute(self, service: str, processing_mode: Any = "parallel_epochs",
                 **kwargs: Any) -> "Dataset":
    """Runs this pipeline on jaxfeed service workers (see jaxfeed.service)."""
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
    # Optimized once per Dataset: nodes that keep something across iterations
    # (an in-memory cache, shuffle's pass counter, from_source's iteration)
    # then live on, as they do when the same Dataset is iterated again in
    # tf.data.
    if self._optimized is None:
      self._optimized = _op("optimize").optimize(self.node, self.options)
    base.begin_iteration(self._optimized)
    root = _op("op_stats").instrument(self._optimized, self._optimized.make_iterator(),
                                      self.options)
    return _op("autotune").autotuned(root, self.options)

  def __iter__(self) -> base.OpIterator:
    return self.make_iterator()

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
    return _op("element_spec").element_spec(self.node)

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
