"""tf.train.Example and tf.train.SequenceExample without TensorFlow.

Records are parsed with protobuf's C parser from a proto that mirrors
TensorFlow's (same messages and field numbers, see
`jaxfeed/protos/example.proto`), so bytes written by `tf.train.Example` parse
here and `make_example`'s bytes parse in TensorFlow. Outputs equal those of
`tf.io.parse_single_example` / `tf.io.parse_example` as NumPy arrays:

  * int64 features -> int64, float features -> float32, bytes features ->
    object arrays of `bytes` (what `tf.Tensor.numpy()` gives for tf.string).
  * `FixedLenFeature(shape)` -> an array of `shape` (`[batch, *shape]` from
    `parse_example`); a missing feature takes `default_value`, and is an error
    without one.
  * `VarLenFeature` -> `SparseArray(indices, values, dense_shape)`, the fields
    of a `tf.SparseTensor`: `indices` is int64 `[n, 1]` (`[n, 2]` as
    (record, position) from `parse_example`), `values` the flat values in
    record order, `dense_shape` `[max_len]` (`[batch, max_len]`).
    `SparseArray.row_lengths()` gives the values per record.

Bytes records should be `bytes` (or an object array of them): NumPy's 'S'
arrays drop trailing zero bytes, which can cut a serialized proto short.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Iterable, Mapping, NamedTuple, Sequence, Union

import numpy as np
from google.protobuf import message as _message

from jaxfeed.protos import example_pb2

__all__ = [
  "FixedLenFeature",
  "FixedLenSequenceFeature",
  "VarLenFeature",
  "SparseArray",
  "parse_single_example",
  "parse_example",
  "parse_single_sequence_example",
  "make_example",
  "make_sequence_example",
]

# Spec dtype -> (output NumPy dtype, the Feature's oneof field that holds it).
_KINDS = {
  np.dtype(np.int64): "int64_list",
  np.dtype(np.float32): "float_list",
  np.dtype(object): "bytes_list",
}
_DTYPE_NAMES = {"int64_list": "int64", "float_list": "float32", "bytes_list": "bytes"}


def _spec_dtype(dtype: Any, where: str) -> np.dtype:
  """int64, float32 or object (bytes) from the spellings users write."""
  given = dtype
  dtype = getattr(dtype, "as_numpy_dtype", dtype)  # a tf.DType
  if dtype in (bytes, str, "string", "bytes") or (
    isinstance(dtype, np.dtype) and dtype.kind in "SUO"
  ):
    return np.dtype(object)
  try:
    dtype = None if dtype is None else np.dtype(dtype)
  except TypeError:
    dtype = None
  if dtype not in _KINDS:
    raise TypeError(
      f"{where}: dtype must be int64, float32 or bytes (object / 'string'), got {given!r}."
    )
  return dtype


def _spec_shape(shape: Any, where: str) -> tuple[int, ...]:
  if isinstance(shape, int):
    shape = (shape,)
  try:
    shape = tuple(int(d) for d in shape)
  except (TypeError, ValueError):
    raise TypeError(f"{where}: shape must be a sequence of ints, got {shape!r}.") from None
  if any(d < 0 for d in shape):
    raise ValueError(f"{where}: shape dimensions must be >= 0, got {shape}.")
  return shape


def _dense_default(
  default_value: Any, shape: tuple[int, ...], dtype: np.dtype, where: str
) -> list | None:
  """The default as a flat list of prod(shape) values, or None."""
  if default_value is None:
    return None
  if dtype == np.dtype(object):
    value = np.empty((), object) if isinstance(default_value, (bytes, str)) else None
    if value is not None:
      value[()] = _as_bytes(default_value)
    else:
      value = np.asarray(
        [_as_bytes(v) for v in np.ravel(np.asarray(default_value, object))], object
      ).reshape(np.shape(default_value))
  else:
    value = np.asarray(default_value, dtype)
  try:
    return np.broadcast_to(value, shape).ravel().tolist()
  except ValueError:
    raise ValueError(
      f"{where}: default_value of shape {np.shape(value)} does not fit the feature shape {shape}."
    ) from None


def _as_bytes(value: Any) -> bytes:
  return value.encode("utf-8") if isinstance(value, str) else bytes(value)


@dataclasses.dataclass(frozen=True)
class FixedLenFeature:
  """A feature with exactly prod(shape) values in every record.

  Attributes:
    shape: The output shape of one record's value.
    dtype: int64, float32 or bytes (also spelled object / "string").
    default_value: Used where the feature is missing (broadcast to shape);
      None makes the feature required.
  """

  shape: Sequence[int] | int  # a tuple once constructed
  dtype: Any
  default_value: Any = None

  def __post_init__(self):
    where = f"FixedLenFeature(shape={self.shape!r}, dtype={self.dtype!r})"
    object.__setattr__(self, "shape", _spec_shape(self.shape, where))
    object.__setattr__(self, "dtype", _spec_dtype(self.dtype, where))
    _dense_default(self.default_value, self.shape, self.dtype, where)


@dataclasses.dataclass(frozen=True)
class FixedLenSequenceFeature:
  """A sequence feature: every step has prod(shape) values -> [steps, *shape].

  Attributes:
    shape: The shape of one step's value.
    dtype: int64, float32 or bytes.
    allow_missing: A missing feature list gives zero steps instead of an error.
  """

  shape: Sequence[int] | int  # a tuple once constructed
  dtype: Any
  allow_missing: bool = False

  def __post_init__(self):
    where = f"FixedLenSequenceFeature(shape={self.shape!r}, dtype={self.dtype!r})"
    object.__setattr__(self, "shape", _spec_shape(self.shape, where))
    object.__setattr__(self, "dtype", _spec_dtype(self.dtype, where))
    if not isinstance(self.allow_missing, bool):
      raise TypeError(f"{where}: allow_missing must be a bool, got {self.allow_missing!r}.")


@dataclasses.dataclass(frozen=True)
class VarLenFeature:
  """A feature with any number of values per record -> `SparseArray`.

  Attributes:
    dtype: int64, float32 or bytes.
  """

  dtype: Any

  def __post_init__(self):
    object.__setattr__(
      self, "dtype", _spec_dtype(self.dtype, f"VarLenFeature(dtype={self.dtype!r})")
    )


FeatureSpec = Union[FixedLenFeature, VarLenFeature]


# The functional form keeps the field annotations real types (the module's
# `from __future__ import annotations` would make them strings that
# documentation tools cannot resolve in the generated constructor).
_SparseFields = NamedTuple(
  "_SparseFields",
  [
    ("indices", np.ndarray),  # int64 [n, rank]
    ("values", np.ndarray),  # [n]
    ("dense_shape", np.ndarray),  # int64 [rank]
  ],
)


class SparseArray(_SparseFields):
  """A VarLenFeature's values: the fields of the equal `tf.SparseTensor`
  (`indices` int64 [n, rank], `values` [n], `dense_shape` int64 [rank])."""

  __slots__ = ()

  def row_lengths(self) -> np.ndarray:
    """Values per row (per record of a batch; per step of a sequence)."""
    if len(self.dense_shape) == 1:
      return np.array([len(self.values)], np.int64)
    return np.bincount(self.indices[:, 0], minlength=int(self.dense_shape[0])).astype(np.int64)


# -- parsing -----------------------------------------------------------------


def _decode(serialized: Any, message_type: type, position: int | None):
  try:
    return message_type.FromString(serialized)
  except (_message.DecodeError, TypeError) as e:
    record = "" if position is None else f" (record {position} of the batch)"
    raise ValueError(
      f"Could not parse a serialized tf.train.{message_type.__name__}"
      f"{record}: {e}; got {type(serialized).__name__} of "
      f"{_length(serialized)} bytes."
    ) from None


def _length(value: Any) -> str:
  try:
    return str(len(value))
  except TypeError:
    return "?"


def _column(key: str, spec: Any, rows: list, where: Any) -> Any:
  """One feature over rows of `Feature` messages (None where missing).

  Args:
    key: The feature's name, for errors.
    spec: FixedLenFeature, FixedLenSequenceFeature or VarLenFeature.
    rows: The Feature of each row (record or sequence step), or None.
    where: `where(i)` names row i in errors.

  Returns:
    A dense array [len(rows), *shape], or a SparseArray of rank 2.
  """
  dtype = spec.dtype
  kind = _KINDS[dtype]
  values = []
  extend = values.extend
  lengths = [] if isinstance(spec, VarLenFeature) else None
  if lengths is None:
    size = math.prod(spec.shape)
    default = getattr(spec, "default_value", None)
    default = None if default is None else _dense_default(default, spec.shape, dtype, "")
  for i, feature in enumerate(rows):
    which = None if feature is None else feature.WhichOneof("kind")
    if which is None:  # a Feature with no list set counts as missing
      if lengths is not None:
        lengths.append(0)
        continue
      if default is None:
        raise ValueError(
          f"Feature {key!r} ({_DTYPE_NAMES[kind]}) is required but missing"
          f"{where(i)}; give FixedLenFeature a default_value to allow that."
        )
      extend(default)
      continue
    if which != kind:
      raise ValueError(
        f"Feature {key!r}{where(i)} holds {_DTYPE_NAMES[which]} values "
        f"({which}), but its spec asks for {_DTYPE_NAMES[kind]}."
      )
    value = getattr(feature, which).value
    if lengths is not None:
      lengths.append(len(value))
    elif len(value) != size:
      raise ValueError(
        f"Feature {key!r}{where(i)} has {len(value)} values, but "
        f"{type(spec).__name__} shape {spec.shape} needs {size}."
      )
    extend(value)
  flat = np.array(values, dtype) if values else np.empty(0, dtype)
  if lengths is None:
    return flat.reshape((len(rows),) + spec.shape)
  return _sparse(flat, np.asarray(lengths, np.int64))


def _sparse(values: np.ndarray, lengths: np.ndarray) -> SparseArray:
  """A rank-2 SparseArray: row i holds the next lengths[i] values."""
  total = len(values)
  if len(lengths) == 1:  # one record (parse_single_example): no repeats
    indices = np.zeros((total, 2), np.int64)
    indices[:, 1] = np.arange(total)
    return SparseArray(indices, values, np.array([1, total], np.int64))
  rows = np.repeat(np.arange(len(lengths), dtype=np.int64), lengths)
  starts = np.cumsum(lengths) - lengths
  columns = np.arange(total, dtype=np.int64) - np.repeat(starts, lengths)
  max_len = int(lengths.max()) if len(lengths) else 0
  return SparseArray(
    np.stack([rows, columns], axis=1), values, np.array([len(lengths), max_len], np.int64)
  )


def _unbatch(value: Any) -> Any:
  """Drops the leading batch-of-one dimension from `_column`'s output."""
  if isinstance(value, SparseArray):
    return SparseArray(
      np.ascontiguousarray(value.indices[:, 1:]), value.values, value.dense_shape[1:]
    )
  return value.reshape(value.shape[1:])  # a 0-d array for shape (), as jax wants


def _check_specs(features: Mapping[str, Any], allowed: tuple, where: str) -> None:
  if not isinstance(features, Mapping):
    raise TypeError(
      f"{where}: features must be a dict of name -> spec, got {type(features).__name__}."
    )
  for key, spec in features.items():
    if not isinstance(spec, allowed):
      raise TypeError(
        f"{where}: feature {key!r} has spec {spec!r}; allowed are "
        f"{', '.join(t.__name__ for t in allowed)}."
      )


def _no_where(i: int) -> str:
  del i
  return ""


def _record_where(i: int) -> str:
  return f" in record {i} of the batch"


def parse_single_example(serialized: bytes, features: Mapping[str, FeatureSpec]) -> dict:
  """Parses one serialized tf.train.Example into NumPy arrays.

  Args:
    serialized: The record's bytes.
    features: Feature name -> FixedLenFeature or VarLenFeature.

  Returns:
    name -> array of the spec's shape, or SparseArray for VarLenFeature.

  Raises:
    ValueError: the bytes are not an Example, or a feature is missing
      (without default), has the wrong type or the wrong number of values.
  """
  _check_specs(features, (FixedLenFeature, VarLenFeature), "parse_single_example")
  fmap = _decode(serialized, example_pb2.Example, None).features.feature
  get = fmap.get
  return {
    key: _unbatch(_column(key, spec, [get(key)], _no_where)) for key, spec in features.items()
  }


def parse_example(serialized: Iterable[bytes], features: Mapping[str, FeatureSpec]) -> dict:
  """Parses a batch of serialized tf.train.Examples into batched arrays.

  Args:
    serialized: A sequence (or 1-D object array) of records' bytes.
    features: Feature name -> FixedLenFeature or VarLenFeature.

  Returns:
    name -> array [batch, *shape], or a rank-2 SparseArray for VarLenFeature.

  Raises:
    ValueError: as `parse_single_example`, naming the record in the batch.
  """
  _check_specs(features, (FixedLenFeature, VarLenFeature), "parse_example")
  decode = example_pb2.Example.FromString
  try:
    maps = [decode(s).features.feature for s in serialized]
  except (_message.DecodeError, TypeError):
    maps = [
      _decode(s, example_pb2.Example, i).features.feature for i, s in enumerate(serialized)
    ]  # names the bad record
  return {
    key: _column(key, spec, [m.get(key) for m in maps], _record_where)
    for key, spec in features.items()
  }


def parse_single_sequence_example(
  serialized: bytes,
  context_features: Mapping[str, FeatureSpec] | None = None,
  sequence_features: Mapping[str, Any] | None = None,
) -> tuple[dict, dict]:
  """Parses one serialized tf.train.SequenceExample.

  Args:
    serialized: The record's bytes.
    context_features: Name -> FixedLenFeature / VarLenFeature, read from the
      context as `parse_single_example` reads features.
    sequence_features: Name -> FixedLenSequenceFeature (-> [steps, *shape])
      or VarLenFeature (-> rank-2 SparseArray over (step, position)).

  Returns:
    (context, sequences): two dicts of arrays.

  Raises:
    ValueError: the bytes are not a SequenceExample, or a feature is missing,
      has the wrong type or the wrong number of values.
  """
  context_features = context_features or {}
  sequence_features = sequence_features or {}
  _check_specs(
    context_features,
    (FixedLenFeature, VarLenFeature),
    "parse_single_sequence_example context_features",
  )
  _check_specs(
    sequence_features,
    (FixedLenSequenceFeature, VarLenFeature),
    "parse_single_sequence_example sequence_features",
  )
  record = _decode(serialized, example_pb2.SequenceExample, None)
  context_map = record.context.feature
  context = {
    key: _unbatch(_column(key, spec, [context_map.get(key)], _no_where))
    for key, spec in context_features.items()
  }
  lists = record.feature_lists.feature_list
  sequences = {}
  for key, spec in sequence_features.items():
    feature_list = lists.get(key)
    if feature_list is None:
      if isinstance(spec, FixedLenSequenceFeature) and not spec.allow_missing:
        raise ValueError(
          f"Sequence feature {key!r} ({_DTYPE_NAMES[_KINDS[spec.dtype]]}) "
          "is required but missing; set allow_missing=True to get zero "
          "steps instead."
        )
      steps = []
    else:
      steps = list(feature_list.feature)
    sequences[key] = _column(key, spec, steps, lambda i: f" at step {i}")
  return context, sequences


# -- writing -----------------------------------------------------------------


def _fill_feature(feature: Any, key: str, value: Any) -> None:
  """Sets `feature`'s list from a scalar, a list or an array."""
  if isinstance(value, (bytes, str)):
    feature.bytes_list.value.append(_as_bytes(value))
    return
  if isinstance(value, (list, tuple)) and value and all(isinstance(v, (bytes, str)) for v in value):
    feature.bytes_list.value.extend([_as_bytes(v) for v in value])
    return
  # SetInParent: an empty typed array still sets the list (an empty Feature
  # would read as a missing one).
  array = np.asarray(value)
  kind = array.dtype.kind
  if array.size == 0 and not isinstance(value, np.ndarray):
    raise ValueError(
      f"make_example: feature {key!r} is empty, so its type is unknown; "
      "pass a typed empty array such as np.array([], np.int64)."
    )
  if kind in "biu":
    if kind == "u" and array.size and array.max() > np.iinfo(np.int64).max:
      raise ValueError(f"make_example: feature {key!r} has values above the int64 range.")
    feature.int64_list.SetInParent()
    feature.int64_list.value.extend(array.ravel().astype(np.int64).tolist())
  elif kind == "f":
    feature.float_list.SetInParent()
    feature.float_list.value.extend(array.ravel().astype(np.float32).tolist())
  elif kind in "SU" or (kind == "O" and all(isinstance(v, (bytes, str)) for v in array.ravel())):
    feature.bytes_list.SetInParent()
    feature.bytes_list.value.extend([_as_bytes(v) for v in array.ravel()])
  else:
    raise TypeError(
      f"make_example: feature {key!r} has {array.dtype} values "
      f"({type(value).__name__}); allowed are ints, floats, bytes or str "
      "(scalars, lists or arrays)."
    )


def make_example(features: Mapping[str, Any]) -> bytes:
  """A serialized tf.train.Example of name -> value.

  Ints and bools become int64_list, floats float_list (float32), bytes and str
  (UTF-8) bytes_list; a value may be a scalar, a list or an array of any shape
  (flattened).
  """
  record = example_pb2.Example()
  fmap = record.features.feature
  for key, value in features.items():
    _fill_feature(fmap[key], key, value)
  return record.SerializeToString()


def make_sequence_example(
  context: Mapping[str, Any] | None = None, feature_lists: Mapping[str, Iterable[Any]] | None = None
) -> bytes:
  """A serialized tf.train.SequenceExample.

  Args:
    context: Name -> value, as in `make_example`.
    feature_lists: Name -> a sequence of step values (each as in
      `make_example`).
  """
  record = example_pb2.SequenceExample()
  fmap = record.context.feature
  for key, value in (context or {}).items():
    _fill_feature(fmap[key], key, value)
  lists = record.feature_lists.feature_list
  for key, steps in (feature_lists or {}).items():
    feature_list = lists[key]
    for step in steps:
      _fill_feature(feature_list.feature.add(), key, step)
  return record.SerializeToString()
