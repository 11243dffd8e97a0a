"""`Dataset`'s batching transformations: `batch`, `padded_batch`,
`ragged_batch`, `sparse_batch`, `window`, `unbatch`, `rebatch`,
`bucket_by_sequence_length`, `group_by_window` and `pack`.

`Dataset` inherits them from `DatasetBatching`; like every method of the
facade, each builds one node from its op module in `jaxfeed/ops/`, imported
in the method (see `jaxfeed/dataset_sources.py` for why).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from jaxfeed.dataset_sources import DatasetSources, _DatasetT


class DatasetBatching(DatasetSources):
  """The batching transformations of `Dataset` (see `jaxfeed.Dataset`)."""

  __slots__ = ()

  def batch(self: _DatasetT, batch_size: int, drop_remainder: bool = False) -> _DatasetT:
    """Stacks `batch_size` consecutive elements along a new leading dimension.

    tf.data's `batch`: every leaf of the elements gets a leading batch
    dimension (elements must share structure, dtypes and shapes; use
    `padded_batch` or `ragged_batch` otherwise). The last batch holds the
    remaining elements unless `drop_remainder=True` drops it (what a jitted
    step with a fixed shape wants). Nothing is buffered between batches, so
    the iterator's state is its input's.

    Example: `Dataset.range(5).batch(2)` yields `[0, 1]`, `[2, 3]`, `[4]`.
    """
    from jaxfeed.ops import batch

    return self._wrap(batch.BatchNode(self.node, batch_size, drop_remainder))

  def padded_batch(
    self: _DatasetT,
    batch_size: int,
    padded_shapes: Any = None,
    padding_values: Any = None,
    drop_remainder: bool = False,
  ) -> _DatasetT:
    """Batches elements of different shapes by padding them.

    tf.data's `padded_batch`: each leaf is padded to its entry of
    `padded_shapes` (None or -1 dimensions, or no `padded_shapes`: to the
    longest element of the batch) with its entry of `padding_values` (0,
    False, b'' or '' by default). An element longer than an explicit size is
    an error. In a multi-process job, give fixed `padded_shapes` so every
    process builds the same global shape.

    Example: `ds.padded_batch(32, padded_shapes={"tokens": [128]})`.
    """
    from jaxfeed.ops import padded_batch

    return self._wrap(
      padded_batch.PaddedBatchNode(
        self.node,
        batch_size,
        padded_shapes=padded_shapes,
        padding_values=padding_values,
        drop_remainder=drop_remainder,
      )
    )

  def ragged_batch(self: _DatasetT, batch_size: int, drop_remainder: bool = False) -> _DatasetT:
    """Batches elements of different lengths: each leaf of rank >= 1 becomes
    `{"values", "row_lengths"}` (tf.data's ragged batch, flattened); scalar
    leaves are stacked. See `jaxfeed.ops.ragged_batch`."""
    from jaxfeed.ops import ragged_batch

    return self._wrap(ragged_batch.RaggedBatchNode(self.node, batch_size, drop_remainder))

  def sparse_batch(self: _DatasetT, batch_size: int, row_shape: Sequence[int | None]) -> _DatasetT:
    """Batches array elements of different shapes as sparse batches (tf.data's
    `sparse_batch`): dicts of `indices`, `values` and `dense_shape`, the parts
    of a `tf.sparse.SparseTensor`. See `jaxfeed.ops.sparse_batch`."""
    from jaxfeed.ops import sparse_batch

    return self._wrap(sparse_batch.SparseBatchNode(self.node, batch_size, row_shape))

  def window(
    self: _DatasetT,
    size: int,
    shift: int | None = None,
    stride: int = 1,
    drop_remainder: bool = False,
    stack: bool = True,
  ) -> _DatasetT:
    """Windows of `size` elements every `shift` (default `size`), taking every
    `stride`-th, with tf.data's rules; each window is one element: stacked
    like `batch` (`stack=True`) or a list. See `jaxfeed.ops.window`."""
    from jaxfeed.ops import window

    return self._wrap(
      window.WindowNode(
        self.node, size, shift=shift, stride=stride, drop_remainder=drop_remainder, stack=stack
      )
    )

  def unbatch(self: _DatasetT) -> _DatasetT:
    """Splits every batch into its rows (tf.data's `unbatch`): every leaf
    needs the same leading dimension; rows are views of the batch."""
    from jaxfeed.ops import unbatch

    return self._wrap(unbatch.UnbatchNode(self.node))

  def rebatch(self: _DatasetT, batch_size: int, drop_remainder: bool = False) -> _DatasetT:
    """Re-splits batches into batches of `batch_size` rows (tf.data's
    `rebatch`): what `unbatch().batch(batch_size)` gives, without splitting
    into elements. `batch_size` may be a list of sizes used in turn."""
    from jaxfeed.ops import rebatch

    return self._wrap(rebatch.RebatchNode(self.node, batch_size, drop_remainder))

  def bucket_by_sequence_length(
    self: _DatasetT,
    element_length_func: Callable[..., Any],
    bucket_boundaries: Sequence[int],
    bucket_batch_sizes: Sequence[int],
    padded_shapes: Any = None,
    padding_values: Any = None,
    pad_to_bucket_boundary: bool = False,
    no_padding: bool = False,
    drop_remainder: bool = False,
  ) -> _DatasetT:
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
    from jaxfeed.ops import bucket_by_sequence_length

    return self._wrap(
      bucket_by_sequence_length.BucketBySequenceLengthNode(
        self.node,
        element_length_func,
        bucket_boundaries,
        bucket_batch_sizes,
        padded_shapes=padded_shapes,
        padding_values=padding_values,
        pad_to_bucket_boundary=pad_to_bucket_boundary,
        no_padding=no_padding,
        drop_remainder=drop_remainder,
      )
    )

  def group_by_window(
    self: _DatasetT,
    key_func: Callable[..., Any],
    reduce_func: Callable[..., Any],
    window_size: int | None = None,
    window_size_func: Callable[..., Any] | None = None,
  ) -> _DatasetT:
    """Groups elements by `key_func` into windows, each reduced to a dataset.

    tf.data's `group_by_window`, output for output: an element goes to the
    group of `key_func(element)` (an integer); a group of `window_size`
    (or `window_size_func(key)`) elements becomes a window, and
    `reduce_func(key, window_dataset)` returns the dataset whose elements are
    output. Partial groups are reduced at the end in key order. Both
    functions must be deterministic (resume re-reads the pending elements).
    """
    from jaxfeed.ops import group_by_window

    return self._wrap(
      group_by_window.GroupByWindowNode(
        self.node, key_func, reduce_func, window_size=window_size, window_size_func=window_size_func
      )
    )

  def pack(
    self: _DatasetT,
    length_struct: Any,
    *,
    num_packing_bins: int,
    algorithm: str = "first_fit",
    max_sequences_per_bin: int | None = None,
    overflow: str = "error",
  ) -> _DatasetT:
    """Packs sequences into fixed-length rows with segment ids and positions.

    `overflow` says what happens to a sequence longer than its row:
    "error", "truncate" (cut to the row length) or "split" (cut into
    row-length pieces packed in order, each with positions from 0; nothing is
    lost). See `jaxfeed.ops.pack` for the packing rules. Over an
    `IndexSampler` (or `mix`) through `map` / `random_map` / `filter`, a
    checkpoint resumes on another number of processes: the tokens are the
    uninterrupted run's, the rows may differ (see docs/multihost.md).
    """
    from jaxfeed.ops import pack

    return self._wrap(
      pack.PackNode(
        self.node,
        length_struct,
        num_packing_bins=num_packing_bins,
        algorithm=algorithm,
        max_sequences_per_bin=max_sequences_per_bin,
        overflow=overflow,
      )
    )
