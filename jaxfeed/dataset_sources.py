"""`Dataset`'s constructors: its sources and mixtures of datasets.

`Dataset` inherits them from `DatasetSources`, which holds the node a dataset
wraps; the transformations live in `jaxfeed/dataset_batching.py` and
`jaxfeed/dataset.py`. Each constructor
builds one node from its op module in `jaxfeed/ops/`.

The op modules are imported in the constructors that use them, not at the top:
`import jaxfeed` imports this file, and importing every op module with it
takes `python -X importtime -c "import jaxfeed"` from about 0.1 s to 0.3 s
(etils.epath, the parallel executor's threads and pools), which service
processes and `import jaxfeed` alone never use.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence, TypeVar

from jaxfeed.ops import base

_DatasetT = TypeVar("_DatasetT", bound="DatasetSources")


class DatasetSources:
  """An immutable pipeline: the node it wraps, with the constructors of
  `Dataset` (see `jaxfeed.Dataset`)."""

  __slots__ = ("node", "options", "_optimized")

  def __init__(self, node: base.Node, options: Any = None):
    if not isinstance(node, base.Node):
      raise TypeError(f"Dataset wraps a jaxfeed op node, got {type(node).__name__}.")
    self.node = node
    self.options = options
    self._optimized: base.Node | None = None

  def _wrap(self: _DatasetT, node: base.Node) -> _DatasetT:
    """`node` as a dataset of this one's class, with this one's options."""
    return type(self)(node, self.options)

  @classmethod
  def from_source(cls: type[_DatasetT], source: Any, sampler: Any = None) -> _DatasetT:
    """Records of a random-access source, in the order a sampler gives."""
    from jaxfeed.ops import from_source

    return cls(from_source.SourceNode(source, sampler))

  @classmethod
  def from_tfrecord(
    cls: type[_DatasetT], paths: Any, compression_type: str | None = None, verify_crc: bool = True
  ) -> _DatasetT:
    """Like tf.data.TFRecordDataset: the records (bytes) of TFRecord files,
    files in order, records in order, read sequentially (compression_type
    None, "GZIP" or "ZLIB"); resumes at the saved (file, byte offset)."""
    from jaxfeed.ops import from_tfrecord

    return cls(from_tfrecord.TFRecordNode(paths, compression_type, verify_crc))

  @classmethod
  def range(cls: type[_DatasetT], *args: int, dtype: Any = None) -> _DatasetT:
    """Integers from `start` to `stop` by `step`, like tf.data.Dataset.range.

    The arguments are `stop`, or `start, stop[, step]`.
    """
    from jaxfeed.ops import range

    return cls(range.RangeNode(*args, dtype=dtype))

  @classmethod
  def from_tensor_slices(cls: type[_DatasetT], tensors: Any) -> _DatasetT:
    """Slices a pytree of arrays along its first dimension."""
    from jaxfeed.ops import from_tensor_slices

    return cls(from_tensor_slices.TensorSlicesNode(tensors))

  @classmethod
  def from_tensors(cls: type[_DatasetT], tensors: Any) -> _DatasetT:
    """One element: the pytree `tensors` whole (tf.data's `from_tensors`;
    leaves convert as in `from_tensor_slices`)."""
    from jaxfeed.ops import from_tensors

    return cls(from_tensors.FromTensorsNode(tensors))

  @classmethod
  def counter(cls: type[_DatasetT], start: Any = 0, step: Any = 1, dtype: Any = None) -> _DatasetT:
    """Endless `start, start + step, ...` (tf.data's `counter`), scalars of
    `dtype` (int64 by default)."""
    from jaxfeed.ops import counter

    return cls(counter.CounterNode(start, step, dtype))

  @classmethod
  def random(
    cls: type[_DatasetT], seed: int | None = None, rerandomize_each_iteration: bool | None = None
  ) -> _DatasetT:
    """Endless int64 values uniform in [0, 2**32) (tf.data's `random`): the
    same for the same `seed`, every iteration unless
    `rerandomize_each_iteration`. See `jaxfeed.ops.random_dataset`."""
    from jaxfeed.ops import random_dataset

    return cls(random_dataset.RandomNode(seed, rerandomize_each_iteration))

  @classmethod
  def list_files(
    cls: type[_DatasetT], file_pattern: Any, shuffle: bool | None = None, seed: int | None = None
  ) -> _DatasetT:
    """The file names (bytes) matching glob patterns, matched now (tf.data's
    `list_files`): shuffled by default, sorted with `shuffle=False`. See
    `jaxfeed.ops.list_files` for how `seed=None` resumes."""
    from jaxfeed.ops import list_files

    return cls(list_files.list_files_node(file_pattern, shuffle, seed))

  @classmethod
  def from_generator(
    cls: type[_DatasetT],
    generator: Callable[..., Any],
    output_signature: Any = None,
    args: Sequence[Any] | None = None,
    skip: Callable[..., Any] | None = None,
  ) -> _DatasetT:
    """The elements of `generator(*args)`, leaves as numpy arrays.

    Like tf.data's `from_generator`; `output_signature`, if given, is a pytree
    of numpy dtypes the leaves are cast to. Resuming calls the generator
    again and skips the elements already returned (exact when it yields the
    same sequence each time), or calls `skip(count, *args)` for an iterator
    that starts at element `count`. See `jaxfeed.ops.from_generator`.
    """
    from jaxfeed.ops import from_generator

    return cls(
      from_generator.GeneratorNode(
        generator, output_signature=output_signature, args=args, skip=skip
      )
    )

  @classmethod
  def load(
    cls: type[_DatasetT],
    path: Any,
    element_spec: Any = None,
    compression: str | None = None,
    reader_func: Callable[..., Any] | None = None,
    wait: bool = False,
    sampler: Any = None,
  ) -> _DatasetT:
    """The dataset saved at `path` by `save` or `jaxfeed.service.distributed_save`
    (tf.data's `load`), as a random-access source: elements in the order
    they were saved, or in `sampler`'s (an `IndexSampler` over them, to
    shuffle and shard). An incomplete save is refused, or waited for with
    `wait=True`. `element_spec`, if given, must match the saved one;
    `compression` is read from the save; `reader_func` has no counterpart
    (read order is the sampler's). See `jaxfeed.ops.load`."""
    from jaxfeed.ops import load

    if reader_func is not None:
      raise ValueError(
        "load: reader_func has no jaxfeed counterpart; pass "
        "sampler=jaxfeed.IndexSampler(...) to choose the order."
      )
    del compression  # the save records its own
    node = load.load_node(path, wait, sampler)
    if element_spec is not None and element_spec != node.source.element_spec:
      raise ValueError(
        f"load: element_spec {element_spec} differs from the saved "
        f"dataset's {node.source.element_spec} at {path}."
      )
    return cls(node)

  @classmethod
  def zip(cls: type[_DatasetT], datasets: Any) -> _DatasetT:
    """Zips a tuple or dict of datasets, like tf.data.Dataset.zip."""
    from jaxfeed.ops import zip

    return cls(zip.ZipNode(datasets))

  @classmethod
  def sample_from_datasets(
    cls: type[_DatasetT],
    datasets: Sequence[DatasetSources],
    weights: Sequence[float] | None = None,
    seed: int | None = None,
    stop_on_empty_dataset: bool = False,
  ) -> _DatasetT:
    """A random mixture: each element comes from a dataset drawn by weight.

    Like tf.data's `sample_from_datasets`. Draw `k` is a pure function of
    (seed, k) and of which datasets are exhausted, so the mixture is
    deterministic from the seed and resumes exactly. With
    `stop_on_empty_dataset=False` (the default) an exhausted dataset drops
    out and the others go on, so no element is lost; with True the output
    ends at the first draw of an exhausted dataset.

    Example: `Dataset.sample_from_datasets([code, prose], [0.7, 0.3], seed=0)`.
    """
    from jaxfeed.ops import mixing, sample_from_datasets

    nodes = mixing.check_datasets(datasets, "sample_from_datasets")
    return cls(
      sample_from_datasets.SampleFromDatasetsNode(
        *nodes, weights=weights, seed=seed, stop_on_empty_dataset=stop_on_empty_dataset
      )
    )

  @classmethod
  def mix(
    cls: type[_DatasetT],
    datasets: Sequence[DatasetSources],
    weights: Sequence[float] | None = None,
    *,
    seed: int = 0,
    shard_options: Any = None,
  ) -> _DatasetT:
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
    from jaxfeed.ops import mix

    return cls(mix.mix_node(datasets, weights, seed=seed, shard_options=shard_options))

  @classmethod
  def choose_from_datasets(
    cls: type[_DatasetT],
    datasets: Sequence[DatasetSources],
    choice_dataset: DatasetSources,
    stop_on_empty_dataset: bool = True,
  ) -> _DatasetT:
    """The next element of `datasets[c]` for each choice `c` of `choice_dataset`.

    Same output as tf.data's `choose_from_datasets`: with
    `stop_on_empty_dataset=True` the output ends at the first choice of an
    exhausted dataset; with False such choices are skipped and the output
    ends when the choices end or every dataset is exhausted. A choice outside
    `[0, len(datasets))` is an error.
    """
    from jaxfeed.ops import mixing, choose_from_datasets

    nodes = mixing.check_datasets(datasets, "choose_from_datasets")
    return cls(
      choose_from_datasets.ChooseFromDatasetsNode(
        *nodes, choice_dataset, stop_on_empty_dataset=stop_on_empty_dataset
      )
    )

  @classmethod
  def from_bucket_plan(
    cls: type[_DatasetT],
    source: Any,
    plan: Any,
    padded_shapes: Any = None,
    padding_values: Any = None,
    pad_to_bucket_boundary: bool = False,
    decode_fn: Callable[..., Any] | None = None,
  ) -> _DatasetT:
    """This host's padded batches of a `jaxfeed.coord.BucketPlan`.

    Records must be pytrees of arrays, or bytes that `decode_fn` turns into
    one; every host pads a step's batch to the same sequence length.
    """
    from jaxfeed.coord import bucket_plan_dataset  # coord sits right of ops

    return cls(
      bucket_plan_dataset.BucketPlanNode(
        source,
        plan,
        padded_shapes=padded_shapes,
        padding_values=padding_values,
        pad_to_bucket_boundary=pad_to_bucket_boundary,
        decode_fn=decode_fn,
      )
    )
