"""`group_by_window`: windows of same-key elements, reduced to datasets (tf.data).

Each input element goes to the group of its key (`key_func(element)`, an
integer; tuples are unpacked into arguments). A group that reaches its window
size (`window_size`, or `window_size_func(key)` computed when the group
starts) becomes a window: `reduce_func(key, window)` gets the key (a numpy
int64) and a `Dataset` of the window's elements and returns a dataset, whose
elements are output before more input is read. When the input ends, the
remaining partial groups are reduced in increasing key order. This is
tf.data's `group_by_window` output for output.

State: the input's position through `InputReplay`, the key, element count and
window size of every pending group, and the open window's key, count and
reduced iterator state. Restoring reads the input again from the oldest
buffered element and keeps the last `count` elements of each key (a key's
buffered elements are always its most recent ones), so `key_func` and
`reduce_func` must be deterministic.
"""

from __future__ import annotations

import collections
import sys
from typing import Any, Callable

import numpy as np

from jaxfeed.ops import base
from jaxfeed.ops import parallel

__all__ = ["GroupByWindowNode", "GroupByWindowIterator", "WindowNode"]

_OP = "group_by_window"
_INT64 = np.iinfo(np.int64)


def _check_key(value: Any) -> int:
  if isinstance(value, np.ndarray) and value.ndim == 0:
    value = value[()]
  if (
    not isinstance(value, (int, np.integer))
    or isinstance(value, (bool, np.bool_))
    or not _INT64.min <= value <= _INT64.max
  ):
    raise TypeError(
      f"{_OP}: key_func must return an int64 scalar, got {type(value).__name__}: {value!r:.200}."
    )
  return int(value)


def _check_window_size(value: Any, key: int) -> int:
  if isinstance(value, np.ndarray) and value.ndim == 0:
    value = value[()]
  if not isinstance(value, (int, np.integer)) or isinstance(value, (bool, np.bool_)) or value <= 0:
    raise ValueError(
      f"{_OP}: window size must be an integer greater than zero, but "
      f"window_size_func returned {value!r:.200} for key {key}."
    )
  return int(value)


class WindowNode(base.Node):
  """The elements of one window (what `reduce_func` receives, wrapped)."""

  op_name = "group_by_window_window"

  def __init__(self, elements: list, seeds: list | None = None):
    super().__init__()
    self.elements = list(elements)
    self.seeds = list(seeds) if seeds is not None else [0] * len(self.elements)

  def spec_params(self) -> dict:
    return {"elements": self.elements, "seeds": self.seeds}

  def cardinality(self) -> int:
    return len(self.elements)

  def make_iterator(self) -> "_WindowIterator":
    return _WindowIterator(self.elements, self.seeds)


class _WindowIterator(base.OpIterator):
  op_name = "group_by_window_window"

  def __init__(self, elements: list, seeds: list):
    super().__init__()
    self._elements = elements
    self._seeds = seeds
    self._pos = 0

  @property
  def last_seed(self) -> int:
    return int(self._seeds[self._pos - 1]) if self._pos else 0

  def __next__(self) -> Any:
    if self._pos >= len(self._elements):
      raise StopIteration
    self._pos += 1
    return self._elements[self._pos - 1]

  def _get_own_state(self) -> dict:
    return {"pos": self._pos}

  def _set_own_state(self, state: dict) -> None:
    self._pos = base.state_int(state, "pos", self.op_name, high=len(self._elements))


class GroupByWindowNode(base.Node):
  """Groups elements by key into windows and reduces each to a dataset.

  Args:
    parent: the input node.
    key_func: element -> integer key (int64 range).
    reduce_func: (key, window Dataset) -> Dataset.
    window_size: the window size of every key; exclusive with
      `window_size_func`.
    window_size_func: key -> window size (an integer > 0).
  """

  op_name = _OP

  def __init__(
    self,
    parent: base.Node,
    key_func: Callable,
    reduce_func: Callable,
    window_size: int | None = None,
    window_size_func: Callable | None = None,
  ):
    super().__init__([base.to_node(parent, _OP, "input")])
    self.key_func = parallel.check_callable(key_func, _OP, "key_func")
    self.reduce_func = parallel.check_callable(reduce_func, _OP, "reduce_func")
    if (window_size is None) == (window_size_func is None):
      raise ValueError(
        f"{_OP}: pass exactly one of window_size and window_size_func, got "
        f"window_size={window_size!r} and "
        f"window_size_func={window_size_func!r}."
      )
    self.window_size = (
      None if window_size is None else base.check_positive_int(window_size, _OP, "window_size")
    )
    self.window_size_func = (
      None
      if window_size_func is None
      else parallel.check_callable(window_size_func, _OP, "window_size_func")
    )

  def spec_params(self) -> dict:
    return {
      "key_func": self.key_func,
      "reduce_func": self.reduce_func,
      "window_size": self.window_size,
      "window_size_func": self.window_size_func,
    }

  def cardinality(self) -> int | None:
    return 0 if self.parents[0].cardinality() == 0 else None

  def make_iterator(self) -> "GroupByWindowIterator":
    return GroupByWindowIterator(self.parents[0].make_iterator(), self)


class _Group:
  __slots__ = ("first_index", "window_size", "elements", "seeds")

  def __init__(self, first_index: int, window_size: int):
    self.first_index = first_index
    self.window_size = window_size
    self.elements: list = []
    self.seeds: list = []


class _Window:
  """The window being reduced: its key, group and reduced iterator."""

  __slots__ = ("key", "group", "iterator")

  def __init__(self, key: int, group: _Group, iterator: base.OpIterator):
    self.key = key
    self.group = group
    self.iterator = iterator


class GroupByWindowIterator(base.OpIterator):
  """Groups input elements, then returns each reduced window's elements."""

  op_name = _OP

  def __init__(self, parent: base.OpIterator, node: GroupByWindowNode):
    super().__init__([parent])
    self._key_func = node.key_func
    self._reduce_func = node.reduce_func
    self._window_size = node.window_size
    self._window_size_func = node.window_size_func
    self._groups: dict[int, _Group] = {}
    self._window: _Window | None = None
    self._end_of_input = False
    self._input = base.InputReplay(parent, _OP, oldest_needed=self._oldest_buffered)

  @property
  def last_seed(self) -> int:
    return 0 if self._window is None else self._window.iterator.last_seed

  def _oldest_buffered(self) -> int:
    indices = [g.first_index for g in self._groups.values()]
    if self._window is not None:
      indices.append(self._window.group.first_index)
    return min(indices) if indices else self._input.num_read

  def _key_of(self, element: Any) -> int:
    return _check_key(parallel.call_unpacked(self._key_func, element))

  def _window_size_of(self, key: int) -> int:
    if self._window_size is not None:
      return self._window_size
    return _check_window_size(self._window_size_func(np.int64(key)), key)

  def _reduce(self, key: int, group: _Group) -> base.OpIterator:
    window = base.as_dataset(WindowNode(group.elements, group.seeds))
    result = self._reduce_func(np.int64(key), window)
    node = base.to_node(result, _OP, "the value returned by reduce_func")
    return node.make_iterator()

  def _open_window(self, key: int, group: _Group) -> None:
    self._window = _Window(key, group, self._reduce(key, group))

  def __next__(self) -> Any:
    groups = self._groups
    while True:
      window = self._window
      if window is not None:
        try:
          return next(window.iterator)
        except StopIteration:
          window.iterator.close()
          self._window = None
      if self._end_of_input:
        if not groups:
          raise StopIteration
        key = min(groups)
        self._open_window(key, groups.pop(key))
        continue
      try:
        element = self._input.read()
      except StopIteration:
        self._end_of_input = True
        continue
      key = self._key_of(element)
      group = groups.get(key)
      if group is None:
        group = _Group(self._input.num_read - 1, self._window_size_of(key))
        groups[key] = group
      group.elements.append(element)
      group.seeds.append(self.parents[0].last_seed)
      if len(group.elements) >= group.window_size:
        del groups[key]
        self._open_window(key, group)

  # -- state -----------------------------------------------------------------
  def _get_own_state(self) -> dict:
    first = self._oldest_buffered()
    window = self._window
    return {
      "input": self._input.get_state(first),
      "first": first,
      "groups": [[key, len(g.elements), g.window_size] for key, g in sorted(self._groups.items())],
      "window": None
      if window is None
      else {
        "key": window.key,
        "count": len(window.group.elements),
        "window_size": window.group.window_size,
        "reduced": window.iterator.get_state(),
      },
      "end_of_input": self._end_of_input,
    }

  def _set_own_state(self, state: dict) -> None:
    self._close_window()
    groups = state.get("groups") if isinstance(state, dict) else None
    window = state.get("window") if isinstance(state, dict) else None
    if (
      not isinstance(groups, list)
      or not all(
        isinstance(g, list) and len(g) == 3 and all(isinstance(v, int) for v in g) and g[1] >= 1
        for g in groups
      )
      or not (window is None or isinstance(window, dict))
    ):
      raise base.PipelineStateError(
        f"Cannot restore op {_OP!r}: own state needs 'groups' as a list of "
        f"[key, count, window_size] and 'window' as None or a dict, got "
        f"{state!r:.300}."
      )
    counts = {key: (count, size) for key, count, size in groups}
    if window is not None:
      counts[base.state_int(window, "key", _OP, low=_INT64.min)] = (
        base.state_int(window, "count", _OP, low=1),
        base.state_int(window, "window_size", _OP, low=1),
      )
    first = base.state_int(state, "first", _OP)
    kept = {key: collections.deque(maxlen=count) for key, (count, _) in counts.items()}

    def consume(index: int, element: Any, seed: int) -> None:
      entries = kept.get(self._key_of(element))
      if entries is not None:
        entries.append((index, element, seed))

    self._input.set_state(state.get("input"), first if counts else sys.maxsize, consume)
    rebuilt = {}
    for key, entries in kept.items():
      count, size = counts[key]
      if len(entries) != count:
        raise base.PipelineStateError(
          f"Cannot restore op {_OP!r}: key {key} should hold {count} "
          f"elements but re-reading the input gave {len(entries)}; the "
          f"state belongs to other data."
        )
      group = _Group(entries[0][0], size)
      group.elements = [e for _, e, _ in entries]
      group.seeds = [s for _, _, s in entries]
      rebuilt[key] = group
    if window is not None:
      group = rebuilt.pop(window["key"])
      self._open_window(window["key"], group)
      self._window.iterator.set_state(window.get("reduced"))
    self._groups = rebuilt
    self._end_of_input = bool(state.get("end_of_input"))

  def _close_window(self) -> None:
    if self._window is not None:
      self._window.iterator.close()
      self._window = None

  def _close_own(self) -> None:
    self._close_window()
