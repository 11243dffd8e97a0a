"""`ignore_errors`: drops the elements whose computation raised.

tf.data's `ignore_errors(log_warning=False)`: an exception raised while
producing an input element (a UDF that fails on it, a corrupt record) drops
that element and the input goes on with the next one. `StopIteration` still
ends the input. The op's `stats()` row and its state count what was dropped:
`errors_ignored` (elements), `damaged_bytes_skipped` (the bytes of damaged
record files that the dropped `CorruptRecordError`s span, where they say) and
`dead_ends`.

The ops above which this works are the ones that go on after an element's
error: `map` / `random_map` / `filter` (sequential or parallel),
`from_source` (a record that fails to read fails alone) and `from_tfrecord`
(it resumes after the damage). An input that cannot go on raises the same
error again without moving: when the same error (type and message) comes
twice in a row and the input's state did not change between the two, the
input is a dead end and ends here (as tf.data's ignore_errors ends a
TFRecordDataset at damage), with a warning, instead of being retried.
"""

from __future__ import annotations

import logging
from typing import Any

from jaxfeed.ops.base import Node, OpIterator, state_int, to_node
from jaxfeed.sources.base import CorruptRecordError

__all__ = ["IgnoreErrorsNode", "IgnoreErrorsIterator"]

_OP = "ignore_errors"
# A input that keeps failing while its state moves (each error a new one)
# is not skipped forever: after this many errors in a row it is raised.
MAX_ERRORS_IN_A_ROW = 10_000
_NO_STATE = object()  # the input's state could not be read


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
  """State: what was dropped so far, and whether the input was ended."""

  op_name = _OP

  def __init__(self, parent: OpIterator, log_warning: bool):
    super().__init__([parent])
    self._log_warning = log_warning
    self.errors_ignored = 0
    self.damaged_bytes_skipped = 0
    self.dead_ends = 0
    self._ended = False

  def __next__(self) -> Any:
    if self._ended:
      raise StopIteration
    in_a_row = 0
    previous: tuple[type, str] | None = None
    previous_state: Any = _NO_STATE
    while True:
      try:
        return next(self.parents[0])
      except StopIteration:
        raise
      except Exception as e:  # noqa: BLE001 -- dropping failed elements is the op
        in_a_row += 1
        error = (type(e), str(e))
        # The input's state is read only for an error that repeats the one
        # before it: most errors are distinct, and reading a state costs.
        state = self._input_state() if error == previous else _NO_STATE
        if state is not _NO_STATE and state == previous_state:
          self._end_dead_input(e)
          raise StopIteration from None
        previous, previous_state = error, state
        self._count(e)
        if in_a_row >= MAX_ERRORS_IN_A_ROW:
          raise RuntimeError(
            f"{_OP}: the input raised {in_a_row} times in a row without "
            "producing an element; it does not go on after errors."
          ) from e

  def _count(self, error: Exception) -> None:
    self.errors_ignored += 1
    if isinstance(error, CorruptRecordError) and error.damaged_bytes:
      self.damaged_bytes_skipped += error.damaged_bytes
    if self._log_warning:
      logging.warning("%s: dropped an element: %s: %s", _OP, type(error).__name__, error)

  def _input_state(self) -> Any:
    try:
      return self.parents[0].get_state()
    except Exception:  # noqa: BLE001 -- an input without state: not compared
      return _NO_STATE

  def _end_dead_input(self, error: Exception) -> None:
    self._ended = True
    self.dead_ends += 1
    logging.warning(
      "%s: the input raised the same error again without moving on, so it "
      "cannot go on; ending it here (%d element(s) dropped so far): %s: %s",
      _OP,
      self.errors_ignored,
      type(error).__name__,
      error,
    )

  def _stats_fields(self) -> dict:
    return {
      "errors_ignored": self.errors_ignored,
      "damaged_bytes_skipped": self.damaged_bytes_skipped,
      "dead_ends": self.dead_ends,
    }

  def _get_own_state(self) -> dict:
    return {
      "errors_ignored": self.errors_ignored,
      "damaged_bytes_skipped": self.damaged_bytes_skipped,
      "dead_ends": self.dead_ends,
      "ended": self._ended,
    }

  def _set_own_state(self, state: dict) -> None:
    self.errors_ignored = state_int(state, "errors_ignored", _OP)
    # States saved before these fields existed have none of them.
    self.damaged_bytes_skipped = (
      state_int(state, "damaged_bytes_skipped", _OP) if "damaged_bytes_skipped" in state else 0
    )
    self.dead_ends = state_int(state, "dead_ends", _OP) if "dead_ends" in state else 0
    ended = state.get("ended", False)
    if not isinstance(ended, bool):
      raise TypeError(f"{_OP}: the state's ended must be a bool, got {ended!r}.")
    self._ended = ended
