"""`bucket_by_sequence_length`: batches of similar-length elements (tf.data).

Bucket `i` holds the elements whose length (`element_length_func(element)`,
tuples unpacked into arguments) lies in `[bucket_boundaries[i-1],
bucket_boundaries[i])`, with `0` below the first boundary and no limit above
the last: `len(bucket_batch_sizes) == len(bucket_boundaries) + 1` buckets.
A bucket that reaches its batch size is emitted at once as a batch padded like
`padded_batch` (stacked like `batch` with `no_padding=True`). When the input
ends, the partial buckets are emitted in increasing bucket order, unless
`drop_remainder`. With `pad_to_bucket_boundary`, a bucket's batches are padded
to `boundary - 1` rather than to their longest element. This is tf.data's
`bucket_by_sequence_length` (which runs `group_by_window`) output for output.

Differences, because numpy elements carry no static shapes: with
`pad_to_bucket_boundary` and no `padded_shapes`, the first dimension of every
non-scalar leaf is padded to `boundary - 1` and other dimensions to the batch
maximum (tf.data pads every dimension it does not know statically); negative
lengths are an error (tf.data files them into the first bucket).

State: the input's position through `InputReplay` plus the number of elements
pending in each bucket. Restoring reads the input again from the oldest pending
element and keeps the last `n` elements that fall into each bucket holding `n`,
so `element_length_func` must be deterministic.

Several JAX processes: each process buckets its own elements, so at one step
the processes' batches can come from different buckets and have different
shapes, which cannot form one global array (`jaxfeed.Loader` raises a
ValueError naming the leaf and each process's shape). For one bucket per step
on every process use coordinated reads (`jaxfeed.coord.BucketPlan` with
`Dataset.from_bucket_plan`); otherwise `Loader(..., pad_to_common_shape=True)`
zero-pads every process to the longest length of the step (the batch sizes must
then be equal, or also padded, with masked rows, by `end_of_input="pad"`).
"""

from __future__ import annotations

import bisect
import collections
import sys
from typing import Any, Callable, Sequence

import numpy as np

from jaxfeed.ops import base
from jaxfeed.ops import parallel
from jaxfeed.ops import padding
from jaxfeed.ops import stacking
from jaxfeed.ops import tree

__all__ = ["BucketBySequenceLengthNode", "BucketBySequenceLengthIterator", "check_length"]

_OP = "bucket_by_sequence_length"


def check_length(value: Any, op_name: str, what: str) -> int:
  """An integer length returned by a user function, as a Python int.

  Raises:
    TypeError: `value` is not an integer scalar.
    ValueError: `value` is negative.
  """
  if isinstance(value, np.ndarray) and value.ndim == 0:
    value = value[()]
  if not isinstance(value, (int, np.integer)) or isinstance(value, (bool, np.bool_)):
    raise TypeError(
      f"{op_name}: {what} must return an integer scalar, got "
      f"{type(value).__name__}: {value!r:.200}."
    )
  if value < 0:
    raise ValueError(
      f"{op_name}: {what} returned the negative length {int(value)}; lengths must be >= 0."
    )
  return int(value)


def _check_boundaries(boundaries: Any) -> tuple[int, ...]:
  if isinstance(boundaries, (str, bytes)) or not isinstance(boundaries, (list, tuple, np.ndarray)):
    raise TypeError(
      f"{_OP}: bucket_boundaries must be a list of integers, got {boundaries!r:.200}."
    )
  values = tuple(base.check_positive_int(b, _OP, "every bucket boundary") for b in boundaries)
  for low, high in zip(values, values[1:]):
    if high <= low:
      raise ValueError(
        f"{_OP}: bucket_boundaries must be strictly increasing, got "
        f"{list(values)} ({high} follows {low})."
      )
  return values


def _check_batch_sizes(sizes: Any, num_boundaries: int) -> tuple[int, ...]:
  if isinstance(sizes, (str, bytes)) or not isinstance(sizes, (list, tuple, np.ndarray)):
    raise TypeError(f"{_OP}: bucket_batch_sizes must be a list of integers, got {sizes!r:.200}.")
  if len(sizes) != num_boundaries + 1:
    raise ValueError(
      f"{_OP}: len(bucket_batch_sizes) must equal len(bucket_boundaries) + 1 "
      f"= {num_boundaries + 1}, got {len(sizes)} batch sizes "
      f"{list(sizes)!r:.200}."
    )
  return tuple(base.check_positive_int(s, _OP, "every bucket batch size") for s in sizes)


class BucketBySequenceLengthNode(base.Node):
  """Padded batches of elements grouped by length buckets (tf.data semantics).

  Args:
    parent: the input node.
    element_length_func: element -> int length (tuples are unpacked).
    bucket_boundaries: strictly increasing ints >= 1, the buckets' upper
      (exclusive) length limits.
    bucket_batch_sizes: the batch size of each bucket, one more than there are
      boundaries.
    padded_shapes, padding_values: as in `padded_batch`; None dimensions are
      padded to the batch maximum, or to `boundary - 1` with
      `pad_to_bucket_boundary`.
    pad_to_bucket_boundary: pad each bucket to its boundary minus one;
      elements must then be shorter than the last boundary.
    no_padding: stack without padding (elements of a bucket must have equal
      shapes).
    drop_remainder: drop each bucket's final partial batch.
  """

  op_name = _OP

  def __init__(
    self,
    parent: base.Node,
    element_length_func: Callable,
    bucket_boundaries: Sequence[int],
    bucket_batch_sizes: Sequence[int],
    padded_shapes: Any = None,
    padding_values: Any = None,
    pad_to_bucket_boundary: bool = False,
    no_padding: bool = False,
    drop_remainder: bool = False,
  ):
    super().__init__([base.to_node(parent, _OP, "input")])
    self.element_length_func = parallel.check_callable(
      element_length_func, _OP, "element_length_func"
    )
    self.bucket_boundaries = _check_boundaries(bucket_boundaries)
    self.bucket_batch_sizes = _check_batch_sizes(bucket_batch_sizes, len(self.bucket_boundaries))
    self.padded_shapes = padded_shapes
    self.padding_values = padding_values
    self.pad_to_bucket_boundary = bool(pad_to_bucket_boundary)
    self.no_padding = bool(no_padding)
    self.drop_remainder = bool(drop_remainder)
    if self.pad_to_bucket_boundary and not self.bucket_boundaries:
      raise ValueError(
        f"{_OP}: pad_to_bucket_boundary=True needs at least one bucket "
        f"boundary, got bucket_boundaries=[]."
      )

  def spec_params(self) -> dict:
    return {
      "element_length_func": self.element_length_func,
      "bucket_boundaries": list(self.bucket_boundaries),
      "bucket_batch_sizes": list(self.bucket_batch_sizes),
      "padded_shapes": self.padded_shapes,
      "padding_values": self.padding_values,
      "pad_to_bucket_boundary": self.pad_to_bucket_boundary,
      "no_padding": self.no_padding,
      "drop_remainder": self.drop_remainder,
    }

  def cardinality(self) -> int | None:
    return 0 if self.parents[0].cardinality() == 0 else None

  def make_iterator(self) -> "BucketBySequenceLengthIterator":
    return BucketBySequenceLengthIterator(self.parents[0].make_iterator(), self)


def _fill_shape_spec(spec: Any, filler: int) -> Any:
  """A leaf's padded shape with None / -1 dimensions set to `filler`."""
  if spec is None:
    return None
  dims = spec.as_list() if hasattr(spec, "as_list") else list(spec)
  return [filler if d is None or int(d) == -1 else int(d) for d in dims]


class _Bucket:
  __slots__ = ("elements", "seeds", "first_index")

  def __init__(self):
    self.elements: list = []
    self.seeds: list = []
    self.first_index = 0


class BucketBySequenceLengthIterator(base.OpIterator):
  """Fills buckets from the input and emits full ones (then the rest)."""

  op_name = _OP

  def __init__(self, parent: base.OpIterator, node: BucketBySequenceLengthNode):
    super().__init__([parent])
    self._length_func = node.element_length_func
    self._boundaries = list(node.bucket_boundaries)
    self._batch_sizes = node.bucket_batch_sizes
    self._padded_shapes = node.padded_shapes
    self._padding_values = node.padding_values
    self._pad_to_boundary = node.pad_to_bucket_boundary and not node.no_padding
    self._no_padding = node.no_padding
    self._drop_remainder = node.drop_remainder
    self._buckets = [_Bucket() for _ in self._batch_sizes]
    self._end_of_input = False
    self._flush_next = 0  # the next bucket to flush once the input ended
    self._last_seed = 0
    self._input = base.InputReplay(parent, _OP, oldest_needed=self._oldest_pending)

  @property
  def last_seed(self) -> int:
    """The seed of the first element of the batch returned last."""
    return self._last_seed

  def _oldest_pending(self) -> int:
    indices = [b.first_index for b in self._buckets if b.elements]
    return min(indices) if indices else self._input.num_read

  def _bucket_of(self, element: Any) -> int:
    length = check_length(
      parallel.call_unpacked(self._length_func, element), _OP, "element_length_func"
    )
    bucket = bisect.bisect_right(self._boundaries, length)
    if self._pad_to_boundary and bucket == len(self._boundaries):
      raise ValueError(
        f"{_OP}: with pad_to_bucket_boundary=True, elements must have length "
        f"< max(bucket_boundaries) = {self._boundaries[-1]}, got an element "
        f"of length {length}."
      )
    return bucket

  def __next__(self) -> Any:
    buckets = self._buckets
    while not self._end_of_input:
      try:
        element = self._input.read()
      except StopIteration:
        self._end_of_input = True
        break
      index = self._bucket_of(element)
      bucket = buckets[index]
      if not bucket.elements:
        bucket.first_index = self._input.num_read - 1
      bucket.elements.append(element)
      bucket.seeds.append(self.parents[0].last_seed)
      if len(bucket.elements) == self._batch_sizes[index]:
        return self._emit(index)
    while self._flush_next < len(buckets):
      index = self._flush_next
      self._flush_next += 1
      if buckets[index].elements:
        if self._drop_remainder:
          buckets[index] = _Bucket()
          continue
        return self._emit(index)
    raise StopIteration

  def _emit(self, index: int) -> Any:
    bucket = self._buckets[index]
    self._buckets[index] = _Bucket()
    self._last_seed = bucket.seeds[0]
    elements = bucket.elements
    if self._no_padding:
      return stacking.stack(elements, _OP)
    return padding.pad_and_stack(
      elements, self._shapes_for(index, elements), self._padding_values, _OP
    )

  def _shapes_for(self, index: int, elements: list) -> Any:
    if not self._pad_to_boundary:
      return self._padded_shapes
    filler = self._boundaries[index] - 1
    if self._padded_shapes is not None:
      try:
        return _fill_unknown_dims(elements[0], self._padded_shapes, filler)
      except (KeyError, IndexError, TypeError, ValueError):
        return self._padded_shapes  # pad_and_stack explains the mismatch.
    return tree.map_structure(
      lambda leaf: [filler] + [None] * (np.ndim(leaf) - 1) if np.ndim(leaf) else [], elements[0]
    )

  # -- state -----------------------------------------------------------------
  def _get_own_state(self) -> dict:
    first = self._oldest_pending()
    return {
      "input": self._input.get_state(first),
      "first": first,
      "pending": [len(b.elements) for b in self._buckets],
      "end_of_input": self._end_of_input,
      "flush_next": self._flush_next,
    }

  def _set_own_state(self, state: dict) -> None:
    pending = state.get("pending") if isinstance(state, dict) else None
    if (
      not isinstance(pending, list)
      or len(pending) != len(self._buckets)
      or not all(
        isinstance(n, int) and 0 <= n < size for n, size in zip(pending, self._batch_sizes)
      )
    ):
      raise base.PipelineStateError(
        f"Cannot restore op {_OP!r}: 'pending' must list, per bucket, a "
        f"count below its batch size {list(self._batch_sizes)}, got "
        f"{pending!r:.200}."
      )
    first = base.state_int(state, "first", _OP)
    flush_next = base.state_int(state, "flush_next", _OP, high=len(self._buckets))
    kept: list[collections.deque[Any]] = [collections.deque(maxlen=n) for n in pending]

    def consume(index: int, element: Any, seed: int) -> None:
      kept[self._bucket_of(element)].append((index, element, seed))

    self._input.set_state(state.get("input"), first if any(pending) else sys.maxsize, consume)
    for i, entries in enumerate(kept):
      if len(entries) != pending[i]:
        raise base.PipelineStateError(
          f"Cannot restore op {_OP!r}: bucket {i} should hold {pending[i]} "
          f"elements but re-reading the input gave {len(entries)}; the "
          f"state belongs to other data."
        )
      bucket = _Bucket()
      if entries:
        bucket.first_index = entries[0][0]
        bucket.elements = [e for _, e, _ in entries]
        bucket.seeds = [s for _, _, s in entries]
      self._buckets[i] = bucket
    self._end_of_input = bool(state.get("end_of_input"))
    self._flush_next = flush_next


def _fill_unknown_dims(structure: Any, padded_shapes: Any, filler: int) -> Any:
  """`padded_shapes` (shaped like the element `structure`) with None dims = filler."""
  if isinstance(structure, dict):
    return {k: _fill_unknown_dims(structure[k], padded_shapes[k], filler) for k in structure}
  if isinstance(structure, (tuple, list)):
    return type(structure)(
      _fill_unknown_dims(s, p, filler) for s, p in zip(structure, padded_shapes, strict=True)
    )
  return _fill_shape_spec(padded_shapes, filler)
