"""`from_generator`: the elements a Python generator yields.

tf.data's `from_generator(generator, output_signature=None, args=None)`:
`generator(*args)` is called to start every iteration; leaves are turned into
numpy values (scalars as numpy scalars, as tf.data's `as_numpy_iterator`
gives them; cast to `output_signature`'s dtypes when it is given: a pytree of
numpy dtypes matching the elements).

Resume: the state is the number of elements returned. Restoring calls
`generator(*args)` again and skips that many elements, which is exact when the
generator yields the same sequence every time it is called (and costs reading
them again). A generator that can start at an offset gives `skip`:
`skip(count, *args)` returns an iterator that starts at element `count`, and
restoring uses it instead. A generator whose output depends on anything else
(time, a network, global state) cannot be resumed exactly.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

from jaxfeed.ops import parallel, tree
from jaxfeed.ops.base import Node, OpIterator, PipelineStateError, state_int

__all__ = ["GeneratorNode", "GeneratorIterator"]

_OP = "from_generator"


class GeneratorNode(Node):
  """The elements of `generator(*args)`."""

  op_name = _OP

  def __init__(
    self,
    generator: Callable,
    output_signature: Any = None,
    args: Sequence[Any] | None = None,
    skip: Callable | None = None,
  ):
    super().__init__([])
    self.generator = parallel.check_callable(generator, _OP)
    self.skip = None if skip is None else parallel.check_callable(skip, _OP)
    self.args = tuple(args) if args is not None else ()
    self.output_signature = output_signature
    if output_signature is not None:
      self._dtypes = [np.dtype(d) for d in tree.flatten(output_signature)]
    else:
      self._dtypes = None

  def spec_params(self) -> dict:
    return {
      "generator": self.generator,
      "output_signature": self.output_signature,
      "args": self.args,
      "skip": self.skip,
    }

  def make_iterator(self) -> "GeneratorIterator":
    return GeneratorIterator(self)


class GeneratorIterator(OpIterator):
  """State: the number of elements returned."""

  op_name = _OP

  def __init__(self, node: GeneratorNode):
    super().__init__([])
    self._node = node
    self._iterator = None
    self._count = 0

  def _convert(self, element: Any) -> Any:
    leaves = tree.flatten(element)
    dtypes = self._node._dtypes  # pylint: disable=protected-access
    if dtypes is None:
      return tree.unflatten(element, [np.asarray(x)[()] for x in leaves])
    if len(dtypes) != len(leaves):
      raise ValueError(
        f"{_OP}: the generator yielded {tree.structure_str(element)}, which "
        f"does not match output_signature {self._node.output_signature!r:.200}."
      )
    return tree.unflatten(element, [np.asarray(x, d)[()] for x, d in zip(leaves, dtypes)])

  def __next__(self) -> Any:
    if self._iterator is None:
      self._iterator = iter(self._node.generator(*self._node.args))
    element = next(self._iterator)
    self._count += 1
    return self._convert(element)

  def _get_own_state(self) -> dict:
    return {"count": self._count}

  def _set_own_state(self, state: dict) -> None:
    count = state_int(state, "count", _OP)
    node = self._node
    if node.skip is not None:
      self._iterator = iter(node.skip(count, *node.args))
    else:
      self._iterator = iter(node.generator(*node.args))
      for done in range(count):
        try:
          next(self._iterator)
        except StopIteration:
          raise PipelineStateError(
            f"Cannot restore op {_OP!r}: the generator ended after {done} "
            f"elements, but the state was saved after {count}; it yields "
            "something else now."
          ) from None
    self._count = count
