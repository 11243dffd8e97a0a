"""What `choose_from_datasets` and `sample_from_datasets` share: reading the
input each choice names, skipping or stopping at exhausted inputs, and the
state of that."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from jaxfeed.ops import base

__all__ = ["MixIterator", "check_datasets", "check_stop"]


def check_datasets(datasets: Any, op_name: str) -> list[base.Node]:
  """The nodes of a non-empty list or tuple of datasets."""
  if (
    isinstance(datasets, dict)
    or not isinstance(datasets, Sequence)
    or isinstance(datasets, (str, bytes))
  ):
    raise TypeError(
      f"{op_name}: datasets must be a non-empty list or tuple of "
      f"jaxfeed Datasets, got {type(datasets).__name__}."
    )
  if not datasets:
    raise ValueError(f"{op_name}: datasets must not be empty.")
  return [base.to_node(d, op_name, f"datasets[{i}]") for i, d in enumerate(datasets)]


def check_stop(value: Any, op_name: str) -> bool:
  if not isinstance(value, (bool, np.bool_)):
    raise TypeError(f"{op_name}: stop_on_empty_dataset must be a bool, got {value!r}.")
  return bool(value)


class MixIterator(base.OpIterator):
  """Reads the input each choice names; subclasses make the choices.

  Parents: the inputs, then (for `choose_from_datasets`) the choice iterator.
  """

  def __init__(
    self,
    inputs: list[base.OpIterator],
    choices: base.OpIterator | None,
    stop_on_empty: bool,
    op_name: str,
  ):
    super().__init__(inputs + ([choices] if choices is not None else []))
    self.op_name = op_name
    self._num_inputs = len(inputs)
    self._stop_on_empty = stop_on_empty
    self._exhausted = [False] * len(inputs)
    self._ended = False
    self._last = 0  # the input the last element came from

  @property
  def last_seed(self) -> int:
    seed = self.parents[self._last].last_seed
    # Distinct seeds when one dataset is mixed in twice.
    return seed if self._last == 0 else base.mix_seed(seed, self._last)

  def _choose(self) -> int:
    """The next input to read (StopIteration when the choices end)."""
    raise NotImplementedError

  def __next__(self) -> Any:
    while not self._ended:
      try:
        index = self._choose()
      except StopIteration:
        self._ended = True
        break
      if self._exhausted[index]:
        continue
      try:
        element = next(self.parents[index])
      except StopIteration:
        self._exhausted[index] = True
        if self._stop_on_empty or all(self._exhausted):
          self._ended = True
        continue
      self._last = index
      return element
    raise StopIteration

  def _get_own_state(self) -> dict:
    return {"exhausted": list(self._exhausted), "ended": self._ended, "last": self._last}

  def _set_own_state(self, state: dict) -> None:
    exhausted = state.get("exhausted")
    ended = state.get("ended")
    if (
      not isinstance(exhausted, list)
      or len(exhausted) != self._num_inputs
      or not all(isinstance(e, bool) for e in exhausted)
      or not isinstance(ended, bool)
    ):
      raise base.PipelineStateError(
        f"Cannot restore op {self.op_name!r}: own state needs 'exhausted' (a "
        f"list of {self._num_inputs} bools) and 'ended' (a bool), got "
        f"{state!r:.200}."
      )
    self._exhausted = list(exhausted)
    self._ended = ended
    self._last = base.state_int(state, "last", self.op_name, high=self._num_inputs - 1)
