"""`range`: the integers start, start+step, ... before stop (tf.data.Dataset.range)."""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from jaxfeed.ops import stacking
from jaxfeed.ops.base import Node, OpIterator, mix_seed, state_int
from jaxfeed.seeding import mix_seeds

_OP = "range"
# Elements computed at once for element-wise reads.
_CHUNK = 256
# 0 .. _CHUNK - 1: a chunk is these plus its first index. np.arange hands the
# GIL over on every call, however short the range (ufuncs and casts keep it
# below about 500 elements), and a consumer that drops the GIL every 256
# elements for a moment too short to use drags any Python thread waiting for
# it into a convoy: woken at every drop, it finds the GIL taken again, and
# since the GIL keeps changing hands it never asks for it either. Until it
# wins a race (tens of ms), every drop costs the consumer a futex wake and a
# scheduling round; a thread waking 10 times a second (the per-op stats'
# sampler, a user's logger) slowed element-wise reads by 5-25%.
_OFFSETS = np.arange(_CHUNK, dtype=np.int64)
_INT64 = np.iinfo(np.int64)


def _check_int(value: Any, name: str) -> int:
  if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
    raise ValueError(f"{_OP}: {name} must be an integer, got {type(value).__name__}: {value!r}.")
  return int(value)


class RangeNode(Node):
  """Like `tf.data.Dataset.range`: `range(stop)` or `range(start, stop[, step])`.

  Elements are numpy scalars of `dtype` (int64 by default). The arguments may
  also be given by keyword (`start`, `stop`, `step`), as `spec_params` does.
  """

  op_name = _OP

  def __init__(
    self,
    *args: int,
    dtype: Any = None,
    start: int | None = None,
    stop: int | None = None,
    step: int | None = None,
  ):
    super().__init__()
    if args and (start is not None or stop is not None or step is not None):
      raise TypeError(
        f"{_OP}: pass start/stop/step either positionally or by keyword, "
        f"got args={args!r} and start={start!r}, stop={stop!r}, step={step!r}."
      )
    if not args:
      if stop is None:
        raise TypeError(f"{_OP}: missing the required argument stop.")
      args = (0 if start is None else start, stop, 1 if step is None else step)
    if len(args) == 1:
      args = (0, args[0], 1)
    elif len(args) == 2:
      args = (args[0], args[1], 1)
    elif len(args) != 3:
      raise TypeError(
        f"{_OP}: expected range(stop) or range(start, stop[, step]), got "
        f"{len(args)} arguments: {args!r}."
      )
    self.start, self.stop, self.step = (
      _check_int(v, n) for v, n in zip(args, ("start", "stop", "step"))
    )
    if self.step == 0:
      raise ValueError(f"{_OP}: step must be a non-zero integer, got 0.")
    dtype = getattr(dtype, "as_numpy_dtype", dtype)  # Accepts tf.DType too.
    try:
      self.dtype = np.dtype(np.int64 if dtype is None else dtype)
    except TypeError as e:
      raise ValueError(f"{_OP}: dtype must be a numpy dtype or its name, got {dtype!r}.") from e
    if self.dtype.kind not in "iuf":
      raise ValueError(f"{_OP}: dtype must be an integer or floating dtype, got {self.dtype}.")

  def spec_params(self) -> dict:
    return {"start": self.start, "stop": self.stop, "step": self.step, "dtype": self.dtype.name}

  def cardinality(self) -> int:
    return len(range(self.start, self.stop, self.step))

  def make_iterator(self) -> "RangeIterator":
    return RangeIterator(self)

  # Index addressing (see jaxfeed.ops.index_ranges): position i is element i.
  def index_addressable(self) -> bool:
    return True

  def num_positions(self) -> int:
    return self.cardinality()

  def range_iterator(self, start: int, stop: int) -> "RangeIterator":
    return RangeIterator(self, start, stop)

  def __repr__(self) -> str:
    return (
      f"RangeNode(start={self.start}, stop={self.stop}, step={self.step}, dtype={self.dtype.name})"
    )


class RangeIterator(OpIterator):
  """Yields the range's elements; state is the index of the next one.

  Values are computed a chunk at a time with numpy and handed out one by one
  (a numpy scalar per `next()` costs a list lookup, not a conversion).
  Implements the batched-read protocol of `jaxfeed.ops.stacking`
  (`next_batch`), which builds a batch with one `np.arange`. With `first`
  and `stop` it yields only the elements of indices [first, stop).
  """

  op_name = _OP

  def __init__(self, node: RangeNode, first: int = 0, stop: int | None = None):
    super().__init__()
    self._start = node.start
    self._step = node.step
    length = node.cardinality()
    self._length = length if stop is None else min(stop, length)
    self._dtype = node.dtype
    self._scalar: Callable[[Any], Any] = node.dtype.type
    last = self._start + max(self._length - 1, 0) * self._step
    low, high = min(self._start, last), max(self._start, last)
    if self._length and node.dtype.kind in "iu":
      info = np.iinfo(node.dtype)
      if not info.min <= low <= high <= info.max:
        # Like tf.data: values computed in int64, cast with wrap-around.
        dtype = node.dtype
        self._scalar = lambda value: np.int64(value).astype(dtype)
    # Values outside int64 are built one by one, so that an element that
    # cannot be represented fails when it is reached, as element-wise.
    self._vectorized = _INT64.min <= low and high <= _INT64.max
    # Values of indices [chunk_start, chunk_start + len(chunk)).
    self._chunk: list = []
    self._chunk_start = first
    self._offset = 0  # Index in self._chunk of the next element.

  def __next__(self) -> Any:
    offset = self._offset
    if offset >= len(self._chunk):
      self._fill_chunk()
      offset = 0
    self._offset = offset + 1
    return self._chunk[offset]

  def _fill_chunk(self) -> None:
    index = self.position
    count = min(_CHUNK, self._length - index)
    if count <= 0:
      raise StopIteration
    if self._vectorized:
      self._chunk = list(self._values(index, count))
      self._chunk_start, self._offset = index, 0
      return
    # One element at a time; one that cannot be represented raises when it
    # is reached and counts as read, so the next call moves on.
    self._chunk, self._chunk_start, self._offset = [], index + 1, 0
    self._chunk = [self._scalar(self._start + index * self._step)]
    self._chunk_start = index

  def _values(self, index: int, count: int) -> np.ndarray:
    """Elements `index .. index + count - 1` as one array (vectorized only)."""
    if count <= _CHUNK:
      values = _OFFSETS[:count] + index  # keeps the GIL, unlike np.arange (see _OFFSETS)
    else:
      values = np.arange(index, index + count, dtype=np.int64)
    if self._step != 1:
      values *= self._step
    if self._start:
      values += self._start
    if self._dtype.kind == "f":
      # Through float64, as numpy converts the Python int of one element.
      values = values.astype(np.float64)
    return values.astype(self._dtype, copy=False)

  def next_batch(self, max_count: int) -> tuple[np.ndarray, np.ndarray]:
    """The next `k <= max_count` elements as one array, and their seeds.

    See the batched-read protocol in `jaxfeed.ops.stacking`.
    """
    index = self.position
    count = min(max_count, self._length - index)
    if count <= 0:
      raise StopIteration
    if not self._vectorized:
      elements = [next(self) for _ in range(count)]
      return stacking.stack(elements, "batch"), _seeds(index, count)
    batch = self._values(index, count)
    self._seek(index + count)
    return batch, _seeds(index, count)

  @property
  def position(self) -> int:
    """The index of the next element."""
    return self._chunk_start + self._offset

  def _seek(self, index: int) -> None:
    offset = index - self._chunk_start
    if 0 <= offset <= len(self._chunk):
      self._offset = offset
    else:
      self._chunk, self._chunk_start, self._offset = [], index, 0

  @property
  def last_seed(self) -> int:
    # Seed 0, epoch 0 and the element's index, as a default IndexSampler
    # gives the same element of a source.
    index = self.position
    return mix_seed(0, 0, index - 1) if index else 0

  def skip_elements(self, count: int) -> int:
    """Skips up to `count` elements without producing them; returns how many."""
    index = self.position
    skipped = max(0, min(count, self._length - index))
    self._seek(index + skipped)
    return skipped

  def _stats_fields(self) -> dict:
    return {"elements": self.position}

  def _get_own_state(self) -> dict:
    return {"index": self.position}

  def _set_own_state(self, state: dict) -> None:
    self._seek(state_int(state, "index", _OP, 0, self._length))


def _seeds(index: int, count: int) -> np.ndarray:
  """The seeds of elements `index .. index + count - 1` (see `last_seed`)."""
  return mix_seeds(0, 0, np.arange(index, index + count, dtype=np.int64))
