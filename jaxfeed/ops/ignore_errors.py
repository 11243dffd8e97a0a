"""`ignore_errors`: drops the elements whose computation raised.

tf.data's `ignore_errors(log_warning=False)`: an exception raised while
producing an input element (a UDF that fails on it, a corrupt record) drops
that element and the input goes on with the next one. `StopIteration` still
ends the input. The number of dropped elements is in the op's `stats()` row
(`errors_ignored`) and in the state.

The ops above which this works are the ones that go on after an element's
error: `map` / `random_map` / `filter` (sequential or parallel) and
`from_source` (a record that fails to read fails alone). An op that cannot
go on after an error (e.g. a failed `interleave` cycle) raises again.
"""

from __future__ import annotations

import logging
from typing import Any

from jaxfeed.ops.base import Node, OpIterator, state_int, to_node

__all__ = ["IgnoreErrorsNode", "IgnoreErrorsIterator"]

_OP = "ignore_errors"
# A input that keeps failing without moving on (the same error forever) is
# not skipped forever: after this many errors in a row it is raised.
MAX_ERRORS_IN_A_ROW = 10_000


class IgnoreErrorsNode(Node):
  """The input's elements, without those whose production raised."""

  op_name = _OP

  def __init__(self, parent: Any, log_warning: bool = False):
    super().__init__([to_node(parent, _OP, "input")])
    if not isinstance(log_warning, bool):
      raise TypeError(f"{_OP}: log_warning must be a bool, got {log_warning!r}.")
    self.log_warning = log_warning

  def spec_params(self) -> dict:
    return {"log_warning": self.log_warning}

  def make_iterator(self) -> "IgnoreErrorsIterator":
    return IgnoreErrorsIterator(self.parents[0].make_iterator(), self.log_warning)


class IgnoreErrorsIterator(OpIterator):
  """State: the number of elements dropped so far."""

  op_name = _OP

  def __init__(self, parent: OpIterator, log_warning: bool):
    super().__init__([parent])
    self._log_warning = log_warning
    self.errors_ignored = 0

  def __next__(self) -> Any:
    in_a_row = 0
    while True:
      try:
        return next(self.parents[0])
      except StopIteration:
        raise
      except Exception as e:  # noqa: BLE001 -- dropping failed elements is the op
        self.errors_ignored += 1
        in_a_row += 1
        if self._log_warning:
          logging.warning("%s: dropped an element: %s: %s", _OP,
                          type(e).__name__, e)
        if in_a_row >= MAX_ERRORS_IN_A_ROW:
          raise RuntimeError(
              f"{_OP}: the input raised {in_a_row} times in a row without "
              "producing an element; it does not go on after errors.") from e

  def _stats_fields(self) -> dict:
    return {"errors_ignored": self.errors_ignored}

  def _get_own_state(self) -> dict:
    return {"errors_ignored": self.errors_ignored}

  def _set_own_state(self, state: dict) -> None:
    self.errors_ignored = state_int(state, "errors_ignored", _OP)
