"""jaxfeed: a deterministic, resumable input pipeline for JAX.

The public API is what this module exports; everything else is internal.
Names are imported lazily so `import jaxfeed` stays cheap for service
processes that never touch JAX; only the Dataset facade (numpy, no JAX) is
imported at once, to be given the service's reader.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from jaxfeed import dataset as _dataset

__version__ = "0.1.0"

_EXPORTS = {
  # op graph
  "Dataset": "jaxfeed.dataset",
  "AUTOTUNE": "jaxfeed.ops.base",
  "PipelineStateError": "jaxfeed.ops.base",
  "Options": "jaxfeed.ops.options",
  "TensorSpec": "jaxfeed.ops.element_spec",
  # sampler
  "IndexSampler": "jaxfeed.sampler",
  "RecordMetadata": "jaxfeed.sampler",
  "ShardOptions": "jaxfeed.sampler",
  "ShardByJaxProcess": "jaxfeed.sampler",
  "NoSharding": "jaxfeed.sampler",
  "MixtureSampler": "jaxfeed.mixture",
  # sources
  "ArraySource": "jaxfeed.sources",
  "ArrayRecordSource": "jaxfeed.sources",
  "TFRecordSource": "jaxfeed.sources",
  "ConcatSource": "jaxfeed.sources",
  "write_array_record": "jaxfeed.sources",
  "write_tfrecord": "jaxfeed.sources",
  "CorruptRecordError": "jaxfeed.sources",
  "DamagedRange": "jaxfeed.sources",
  "SequentialReadError": "jaxfeed.sources.tfrecord_source",
  "RecordSource": "jaxfeed.sources",
  "SavedDatasetSource": "jaxfeed.ops.load",
  "SaveFormatError": "jaxfeed.ops.save_format",
  # device and loader
  "DevicePrefetcher": "jaxfeed.device",
  "batch_sharding": "jaxfeed.device",
  "Loader": "jaxfeed.loader",
  "LoaderCheckpointHandler": "jaxfeed.loader_checkpoint",
  "LoaderSave": "jaxfeed.loader_checkpoint",
  "LoaderRestore": "jaxfeed.loader_checkpoint",
  "save_checkpoint": "jaxfeed.loader_checkpoint",
  "restore_checkpoint": "jaxfeed.loader_checkpoint",
  "reshard_loader_states": "jaxfeed.loader_checkpoint",
  "align_mixture_states": "jaxfeed.ops.mix",
  # text
  "ByteTokenizer": "jaxfeed.text",
  "HFTokenizer": "jaxfeed.text",
  "Tokenize": "jaxfeed.text",
  # tf.train.Example records
  "FixedLenFeature": "jaxfeed.example",
  "FixedLenSequenceFeature": "jaxfeed.example",
  "VarLenFeature": "jaxfeed.example",
  "SparseArray": "jaxfeed.example",
  "parse_single_example": "jaxfeed.example",
  "parse_example": "jaxfeed.example",
  "parse_single_sequence_example": "jaxfeed.example",
  "make_example": "jaxfeed.example",
  "make_sequence_example": "jaxfeed.example",
  # coordinated reads
  "BucketPlan": "jaxfeed.coord",
  "compute_lengths": "jaxfeed.coord",
}

# Submodules reachable as attributes (`jaxfeed.example.parse_example`).
_SUBMODULES = (
  "sources",
  "ops",
  "service",
  "device",
  "coord",
  "sampler",
  "text",
  "example",
  "image",
)

if TYPE_CHECKING:
  # What type checkers and IDEs see of the lazy exports above (a test
  # checks that both name the same things).
  from jaxfeed.coord import BucketPlan as BucketPlan, compute_lengths as compute_lengths
  from jaxfeed.dataset import Dataset as Dataset
  from jaxfeed.device import DevicePrefetcher as DevicePrefetcher, batch_sharding as batch_sharding
  from jaxfeed.example import (
    FixedLenFeature as FixedLenFeature,
    FixedLenSequenceFeature as FixedLenSequenceFeature,
    SparseArray as SparseArray,
    VarLenFeature as VarLenFeature,
    make_example as make_example,
    make_sequence_example as make_sequence_example,
    parse_example as parse_example,
    parse_single_example as parse_single_example,
    parse_single_sequence_example as parse_single_sequence_example,
  )
  from jaxfeed.loader import Loader as Loader
  from jaxfeed.loader_checkpoint import (
    LoaderCheckpointHandler as LoaderCheckpointHandler,
    LoaderRestore as LoaderRestore,
    LoaderSave as LoaderSave,
    reshard_loader_states as reshard_loader_states,
    restore_checkpoint as restore_checkpoint,
    save_checkpoint as save_checkpoint,
  )
  from jaxfeed.mixture import MixtureSampler as MixtureSampler
  from jaxfeed.ops.base import AUTOTUNE as AUTOTUNE, PipelineStateError as PipelineStateError
  from jaxfeed.ops.element_spec import TensorSpec as TensorSpec
  from jaxfeed.ops.load import SavedDatasetSource as SavedDatasetSource
  from jaxfeed.ops.mix import align_mixture_states as align_mixture_states
  from jaxfeed.ops.options import Options as Options
  from jaxfeed.ops.save_format import SaveFormatError as SaveFormatError
  from jaxfeed.sampler import (
    IndexSampler as IndexSampler,
    NoSharding as NoSharding,
    RecordMetadata as RecordMetadata,
    ShardByJaxProcess as ShardByJaxProcess,
    ShardOptions as ShardOptions,
  )
  from jaxfeed.sources import (
    ArrayRecordSource as ArrayRecordSource,
    ArraySource as ArraySource,
    ConcatSource as ConcatSource,
    CorruptRecordError as CorruptRecordError,
    DamagedRange as DamagedRange,
    RecordSource as RecordSource,
    TFRecordSource as TFRecordSource,
    write_array_record as write_array_record,
    write_tfrecord as write_tfrecord,
  )
  from jaxfeed.sources.tfrecord_source import SequentialReadError as SequentialReadError
  from jaxfeed.text import (
    ByteTokenizer as ByteTokenizer,
    HFTokenizer as HFTokenizer,
    Tokenize as Tokenize,
  )

__all__ = sorted(_EXPORTS) + [m for m in _SUBMODULES if m != "sampler"]


def _distribute(
  dataset: Any, service: str, processing_mode: Any = "parallel_epochs", **kwargs: Any
) -> Any:
  # Imported on first use: reading through the service needs gRPC, which
  # importing jaxfeed does not.
  client = importlib.import_module("jaxfeed.service.client.distribute")
  return client.distribute(dataset, service, processing_mode, **kwargs)


# The facade cannot import the service (the service imports it): the root,
# above both, gives `Dataset.distribute` the service's reader.
_dataset.register_distribute(_distribute)


def __getattr__(name: str) -> Any:
  module = _EXPORTS.get(name)
  if module is None:
    if name in _SUBMODULES:
      return importlib.import_module(f"jaxfeed.{name}")
    raise AttributeError(f"module 'jaxfeed' has no attribute {name!r}")
  value = getattr(importlib.import_module(module), name)
  globals()[name] = value
  return value


def __dir__() -> list[str]:
  return __all__
