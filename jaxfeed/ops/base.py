"""The node and iterator base of the op graph.

Every op in `jaxfeed/ops/` is one file holding a `Node` subclass (the immutable
graph node: op name, params, parents) and an `OpIterator` subclass (the running
iterator with explicit, JSON-able state). Op files import only this module (and
`jaxfeed.sources` / `jaxfeed.sampler` where they read records); the chaining
facade `jaxfeed.dataset.Dataset` imports the op files, never the other way.

Per-element seeds: every iterator exposes `last_seed`, the 64-bit rng seed of
the element it returned last. Sources set it from the sampler's per-record seed,
element-wise ops pass their parent's through (the default below), and ops that
buffer or combine elements (shuffle, batch, parallel map, prefetch, ...) keep
the seed beside each buffered element and override `last_seed`.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from jaxfeed.seeding import mix_seed  # re-exported for op modules

AUTOTUNE = -1
"""Pass as `num_parallel_calls` or a buffer size to let the autotuner choose."""

__all__ = ["AUTOTUNE", "Node", "OpIterator", "PipelineStateError", "mix_seed"]


class PipelineStateError(ValueError):
  """A state dict does not belong to the pipeline it is restored into."""


class OpIterator:
  """Base of every op's iterator: `__next__`, `get_state`, `set_state`, `close`.

  Subclasses set `op_name`, keep their children in `self.parents` and
  implement `__next__`, `_get_own_state` and `_set_own_state`. The state of the
  whole subtree is `{"op": name, "own": ..., "parents": [...]}`, so restoring a
  state saved from a different pipeline fails loudly instead of silently
  producing other data.
  """

  op_name: str = "op"

  def __init__(self, parents: Sequence["OpIterator"] = ()):
    self.parents: list[OpIterator] = list(parents)
    self._closed = False

  # -- iteration ---------------------------------------------------------
  def __iter__(self) -> "OpIterator":
    return self

  def __next__(self) -> Any:
    raise NotImplementedError

  @property
  def last_seed(self) -> int:
    """The rng seed of the element returned last (see module docstring)."""
    if self.parents:
      return self.parents[0].last_seed
    return 0

  def tunables(self) -> list:
    """This op's `jaxfeed.ops.autotune.Knob`s (AUTOTUNE parallelism/buffers)."""
    return []

  # -- state ---------------------------------------------------------------
  def _get_own_state(self) -> dict:
    return {}

  def _set_own_state(self, state: dict) -> None:
    del state

  def get_state(self) -> dict:
    """A small JSON-serializable dict from which `set_state` resumes exactly."""
    return {
        "op": self.op_name,
        "own": self._get_own_state(),
        "parents": [p.get_state() for p in self.parents],
    }

  def set_state(self, state: dict) -> None:
    """Restores a state returned by `get_state` of an identical pipeline."""
    check_state(state, self.op_name, len(self.parents))
    for parent, parent_state in zip(self.parents, state["parents"]):
      parent.set_state(parent_state)
    self._set_own_state(state["own"])

  # -- lifetime ------------------------------------------------------------
  def close(self) -> None:
    """Stops background work of this iterator and its parents. Idempotent."""
    if self._closed:
      return
    self._closed = True
    self._close_own()
    for parent in self.parents:
      parent.close()

  def _close_own(self) -> None:
    """Subclasses with threads, processes or memory release them here."""

  def __enter__(self) -> "OpIterator":
    return self

  def __exit__(self, *exc) -> None:
    self.close()


def check_state(state: Any, op_name: str, num_parents: int) -> None:
  """Raises PipelineStateError unless `state` was saved by op `op_name`."""
  if not isinstance(state, dict) or "op" not in state or "parents" not in state:
    raise PipelineStateError(
        f"Cannot restore op {op_name!r}: expected a state dict from "
        f"get_state() with keys 'op', 'own', 'parents', got {_short(state)}.")
  if state["op"] != op_name or len(state["parents"]) != num_parents:
    raise PipelineStateError(
        f"State belongs to a different pipeline: op {op_name!r} with "
        f"{num_parents} input(s) was given the state of op {state['op']!r} "
        f"with {len(state['parents'])} input(s).")


def _short(value: Any, limit: int = 120) -> str:
  text = repr(value)
  return text if len(text) <= limit else text[:limit] + "..."


class Node:
  """An immutable node of the op graph: op name, params and parent nodes.

  Subclasses set `op_name`, store their params as attributes, list the JSON-able
  ones in `spec_params()` (used for fingerprints and service specs) and build
  their iterator in `make_iterator`.
  """

  op_name: str = "node"

  def __init__(self, parents: Sequence["Node"] = ()):
    self.parents: tuple[Node, ...] = tuple(parents)

  def make_iterator(self) -> OpIterator:
    raise NotImplementedError

  def spec_params(self) -> dict:
    """The keyword arguments that rebuild this node.

    `type(node)(*parent_nodes, **node.spec_params())` must build an equal node.
    Values may be callables, numpy arrays, sources or samplers; fingerprints
    and service specs encode them (callables by `module:qualname`).
    """
    return {}

  def cardinality(self) -> int | None:
    """Number of elements if known and finite, -1 for infinite, None unknown."""
    return None

  def fingerprint(self) -> str:
    """A stable hash of this subgraph (op names, params, parents)."""
    payload = json.dumps(
        {
            "op": self.op_name,
            "params": self.spec_params(),
            "parents": [p.fingerprint() for p in self.parents],
        },
        sort_keys=True,
        default=_spec_default,
    )
    return hashlib.sha256(payload.encode()).hexdigest()[:32]

  def __repr__(self) -> str:
    return f"{type(self).__name__}({self.op_name})"


def callable_path(fn: Callable) -> str:
  """`module:qualname` of a callable, or its repr for lambdas and closures."""
  module = getattr(fn, "__module__", None)
  qualname = getattr(fn, "__qualname__", None)
  if module and qualname:
    return f"{module}:{qualname}"
  return repr(fn)


def _spec_default(value: Any) -> Any:
  if callable(value):
    return callable_path(value)
  if isinstance(value, np.ndarray):
    return {"array": value.tolist(), "dtype": str(value.dtype)}
  if isinstance(value, (np.integer, np.floating, np.bool_)):
    return value.item()
  if isinstance(value, np.dtype):
    return str(value)
  return repr(value)


def to_node(value: Any, op_name: str, what: str = "value") -> Node:
  """Accepts a Node or a facade `Dataset` (anything with a `.node`)."""
  if isinstance(value, Node):
    return value
  node = getattr(value, "node", None)
  if isinstance(node, Node):
    return node
  raise TypeError(
      f"{op_name}: {what} must be a jaxfeed Dataset, got "
      f"{type(value).__name__}: {_short(value)}.")


def check_positive_int(value: Any, op_name: str, name: str,
                       allow_zero: bool = False) -> int:
  """Validates an integer option and returns it as int."""
  ok = isinstance(value, (int, np.integer)) and not isinstance(value, bool)
  low = 0 if allow_zero else 1
  if not ok or value < low:
    raise ValueError(
        f"{op_name}: {name} must be an integer >= {low}, got {value!r}.")
  return int(value)


def check_count(value: Any, op_name: str, name: str = "count") -> int:
  """Validates a tf.data-style element count: an int, negative meaning 'all'."""
  if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
    raise ValueError(
        f"{op_name}: {name} must be an integer (-1 for all elements), got "
        f"{type(value).__name__}: {_short(value)}.")
  return int(value)


def state_int(state: Any, key: str, op_name: str, low: int = 0,
              high: int | None = None) -> int:
  """Reads integer `state[key]` of an own state, checking `low <= it <= high`."""
  value = state.get(key) if isinstance(state, dict) else None
  if (not isinstance(value, int) or isinstance(value, bool) or value < low
      or (high is not None and value > high)):
    allowed = f"[{low}, {high}]" if high is not None else f">= {low}"
    raise PipelineStateError(
        f"Cannot restore op {op_name!r}: own state needs an integer {key!r} "
        f"in {allowed}, got {_short(state)}.")
  return value


def iterate(node: Node) -> Iterator[Any]:
  """Convenience: a fresh iterator over a node."""
  return node.make_iterator()
