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

What the verdict is, for partial batches (`partial_batch`) and inputs that
end at different steps (`end_of_input`), is `jaxfeed.device.step_verdict`'s
business; this module gathers the messages and hands the verdict out.
"""

from __future__ import annotations

import json
import threading
from typing import Any

import jax
import numpy as np

from jaxfeed.device import step_verdict
from jaxfeed.device.step_verdict import StepPolicy

_POLL_MS = 500  # How often a wait for other processes checks for close().
_CHUNK = 64  # Own keys are deleted 64 steps at a time.


class Interrupted(Exception):
  """The wait for other processes was stopped by `close()`."""


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
    policy: a `StepPolicy`, or an `end_of_input` policy name (the default
      `partial_batch` then).
    namespace: a key prefix unique to this agreement and equal on every
      process.
    client: the coordination service client (`distributed_client()`).
    pad_to_common_shape: with a policy name: zero-pad each leaf's dimensions
      after the first to the largest size any process has at that step,
      instead of requiring equal sizes.
  """

  def __init__(
    self,
    policy: StepPolicy | str,
    namespace: str,
    client: Any,
    *,
    pad_to_common_shape: bool = False,
  ):
    if isinstance(policy, str):
      policy = step_verdict.resolve_policy(
        None, policy, "StepAgreement", pad_to_common_shape=pad_to_common_shape
      )
    self._policy = policy
    self._namespace = namespace
    self._client = client
    self._index = jax.process_index()
    self._count = jax.process_count()
    self._step = 0
    self._treedef: Any = None  # Of this process's last batch, for padding.
    # (treedef, leaf shapes and dtypes) -> (message, rows) of the last batch.
    self._message_cache: tuple[Any, str, int | None] = (None, "", None)

  def step(self, batch: Any, stop: threading.Event | None = None) -> Any:
    """This step's batch as agreed by all processes, None (the input ended)
    or `step_verdict.SKIP` (the step is dropped).

    Args:
      batch: this process's batch for the step, or None if its input ended.
      stop: when set, a wait for other processes raises `Interrupted`.

    Returns:
      None when the input ended for all processes; `step_verdict.SKIP` when
      every process drops this step's batch; else the batch to place
      (`batch` itself, or padded and masked).

    Raises:
      ValueError: on every process alike, when the processes' batches cannot
        form one global array, or a partial batch under
        `partial_batch="error"`.
    """
    step = self._step
    self._step += 1
    rows = None
    if batch is not None:
      message, rows = self._encode(batch)
    else:
      # "never": out of input without a batch ever, so no structure to pad.
      message = '"never"' if self._treedef is None else "null"
    directory = self._directory(step)
    if self._index == 0:  # Process 0 keeps its own message.
      verdict = self._decide(step, directory, message, rows, stop)
      self._client.key_value_set(f"{directory}/verdict", json.dumps(verdict))
      if step >= 2 and (step - 2) % _CHUNK == _CHUNK - 1:
        # Every process has read the verdicts up to step - 2: it wrote its
        # message of step - 1, which process 0 has read, after reading them.
        self._client.key_value_delete(self._directory(step - 2).rsplit("/", 1)[0])
    else:
      self._client.key_value_set(f"{directory}/p{self._index}", message)
      if batch is None and self._policy.end_of_input == "stop_at_shortest":
        return None  # Whatever the others have, the input ends here.
      verdict = json.loads(self._read(f"{directory}/verdict", stop))
    if "error" in verdict:
      raise ValueError(verdict["error"])
    if verdict.get("end"):
      return None
    if verdict.get("skip"):
      return step_verdict.SKIP
    if "targets" not in verdict:
      return batch
    return step_verdict.pad(batch, self._treedef, verdict["targets"], self._policy.mask_key)

  # -- messages ---------------------------------------------------------------
  def _directory(self, step: int) -> str:
    return f"{self._namespace}/c{step // _CHUNK}/s{step}"

  def _encode(self, batch: Any) -> tuple[str, int | None]:
    """The message for `batch` and its rows; notes its structure for padding."""
    leaves, self._treedef = jax.tree_util.tree_flatten(batch)
    key = (self._treedef, tuple((np.shape(leaf), np.asarray(leaf).dtype.str) for leaf in leaves))
    # Shapes rarely change between steps: reuse the message, whose leaf
    # paths cost more to build than this key.
    if self._message_cache[0] != key:
      described = step_verdict.describe(batch)
      self._message_cache = (key, json.dumps(described), step_verdict.rows_of(described))
    return self._message_cache[1], self._message_cache[2]

  def _read(self, key: str, stop: threading.Event | None) -> str:
    while True:
      try:
        return self._client.blocking_key_value_get(key, _POLL_MS)
      except Exception as e:  # pylint: disable=broad-except
        if "DEADLINE_EXCEEDED" not in str(e):
          raise
      if stop is not None and stop.is_set():
        raise Interrupted()

  def _messages(self, directory: str, own: str, stop: threading.Event | None) -> dict[int, str]:
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
            messages[int(key[len(prefix) :])] = value

  # -- agreement (process 0) ----------------------------------------------------
  def _decide(
    self, step: int, directory: str, own: str, rows: int | None, stop: threading.Event | None
  ) -> dict:
    """The verdict (see `step_verdict.decide`)."""
    raw = self._messages(directory, own, stop)
    policy = self._policy
    if (
      not policy.pads
      and not policy.pad_to_common_shape
      and own[0] == "["
      and (policy.full_rows is None or rows is None or rows >= policy.full_rows)
      and all(m == own for m in raw.values())
    ):
      return {}  # The usual step: every process has a complete batch like this one.
    return step_verdict.decide(
      step, {p: json.loads(m) for p, m in raw.items()}, self._count, policy
    )
