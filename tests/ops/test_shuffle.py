"""The windowed `shuffle`: tf.data's multisets, mixing guarantees, resume."""

import collections
import gc
import json
import pickle
import weakref

import numpy as np
import pytest

from jaxfeed.dataset import Dataset
from jaxfeed.ops import base
from jaxfeed.seeding import mix_seed
import op_testing

tf = op_testing.import_tensorflow()


def values(ds):
  return [int(x) for x in ds]


def tf_values(ds):
  return [int(x) for x in ds.as_numpy_iterator()]


def positions(output):
  """Output position of each input element (inputs are 0..n-1)."""
  where = np.empty(len(output), np.int64)
  where[np.asarray(output, np.int64)] = np.arange(len(output))
  return where


# ---------------------------------------------------------------------------
# against tf.data
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("n", [0, 1, 20])
@pytest.mark.parametrize("buffer_size", [1, 3, 7, 20, 50])
def test_each_epoch_holds_the_elements_tf_data_yields(n, buffer_size):
  ours = values(Dataset.range(n).shuffle(buffer_size, seed=5).repeat(2))
  theirs = tf_values(tf.data.Dataset.range(n).shuffle(buffer_size, seed=5).repeat(2))
  assert len(ours) == len(theirs) == 2 * n
  assert sorted(ours[:n]) == sorted(theirs[:n]) == list(range(n))
  assert sorted(ours[n:]) == sorted(theirs[n:])


def test_dict_elements_are_shuffled_whole():
  data = {"x": np.arange(30, dtype=np.int32), "y": np.arange(30) * 10.0}
  ours = list(Dataset.from_tensor_slices(data).shuffle(8, seed=1))
  theirs = list(tf.data.Dataset.from_tensor_slices(data).shuffle(8, seed=1).as_numpy_iterator())
  pairs = sorted((int(e["x"]), float(e["y"])) for e in ours)
  assert pairs == sorted((int(e["x"]), float(e["y"])) for e in theirs)
  assert all(y == 10.0 * x for x, y in pairs)
  assert [int(e["x"]) for e in ours] != list(range(30))


def test_buffer_size_one_keeps_the_order_like_tf_data():
  ours = values(Dataset.range(15).shuffle(1, seed=3))
  assert ours == tf_values(tf.data.Dataset.range(15).shuffle(1, seed=3))
  assert ours == list(range(15))


def test_cardinality_matches_tf_data():
  assert (
    Dataset.range(17).shuffle(4).cardinality()
    == int(tf.data.Dataset.range(17).shuffle(4).cardinality())
    == 17
  )


@pytest.mark.parametrize("reshuffle", [True, False])
def test_epochs_under_repeat_reshuffle_like_tf_data(reshuffle):
  n = 30
  ours = values(Dataset.range(n).shuffle(n, seed=9, reshuffle_each_iteration=reshuffle).repeat(3))
  theirs = tf_values(
    tf.data.Dataset.range(n).shuffle(n, seed=9, reshuffle_each_iteration=reshuffle).repeat(3)
  )
  for out in (ours, theirs):
    epochs = [out[i * n : (i + 1) * n] for i in range(3)]
    assert (epochs[0] == epochs[1] == epochs[2]) is (not reshuffle)
    assert len({tuple(e) for e in epochs}) == (3 if reshuffle else 1)


# ---------------------------------------------------------------------------
# what the windowed design guarantees
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("n,buffer_size", [(50, 2), (50, 3), (50, 7), (50, 10), (49, 50)])
def test_elements_leave_within_their_own_window(n, buffer_size):
  where = positions(values(Dataset.range(n).shuffle(buffer_size, seed=11)))
  window_start = (np.arange(n) // buffer_size) * buffer_size
  assert (where >= window_start).all()
  assert (where < np.minimum(window_start + buffer_size, n)).all()
  moved = np.abs(where - np.arange(n))
  assert moved.max() <= buffer_size - 1


@pytest.mark.parametrize("buffer_size", [3, 8])
def test_no_element_moves_earlier_than_tf_data_allows(buffer_size):
  # tf.data's reservoir never emits an element more than buffer_size - 1
  # positions early; the windowed shuffle keeps that bound.
  n = 60
  ours = positions(values(Dataset.range(n).shuffle(buffer_size, seed=2)))
  theirs = positions(tf_values(tf.data.Dataset.range(n).shuffle(buffer_size, seed=2)))
  for where in (ours, theirs):
    assert (where >= np.arange(n) - (buffer_size - 1)).all()


def test_small_windows_are_actually_mixed():
  out = values(Dataset.range(80).shuffle(8, seed=4))
  windows = [out[i : i + 8] for i in range(0, 80, 8)]
  unchanged = sum(w == list(range(i * 8, i * 8 + 8)) for i, w in enumerate(windows))
  assert unchanged <= 1


def test_full_buffer_orders_are_uniform_permutations():
  # 3000 passes of 6 elements: every element at every position ~500 times.
  n, passes = 6, 3000
  ds = Dataset.range(n).shuffle(100, seed=123)
  counts = np.zeros((n, n), np.int64)
  orders = collections.Counter()
  for _ in range(passes):
    out = values(ds)
    orders[tuple(out)] += 1
    counts[np.arange(n), positions(out)] += 1
  expected = passes / n
  sigma = np.sqrt(passes * (1 / n) * (1 - 1 / n))
  assert np.abs(counts - expected).max() < 5 * sigma
  assert len(orders) > 690  # of the 720 permutations (about 709 expected)
  assert max(orders.values()) < 20  # each has probability 1/720


def test_different_seeds_give_different_orders_and_same_seed_the_same():
  runs = [values(Dataset.range(40).shuffle(40, seed=s)) for s in (1, 1, 2)]
  assert runs[0] == runs[1]
  assert runs[0] != runs[2]
  assert sorted(runs[2]) == list(range(40))


def test_unseeded_shuffles_differ():
  assert values(Dataset.range(40).shuffle(40)) != values(Dataset.range(40).shuffle(40))


@pytest.mark.parametrize("reshuffle", [True, False])
def test_passes_over_one_dataset_reshuffle_unless_disabled(reshuffle):
  ds = Dataset.range(40).shuffle(40, seed=7, reshuffle_each_iteration=reshuffle)
  first, second = values(ds), values(ds)
  assert (first != second) is reshuffle
  # A separately built equal pipeline starts with the same order.
  again = Dataset.range(40).shuffle(40, seed=7, reshuffle_each_iteration=reshuffle)
  assert values(again) == first


def _plus_one(x):
  return x + 1


def _times_two(x):
  return x * 2


def test_passes_reshuffle_when_graph_rewrites_rebuild_the_node():
  # map(f).map(g) is fused before running, which rebuilds the shuffle node.
  ds = Dataset.range(40).map(_plus_one).map(_times_two).shuffle(40, seed=7)
  first, second = values(ds), values(ds)
  assert sorted(first) == sorted(second) == [2 * (i + 1) for i in range(40)]
  assert first != second
  rebuilt = Dataset.range(40).map(_plus_one).map(_times_two).shuffle(40, seed=7)
  assert values(rebuilt) == first


def test_last_seed_is_the_seed_of_the_emitted_element():
  it = Dataset.range(20).shuffle(6, seed=1).make_iterator()
  for x in it:
    assert it.last_seed == mix_seed(0, 0, int(x))


# ---------------------------------------------------------------------------
# state
# ---------------------------------------------------------------------------
def _pipelines():
  return {
    "window_3": lambda seed: Dataset.range(10).shuffle(3, seed=seed),
    "whole_input": lambda seed: Dataset.range(10).shuffle(10, seed=seed),
    "larger_buffer": lambda seed: Dataset.range(10).shuffle(64, seed=seed),
    "shuffle_then_repeat": lambda seed: Dataset.range(7).shuffle(4, seed=seed).repeat(3),
    "repeat_then_shuffle": lambda seed: Dataset.range(7).repeat(3).shuffle(5, seed=seed),
    "dicts": lambda seed: Dataset.from_tensor_slices(
      {"a": np.arange(9), "b": np.arange(9) * 2.0}
    ).shuffle(4, seed=seed),
  }


def _as_tuple(element):
  if isinstance(element, dict):
    return tuple((k, float(v)) for k, v in sorted(element.items()))
  return int(element)


@pytest.mark.parametrize("name", sorted(_pipelines()))
@pytest.mark.parametrize("seed", [0, None])
def test_resume_at_every_cut_point_into_a_new_pipeline(name, seed):
  build = _pipelines()[name]
  ds = build(seed)
  first = ds.make_iterator()
  initial = json.loads(json.dumps(first.get_state()))
  expected = [_as_tuple(e) for e in first]
  for cut in range(len(expected) + 1):
    it = ds.make_iterator()
    it.set_state(initial)  # the first pass again (iteration 0)
    for _ in range(cut):
      next(it)
    state = json.loads(json.dumps(it.get_state()))
    restored = build(seed).make_iterator()  # as a new process would build it
    restored.set_state(state)
    assert [_as_tuple(e) for e in restored] == expected[cut:], cut


def test_restored_seed_and_iteration_carry_over_to_later_passes():
  ds = Dataset.range(12).shuffle(12)  # unseeded
  passes = [values(ds) for _ in range(3)]
  it = ds.make_iterator()  # the fourth pass
  state = json.loads(json.dumps(it.get_state()))
  fourth = values(it)
  fifth = values(ds)
  other = Dataset.range(12).shuffle(12)  # another drawn seed
  restored = other.make_iterator()
  restored.set_state(state)
  assert values(restored) == fourth
  assert values(other) == fifth
  assert len({tuple(p) for p in passes + [fourth, fifth]}) == 5


def test_state_size_does_not_grow_with_the_buffer():
  data = {"x": np.zeros((200, 1000), np.float32)}
  it = Dataset.from_tensor_slices(data).shuffle(200, seed=1).make_iterator()
  for _ in range(50):
    next(it)
  assert len(json.dumps(it.get_state())) < 500


def test_other_explicit_seed_raises_pipeline_state_error():
  it = Dataset.range(10).shuffle(4, seed=1).make_iterator()
  next(it)
  state = it.get_state()
  with pytest.raises(base.PipelineStateError, match="seed"):
    Dataset.range(10).shuffle(4, seed=2).make_iterator().set_state(state)


def test_other_buffer_size_raises_pipeline_state_error():
  state = Dataset.range(10).shuffle(4, seed=1).make_iterator().get_state()
  with pytest.raises(base.PipelineStateError, match="buffer_size"):
    Dataset.range(10).shuffle(5, seed=1).make_iterator().set_state(state)


def test_state_of_other_pipeline_raises_pipeline_state_error():
  state = Dataset.range(10).batch(2).make_iterator().get_state()
  with pytest.raises(base.PipelineStateError):
    Dataset.range(10).shuffle(4, seed=1).make_iterator().set_state(state)


@pytest.mark.parametrize(
  "corrupt",
  [
    lambda own: own.pop("offset"),
    lambda own: own.update(offset=-1),
    lambda own: own.update(window_index="1"),
    lambda own: own.update(seed=2**64),
  ],
)
def test_malformed_own_state_raises_pipeline_state_error(corrupt):
  it = Dataset.range(10).shuffle(4, seed=1).make_iterator()
  next(it)
  state = it.get_state()
  corrupt(state["own"])
  with pytest.raises(base.PipelineStateError):
    Dataset.range(10).shuffle(4, seed=1).make_iterator().set_state(state)


def test_state_past_the_end_of_other_input_raises_pipeline_state_error():
  it = Dataset.range(10).shuffle(4, seed=1).make_iterator()
  for _ in range(9):
    next(it)
  state = it.get_state()  # 1 element into the last window (2 elements)
  state["own"]["offset"] = 3
  with pytest.raises(base.PipelineStateError, match="window"):
    Dataset.range(10).shuffle(4, seed=1).make_iterator().set_state(state)


# ---------------------------------------------------------------------------
# construction
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("buffer_size", [0, -1, 2.0, None])
def test_invalid_buffer_size_raises(buffer_size):
  with pytest.raises(ValueError, match="buffer_size"):
    Dataset.range(3).shuffle(buffer_size)


@pytest.mark.parametrize("seed", [-1, 1.5, "1", 2**64])
def test_invalid_seed_raises(seed):
  with pytest.raises(ValueError, match="seed"):
    Dataset.range(3).shuffle(2, seed=seed)


def test_node_spec_params_rebuild_an_equal_node():
  node = Dataset.range(20).shuffle(20, seed=4).node
  params = node.spec_params()
  assert json.loads(json.dumps(params)) == {
    "buffer_size": 20,
    "seed": 4,
    "reshuffle_each_iteration": True,
  }
  rebuilt = Dataset(type(node)(*node.parents, **params))
  assert rebuilt.fingerprint() == node.fingerprint()
  assert values(rebuilt) != values(rebuilt)  # still reshuffles per pass
  other = Dataset.range(20).shuffle(20, seed=5)
  assert other.fingerprint() != node.fingerprint()


def test_emitted_elements_are_not_kept_alive_by_the_window():
  it = Dataset.range(10).map(lambda i: np.full(3, i)).shuffle(10, seed=1).make_iterator()
  element = next(it)
  ref = weakref.ref(element)
  del element
  gc.collect()
  assert ref() is None
  assert len(list(it)) == 9


def test_node_and_spec_params_pickle():
  ds = Dataset.range(20).shuffle(20, seed=3)
  params = pickle.loads(pickle.dumps(ds.node.spec_params()))
  assert type(params["seed"]) is int and params["seed"] == 3
  copy = Dataset(pickle.loads(pickle.dumps(ds.node)))
  assert values(copy) == values(Dataset.range(20).shuffle(20, seed=3))
