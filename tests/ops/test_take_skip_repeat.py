"""Tests of take, skip and repeat against tf.data, and of their states."""

import itertools
import json

import numpy as np
import pytest

from jaxfeed.dataset import Dataset
from jaxfeed.ops.base import PipelineStateError, mix_seed
from jaxfeed.ops.repeat import RepeatNode
from jaxfeed.ops.skip import SkipNode
from jaxfeed.ops.take import TakeNode
import op_testing
from op_testing import (
  ListNode,
  assert_same_stream,
  check_resume,
  elements_and_seeds,
  graph_iterator,
)

tf = op_testing.import_tensorflow()

# Enough to see several epochs of every finite input; infinite pipelines are
# compared on this many elements.
LIMIT = 40


def _apply(dataset, ops):
  for name, arg in ops:
    dataset = getattr(dataset, name)(arg) if arg != "default" else getattr(dataset, name)()
  return dataset


def _ours(num, ops):
  return _apply(Dataset.range(num), ops)


def _theirs(num, ops):
  return _apply(tf.data.Dataset.range(num), ops)


def _assert_same_as_tf(num, ops):
  ours = list(itertools.islice(graph_iterator(_ours(num, ops)), LIMIT))
  theirs = list(_theirs(num, ops).take(LIMIT).as_numpy_iterator())
  assert [type(x) for x in ours] == [type(x) for x in theirs]
  assert [int(x) for x in ours] == [int(x) for x in theirs]
  # tf.data's cardinality is exact for these inputs, except that it reports
  # take(count < -1) as the unknown -2.
  tf_cardinality = int(_theirs(num, ops).cardinality())
  if tf_cardinality >= -1:
    assert _ours(num, ops).cardinality() == tf_cardinality


COUNTS = [-2, -1, 0, 1, 3, 5, 10]
SIZES = [0, 1, 5]


@pytest.mark.parametrize("count", COUNTS)
@pytest.mark.parametrize("num", SIZES)
def test_take_matches_tf_data(num, count):
  _assert_same_as_tf(num, [("take", count)])


@pytest.mark.parametrize("count", COUNTS)
@pytest.mark.parametrize("num", SIZES)
def test_skip_matches_tf_data(num, count):
  _assert_same_as_tf(num, [("skip", count)])


@pytest.mark.parametrize("count", ["default", None, -2, -1, 0, 1, 3])
@pytest.mark.parametrize("num", [0, 1, 3])
def test_repeat_matches_tf_data(num, count):
  _assert_same_as_tf(num, [("repeat", count)])


CHAINS = [
  (10, [("skip", 3), ("take", 5), ("repeat", 2)]),
  (10, [("repeat", 3), ("skip", 4), ("take", 13)]),
  (5, [("take", 3), ("repeat", "default"), ("take", 10)]),
  (0, [("repeat", "default"), ("take", 5)]),
  (7, [("repeat", 2), ("skip", -1)]),
  (4, [("repeat", "default"), ("skip", 6), ("take", 7)]),
  (6, [("skip", 6), ("repeat", "default")]),
  (6, [("take", 0), ("repeat", 5)]),
  (3, [("repeat", 2), ("repeat", 3)]),
  (5, [("skip", 2), ("skip", 1), ("take", 10), ("take", 1)]),
  (4, [("repeat", -1), ("take", -1), ("skip", 3), ("take", 9)]),
]


@pytest.mark.parametrize("num, ops", CHAINS)
def test_chains_match_tf_data(num, ops):
  _assert_same_as_tf(num, ops)


def _elements(iterator, limit=LIMIT):
  return [int(x) for x in itertools.islice(iterator, limit)]


@pytest.mark.parametrize(
  "num, ops",
  CHAINS[:7]
  + [
    (3, [("repeat", "default"), ("take", 8)]),
    (4, [("take", 2), ("repeat", 3), ("skip", 1)]),
  ],
)
def test_state_resumes_exactly_at_every_cut(num, ops):
  check_resume(
    lambda: _ours(num, ops), make_iterator=graph_iterator, limit=LIMIT, into_same_iterator=True
  )


def test_state_of_a_finished_repeat_restores_finished():
  iterator = graph_iterator(Dataset.range(2).repeat(2))
  assert _elements(iterator) == [0, 1, 0, 1]
  state = json.loads(json.dumps(iterator.get_state()))
  assert state["own"]["done"] is True
  fresh = graph_iterator(Dataset.range(2).repeat(2))
  fresh.set_state(state)
  assert _elements(fresh) == []
  # And back to an unfinished state from the finished iterator.
  other = graph_iterator(Dataset.range(2).repeat(2))
  next(other)
  fresh.set_state(other.get_state())
  assert _elements(fresh) == [1, 0, 1]


@pytest.mark.parametrize(
  "make, state",
  [
    (lambda: Dataset.range(10).skip(3), graph_iterator(Dataset.range(10).take(3)).get_state()),
    (
      lambda: Dataset.range(10).take(3).repeat(2),
      graph_iterator(Dataset.range(10).repeat(2).take(3)).get_state(),
    ),
    (
      lambda: Dataset.range(10).repeat(2),
      graph_iterator(Dataset.from_tensor_slices([1, 2]).repeat(2)).get_state(),
    ),
    (
      lambda: Dataset.range(10).take(3),
      {
        "op": "take",
        "own": {"taken": 4},
        "parents": [{"op": "range", "own": {"index": 0}, "parents": []}],
      },
    ),
    (
      lambda: Dataset.range(10).skip(3),
      {
        "op": "skip",
        "own": {"remaining": -1},
        "parents": [{"op": "range", "own": {"index": 0}, "parents": []}],
      },
    ),
    (
      lambda: Dataset.range(10).repeat(3),
      {
        "op": "repeat",
        "own": {"epoch": 3, "epoch_is_empty": True, "done": False},
        "parents": [{"op": "range", "own": {"index": 0}, "parents": []}],
      },
    ),
    (
      lambda: Dataset.range(10).repeat(3),
      {
        "op": "repeat",
        "own": {"epoch": 0},
        "parents": [{"op": "range", "own": {"index": 0}, "parents": []}],
      },
    ),
    (
      lambda: Dataset.range(10).repeat(3),
      {
        "op": "repeat",
        "own": {"epoch": 0, "epoch_is_empty": True, "done": True},
        "parents": [{"op": "take", "own": {"taken": 0}, "parents": []}],
      },
    ),
  ],
)
def test_foreign_or_corrupt_state_raises_pipeline_state_error(make, state):
  iterator = graph_iterator(make())
  with pytest.raises(PipelineStateError):
    iterator.set_state(state)


# -- laziness, iterator lifetime and seeds -----------------------------------------


def test_take_pulls_no_more_than_count():
  node = ListNode(range(100))
  assert list(TakeNode(node, 3).make_iterator()) == [0, 1, 2]
  assert node.pulls == 3


def test_skip_is_lazy_until_the_first_next():
  node = ListNode(range(10))
  iterator = SkipNode(node, 4).make_iterator()
  assert node.pulls == 0
  assert iterator.get_state()["own"] == {"remaining": 4}
  assert next(iterator) == 4
  assert node.pulls == 5
  assert iterator.get_state()["own"] == {"remaining": 0}


def test_skip_uses_the_fast_path_of_sources():
  iterator = graph_iterator(Dataset.range(10**15).skip(10**15 - 2))
  assert _elements(iterator) == [10**15 - 2, 10**15 - 1]


def test_repeat_makes_a_fresh_parent_iterator_per_epoch_and_closes_the_old():
  node = ListNode(range(2))
  iterator = RepeatNode(node, 3).make_iterator()
  assert list(iterator) == [0, 1] * 3
  assert len(node.made) == 3
  assert all(it._closed for it in node.made)


def test_closing_repeat_closes_the_current_parent():
  node = ListNode(range(5))
  iterator = RepeatNode(node, None).make_iterator()
  _elements(iterator, 7)
  iterator.close()
  iterator.close()  # Idempotent.
  assert all(it._closed for it in node.made)


def test_repeat_of_zero_makes_no_parent_iterator():
  node = ListNode(range(5))
  assert list(RepeatNode(node, 0).make_iterator()) == []
  assert node.made == []


@pytest.mark.parametrize("count", [None, -1, 10**12])
def test_repeat_of_an_empty_dataset_ends(count):
  node = ListNode(range(0))
  assert list(RepeatNode(node, count).make_iterator()) == []
  assert len(node.made) == 1


def test_last_seed_passes_through_take_skip_and_repeat():
  iterator = graph_iterator(Dataset.range(6).skip(1).take(3).repeat(2))
  _, seeds = elements_and_seeds(iterator)
  assert seeds == [mix_seed(0, 0, i) for i in (1, 2, 3)] * 2


# -- validation and graph properties ------------------------------------------


@pytest.mark.parametrize("node_type", [TakeNode, SkipNode, RepeatNode])
@pytest.mark.parametrize("count", ["3", 1.5, True, [1]])
def test_non_integer_counts_raise_value_error_naming_the_op(node_type, count):
  with pytest.raises(ValueError, match=f"{node_type.op_name}: count"):
    node_type(Dataset.range(3).node, count)


@pytest.mark.parametrize("node_type", [TakeNode, SkipNode, RepeatNode])
def test_input_must_be_a_dataset(node_type):
  with pytest.raises(TypeError, match=f"{node_type.op_name}: input"):
    node_type([1, 2, 3], 2)


@pytest.mark.parametrize(
  "node_type, count", [(TakeNode, 3), (SkipNode, 3), (RepeatNode, 3), (RepeatNode, None)]
)
def test_spec_params_rebuild_an_equal_node(node_type, count):
  parent = Dataset.range(5).node
  node = node_type(parent, count)
  rebuilt = node_type(parent, **json.loads(json.dumps(node.spec_params())))
  assert rebuilt.fingerprint() == node.fingerprint()
  assert node_type(parent, 4).fingerprint() != node.fingerprint()


@pytest.mark.parametrize(
  "ops, expected",
  [
    ([("repeat", "default")], -1),
    ([("repeat", "default"), ("take", 7)], 7),
    ([("repeat", "default"), ("skip", 7)], -1),
    ([("repeat", 0)], 0),
    ([("take", -1), ("repeat", 4)], 20),
    ([("skip", 2), ("repeat", 2)], 6),
  ],
)
def test_cardinality(ops, expected):
  assert _ours(5, ops).cardinality() == expected


def test_cardinality_of_an_unknown_input_stays_unknown_unless_forced():
  node = ListNode(range(5))  # cardinality() is None: unknown.
  assert TakeNode(node, 3).cardinality() is None
  assert TakeNode(node, 0).cardinality() == 0
  assert SkipNode(node, 3).cardinality() is None
  assert RepeatNode(node, 2).cardinality() is None
  assert RepeatNode(node, 0).cardinality() == 0


def test_elements_keep_their_values_and_dtypes_through_the_ops():
  data = {"x": np.arange(12, dtype=np.float16).reshape(4, 3)}
  ours = list(graph_iterator(Dataset.from_tensor_slices(data).skip(1).take(2).repeat(2)))
  theirs = list(
    tf.data.Dataset.from_tensor_slices(data).skip(1).take(2).repeat(2).as_numpy_iterator()
  )
  assert len(ours) == 4
  assert_same_stream(ours, theirs)
