"""`from_tensor_slices`: a pytree of arrays sliced along its first dimension.

Follows tf.data.Dataset.from_tensor_slices: dicts (any mapping), tuples and
namedtuples are structure; everything else, Python lists included, is one
tensor. Python values convert as TensorFlow converts them (ints to int32 when
they all fit, else int64; floats to float32; strings to bytes); numpy arrays
keep their dtype, except that string arrays yield `bytes` as in tf.data.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import numpy as np

from jaxfeed.ops import stacking
from jaxfeed.ops.base import Node, OpIterator, mix_seed, state_int
from jaxfeed.seeding import mix_seeds

_OP = "from_tensor_slices"
_INT32 = np.iinfo(np.int32)


def _holds_numpy_dtype(value: Any) -> bool:
  """Whether a (nested) Python sequence holds values that fix their dtype.

  TensorFlow keeps the dtype of numpy arrays and non-integer numpy scalars
  inside Python lists, but converts numpy integer scalars like Python ints.
  """
  if isinstance(value, np.ndarray):
    return True
  if isinstance(value, np.generic):
    return not isinstance(value, np.integer)
  if isinstance(value, (list, tuple)):
    return any(_holds_numpy_dtype(v) for v in value)
  return False


def _to_array(leaf: Any, path: str) -> np.ndarray:
  """Converts one component to a read-only array with tf.data's dtype rules."""
  # Other array-likes (jax, tf) keep their dtype through np.asarray.
  python_values = isinstance(leaf, (list, int, float)) and (not _holds_numpy_dtype(leaf))
  try:
    array = np.asarray(leaf)
  except (ValueError, OverflowError) as e:
    raise ValueError(
      f"{_OP}: component {path!r} cannot be converted to an array "
      f"(non-rectangular nested lists or out-of-range integers?): {e}"
    ) from e
  if array.dtype == object and not all(isinstance(v, (str, bytes)) for v in array.flat):
    raise ValueError(
      f"{_OP}: component {path!r} must be numeric, boolean or string data; "
      f"got values of types "
      f"{sorted({type(v).__name__ for v in array.flat})}."
    )
  if python_values:
    if array.dtype.kind in "iu":
      fits = array.size == 0 or (array.min() >= _INT32.min and array.max() <= _INT32.max)
      array = array.astype(np.int32 if fits else np.int64)
    elif array.dtype.kind == "f":
      array = array.astype(np.float32)
  if array.dtype.kind in "USO":
    # tf.data yields strings as `bytes`.
    array = np.array(
      [v.encode() if isinstance(v, str) else bytes(v) for v in array.flat], dtype=object
    ).reshape(array.shape)
  if array.ndim == 0:
    raise ValueError(
      f"{_OP}: slicing needs components of rank >= 1, but component {path!r} is a scalar: {leaf!r}."
    )
  # A view, so the caller's array keeps its own flags; read-only, because
  # yielded slices share its memory.
  array = array.view()
  array.flags.writeable = False
  return array


def _compile(value: Any, path: str, leaves: list[tuple[str, np.ndarray]]) -> Callable[[int], Any]:
  """Converts the leaves of `value` and returns a builder of element i."""
  if isinstance(value, Mapping):
    items = [(k, _compile(v, f"{path}/{k}" if path else str(k), leaves)) for k, v in value.items()]
    return lambda i: {k: build(i) for k, build in items}
  if isinstance(value, tuple):
    builders = [_compile(v, f"{path}/{n}" if path else str(n), leaves) for n, v in enumerate(value)]
    if hasattr(value, "_fields"):  # namedtuple
      cls = type(value)
      return lambda i: cls(*[build(i) for build in builders])
    return lambda i: tuple([build(i) for build in builders])
  array = _to_array(value, path or "<root>")
  leaves.append((path or "<root>", array))
  return array.__getitem__


class TensorSlicesNode(Node):
  """Like `tf.data.Dataset.from_tensor_slices(tensors)`."""

  op_name = _OP

  def __init__(self, tensors: Any):
    super().__init__()
    self.tensors = tensors
    leaves: list[tuple[str, np.ndarray]] = []
    self._build = _compile(tensors, "", leaves)
    if not leaves:
      raise ValueError(
        f"{_OP}: tensors must hold at least one array, got the empty structure {tensors!r}."
      )
    sizes = {path: array.shape[0] for path, array in leaves}
    if len(set(sizes.values())) > 1:
      listed = ", ".join(f"{path!r}: {size}" for path, size in sizes.items())
      raise ValueError(
        f"{_OP}: all components must have the same size in dimension 0, got {listed}."
      )
    self._length = leaves[0][1].shape[0]

  def spec_params(self) -> dict:
    return {"tensors": self.tensors}

  def cardinality(self) -> int:
    return self._length

  def columns(self) -> Any:
    """The structure with each component's whole (converted) array."""
    return self._build(slice(None))

  def make_iterator(self) -> "TensorSlicesIterator":
    return TensorSlicesIterator(self._build, self._length)

  # Index addressing (see jaxfeed.ops.index_ranges): position i is slice i.
  def index_addressable(self) -> bool:
    return True

  def num_positions(self) -> int:
    return self._length

  def range_iterator(self, start: int, stop: int) -> "TensorSlicesIterator":
    return TensorSlicesIterator(self._build, min(stop, self._length), start)

  def __repr__(self) -> str:
    return f"TensorSlicesNode(length={self._length})"


class TensorSlicesIterator(OpIterator):
  """Yields slice i of every component; state is the next index.

  Implements the batched-read protocol of `jaxfeed.ops.stacking`
  (`next_batch`): a batch is a copy of slices `i:j` of the components. It
  yields slices [first, length).
  """

  op_name = _OP

  def __init__(self, build: Callable[[int], Any], length: int, first: int = 0):
    super().__init__()
    self._build = build
    self._length = length
    self._index = first

  def __next__(self) -> Any:
    index = self._index
    if index >= self._length:
      raise StopIteration
    self._index = index + 1
    return self._build(index)

  def next_batch(self, max_count: int) -> tuple[Any, np.ndarray]:
    """The next `k <= max_count` elements stacked, and their seeds.

    See the batched-read protocol in `jaxfeed.ops.stacking`.
    """
    index = self._index
    count = min(max_count, self._length - index)
    if count <= 0:
      raise StopIteration
    # The element builder indexes every component; with a slice it builds
    # the components' rows, which `as_batch` copies into the batch layout.
    batch = stacking.as_batch(self._build(slice(index, index + count)), copy=True)
    if batch is None:
      batch = stacking.stack([self._build(i) for i in range(index, index + count)], "batch")
    self._index = index + count
    return batch, mix_seeds(0, 0, np.arange(index, index + count, dtype=np.int64))

  @property
  def last_seed(self) -> int:
    # Seed 0, epoch 0 and the element's index, as a default IndexSampler
    # gives the same element of a source.
    return mix_seed(0, 0, self._index - 1) if self._index else 0

  def skip_elements(self, count: int) -> int:
    """Skips up to `count` elements without producing them; returns how many."""
    skipped = max(0, min(count, self._length - self._index))
    self._index += skipped
    return skipped

  def _stats_fields(self) -> dict:
    return {"elements": self._index}

  def _get_own_state(self) -> dict:
    return {"index": self._index}

  def _set_own_state(self, state: dict) -> None:
    self._index = state_int(state, "index", _OP, 0, self._length)
