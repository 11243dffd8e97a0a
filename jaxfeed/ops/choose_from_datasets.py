"""`choose_from_datasets`: the next element of the input a choice dataset names.

tf.data's `Dataset.choose_from_datasets(datasets, choice_dataset,
stop_on_empty_dataset=True)`: `choice_dataset` yields scalar integers in
`[0, len(datasets))`; each output element is the next element of
`datasets[choice]`.

- `stop_on_empty_dataset=True`: the output ends as soon as a chosen input has
  no more elements (or the choices end).
- `stop_on_empty_dataset=False`: a choice of an exhausted input is skipped;
  the output ends when the choices end or every input is exhausted.

A choice outside the range is an error naming it. The state is the inputs'
and the choices' states plus which inputs are exhausted.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from jaxfeed.ops import base
from jaxfeed.ops import mixing

__all__ = ["ChooseFromDatasetsNode", "ChooseIterator"]

_OP = "choose_from_datasets"


class ChooseFromDatasetsNode(base.Node):
  """Elements of `datasets` in the order `choice_dataset` names them."""

  op_name = _OP

  def __init__(self, *parents: Any, stop_on_empty_dataset: bool = True):
    """Chooses from `parents[:-1]` by the choices of `parents[-1]`.

    Args:
      *parents: the nodes chosen from, then the choice dataset (last; a
        Dataset or its node).
      stop_on_empty_dataset: end at the first choice of an exhausted input.
    """
    if len(parents) < 2:
      raise ValueError(f"{_OP}: needs at least one dataset and a choice dataset.")
    nodes = mixing.check_datasets(list(parents[:-1]), _OP)
    choice = base.to_node(parents[-1], _OP, "choice_dataset")
    super().__init__(nodes + [choice])
    self.stop_on_empty_dataset = mixing.check_stop(stop_on_empty_dataset, _OP)

  def spec_params(self) -> dict:
    return {"stop_on_empty_dataset": self.stop_on_empty_dataset}

  def make_iterator(self) -> "ChooseIterator":
    inputs = [p.make_iterator() for p in self.parents[:-1]]
    return ChooseIterator(inputs, self.parents[-1].make_iterator(), self.stop_on_empty_dataset)


class ChooseIterator(mixing.MixIterator):
  """Reads the choices from the last parent."""

  op_name = _OP

  def __init__(self, inputs: list[base.OpIterator], choices: base.OpIterator, stop_on_empty: bool):
    super().__init__(inputs, choices, stop_on_empty, _OP)

  def _choose(self) -> int:
    """The next input to read (StopIteration when the choices end)."""
    value = next(self.parents[-1])
    array = np.asarray(value)
    if array.ndim != 0 or array.dtype.kind not in "iu":
      raise TypeError(
        f"{self.op_name}: choice_dataset must yield scalar integers, got {value!r:.80}."
      )
    index = int(array)
    if not 0 <= index < self._num_inputs:
      raise ValueError(
        f"{self.op_name}: choice {index} is out of range: there are "
        f"{self._num_inputs} datasets (valid choices are 0 to "
        f"{self._num_inputs - 1})."
      )
    return index
