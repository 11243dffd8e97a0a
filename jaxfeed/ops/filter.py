"""`filter`: keeps the elements a predicate accepts (tf.data's `filter`)."""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from jaxfeed.ops import parallel
from jaxfeed.ops.base import Node, OpIterator, callable_path

__all__ = ["FilterNode", "FilterIterator"]


class FilterNode(Node):
  """Elements for which predicate(element) is True.

  As in tf.data, a tuple element is unpacked into the predicate's arguments
  and the predicate must return a boolean scalar: a Python bool, a numpy
  bool or a 0-d boolean array. Anything else raises TypeError.
  """

  op_name = "filter"

  def __init__(self, parent: Node, predicate: Callable):
    super().__init__([parent])
    self.predicate = parallel.check_callable(predicate, self.op_name, "predicate")

  def make_iterator(self) -> "FilterIterator":
    return FilterIterator(self.parents[0].make_iterator(), self.predicate)

  def spec_params(self) -> dict:
    return {"predicate": self.predicate}

  def cardinality(self) -> int | None:
    return None  # tf.data reports UNKNOWN for filter, whatever its input.


def predicate_result(predicate: Callable, result: Any, op_name: str) -> bool:
  """`result` as a bool, or TypeError if it is not a boolean scalar."""
  if type(result) is bool:
    return result
  if type(result) is np.bool_:
    return bool(result)
  dtype = getattr(result, "dtype", None)
  if dtype is not None and getattr(result, "shape", None) == () and (dtype == np.bool_):
    return bool(result)
  raise TypeError(
    f"{op_name}: predicate {callable_path(predicate)} must return a bool "
    f"scalar (Python bool, numpy bool or 0-d bool array), got "
    f"{type(result).__name__}"
    + (
      f" with dtype {dtype} and shape {getattr(result, 'shape', None)}" if dtype is not None else ""
    )
    + f": {_short(result)}."
  )


def _short(value: Any, limit: int = 80) -> str:
  text = repr(value)
  return text if len(text) <= limit else text[:limit] + "..."


class FilterIterator(OpIterator):
  """Iterator of `FilterNode`; its state is its parent's."""

  op_name = "filter"

  def __init__(self, parent: OpIterator, predicate: Callable):
    super().__init__([parent])
    self._parent = parent
    self._predicate = predicate
    self._kept = 0  # elements returned, for stats()

  def __next__(self) -> Any:
    parent = self._parent
    predicate = self._predicate
    while True:
      element = next(parent)
      if type(element) is tuple:
        keep = predicate(*element)
      else:
        keep = predicate(element)
      if keep is True:
        self._kept += 1
        return element
      if keep is False:
        continue
      if type(keep) is np.bool_:
        if keep:
          self._kept += 1
          return element
        continue
      if predicate_result(predicate, keep, self.op_name):
        self._kept += 1
        return element

  def _stats_fields(self) -> dict:
    return {"elements": self._kept}
