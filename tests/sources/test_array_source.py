"""ArraySource: rows of an in-memory pytree of arrays."""

from __future__ import annotations

import collections
import pickle

import numpy as np
import pytest

from jaxfeed.sources import ArraySource

Pair = collections.namedtuple("Pair", ["left", "right"])


def _tree(n: int = 10, seed: int = 0) -> dict:
  rng = np.random.default_rng(seed)
  return {
    "image": rng.integers(0, 255, (n, 4, 3), dtype=np.uint8),
    "label": np.arange(n, dtype=np.int32),
    "meta": (rng.normal(size=(n, 2)), [np.arange(n) * 2.5]),
    "pair": Pair(np.arange(n), np.arange(n)[::-1].copy()),
  }


def _assert_tree_equal(a, b) -> None:
  assert type(a) is type(b)
  if isinstance(a, dict):
    assert list(a) == list(b)
    for k in a:
      _assert_tree_equal(a[k], b[k])
  elif isinstance(a, (list, tuple)):
    assert len(a) == len(b)
    for x, y in zip(a, b):
      _assert_tree_equal(x, y)
  else:
    assert isinstance(a, (np.ndarray, np.generic)), type(a)
    assert a.dtype == b.dtype and a.shape == b.shape
    np.testing.assert_array_equal(a, b)


def _slice(tree, index):
  if isinstance(tree, dict):
    return {k: _slice(v, index) for k, v in tree.items()}
  if isinstance(tree, tuple) and hasattr(tree, "_fields"):
    return type(tree)(*(_slice(v, index) for v in tree))
  if isinstance(tree, (list, tuple)):
    return type(tree)(_slice(v, index) for v in tree)
  return tree[index]


@pytest.mark.parametrize("index", [0, 3, 9])
def test_getitem_returns_the_tree_sliced_at_the_index(index):
  tree = _tree()
  source = ArraySource(tree)
  assert len(source) == 10
  _assert_tree_equal(source[index], _slice(tree, index))


def test_one_dimensional_leaves_give_numpy_scalars_of_their_dtype():
  source = ArraySource({"x": np.arange(5, dtype=np.int16)})
  for record in (source[2]["x"], source.get_many([2])[0]["x"]):
    assert isinstance(record, np.generic)
    assert record.shape == () and record.dtype == np.int16 and record == 2


@pytest.mark.parametrize("data", [np.arange(6), [np.arange(6), np.ones(6)], (np.zeros((6, 2)),)])
def test_non_dict_trees_keep_their_structure(data):
  source = ArraySource(data)
  _assert_tree_equal(source[5], _slice(data, 5))
  _assert_tree_equal(source.get_many([5])[0], _slice(data, 5))


@pytest.mark.parametrize("indices", [[0], [9, 0, 4], [3, 3, 3], list(range(9, -1, -1)), []])
def test_get_many_equals_single_reads_in_requested_order(indices):
  tree = _tree()
  source = ArraySource(tree)
  got = source.get_many(np.asarray(indices, np.int64))
  assert isinstance(got, list) and len(got) == len(indices)
  for record, i in zip(got, indices):
    _assert_tree_equal(record, source[i])


@pytest.mark.parametrize("indices", [[0], [9, 0, 4, 4], list(range(10))])
def test_get_batch_stacks_the_records(indices):
  tree = _tree()
  source = ArraySource(tree)
  batch = source.get_batch(indices)
  expected = _slice(tree, np.asarray(indices))
  _assert_tree_equal(batch, expected)


@pytest.mark.parametrize("bad", [-1, 10, 100])
def test_out_of_range_indices_raise_index_error(bad):
  source = ArraySource(_tree())
  for read in (
    lambda: source[bad],
    lambda: source.get_many([1, bad]),
    lambda: source.get_batch([bad]),
  ):
    with pytest.raises(IndexError, match=f"record index {bad} .* 10 records"):
      read()


def test_leaves_of_different_lengths_raise_naming_paths_and_lengths():
  with pytest.raises(ValueError) as info:
    ArraySource({"a": np.zeros(4), "b": {"c": np.zeros((5, 2))}})
  message = str(info.value)
  assert "['a']: 4" in message and "['b']['c']: 5" in message


@pytest.mark.parametrize("data", [{}, [], {"a": {}}])
def test_tree_without_leaves_is_rejected(data):
  with pytest.raises(ValueError, match="no array leaves"):
    ArraySource(data)


def test_scalar_leaf_is_rejected_naming_it():
  with pytest.raises(ValueError, match=r"\['s'\] is a scalar"):
    ArraySource({"x": np.arange(3), "s": 5})


def test_records_are_read_only_views_and_get_batch_is_a_copy():
  data = {"x": np.arange(12).reshape(6, 2)}
  source = ArraySource(data)
  with pytest.raises(ValueError, match="read-only"):
    source[1]["x"][0] = 100
  with pytest.raises(ValueError, match="read-only"):
    source.get_many([1])[0]["x"][0] = 100
  assert source[1]["x"][0] == 2
  batch = source.get_batch([1, 2])["x"]
  batch[:] = 0
  assert source[2]["x"][1] == 5
  data["x"][0, 0] = -1  # the user's own array stays writable
  assert source[0]["x"][0] == -1


def test_array_like_leaves_are_accepted_and_lists_are_structure():
  # Like jax pytrees: lists are containers, other array-likes are leaves.
  source = ArraySource({"x": [np.arange(3), range(3)], "y": range(3)})
  _assert_tree_equal(source[2], {"x": [np.int64(2), np.int64(2)], "y": np.int64(2)})


def test_repr_is_stable_and_tracks_content():
  a = ArraySource(_tree(seed=1))
  b = ArraySource(_tree(seed=1))
  assert repr(a) == repr(b) == repr(pickle.loads(pickle.dumps(a)))
  assert "0x" not in repr(a) and "content_hash=" in repr(a)
  changed = _tree(seed=1)
  changed["label"][7] += 1
  assert repr(ArraySource(changed)) != repr(a)
  renamed = _tree(seed=1)
  renamed["labels"] = renamed.pop("label")
  assert repr(ArraySource(renamed)) != repr(a)


def test_pickled_source_reads_the_same_records():
  source = ArraySource(_tree())
  copy = pickle.loads(pickle.dumps(source))
  for i in range(10):
    _assert_tree_equal(copy[i], source[i])
  with pytest.raises(ValueError, match="read-only"):
    copy[0]["image"][0, 0] = 5


def test_spec_params_rebuild_an_equal_source():
  source = ArraySource(_tree())
  rebuilt = ArraySource(**source.spec_params())
  assert repr(rebuilt) == repr(source)
  _assert_tree_equal(rebuilt.get_batch(range(10)), source.get_batch(range(10)))


def test_object_arrays_of_bytes_are_records_too():
  data = np.array([b"a", b"bc", b""], dtype=object)
  source = ArraySource({"raw": data})
  assert source.get_many([1, 2])[0]["raw"] == b"bc"
  assert source[2]["raw"] == b""
  assert "content_hash=" in repr(source)


def test_close_and_context_manager_are_harmless():
  with ArraySource(_tree()) as source:
    source.close()
    assert len(source.get_many([1, 2])) == 2
