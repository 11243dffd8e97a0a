"""`flat_map`: the elements of the dataset `fn` returns for each input element.

tf.data's `flat_map` is `interleave` with `cycle_length=1`: each nested dataset
is read to its end before the next input element is mapped. It runs on the
interleave engine, with the same state layout.
"""

from __future__ import annotations

from typing import Callable

from jaxfeed.ops import base
from jaxfeed.ops import interleave
from jaxfeed.ops import parallel

__all__ = ["FlatMapNode"]


class FlatMapNode(base.Node):
  """Concatenates the datasets `fn(element)` (fn(*element) for tuples)."""

  op_name = "flat_map"

  def __init__(self, parent: base.Node, fn: Callable):
    super().__init__([base.to_node(parent, self.op_name, "input")])
    self.fn = parallel.check_callable(fn, self.op_name)

  def spec_params(self) -> dict:
    return {"fn": self.fn}

  def cardinality(self) -> int | None:
    return 0 if self.parents[0].cardinality() == 0 else None

  def make_iterator(self) -> interleave.InterleaveIterator:
    return interleave.InterleaveIterator(
      self.parents[0].make_iterator(),
      self.fn,
      cycle_length=1,
      block_length=1,
      num_threads=None,
      deterministic=True,
      op_name=self.op_name,
    )
