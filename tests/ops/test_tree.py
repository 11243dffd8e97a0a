"""Pytree helpers, and that pipelines free batches without the garbage collector."""

import gc
import weakref

import numpy as np
import pytest

import jaxfeed
from jaxfeed.ops import tree

TREES = [
  np.arange(3),
  {"b": (1, [2, 3]), "a": 4},
  ({"y": 1, "x": [2, {"z": 3}]}, 5),
  [],
  {"only": {}},
]


@pytest.mark.parametrize("value", TREES)
def test_unflatten_inverts_flatten_and_keeps_key_order(value):
  leaves = tree.flatten(value)
  rebuilt = tree.unflatten(value, leaves)
  assert tree.same_structure(value, rebuilt)
  assert list(rebuilt) == list(value) if isinstance(value, dict) else True
  assert [np.asarray(x).tolist() for x in tree.flatten(rebuilt)] == [
    np.asarray(x).tolist() for x in leaves
  ]


def test_flatten_orders_dict_leaves_by_sorted_key_and_paths_name_them():
  value = {"b": (1, [2, 3]), "a": 4}
  assert tree.flatten(value) == [4, 1, 2, 3]
  assert tree.paths(value) == ["a", "b/0", "b/1/0", "b/1/1"]


def test_unflatten_leaves_no_reference_cycles():
  gc.collect()
  gc.disable()
  try:
    for _ in range(50):
      tree.unflatten({"x": [0, 0], "y": (0,)}, [np.ones(3), np.ones(2), np.ones(1)])
    assert gc.collect() == 0
  finally:
    gc.enable()


@pytest.mark.parametrize("prefetch", [False, True])
def test_batches_are_freed_as_soon_as_the_consumer_drops_them(prefetch):
  ds = jaxfeed.Dataset.from_tensor_slices({"x": np.zeros((64, 1000), np.float32)})
  ds = ds.map(lambda e: {"x": e["x"] + 1}).batch(8)
  if prefetch:
    ds = ds.prefetch(2)
  gc.collect()
  gc.disable()
  try:
    alive = []
    with ds.make_iterator() as it:
      for batch in it:
        alive.append(weakref.ref(batch["x"]))
        del batch
        # Only the prefetch buffer (and the batch being assembled) may hold any.
        assert sum(r() is not None for r in alive) <= (3 if prefetch else 0)
  finally:
    gc.enable()
