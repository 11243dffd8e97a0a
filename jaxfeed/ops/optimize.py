"""Static graph rewrites applied before a pipeline runs.

Every rewrite keeps the pipeline's output identical and can be switched off
through `jaxfeed.Options`. Nodes are rebuilt through the `spec_params` contract
of `base.Node` (`type(node)(*parents, **node.spec_params())`), so this module
needs no knowledge of an op's internals beyond its parameter names.

Rewrites, bottom-up over the graph:
  * noop elimination: take(-1), skip(0), repeat(1), prefetch(0) disappear;
  * filter fusion: filter(p).filter(q) -> filter(p and q);
  * map fusion: map(f).map(g) -> map(g . f) (same parallelism settings);
  * map and filter fusion: map(f).filter(p) -> one op that runs f and p in the
    same (possibly parallel) call;
  * map and batch vectorization: map(f, batched=True).batch(b) ->
    batch(b).map(f, batched=True): f runs once per batch;
  * process batching: range | from_tensor_slices | from_source ->
    (map | random_map | filter)* -> batch, with a map asking for
    backend="process" (or AUTOTUNE and picklable functions), becomes one
    `process_batch` node: worker processes compute whole batches of the
    chain (see `jaxfeed.ops.process_batch`; AUTOTUNE there picks threads
    or processes by measurement);
  * prefetch injection: prefetch(AUTOTUNE) at the end (off by default, since
    `jaxfeed.Loader` already prefetches onto the device).
"""

from __future__ import annotations

import importlib
from typing import Any, Callable

from jaxfeed.ops import base
from jaxfeed.ops import op_stats
from jaxfeed.ops.parallel import call_unpacked
from jaxfeed.ops.options import Options


class ComposedFn:
  """g . f with tf.data's tuple unpacking between the two calls."""

  def __init__(self, f: Callable, g: Callable):
    self.f, self.g = f, g
    self.__qualname__ = f"ComposedFn({base.callable_path(f)}, {base.callable_path(g)})"
    self.__module__ = __name__

  def __call__(self, *args: Any) -> Any:
    return call_unpacked(self.g, self.f(*args))


class AllOf:
  """p and q (short-circuit) over the same element."""

  def __init__(self, p: Callable, q: Callable):
    self.p, self.q = p, q
    self.__qualname__ = f"AllOf({base.callable_path(p)}, {base.callable_path(q)})"
    self.__module__ = __name__

  def __call__(self, *args: Any) -> bool:
    return bool(self.p(*args)) and bool(self.q(*args))


_NOOPS = {
  "take": lambda p: p.get("count") == -1,
  "skip": lambda p: p.get("count") == 0,
  "repeat": lambda p: p.get("count") == 1,
  "prefetch": lambda p: p.get("buffer_size") == 0,
}


def _fused(fused: base.Node, *parts: base.Node) -> base.Node:
  """Labels `fused` with the names of the nodes it replaces, for `stats()`."""
  fused.stats_label = op_stats.fuse_labels(*parts)
  return fused


def _rebuild(node: base.Node, parents: tuple, **changes: Any) -> base.Node:
  params = {**node.spec_params(), **node.local_params(), **changes}
  rebuilt = type(node)(*parents, **params)
  rebuilt.stats_label = node.stats_label
  return rebuilt


def _same_execution(a: dict, b: dict) -> bool:
  keys = ("num_parallel_calls", "deterministic", "batched", "backend")
  # A function writing into its batch row is called with the row as `out`,
  # which a composition or fusion would not pass on.
  return (
    all(a.get(k) == b.get(k) for k in keys) and not a.get("writes_out") and not b.get("writes_out")
  )


def _rewrite(node: base.Node, options: Options, memo: dict) -> base.Node:
  key = id(node)
  if key in memo:
    return memo[key]
  parents = tuple(_rewrite(p, options, memo) for p in node.parents)
  if any(new is not old for new, old in zip(parents, node.parents)):
    node = _rebuild(node, parents)
  # A rewrite can expose another (filter fusion, then map and filter fusion).
  for _ in range(16):
    rewritten = _rewrite_one(node, options)
    if rewritten is node:
      break
    node = rewritten
  memo[key] = node
  return node


def _rewrite_one(node: base.Node, options: Options) -> base.Node:
  """Applies the rewrites whose pattern ends at `node` (parents already done)."""
  op = node.op_name
  params = node.spec_params() if op in _NOOPS or op in ("map", "filter", "batch") else {}
  parent = node.parents[0] if node.parents else None
  parent_op = parent.op_name if parent is not None else None

  if options.noop_elimination and op in _NOOPS and _NOOPS[op](params):
    return parent

  if op == "filter" and parent_op == "filter" and options.filter_fusion:
    inner = parent.spec_params()
    return _fused(
      _rebuild(parent, parent.parents, predicate=AllOf(inner["predicate"], params["predicate"])),
      parent,
      node,
    )

  if op == "filter" and parent_op == "map_and_filter" and options.filter_fusion:
    inner = parent.spec_params()
    return _fused(
      _rebuild(parent, parent.parents, predicate=AllOf(inner["predicate"], params["predicate"])),
      parent,
      node,
    )

  if op == "map" and parent_op == "map" and options.map_fusion:
    inner = parent.spec_params()
    if _same_execution(inner, params):
      return _fused(
        _rebuild(parent, parent.parents, fn=ComposedFn(inner["fn"], params["fn"])), parent, node
      )

  if op == "filter" and parent_op == "map" and options.map_and_filter_fusion:
    inner = parent.spec_params()
    # map_and_filter runs on threads: a map asking for processes stays.
    if (
      not inner.get("batched") and inner.get("backend") != "process" and not inner.get("writes_out")
    ):
      fused = importlib.import_module("jaxfeed.ops.map_and_filter")
      return _fused(
        fused.MapAndFilterNode(
          parent.parents[0],
          inner["fn"],
          params["predicate"],
          num_parallel_calls=inner.get("num_parallel_calls"),
          deterministic=inner.get("deterministic", True),
        ),
        parent,
        node,
      )

  if (
    op == "batch"
    and parent_op == "map"
    and options.map_and_batch_vectorization
    and parent.spec_params().get("batched")
  ):
    inner = parent.spec_params()
    batched = _rebuild(node, (parent.parents[0],))
    return _rebuild(parent, (batched,), **{k: v for k, v in inner.items()})

  if op == "batch" and parent_op in ("map", "random_map", "filter", "map_and_filter"):
    fused = importlib.import_module("jaxfeed.ops.process_batch").fuse(node)
    if fused is not None:
      chain = fused.chain
      return _fused(fused, chain.input, *chain.stage_nodes, chain.batch_node)

  return node


def optimize(node: base.Node, options: Options | None = None) -> base.Node:
  """Returns an equivalent, rewritten graph (the input graph is unchanged).

  Args:
    node: the root of the pipeline.
    options: `jaxfeed.Options`; None means the defaults.

  Returns:
    The root of the rewritten graph (possibly `node` itself).
  """
  options = options or Options()
  if not options.optimize:
    return node
  root = _rewrite(node, options, {})
  if options.inject_prefetch and root.op_name != "prefetch":
    prefetch = importlib.import_module("jaxfeed.ops.prefetch")
    root = prefetch.PrefetchNode(root, base.AUTOTUNE)
  return root
