"""`BucketPlanNode`: this host's padded batches of a `BucketPlan`.

`Dataset.from_bucket_plan(source, plan, ...)` builds this node. At step `s` it
reads this host's slice of the plan's global batch with `source.get_many` and
pads every sequence dimension to the step's padded length, which every host
derives from the plan alone (no communication):

* `pad_to_bucket_boundary=False`: the longest record of the GLOBAL batch
  (from the length index), so all hosts agree even though each sees only its
  own rows;
* `pad_to_bucket_boundary=True`: the bucket's boundary minus one, as in
  tf.data's `bucket_by_sequence_length`.

Records must be pytrees of numpy arrays (dicts, tuples, lists); a source of
encoded records (bytes) is decoded per record by `decode_fn`.

Which dimensions are sequence dimensions: with `padded_shapes=None`, the first
dimension of every array leaf; with `padded_shapes`, every dimension given as
`None` or -1 (fixed sizes pad to that size). Other dimensions left to the
default are padded to the host's batch maximum, as tf.data's `padded_batch`
does — give them fixed sizes when they vary, or hosts could disagree.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from jaxfeed.coord.bucket_plan import BucketPlan
from jaxfeed.coord.length_index import read_records
from jaxfeed.ops import base
from jaxfeed.ops import padding
from jaxfeed.ops import tree

__all__ = ["BucketPlanNode", "BucketPlanIterator", "RecordLengthMismatchError"]

_OP = "from_bucket_plan"


class RecordLengthMismatchError(ValueError):
  """A record is longer than its step's padded length (stale length index)."""


class BucketPlanNode(base.Node):
  """Source node yielding this host's padded batch for each plan step.

  Args:
    source: A random-access source with one record per entry of the plan's
      length index (`len`, `source[i]`, ideally `get_many`).
    plan: A `jaxfeed.coord.BucketPlan` built with this host's shard options.
    padded_shapes: Optional pytree matching a record; each leaf a shape whose
      `None` / -1 entries are sequence dimensions (see module docstring).
    padding_values: A scalar for every leaf, or a pytree of scalars matching a
      record; default 0 (empty string for string leaves).
    pad_to_bucket_boundary: Pad to the bucket boundary minus one instead of
      the global batch's longest record; every record must then be shorter
      than the last boundary.
    decode_fn: Optional function applied to every record read (for sources of
      encoded records).
  """

  op_name = _OP

  def __init__(
    self,
    source: Any,
    plan: BucketPlan,
    padded_shapes: Any = None,
    padding_values: Any = None,
    pad_to_bucket_boundary: bool = False,
    decode_fn: Callable[[Any], Any] | None = None,
  ):
    super().__init__(())
    if not isinstance(plan, BucketPlan):
      raise TypeError(f"{_OP}: plan must be a jaxfeed.coord.BucketPlan, got {type(plan).__name__}.")
    num_records = len(source)
    if num_records != plan.num_records:
      raise ValueError(
        f"{_OP}: the plan's length index has {plan.num_records} lengths but "
        f"the source {source!r} has {num_records} records; compute the "
        f"lengths for this source (jaxfeed.coord.compute_lengths)."
      )
    if pad_to_bucket_boundary:
      _check_bounded(plan)
    if decode_fn is not None and not callable(decode_fn):
      raise TypeError(f"{_OP}: decode_fn must be callable, got {decode_fn!r}.")
    self.source = source
    self.plan = plan
    self.padded_shapes = padded_shapes
    self.padding_values = padding_values
    self.pad_to_bucket_boundary = bool(pad_to_bucket_boundary)
    self.decode_fn = decode_fn

  def make_iterator(self) -> "BucketPlanIterator":
    return BucketPlanIterator(self)

  def spec_params(self) -> dict:
    return {
      "source": self.source,
      "plan": self.plan,
      "padded_shapes": self.padded_shapes,
      "padding_values": self.padding_values,
      "pad_to_bucket_boundary": self.pad_to_bucket_boundary,
      "decode_fn": self.decode_fn,
    }

  def cardinality(self) -> int:
    steps = self.plan.num_steps()
    return -1 if steps is None else steps


class BucketPlanIterator(base.OpIterator):
  """Iterates a `BucketPlanNode`; its state is the next step."""

  op_name = _OP

  def __init__(self, node: BucketPlanNode):
    super().__init__(())
    self._node = node
    self._plan = node.plan
    self._num_steps = node.plan.num_steps()
    self._step = 0
    self._last_seed = 0
    self.last_step: int | None = None
    """Global step of the batch returned last."""
    self.last_bucket_id: int | None = None
    """Bucket of the batch returned last (the same on every host)."""

  def __next__(self) -> Any:
    if self._closed:
      raise RuntimeError(f"{_OP}: iterator used after close().")
    step = self._step
    if self._num_steps is not None and step >= self._num_steps:
      raise StopIteration
    node = self._node
    bucket_id, indices = self._plan[step]
    records = read_records(node.source, indices)
    if node.decode_fn is not None:
      records = [node.decode_fn(record) for record in records]
    padded_length = self._plan.padded_length(step, node.pad_to_bucket_boundary)
    batch = pad_records(
      records, padded_length, node.padded_shapes, node.padding_values, indices, step
    )
    self._step = step + 1
    self._last_seed = base.mix_seed(self._plan.seed, step)
    self.last_step = step
    self.last_bucket_id = bucket_id
    return batch

  @property
  def last_seed(self) -> int:
    return self._last_seed

  def _get_own_state(self) -> dict:
    return {"step": self._step}

  def _set_own_state(self, state: dict) -> None:
    step = state.get("step") if isinstance(state, dict) else None
    limit = self._num_steps
    if (
      not isinstance(step, int)
      or isinstance(step, bool)
      or step < 0
      or (limit is not None and step > limit)
    ):
      allowed = "an integer >= 0" if limit is None else f"an integer 0..{limit}"
      raise base.PipelineStateError(
        f"{_OP}: state step must be {allowed} (steps of {self._plan!r}), got {state!r}."
      )
    self._step = step
    self._last_seed = base.mix_seed(self._plan.seed, step - 1) if step else 0


def _check_bounded(plan: BucketPlan) -> None:
  boundaries = plan.bucket_boundaries
  longest = int(plan.lengths.max()) if plan.num_records else 0
  if not boundaries or longest >= boundaries[-1]:
    limit = boundaries[-1] if boundaries else "(no boundaries)"
    raise ValueError(
      f"{_OP}: pad_to_bucket_boundary=True needs every record shorter than "
      f"the last bucket boundary {limit}, but the longest record has length "
      f"{longest}."
    )


def pad_records(
  records: list,
  padded_length: int,
  padded_shapes: Any,
  padding_values: Any,
  indices: np.ndarray,
  step: int,
) -> Any:
  """Stacks records into one batch, sequence dims padded to `padded_length`.

  Args:
    records: Pytrees of arrays with identical structure.
    padded_length: The size of every sequence dimension.
    padded_shapes: None, or a pytree of shapes (see module docstring).
    padding_values: None, a scalar, or a pytree of scalars matching a record.
    indices: Record indices of `records` (for error messages).
    step: The plan step (for error messages).

  Returns:
    A pytree like a record with a leading batch dimension.

  Raises:
    RecordLengthMismatchError: A record's sequence dimension is longer than
      `padded_length`.
  """
  structure = records[0]
  specs = _leaf_shape_specs(structure, padded_shapes)
  first_leaves = tree.flatten(structure)
  shapes = []
  for j, (spec, leaf) in enumerate(zip(specs, first_leaves)):
    if spec is None:  # default: the first dimension is the sequence dimension
      rank = np.ndim(leaf)
      sequence_axes: tuple[int, ...] = (0,) if rank else ()
      # pad_and_stack reads None as "the batch maximum".
      shapes.append([padded_length] + [None] * (rank - 1) if rank else [])
    else:
      sequence_axes = tuple(a for a, d in enumerate(spec) if d is None or d == -1)
      shapes.append([padded_length if a in sequence_axes else int(d) for a, d in enumerate(spec)])
    if sequence_axes:
      _check_sequence_fits(records, j, sequence_axes, padded_length, indices, step, structure)
  return padding.pad_and_stack(
    records, tree.unflatten(structure, shapes), padding_values, op_name=_OP
  )


def _check_sequence_fits(
  records: list,
  leaf_index: int,
  axes: tuple,
  padded_length: int,
  indices: np.ndarray,
  step: int,
  structure: Any,
) -> None:
  for row, record in enumerate(records):
    leaves = tree.flatten(record)
    if leaf_index >= len(leaves):
      return  # pad_and_stack reports the structure mismatch
    shape = np.shape(leaves[leaf_index])
    if any(a < len(shape) and shape[a] > padded_length for a in axes):
      path = tree.paths(structure)[leaf_index] or "<record>"
      raise RecordLengthMismatchError(
        f"{_OP}: record {int(indices[row])} feature {path!r} has shape "
        f"{shape}, longer than {padded_length}, the padded length the plan "
        f"gives step {step} from its length index. The length index is "
        f"stale or measures a different feature; recompute it with "
        f"jaxfeed.coord.compute_lengths."
      )


def _leaf_shape_specs(structure: Any, padded_shapes: Any) -> list:
  """Per-leaf shape spec (tuple) or None, walking the record's structure."""
  if padded_shapes is None:
    return [None] * len(tree.flatten(structure))
  specs: list = []

  def walk(node, spec, where):
    if tree.is_leaf(node):
      if spec is None:
        specs.append(None)
        return
      if hasattr(spec, "as_list"):
        spec = spec.as_list()
      if not isinstance(spec, (tuple, list, np.ndarray)) or not all(
        s is None or (isinstance(s, (int, np.integer)) and s >= -1) for s in spec
      ):
        raise ValueError(
          f"{_OP}: padded_shapes at {where or '<record>'!r} must be a shape "
          f"(a tuple of ints >= 0, None or -1), got {spec!r}."
        )
      specs.append(tuple(spec))
      return
    if isinstance(node, dict):
      if not isinstance(spec, dict) or set(spec) != set(node):
        _spec_mismatch(node, spec, where)
      for key in sorted(node):
        walk(node[key], spec[key], f"{where}/{key}" if where else str(key))
      return
    if not isinstance(spec, (tuple, list)) or len(spec) != len(node):
      _spec_mismatch(node, spec, where)
    for i, (child, child_spec) in enumerate(zip(node, spec)):
      walk(child, child_spec, f"{where}/{i}" if where else str(i))

  walk(structure, padded_shapes, "")
  return specs


def _spec_mismatch(node: Any, spec: Any, where: str) -> None:
  raise ValueError(
    f"{_OP}: padded_shapes {spec!r} does not match the record's structure "
    f"{tree.structure_str(node)} at {where or '<record>'!r}."
  )
