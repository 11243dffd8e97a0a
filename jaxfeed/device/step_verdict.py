"""What one step's batches become: placed as they are, padded and masked,
dropped, the end of the epoch, or an error.

A step's batches are this process's alone, or, in a multi-process job, one
per process (`jaxfeed.device.agreement` gathers them and hands out the
verdict this module computes). Two policies decide.

`partial_batch`: a batch is *partial* when it has fewer rows (its leaves'
common leading dimension) than a complete one: the per-process batch size
when the pipeline says it (`full_rows`: the Loader reads it from the
pipeline's last `batch` / `padded_batch`, see
`jaxfeed.ops.batch_rows`), else the most rows any process has at the step.
- `"drop"`: a step where some process's batch is partial is dropped on every
  process, as `batch(..., drop_remainder=True)` drops a partial batch; the
  next step follows.
- `"pad"`: partial batches get zero rows up to the complete size, and every
  batch a bool leaf `MASK_KEY` of shape `[rows]`, True for real rows
  (tf.distribute's partial batch handling): shapes and structure never change.
- `"error"`: a ValueError naming the step, each process's shape and the
  complete size.

`end_of_input` (several processes): a process whose input ended has no batch.
- `"stop_at_shortest"`: the epoch ends for all at the first such step.
- `"pad"`: steps go on while any process has a batch; the others' batches are
  all padding (a partial batch of no rows).

By default (`resolve_policy(None, None)`) partial steps are dropped and the
epoch stops at the shortest input: no step changes shape, no leaf is added,
and no end of an epoch raises. `partial_batch="pad"` alone goes on to the
longest input, so every real row is delivered once. `end_of_input="pad"`
alone keeps the behaviour it had before `partial_batch` existed: padding as
`"pad"`, with the mask leaf named `LEGACY_MASK_KEY`.

In every case the processes' leaves must agree in path, dtype and rank, and
in the sizes after the first dimension (unless `pad_to_common_shape`
zero-pads them to the largest any process has); otherwise every process
raises a ValueError naming the leaf and each process's shape.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Mapping

import jax
import numpy as np

PARTIAL_BATCH_POLICIES = ("drop", "pad", "error")
END_OF_INPUT_POLICIES = ("stop_at_shortest", "pad")
MASK_KEY = "mask"
"""The bool leaf `partial_batch="pad"` adds to every batch."""
LEGACY_MASK_KEY = "valid"
"""Its name under `end_of_input="pad"` without `partial_batch`."""

SKIP = "skip"
"""What a step returns when its batches are dropped (`partial_batch="drop"`)."""


@dataclasses.dataclass(frozen=True)
class StepPolicy:
  """How a step's batches are agreed on (see the module docstring).

  Attributes:
    partial_batch: one of `PARTIAL_BATCH_POLICIES`.
    end_of_input: one of `END_OF_INPUT_POLICIES`.
    mask_key: the mask leaf padding adds, None when nothing is padded.
    full_rows: the rows of a complete per-process batch, if known.
    pad_to_common_shape: zero-pad the dimensions after the first to the
      largest size any process has at the step.
  """

  partial_batch: str = "drop"
  end_of_input: str = "stop_at_shortest"
  mask_key: str | None = None
  full_rows: int | None = None
  pad_to_common_shape: bool = False

  def __post_init__(self):
    if self.full_rows is not None and (
      isinstance(self.full_rows, bool) or not isinstance(self.full_rows, int) or self.full_rows < 1
    ):
      raise ValueError(f"full_rows must be None or an integer >= 1, got {self.full_rows!r}.")

  @property
  def pads(self) -> bool:
    """Whether every batch is padded to agreed shapes and masked."""
    return self.mask_key is not None

  def with_full_rows(self, full_rows: int | None) -> "StepPolicy":
    return dataclasses.replace(self, full_rows=full_rows)


def resolve_policy(
  partial_batch: str | None,
  end_of_input: str | None,
  who: str,
  *,
  pad_to_common_shape: bool = False,
) -> StepPolicy:
  """The policy of a Loader's (or DevicePrefetcher's) arguments; None means
  the default (see the module docstring).

  Raises:
    ValueError: an unknown value, or `partial_batch="drop"` with
      `end_of_input="pad"` (padding a step and dropping it).
  """
  if partial_batch is not None and partial_batch not in PARTIAL_BATCH_POLICIES:
    raise ValueError(
      f"{who}: partial_batch must be one of {PARTIAL_BATCH_POLICIES}, got {partial_batch!r}."
    )
  if end_of_input is not None and end_of_input not in END_OF_INPUT_POLICIES:
    raise ValueError(
      f"{who}: end_of_input must be one of {END_OF_INPUT_POLICIES}, got {end_of_input!r}."
    )
  if partial_batch is None and end_of_input == "pad":
    return StepPolicy("pad", "pad", LEGACY_MASK_KEY, pad_to_common_shape=pad_to_common_shape)
  partial_batch = partial_batch or "drop"
  if end_of_input is None:
    end_of_input = "pad" if partial_batch == "pad" else "stop_at_shortest"
  if partial_batch == "drop" and end_of_input == "pad":
    raise ValueError(
      f"{who}: partial_batch='drop' drops the steps where a process's "
      "batch is incomplete, and end_of_input='pad' pads the steps where a "
      "process has none; use partial_batch='pad' (pads both) or "
      "end_of_input='stop_at_shortest'."
    )
  pads = partial_batch == "pad" or end_of_input == "pad"
  return StepPolicy(
    partial_batch, end_of_input, MASK_KEY if pads else None, pad_to_common_shape=pad_to_common_shape
  )


# -- describing batches -------------------------------------------------------------
def describe(batch: Any) -> list:
  """[[leaf path, shape, dtype], ...] in flatten order."""
  leaves = jax.tree_util.tree_flatten_with_path(batch)[0]
  described = []
  for path, leaf in leaves:
    leaf = np.asarray(leaf)
    described.append([jax.tree_util.keystr(path) or "<batch>", list(leaf.shape), leaf.dtype.str])
  return described


def rows_of(described: list) -> int | None:
  """The leading dimension all leaves of rank >= 1 share; None if they do
  not share one (then rows are not padded or dropped)."""
  sizes = {shape[0] for _, shape, _ in described if shape}
  return sizes.pop() if len(sizes) == 1 else None


def leaf_rows(batch: Any) -> int | None:
  """`rows_of(describe(batch))` without describing the batch."""
  sizes = {np.shape(leaf)[0] for leaf in jax.tree_util.tree_leaves(batch) if np.ndim(leaf)}
  return sizes.pop() if len(sizes) == 1 else None


# -- the verdict --------------------------------------------------------------------
def decide(step: int, messages: Mapping[int, Any], count: int, policy: StepPolicy) -> dict:
  """The verdict on one step.

  Args:
    step: the step's index (counting dropped steps), for messages.
    messages: per process, `describe(batch)`, or "null" when its input has
      ended, or "never" when it ended without any batch.
    count: the number of processes.
    policy: the policy.

  Returns:
    {"end": True}; {"error": message}; {"skip": True} (drop the step); {}
    (place the batches as they are); or {"targets": [[shape, dtype], ...]}
    (pad every leaf to them, and add the mask).
  """
  present = {p: m for p, m in messages.items() if isinstance(m, list)}
  if not present or (len(present) < count and policy.end_of_input == "stop_at_shortest"):
    return {"end": True}
  rows = {p: rows_of(d) for p, d in present.items()}
  by_rows = None not in rows.values()
  pad_rows = policy.pads or by_rows
  signatures = {p: _signature(d, pad_rows, policy.pad_to_common_shape) for p, d in present.items()}
  if len(set(signatures.values())) > 1:
    return {
      "error": _mismatch_message(step, present, signatures, pad_rows, policy.pad_to_common_shape)
    }
  full = None
  if by_rows:
    full = max([*rows.values(), policy.full_rows or 0])
    partial = sorted(p for p, r in rows.items() if r < full)
    if partial and policy.partial_batch == "drop":
      logging.info(
        "Loader: step %d dropped on every process: processes %s have %s of "
        "%d rows (partial_batch='pad' keeps them, with a mask).",
        step,
        partial,
        [rows[p] for p in partial],
        full,
      )
      return {"skip": True}
    if partial and policy.partial_batch == "error":
      return {"error": _partial_message(step, present, partial, full)}
  if not policy.pads and not policy.pad_to_common_shape:
    return {}
  without_structure = sorted(p for p, m in messages.items() if m == "never")
  if without_structure:
    return {
      "error": (
        f"Loader(end_of_input='pad'): processes {without_structure} have "
        f"had no batch at all by step {step}, so they cannot build padding "
        "batches of the right structure; every process needs at least one "
        "batch of its own."
      )
    }
  reference = next(iter(present.values()))
  targets = []
  for i, (_, shape, dtype) in enumerate(reference):
    target = [max(d[i][1][dim] for d in present.values()) for dim in range(len(shape))]
    if shape and full is not None and policy.pads:
      target[0] = full
    if not policy.pad_to_common_shape:
      target[1:] = shape[1:]
    targets.append([target, dtype])
  return {"targets": targets}


def _signature(described: list, pad_rows: bool, pad_dims: bool) -> tuple:
  """What must be equal on every process: paths, dtypes, ranks and the sizes
  of the dimensions that are not padded."""

  def sizes(shape: list) -> tuple:
    return tuple(
      None if (d == 0 and pad_rows) or (d > 0 and pad_dims) else n for d, n in enumerate(shape)
    )

  return tuple((path, dtype, sizes(shape)) for path, shape, dtype in described)


def _shapes(present: Mapping[int, list], leaf: int) -> str:
  return ", ".join(
    f"{tuple(d[leaf][1])} {np.dtype(d[leaf][2]).name} on process {p}"
    for p, d in sorted(present.items())
  )


def _partial_message(step: int, present: Mapping[int, list], partial: list, full: int) -> str:
  leaf = next(i for i, (_, shape, _) in enumerate(next(iter(present.values()))) if shape)
  path = next(iter(present.values()))[leaf][0]
  return (
    f"Loader(partial_batch='error'): the batch of process(es) {partial} at "
    f"step {step} is partial: leaf {path} has local shape and dtype "
    f"{_shapes(present, leaf)}, and a complete batch has {full} rows. Use "
    "partial_batch='drop' to drop such steps, partial_batch='pad' to pad "
    "them with a mask, or batch(..., drop_remainder=True)."
  )


def _mismatch_message(
  step: int,
  present: Mapping[int, list],
  signatures: Mapping[int, tuple],
  pad_rows: bool,
  pad_dims: bool,
) -> str:
  """Names the first leaf whose path, dtype or shape differs between processes."""
  described = sorted(present.items())
  paths = {p: [leaf[0] for leaf in d] for p, d in described}
  if len({tuple(v) for v in paths.values()}) > 1:
    what = "; ".join(f"process {p}: {v}" for p, v in paths.items())
    return (
      f"Loader: the processes' batches at step {step} have different "
      f"structures (leaf paths {what}); every process must yield the "
      "same structure."
    )
  for i, path in enumerate(next(iter(paths.values()))):
    if len({signatures[p][i] for p, _ in described}) > 1:
      if pad_dims:
        allowed = "the same rank" + ("" if pad_rows else " and leading (batch) dimension")
      elif pad_rows:
        allowed = "the same shape except the leading (batch) dimension"
      else:
        allowed = "the same shape"
      only_rows = len({tuple(d[i][1][1:]) for _, d in described}) == 1
      if only_rows:
        remedy = (
          "for a last partial batch, use batch(..., "
          "drop_remainder=True) or Loader(partial_batch='pad')"
        )
      else:
        remedy = (
          "pad to sizes every process agrees on (e.g. padded_batch("
          "..., padded_shapes=<fixed sizes>) instead of padding to each "
          "process's longest element), or pass "
          "Loader(pad_to_common_shape=True)"
        )
      return (
        f"Loader: leaf {path} cannot form one global array at step {step}: "
        f"its local shape and dtype are {_shapes(present, i)}. Every process "
        f"must yield {allowed} and dtype: {remedy}."
      )
  raise AssertionError("no mismatching leaf")  # Callers checked one differs.


# -- applying it ----------------------------------------------------------------------
def pad(batch: Any, treedef: Any, targets: list, mask_key: str | None) -> Any:
  """`batch` (zeros when None) with each leaf zero-padded to its target
  shape, and the mask leaf `mask_key` (unless None)."""
  shapes = [tuple(shape) for shape, _ in targets]
  if batch is None:
    leaves = [np.zeros(shape, dtype) for shape, (_, dtype) in zip(shapes, targets)]
    valid = 0
  else:
    leaves = [
      _pad_to(np.asarray(leaf), shape)
      for leaf, shape in zip(jax.tree_util.tree_leaves(batch), shapes)
    ]
    valid = max(
      (np.shape(leaf)[0] for leaf in jax.tree_util.tree_leaves(batch) if np.ndim(leaf)), default=0
    )
  batch = jax.tree_util.tree_unflatten(treedef, leaves)
  if mask_key is None:
    return batch
  if not isinstance(batch, Mapping):
    raise TypeError(
      f"Loader: padded batches must be dicts to carry the '{mask_key}' "
      f"mask leaf, got {type(batch).__name__}; map the batches to dicts, or "
      "use partial_batch='drop'."
    )
  if mask_key in batch:
    raise ValueError(
      f"Loader: the batch already has a leaf '{mask_key}', the name of the "
      "mask padding adds; rename it."
    )
  rows = max((shape[0] for shape in shapes if shape), default=0)
  mask = np.zeros(rows, bool)
  mask[:valid] = True
  return {**batch, mask_key: mask}


def _pad_to(leaf: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
  if leaf.shape == shape:
    return leaf
  return np.pad(leaf, [(0, n - m) for m, n in zip(leaf.shape, shape)])


class LocalSteps:
  """The verdicts of a process whose batches are its own (one process, or
  shardings on its own devices): the same as `decide` with one process."""

  def __init__(self, policy: StepPolicy):
    self._policy = dataclasses.replace(policy, pad_to_common_shape=False)
    # `end_of_input="pad"` alone is about other processes, as it was
    # before `partial_batch`: alone, a process's batches pass as they are.
    self._as_they_are = policy.mask_key == LEGACY_MASK_KEY
    self._step = 0

  def step(self, batch: Any) -> Any:
    """The batch to place, None at the end, or `SKIP`."""
    if batch is None:
      return None
    step = self._step
    self._step += 1
    policy = self._policy
    if (
      self._as_they_are
      or not policy.pads
      and (policy.full_rows is None or (leaf_rows(batch) or policy.full_rows) >= policy.full_rows)
    ):
      return batch  # The usual step: nothing to pad, drop or check.
    verdict = decide(step, {0: describe(batch)}, 1, policy)
    if "error" in verdict:
      raise ValueError(verdict["error"])
    if verdict.get("skip"):
      return SKIP
    if "targets" not in verdict:
      return batch
    return pad(batch, jax.tree_util.tree_structure(batch), verdict["targets"], policy.mask_key)
