"""`sparse_batch`: batches elements of different shapes as sparse tensors
(tf.data's `Dataset.sparse_batch`).

jaxfeed has no sparse tensor type; a batch is the three parts of a
`tf.sparse.SparseTensor`, as a dict of numpy arrays:

- `"indices"`: int64 `[n, 1 + rank]`, the position of each value: its row in
  the batch, then its position in the element (row-major, element after
  element, as tf.data orders them);
- `"values"`: `[n]`, every value of every element (zeros too: the elements
  are dense, as in tf.data), in the elements' dtype;
- `"dense_shape"`: int64 `[1 + rank]`, the number of elements in the batch
  (the last batch may hold fewer) then `row_shape`, whose None dimensions are
  the largest size in the batch.

In JAX: `jax.experimental.sparse.BCOO((batch["values"], batch["indices"]),
shape=tuple(batch["dense_shape"]))`, or `.todense()` of it. Every element
must be one array (not a structure) of rank `len(row_shape)`, no larger than
`row_shape` in any dimension. Like `batch`, nothing is held between batches,
so the state is the input's.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from jaxfeed.ops import base
from jaxfeed.ops import batch

__all__ = ["SparseBatchNode", "SparseBatchIterator"]

_OP = "sparse_batch"


def _check_row_shape(row_shape: Any) -> tuple[int | None, ...]:
  dims = getattr(row_shape, "as_list", lambda: row_shape)()  # tf.TensorShape
  if isinstance(dims, np.ndarray):
    dims = dims.tolist()
  if not isinstance(dims, (list, tuple)) or any(
    not (d is None or (isinstance(d, (int, np.integer)) and not isinstance(d, bool) and d >= 0))
    for d in dims
  ):
    raise ValueError(
      f"{_OP}: row_shape must be a list of sizes (integers >= 0, or None "
      f"for the largest in each batch), got {row_shape!r}."
    )
  return tuple(None if d is None else int(d) for d in dims)


class SparseBatchNode(batch.BatchNode):
  """Sparse batches (indices, values, dense_shape) of `batch_size` elements."""

  op_name = _OP

  def __init__(self, parent: base.Node, batch_size: int, row_shape: Sequence[int | None]):
    super().__init__(parent, batch_size)
    self.row_shape = _check_row_shape(row_shape)

  def spec_params(self) -> dict:
    return {"batch_size": self.batch_size, "row_shape": list(self.row_shape)}

  def make_iterator(self) -> "SparseBatchIterator":
    return SparseBatchIterator(self.parents[0].make_iterator(), self)


class SparseBatchIterator(batch.BatchIterator):
  """Reads `batch_size` elements per `next()` and lists their values."""

  op_name = _OP
  _use_batched_reads = False

  def __init__(self, parent: base.OpIterator, node: SparseBatchNode):
    super().__init__(parent, node.batch_size, False)
    self._row_shape = node.row_shape

  def _assemble(self, elements: list) -> dict:
    arrays = [self._check(element) for element in elements]
    rank = len(self._row_shape)
    indices = [
      np.concatenate(
        [
          np.full((array.size, 1), row, np.int64),
          np.argwhere(np.ones(array.shape, bool)).astype(np.int64),
        ],
        axis=1,
      )
      for row, array in enumerate(arrays)
    ]
    dense = [len(arrays)] + [
      size if size is not None else max(a.shape[d] for a in arrays)
      for d, size in enumerate(self._row_shape)
    ]
    return {
      "indices": np.concatenate(indices).reshape(-1, rank + 1),
      "values": np.concatenate([a.reshape(-1) for a in arrays]),
      "dense_shape": np.array(dense, np.int64),
    }

  def _check(self, element: Any) -> np.ndarray:
    if isinstance(element, (dict, tuple, list)):
      raise TypeError(
        f"{_OP}: every element must be one array, got a "
        f"{type(element).__name__}; sparse_batch each component separately "
        "(e.g. map to one leaf first)."
      )
    array = np.asarray(element)
    if array.dtype.kind in "SU":  # Strings as bytes objects, as `batch` has them.
      array = np.array(
        [v.encode() if isinstance(v, str) else bytes(v) for v in array.reshape(-1).tolist()],
        dtype=object,
      ).reshape(array.shape)
    if array.ndim != len(self._row_shape) or any(
      size is not None and n > size for n, size in zip(array.shape, self._row_shape)
    ):
      problem = "rank differs from" if array.ndim != len(self._row_shape) else "is larger than"
      raise ValueError(
        f"{_OP}: an element of shape {array.shape} {problem} row_shape "
        f"{list(self._row_shape)}; elements must have rank "
        f"{len(self._row_shape)} and fit in row_shape."
      )
    return array
