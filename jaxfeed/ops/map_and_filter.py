"""`map_and_filter`: map(fn).filter(predicate) fused into one op.

Made by the static optimizer (`jaxfeed.ops.optimize`), never by users: the
predicate runs in the same (possibly parallel) call as fn, so a parallel map
followed by an expensive filter does not serialize on the filter.
"""

from __future__ import annotations

from typing import Any, Callable

from jaxfeed.ops import parallel
from jaxfeed.ops.base import Node, OpIterator
from jaxfeed.ops.filter import predicate_result

__all__ = ["MapAndFilterNode", "MapAndFilterIterator"]


class MapAndFilterNode(Node):
  """The elements fn(x) for which predicate(fn(x)) holds."""

  op_name = "map_and_filter"

  def __init__(
    self,
    parent: Node,
    fn: Callable,
    predicate: Callable,
    num_parallel_calls: int | None = None,
    deterministic: bool = True,
  ):
    super().__init__([parent])
    self.fn = parallel.check_callable(fn, self.op_name)
    self.predicate = parallel.check_callable(predicate, self.op_name, "predicate")
    self.num_parallel_calls = parallel.check_num_parallel_calls(num_parallel_calls, self.op_name)
    self.deterministic = parallel.check_deterministic(deterministic, self.op_name)

  def make_iterator(self) -> "MapAndFilterIterator":
    return MapAndFilterIterator(
      self.parents[0].make_iterator(),
      self.fn,
      self.predicate,
      self.num_parallel_calls,
      self.deterministic,
    )

  def spec_params(self) -> dict:
    return {
      "fn": self.fn,
      "predicate": self.predicate,
      "num_parallel_calls": self.num_parallel_calls,
      "deterministic": self.deterministic,
    }


def _map_and_test(fn: Callable, predicate: Callable) -> Callable[[Any], tuple]:
  def apply(element: Any) -> tuple:
    mapped = parallel.call_unpacked(fn, element)
    keep = predicate_result(predicate, parallel.call_unpacked(predicate, mapped), "filter")
    return keep, mapped

  return apply


class MapAndFilterIterator(parallel.ParallelMapIterator):
  """Iterator of `MapAndFilterNode`."""

  op_name = "map_and_filter"
  stats_one_to_one = False

  def __init__(
    self,
    parent: OpIterator,
    fn: Callable,
    predicate: Callable,
    num_parallel_calls: int | None,
    deterministic: bool,
  ):
    apply = _map_and_test(fn, predicate)
    self._apply = apply
    super().__init__(
      parent, lambda element, seed: apply(element), num_parallel_calls, deterministic
    )
    self._kept = 0  # elements returned, for stats()

  def __next__(self) -> Any:
    while True:
      keep, mapped = super().__next__()
      if keep:
        self._kept += 1
        return mapped

  def _stats_fields(self) -> dict:
    return {**super()._stats_fields(), "elements": self._kept}
