"""`get_single_element`: the only element of a dataset
(tf.data's `Dataset.get_single_element`)."""

from __future__ import annotations

from typing import Any

from jaxfeed.ops.base import OpIterator

__all__ = ["single_element"]


def single_element(iterator: OpIterator, description: str) -> Any:
  """Reads `iterator` (then closes it) and returns its one element.

  Args:
    iterator: a fresh iterator of the dataset.
    description: names the dataset in errors (its repr).

  Raises:
    ValueError: the dataset is empty or has more than one element (it is
      read up to its second element only).
  """
  with iterator:
    try:
      element = next(iterator)
    except StopIteration:
      raise ValueError(
        f"get_single_element: the dataset {description} is empty; it must have exactly one element."
      ) from None
    try:
      next(iterator)
    except StopIteration:
      return element
  raise ValueError(
    f"get_single_element: the dataset {description} has more than one "
    "element; it must have exactly one (e.g. end it with .take(1), or "
    ".batch(n) to get all its elements as one batch)."
  )
