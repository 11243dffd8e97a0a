"""End-of-input agreement: every JAX process stops at the same step.

In a multi-process job each process reads its own share of the input, and the
shares can end at different steps (uneven shards, a `filter` keeping different
numbers of records per host, several hosts reading one shared job). A process
that leaves the training loop early leaves the others blocked in the next
collective. `StepAgreement` makes the processes agree, before each step's batch
is placed, on whether the step happens and on the batch's local shapes.

Each step every process writes one short message in the `jax.distributed`
key-value store (whether it has a batch, and the path, shape and dtype of each
leaf); process 0 reads them all and writes the verdict, which the others read.
This is host-side only: it never enqueues a device collective, so running it
on the device prefetch thread cannot interleave with the training loop's
collectives, and it overlaps with the read-ahead. Cost per step: two or three
requests to the coordinator per process, whatever the number of processes
(`benchmarks/end_of_input_cost.py` measures it).

Policies (`end_of_input`):
- `"stop_at_shortest"`: the input ends for every process at the first step
  where some process has no batch; batches other processes read for that step
  are dropped (their checkpoint state stays that of the last step taken).
- `"pad"`: steps go on while some process has a batch. A process without one
  (or with a shorter leading dimension, e.g. a last partial batch) yields
  zero rows up to the longest process's batch size, and every batch (a dict)
  gets a bool leaf `PAD_MASK_KEY` of shape `[batch]`: True for real rows, False
  for padding. A process needs one batch of its own first to know the
  structure; otherwise every process raises a ValueError at that step.

In both, the processes' leaf shapes must agree (in `"pad"`, up to the leading
dimension; with `pad_to_common_shape`, up to the dimensions after the first,
which are zero-padded to the largest size any process has at that step);
otherwise every process raises `ValueError` naming the leaf and the shape on
each process.
"""

from __future__ import annotations

import json
import threading
from typing import Any, Mapping

import jax
import numpy as np

END_OF_INPUT_POLICIES = ("stop_at_shortest", "pad")
PAD_MASK_KEY = "valid"
"""The mask leaf `end_of_input="pad"` adds to every batch."""

_POLL_MS = 500  # How often a wait for other processes checks for close().
_CHUNK = 64  # Own keys are deleted 64 steps at a time.


class Interrupted(Exception):
  """The wait for other processes was stopped by `close()`."""


def check_policy(end_of_input: str, who: str) -> str:
  if end_of_input not in END_OF_INPUT_POLICIES:
    raise ValueError(
        f"{who}: end_of_input must be one of {END_OF_INPUT_POLICIES}, got "
        f"{end_of_input!r}.")
  return end_of_input


def distributed_client() -> Any:
  """The `jax.distributed` coordination client (None when not initialized)."""
  # jax has no public handle on its key-value store; orbax uses the same one.
  from jax._src import distributed  # pylint: disable=g-import-not-at-top
  return distributed.global_state.client


class StepAgreement:
  """Per-step agreement of all JAX processes on whether the input goes on.

  Every process must create its agreements in the same order (their keys are
  numbered) and call `step` once per step.

  Each step every process writes its message; process 0 reads them all (one
  directory read, plus a wait for any still missing), decides, and writes the
  verdict, which the others read. So a process makes O(1) requests to the
  coordinator per step, whatever the number of processes, and the coordinator
  handles O(process_count).

  Args:
    policy: one of `END_OF_INPUT_POLICIES`.
    namespace: a key prefix unique to this agreement and equal on every
      process.
    client: the coordination service client (`distributed_client()`).
    pad_to_common_shape: zero-pad each leaf's dimensions after the first to
      the largest size any process has at that step, instead of requiring
      equal sizes.
  """

  def __init__(self, policy: str, namespace: str, client: Any, *,
               pad_to_common_shape: bool = False):
    self._policy = policy
    self._pad_dims = pad_to_common_shape
    self._namespace = namespace
    self._client = client
    self._index = jax.process_index()
    self._count = jax.process_count()
    self._step = 0
    self._treedef: Any = None  # Of this process's last batch, for padding.
    # (treedef, leaf shapes and dtypes) -> message of the last batch.
    self._message_cache: tuple[Any, str] = (None, "")

  def step(self, batch: Any, stop: threading.Event | None = None) -> Any:
    """This step's batch as agreed by all processes, or None: input ended.

    Args:
      batch: this process's batch for the step, or None if its input ended.
      stop: when set, a wait for other processes raises `Interrupted`.

    Returns:
      None when the input ended for all processes; else the batch to place
      (`batch` itself, or padded, and masked under `"pad"`).

    Raises:
      ValueError: on every process alike, when the processes' batches cannot
        form one global array.
    """
    step = self._step
    self._step += 1
    if batch is not None:
      message = self._encode(batch)
    else:
      # "never": out of input without a batch ever, so no structure to pad.
      message = '"never"' if self._treedef is None else "null"
    directory = self._directory(step)
    if self._index == 0:  # Process 0 keeps its own message.
      verdict = self._decide(step, directory, message, stop)
      self._client.key_value_set(f"{directory}/verdict", json.dumps(verdict))
      if step >= 2 and (step - 2) % _CHUNK == _CHUNK - 1:
        # Every process has read the verdicts up to step - 2: it wrote its
        # message of step - 1, which process 0 has read, after reading them.
        self._client.key_value_delete(self._directory(step - 2)
                                      .rsplit("/", 1)[0])
    else:
      self._client.key_value_set(f"{directory}/p{self._index}", message)
      if batch is None and self._policy == "stop_at_shortest":
        return None  # Whatever the others have, the input ends here.
      verdict = json.loads(self._read(f"{directory}/verdict", stop))
    if "error" in verdict:
      raise ValueError(verdict["error"])
    if verdict.get("end"):
      return None
    if "targets" not in verdict:
      return batch
    return _pad(batch, self._treedef, verdict["targets"],
                self._policy == "pad")

  # -- messages ---------------------------------------------------------------
  def _directory(self, step: int) -> str:
    return f"{self._namespace}/c{step // _CHUNK}/s{step}"

  def _encode(self, batch: Any) -> str:
    """The message for `batch`; notes its structure for padding."""
    leaves, self._treedef = jax.tree_util.tree_flatten(batch)
    key = (self._treedef, tuple((np.shape(leaf), np.asarray(leaf).dtype.str)
                                for leaf in leaves))
    # Shapes rarely change between steps: reuse the message, whose leaf
    # paths cost more to build than this key.
    if self._message_cache[0] != key:
      self._message_cache = (key, json.dumps(_describe(batch)))
    return self._message_cache[1]

  def _read(self, key: str, stop: threading.Event | None) -> str:
    while True:
      try:
        return self._client.blocking_key_value_get(key, _POLL_MS)
      except Exception as e:  # pylint: disable=broad-except
        if "DEADLINE_EXCEEDED" not in str(e):
          raise
      if stop is not None and stop.is_set():
        raise Interrupted()

  def _messages(self, directory: str, own: str,
                stop: threading.Event | None) -> dict[int, str]:
    """Every process's message of the step (JSON), waiting for missing ones."""
    messages = {self._index: own}
    prefix = f"{directory}/p"
    while True:
      missing = [p for p in range(self._count) if p not in messages]
      if not missing:
        return messages
      # Wait for the last missing one; the others have usually arrived by
      # then and come in one directory read.
      messages[missing[-1]] = self._read(f"{prefix}{missing[-1]}", stop)
      if len(missing) > 1:
        for key, value in self._client.key_value_dir_get(directory):
          if key.startswith(prefix):
            messages[int(key[len(prefix):])] = value

  # -- agreement (process 0) ----------------------------------------------------
  def _decide(self, step: int, directory: str, own: str,
              stop: threading.Event | None) -> dict:
    """The verdict: {"end": True}, {"error": message}, {} (place as is) or
    {"targets": [[shape, dtype], ...]} (pad every leaf to them)."""
    raw = self._messages(directory, own, stop)
    if (self._policy == "stop_at_shortest" and not self._pad_dims
        and own[0] == "[" and all(m == own for m in raw.values())):
      return {}  # The usual step: every process has a batch like this one.
    messages = {p: json.loads(m) for p, m in raw.items()}
    without_structure = sorted(p for p, m in messages.items() if m == "never")
    present = {p: m for p, m in messages.items() if isinstance(m, list)}
    if not present or (len(present) < self._count
                       and self._policy == "stop_at_shortest"):
      return {"end": True}
    pad_rows = self._policy == "pad"
    signatures = {p: _signature(d, pad_rows, self._pad_dims)
                  for p, d in present.items()}
    if len(set(signatures.values())) > 1:
      return {"error": _mismatch_message(step, present, signatures, pad_rows,
                                         self._pad_dims)}
    if not pad_rows and not self._pad_dims:
      return {}
    if without_structure:
      return {"error": (
          f"Loader(end_of_input='pad'): processes {without_structure} have "
          f"had no batch at all by step {step}, so they cannot build padding "
          "batches of the right structure; every process needs at least one "
          "batch of its own.")}
    reference = next(iter(present.values()))
    return {"targets": [
        [[max(d[i][1][dim] for d in present.values())
          for dim in range(len(leaf[1]))], leaf[2]]
        for i, leaf in enumerate(reference)]}


def _describe(batch: Any) -> list:
  """[[leaf path, shape, dtype], ...] in flatten order."""
  leaves = jax.tree_util.tree_flatten_with_path(batch)[0]
  described = []
  for path, leaf in leaves:
    leaf = np.asarray(leaf)
    described.append([jax.tree_util.keystr(path) or "<batch>",
                      list(leaf.shape), leaf.dtype.str])
  return described


def _signature(described: list, pad_rows: bool, pad_dims: bool) -> tuple:
  """What must be equal on every process: paths, dtypes, ranks and the sizes
  of the dimensions that are not padded."""
  def sizes(shape: list) -> tuple:
    return tuple(None if (d == 0 and pad_rows) or (d > 0 and pad_dims) else n
                 for d, n in enumerate(shape))
  return tuple((path, dtype, sizes(shape)) for path, shape, dtype in described)


def _mismatch_message(step: int, present: dict[int, list],
                      signatures: dict[int, tuple], pad_rows: bool,
                      pad_dims: bool) -> str:
  """Names the first leaf whose path, dtype or shape differs between processes."""
  described = sorted(present.items())
  paths = {p: [leaf[0] for leaf in d] for p, d in described}
  if len({tuple(v) for v in paths.values()}) > 1:
    what = "; ".join(f"process {p}: {v}" for p, v in paths.items())
    return (f"Loader: the processes' batches at step {step} have different "
            f"structures (leaf paths {what}); every process must yield the "
            "same structure.")
  for i, path in enumerate(next(iter(paths.values()))):
    if len({signatures[p][i] for p, _ in described}) > 1:
      shapes = ", ".join(f"{tuple(d[i][1])} {np.dtype(d[i][2]).name} on "
                         f"process {p}" for p, d in described)
      if pad_dims:
        allowed = "the same rank" + ("" if pad_rows else
                                     " and leading (batch) dimension")
      elif pad_rows:
        allowed = "the same shape except the leading (batch) dimension"
      else:
        allowed = "the same shape"
      only_rows = len({tuple(d[i][1][1:]) for _, d in described}) == 1
      if only_rows:
        remedy = ("for a last partial batch, use batch(..., "
                  "drop_remainder=True) or Loader(end_of_input='pad')")
      else:
        remedy = ("pad to sizes every process agrees on (e.g. padded_batch("
                  "..., padded_shapes=<fixed sizes>) instead of padding to each "
                  "process's longest element), or pass "
                  "Loader(pad_to_common_shape=True)")
      return (
          f"Loader: leaf {path} cannot form one global array at step {step}: "
          f"its local shape and dtype are {shapes}. Every process must yield "
          f"{allowed} and dtype: {remedy}.")
  raise AssertionError("no mismatching leaf")  # Callers checked one differs.


def _pad(batch: Any, treedef: Any, targets: list, pad_rows: bool) -> Any:
  """`batch` (zeros when None) with each leaf zero-padded to its target shape;
  the mask leaf when `pad_rows`."""
  shapes = [tuple(shape) for shape, _ in targets]
  if batch is None:
    leaves = [np.zeros(shape, dtype) for shape, (_, dtype) in zip(shapes, targets)]
    valid = 0
  else:
    leaves = [_pad_to(np.asarray(leaf), shape) for leaf, shape
              in zip(jax.tree_util.tree_leaves(batch), shapes)]
    valid = max((np.shape(leaf)[0] for leaf in jax.tree_util.tree_leaves(batch)
                 if np.ndim(leaf)), default=0)
  batch = jax.tree_util.tree_unflatten(treedef, leaves)
  if not pad_rows:
    return batch
  if not isinstance(batch, Mapping):
    raise TypeError(
        "Loader(end_of_input='pad'): batches must be dicts to carry the "
        f"'{PAD_MASK_KEY}' mask leaf, got {type(batch).__name__}.")
  if PAD_MASK_KEY in batch:
    raise ValueError(
        f"Loader(end_of_input='pad'): the batch already has a leaf "
        f"'{PAD_MASK_KEY}', the name of the mask this policy adds.")
  rows = max((shape[0] for shape in shapes if shape), default=0)
  mask = np.zeros(rows, bool)
  mask[:valid] = True
  return {**batch, PAD_MASK_KEY: mask}


def _pad_to(leaf: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
  if leaf.shape == shape:
    return leaf
  return np.pad(leaf, [(0, n - m) for m, n in zip(leaf.shape, shape)])
