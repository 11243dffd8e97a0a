"""`repeat`: a dataset's elements `count` times over (tf.data.Dataset.repeat)."""

from __future__ import annotations

from typing import Any

from jaxfeed.ops.base import (
  Node,
  OpIterator,
  PipelineStateError,
  begin_iteration,
  check_count,
  check_state,
  state_int,
  to_node,
)

_OP = "repeat"


class RepeatNode(Node):
  """`parent` repeated `count` times; None or a negative count: forever.

  Each repetition (epoch) iterates a fresh iterator of `parent`, its next
  iteration: as in tf.data, a shuffled `IndexSampler` (or `shuffle`) under
  the repeat gives each repetition its own order. As in tf.data, repeating
  forever ends when an epoch yields no element; so does a finite repeat,
  instead of cycling through empty epochs.
  """

  op_name = _OP

  def __init__(self, parent: Any, count: int | None = None):
    super().__init__([to_node(parent, _OP, "input")])
    self.count = -1 if count is None else check_count(count, _OP)
    if self.count < 0:
      self.count = -1

  def spec_params(self) -> dict:
    return {"count": None if self.count < 0 else self.count}

  def cardinality(self) -> int | None:
    parent = self.parents[0].cardinality()
    if self.count == 0 or parent == 0:
      return 0
    if parent is None:
      return None
    if self.count < 0 or parent == -1:
      return -1
    return parent * self.count

  def make_iterator(self) -> "RepeatIterator":
    return RepeatIterator(self.parents[0], self.count)

  def __repr__(self) -> str:
    return f"RepeatNode(count={None if self.count < 0 else self.count})"


class RepeatIterator(OpIterator):
  """Iterates `parent` epoch after epoch.

  State: the epoch, whether it has yielded an element yet, whether the
  repeat is over, and the state of the current epoch's parent iterator.
  """

  op_name = _OP

  def __init__(self, parent_node: Node, count: int):
    self._parent_node = parent_node
    self._count = count
    self._epoch = 0
    self._epoch_is_empty = True
    self._done = count == 0
    # A finished repeat keeps the final state of its closed parent.
    self._final_parent_state: dict | None = None
    super().__init__([] if self._done else [parent_node.make_iterator()])

  def __next__(self) -> Any:
    while not self._done:
      try:
        element = next(self.parents[0])
      except StopIteration:
        self._end_epoch()
        continue
      self._epoch_is_empty = False
      return element
    raise StopIteration

  def _end_epoch(self) -> None:
    parent = self.parents[0]
    epoch = self._epoch + 1
    if self._epoch_is_empty or (self._count >= 0 and epoch >= self._count):
      self._final_parent_state = parent.get_state()
      self._done = True
      parent.close()
      return
    parent.close()
    begin_iteration(self._parent_node)
    self.parents[0] = self._parent_node.make_iterator()
    self._epoch = epoch
    self._epoch_is_empty = True

  def get_state(self) -> dict:
    if self._done and self.parents:
      parents = [self._final_parent_state]
    else:
      parents = [p.get_state() for p in self.parents]
    return {"op": self.op_name, "own": self._get_own_state(), "parents": parents}

  def set_state(self, state: dict) -> None:
    check_state(state, self.op_name, len(self.parents))
    own = state["own"]
    epoch = state_int(own, "epoch", _OP, 0, None if self._count < 0 else max(self._count - 1, 0))
    done, epoch_is_empty = own.get("done"), own.get("epoch_is_empty")
    if not isinstance(done, bool) or not isinstance(epoch_is_empty, bool):
      raise PipelineStateError(
        f"Cannot restore op {_OP!r}: own state needs booleans 'done' and "
        f"'epoch_is_empty', got {own!r}."
      )
    if self.parents:
      parent, parent_state = self.parents[0], state["parents"][0]
      if done:
        check_state(parent_state, parent.op_name, len(parent.parents))
        parent.close()
        self._final_parent_state = parent_state
      else:
        if self._done:  # The finished epoch's parent is closed: start anew.
          self.parents[0] = parent = self._parent_node.make_iterator()
        parent.set_state(parent_state)
    self._epoch, self._epoch_is_empty, self._done = epoch, epoch_is_empty, done

  def _get_own_state(self) -> dict:
    return {"epoch": self._epoch, "epoch_is_empty": self._epoch_is_empty, "done": self._done}
