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

import collections
import threading
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from jaxfeed.ops import fingerprint as fingerprint_lib
from jaxfeed.ops import op_stats
from jaxfeed.seeding import mix_seed  # re-exported for op modules

AUTOTUNE = -1
"""Pass as `num_parallel_calls` or a buffer size to let the autotuner choose."""

__all__ = [
  "AUTOTUNE",
  "InputReplay",
  "IterationCounter",
  "Node",
  "OpIterator",
  "PipelineStateError",
  "begin_iteration",
  "graph_nodes",
  "mix_seed",
]


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

  stats_one_to_one: bool = False
  """Whether the op returns one element per input element (its `stats()`
  row then shows its input's element count unless it counts its own)."""

  _stats_label: str | None = None

  def __init_subclass__(cls, **kwargs: Any):
    super().__init_subclass__(**kwargs)
    op_stats.register_op_class(cls)

  def __init__(self, parents: Sequence["OpIterator"] = ()):
    self.parents: list[OpIterator] = list(parents)
    self._closed = False
    # Made here, not on first use: an attribute added to a running object
    # (or a look at its __dict__) slows every attribute access on it.
    self._stats_cell = op_stats.OpCell()

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

  # -- statistics ----------------------------------------------------------
  @property
  def stats_label(self) -> str:
    """The op's name in `stats()`: the op as the user wrote it, or the ops
    the optimizer fused into it joined by "+" (e.g. "map+filter")."""
    return self._stats_label or self.op_name

  @stats_label.setter
  def stats_label(self, value: str) -> None:
    self._stats_label = value

  def stats(self) -> dict:
    """Per-op statistics of this iterator's pipeline, inputs first.

    Returns `{"ops": [{"op", "elements", "self_seconds", "wait_seconds",
    "buffer_fill", "parallelism", ...}, ...]}`: elements returned (None when
    the op does not count them), seconds spent in the op itself (its input's
    time excluded; on all its threads), seconds its consumer waited for it,
    the mean fill of its buffer (None without one), how many elements it
    works on at once, and fields of the op's own (e.g. `errors_ignored`).
    Times are sampled (see `jaxfeed.ops.op_stats`) from the moment the
    iterator was made, unless `jaxfeed.Options(stats=False)`.
    """
    return {"ops": op_stats.op_rows(self)}

  def _stats_fields(self) -> dict:
    """This op's part of its stats row: any of "elements", "parallelism",
    "busy_seconds" (work done outside op methods, e.g. on worker threads,
    added to self_seconds) and fields of its own."""
    return {}

  def _stats_buffer_fill(self) -> float | None:
    """Ops with a buffer return its fill now (0..1), sampled into the row."""
    return None

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
    """Restores a state returned by `get_state` of an identical pipeline.

    A state of another pipeline raises PipelineStateError naming what
    differs: an op, or what `from_source` records of its sampler and source
    (see `jaxfeed.ops.state_identity`).
    """
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
    op_stats.release(self)

  def _close_own(self) -> None:
    """Subclasses with threads, processes or memory release them here."""

  def __enter__(self) -> "OpIterator":
    return self

  def __exit__(self, *exc) -> None:
    self.close()


op_stats.register_op_class(OpIterator)


def check_state(state: Any, op_name: str, num_parents: int) -> None:
  """Raises PipelineStateError unless `state` was saved by op `op_name`."""
  if not isinstance(state, dict) or "op" not in state or "parents" not in state:
    raise PipelineStateError(
      f"Cannot restore op {op_name!r}: expected a state dict from "
      f"get_state() with keys 'op', 'own', 'parents', got {_short(state)}."
    )
  if state["op"] != op_name or len(state["parents"]) != num_parents:
    raise PipelineStateError(
      f"State belongs to a different pipeline: op {op_name!r} with "
      f"{num_parents} input(s) was given the state of op {state['op']!r} "
      f"with {len(state['parents'])} input(s)."
    )


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

  stats_label: str | None = None
  """Set by the optimizer on a node it fused from several ops: their names
  joined by "+" (e.g. "map+filter"), shown by `OpIterator.stats()`."""

  def __init__(self, parents: Sequence["Node"] = ()):
    self.parents: tuple[Node, ...] = tuple(parents)

  def make_iterator(self) -> OpIterator:
    raise NotImplementedError

  def begin_iteration(self) -> None:
    """Called by `begin_iteration(graph)` before a new iteration of a graph
    holding this node; nodes whose data differ per iteration (`from_source`
    with a reshuffling sampler) count them here."""

  def spec_params(self) -> dict:
    """The keyword arguments that rebuild this node.

    `type(node)(*parent_nodes, **node.spec_params())` must build an equal node.
    Values may be callables, numpy arrays, sources or samplers; fingerprints
    hash them by content, service specs encode them.
    """
    return {}

  def local_params(self) -> dict:
    """Keyword arguments that rebuild this node in this process (with
    `spec_params`, when the optimizer rebuilds it) but stay out of
    fingerprints and service specs: a local folder, say."""
    return {}

  def cardinality(self) -> int | None:
    """Number of elements if known and finite, -1 for infinite, None unknown."""
    return None

  def close(self) -> None:
    """Releases what the node keeps for its iterators from one pass to the
    next (a fused chain's warm worker processes, see
    `jaxfeed.ops.process_batch`); the next iterator starts afresh. Most
    nodes keep nothing."""

  def fingerprint(self) -> fingerprint_lib.Fingerprint:
    """A stable hash of what this subgraph computes: op names, parents and
    params by content, UDFs by their code (see `jaxfeed.ops.fingerprint`)."""
    return fingerprint_lib.node_fingerprint(
      self.op_name, self.spec_params(), [p.fingerprint() for p in self.parents]
    )

  def __repr__(self) -> str:
    return f"{type(self).__name__}({self.op_name})"


def begin_iteration(root: Node) -> None:
  """Starts the next iteration of the graph of `root`: every node in it
  (once, however many paths reach it) gets `begin_iteration()`.

  Called when a `Dataset` is iterated again and when `repeat` starts its
  next repetition, never by iterators an op makes for its own bookkeeping,
  so every iterator of one iteration reads the same data.
  """
  for node in graph_nodes(root):
    node.begin_iteration()


def graph_nodes(root: Node) -> Iterator[Node]:
  """Every node of the graph of `root`, once however many paths reach it."""
  seen: set[int] = set()
  stack = [root]
  while stack:
    node = stack.pop()
    if id(node) in seen:
      continue
    seen.add(id(node))
    yield node
    stack.extend(node.parents)


class IterationCounter:
  """The iterations of one node: which one iterators made now read.

  `begin()` starts the next (0 first); `restored(i)` says an iterator was
  restored into iteration `i`, so the next iteration is `i + 1`, as in the
  run whose state it was.
  """

  def __init__(self):
    self._lock = threading.Lock()
    self._current = 0
    self._next = 0

  @property
  def current(self) -> int:
    return self._current

  def begin(self) -> int:
    with self._lock:
      self._current = self._next
      self._next += 1
      return self._current

  def restored(self, iteration: int) -> None:
    with self._lock:
      self._current = iteration
      self._next = iteration + 1


def callable_path(fn: Callable) -> str:
  """`module:qualname` of a callable, or its repr for lambdas and closures."""
  module = getattr(fn, "__module__", None)
  qualname = getattr(fn, "__qualname__", None)
  if module and qualname:
    return f"{module}:{qualname}"
  return repr(fn)


fingerprint_lib.register_node_class(Node)


_dataset_wrapper: Callable[[Node], Any] | None = None


def register_dataset_wrapper(wrapper: Callable[[Node], Any]) -> None:
  """Called once by the facade: how `as_dataset` wraps a node for users."""
  global _dataset_wrapper
  _dataset_wrapper = wrapper


def as_dataset(node: Node) -> Any:
  """`node` as the public Dataset, for ops that hand datasets to user code
  (group_by_window's reduce_func) without importing the facade."""
  if _dataset_wrapper is None:
    raise RuntimeError(
      "jaxfeed.dataset has not been imported; build pipelines through jaxfeed.Dataset."
    )
  return _dataset_wrapper(node)


def to_node(value: Any, op_name: str, what: str = "value") -> Node:
  """Accepts a Node or a facade `Dataset` (anything with a `.node`)."""
  if isinstance(value, Node):
    return value
  node = getattr(value, "node", None)
  if isinstance(node, Node):
    return node
  raise TypeError(
    f"{op_name}: {what} must be a jaxfeed Dataset, got {type(value).__name__}: {_short(value)}."
  )


def check_positive_int(value: Any, op_name: str, name: str, allow_zero: bool = False) -> int:
  """Validates an integer option and returns it as int."""
  ok = isinstance(value, (int, np.integer)) and not isinstance(value, bool)
  low = 0 if allow_zero else 1
  if not ok or value < low:
    raise ValueError(f"{op_name}: {name} must be an integer >= {low}, got {value!r}.")
  return int(value)


def check_count(value: Any, op_name: str, name: str = "count") -> int:
  """Validates a tf.data-style element count: an int, negative meaning 'all'."""
  if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
    raise ValueError(
      f"{op_name}: {name} must be an integer (-1 for all elements), got "
      f"{type(value).__name__}: {_short(value)}."
    )
  return int(value)


def state_int(state: Any, key: str, op_name: str, low: int = 0, high: int | None = None) -> int:
  """Reads integer `state[key]` of an own state, checking `low <= it <= high`."""
  value = state.get(key) if isinstance(state, dict) else None
  if (
    not isinstance(value, int)
    or isinstance(value, bool)
    or value < low
    or (high is not None and value > high)
  ):
    allowed = f"[{low}, {high}]" if high is not None else f">= {low}"
    raise PipelineStateError(
      f"Cannot restore op {op_name!r}: own state needs an integer {key!r} "
      f"in {allowed}, got {_short(state)}."
    )
  return value


def iterate(node: Node) -> Iterator[Any]:
  """Convenience: a fresh iterator over a node."""
  return node.make_iterator()


class InputReplay:
  """Re-reads the buffered input elements of an op from saved parent states.

  Ops that hold input elements across `next()` calls (cycles, windows,
  buckets, bins) keep their state small by not saving those elements. They
  read their parent through this object, which counts the reads and, every
  `interval` reads, remembers the parent's state (an anchor). The op's state
  names the read index of its oldest buffered element; on restore the parent
  is rewound to the newest anchor at or before that index and the elements up
  to the saved position are read again, so the op rebuilds its buffers from
  the same elements (user functions are assumed deterministic).

  Restoring costs reading the buffered span again plus at most `interval`
  elements; running costs one parent `get_state()` per `interval` reads.
  """

  def __init__(
    self,
    parent: OpIterator,
    op_name: str,
    interval: int = 64,
    oldest_needed: Callable[[], int] | None = None,
  ):
    """Records anchors of `parent`'s reads to replay them on restore.

    Args:
      parent: The iterator read from.
      op_name: The op named in restore errors.
      interval: Reads between two anchors (1: an anchor before every read).
      oldest_needed: Returns the read index of the oldest element still
        needed; anchors before it are forgotten when a new one is taken.
        None: no element is needed once the next one is read.
    """
    self.parent = parent
    self.num_read = 0
    self._op_name = op_name
    self._interval = interval
    self._oldest_needed = oldest_needed
    self._anchors: collections.deque = collections.deque()

  def read(self) -> Any:
    """The parent's next element (StopIteration at its end)."""
    anchors = self._anchors
    if not anchors or self.num_read - anchors[-1][0] >= self._interval:
      self._forget_before(self.num_read if self._oldest_needed is None else self._oldest_needed())
      anchors.append((self.num_read, self.parent.get_state()))
    element = next(self.parent)
    self.num_read += 1
    return element

  def _forget_before(self, index: int) -> None:
    anchors = self._anchors
    while len(anchors) > 1 and anchors[1][0] <= index:
      anchors.popleft()

  def get_state(self, oldest_needed: int) -> dict:
    """A state from which elements `oldest_needed ..` can be read again."""
    if oldest_needed >= self.num_read:
      return {"num_read": self.num_read}
    self._forget_before(oldest_needed)
    index, parent_state = self._anchors[0]
    return {"num_read": self.num_read, "anchor_index": index, "anchor": parent_state}

  def set_state(
    self, state: Any, first_needed: int, consume: Callable[[int, Any, int], None]
  ) -> None:
    """Re-reads elements `first_needed ..` of a saved state.

    Calls `consume(read_index, element, seed)` for each of them, in order, and
    leaves the parent where it was when this is called (the saved position).

    Raises:
      PipelineStateError: The state is malformed or the parent ends before
        the saved position (the state belongs to other data).
    """
    num_read = state_int(state, "num_read", self._op_name)
    current = None
    self._anchors.clear()
    if first_needed < num_read:
      index = state_int(state, "anchor_index", self._op_name, high=first_needed)
      anchor = state.get("anchor")
      current = self.parent.get_state()
      self.parent.set_state(anchor)
      self._anchors.append((index, anchor))
      parent = self.parent
      while index < num_read:
        try:
          element = next(parent)
        except StopIteration:
          raise PipelineStateError(
            f"Cannot restore op {self._op_name!r}: its input ended after "
            f"{index} elements while re-reading the {num_read} the state "
            f"was saved at; the state belongs to other data."
          ) from None
        if index >= first_needed:
          consume(index, element, parent.last_seed)
        index += 1
      self.parent.set_state(current)
    self.num_read = num_read
