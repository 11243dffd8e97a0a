"""`map`: applies a function to every element (tf.data's `Dataset.map`)."""

from __future__ import annotations

from typing import Any, Callable

from jaxfeed.ops import parallel, process_pool
from jaxfeed.ops.base import Node, OpIterator

__all__ = ["MapNode", "MapIterator"]


class MapNode(Node):
  """fn(element), or fn(*element) for tuple elements, as in tf.data.

  Args:
    parent: the input node.
    fn: the function; dict elements are passed as one argument.
    num_parallel_calls: None or 1 runs fn in the consumer's thread; an int
      > 1 or `jaxfeed.AUTOTUNE` runs it on that many threads.
    deterministic: whether parallel outputs keep the input order. With False
      each output is returned as soon as it is ready.
    batched: declares fn vectorized over a leading batch dimension; the
      optimizer may then run it once per batch when the map is followed by a
      batch. It does not change what this op computes.
    backend: "thread" runs fn on threads (numpy releases the GIL);
      "process" runs it in worker processes (for GIL-bound Python), which
      return numpy arrays through shared memory; fn travels to them by
      value (lambdas, closures and functions of a script too; one that
      cannot travel, say over a lock, runs on threads, with a log line
      saying why). Where the map sits between `range`,
      `from_tensor_slices` or `from_source` and a `batch` (with other maps
      and filters), the optimizer hands the whole chain to worker processes
      by chunks of input (`jaxfeed.ops.process_batch`); elsewhere each
      parallel call drives one process. "auto" is "thread", except that in
      such a chain with AUTOTUNE the chain runs inline, on threads or in
      processes, whichever measures fastest.
    writes_out: fn takes a keyword argument `out` (see `Dataset.map`).
  """

  op_name = "map"

  def __init__(
    self,
    parent: Node,
    fn: Callable,
    num_parallel_calls: int | None = None,
    deterministic: bool = True,
    batched: bool = False,
    backend: str = "auto",
    writes_out: bool = False,
  ):
    super().__init__([parent])
    self.fn = parallel.check_callable(fn, self.op_name)
    self.num_parallel_calls = parallel.check_num_parallel_calls(num_parallel_calls, self.op_name)
    self.deterministic = parallel.check_deterministic(deterministic, self.op_name)
    if not isinstance(batched, bool):
      raise TypeError(f"map: batched must be a bool, got {batched!r}.")
    self.batched = batched
    self.backend = parallel.check_backend(backend, self.op_name)
    self.writes_out = parallel.check_writes_out(writes_out, self.op_name)

  def make_iterator(self) -> "MapIterator":
    return MapIterator(
      self.parents[0].make_iterator(),
      self.fn,
      self.num_parallel_calls,
      self.deterministic,
      self.backend,
      self.writes_out,
    )

  def spec_params(self) -> dict:
    params = {
      "fn": self.fn,
      "num_parallel_calls": self.num_parallel_calls,
      "deterministic": self.deterministic,
      "batched": self.batched,
      "backend": self.backend,
    }
    return parallel.with_writes_out(params, self.writes_out)

  def cardinality(self) -> int | None:
    return self.parents[0].cardinality()


def _map_work(fn: Callable, writes_out: bool) -> Callable[..., Any]:
  if writes_out:

    def work_into(element: Any, seed: int, out: Any = None) -> Any:
      del seed
      if type(element) is tuple:
        return fn(*element, out=out)
      return fn(element, out=out)

    return work_into

  def work(element: Any, seed: int) -> Any:
    del seed
    return parallel.call_unpacked(fn, element)

  return work


class MapIterator(parallel.ParallelMapIterator):
  """Iterator of `MapNode`."""

  places_batches = True

  op_name = "map"

  def __init__(
    self,
    parent: OpIterator,
    fn: Callable,
    num_parallel_calls: int | None,
    deterministic: bool,
    backend: str = "auto",
    writes_out: bool = False,
  ):
    self._fn = fn
    self._pool = None
    if backend == "process":
      # Unpacks tuples itself; the executor's threads each drive a process.
      # Outside a fused chain (`process_batch`) there is no row to hand out.
      self._pool = process_pool.pool_or_threads(parallel.without_out(fn, writes_out), self.op_name)
    if self._pool is not None:
      work = self._pool
      writes_out = False
    else:
      work = _map_work(fn, writes_out)
    self._work = work
    super().__init__(parent, work, num_parallel_calls, deterministic, writes_out)

  def _apply(self, element: Any) -> Any:
    if self._pool is not None:
      return self._pool(element, 0)
    return self._work(element, 0)

  def skip_elements(self, count: int) -> int:
    """Skips up to `count` elements, without calling fn where possible."""
    return self._skip_one_to_one(count)
