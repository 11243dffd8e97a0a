"""Tests of the range op against tf.data.Dataset.range."""

import json

import numpy as np
import pytest

from jaxfeed.dataset import Dataset
from jaxfeed.ops.base import PipelineStateError, mix_seed
from jaxfeed.ops.range import RangeNode
from gil_testing import spinner_count_during
import op_testing
from op_testing import assert_same_element, assert_same_stream, check_next_batch, check_resume

tf = op_testing.import_tensorflow()

ARGS = [
  (5,),
  (0,),
  (1,),
  (-3,),
  (2, 7),
  (7, 2),
  (3, 3),
  (0, 10, 3),
  (0, 9, 3),
  (10, 0, -3),
  (5, -3, -2),
  (-5, 5, 4),
  (1, 0, -1),
  (0, 1, 5),
  (-2, -8, -1),
  (10**12, 10**12 + 30, 7),
  (0, 10**15, 10**14),
]
DTYPES = [None, np.int32, np.int64, np.float32, np.float64]
TF_DTYPES = {
  None: tf.int64,
  np.int32: tf.int32,
  np.int64: tf.int64,
  np.float32: tf.float32,
  np.float64: tf.float64,
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("args", ARGS)
def test_range_matches_tf_data(args, dtype):
  ours = Dataset.range(*args, dtype=dtype)
  theirs = tf.data.Dataset.range(*args, output_type=TF_DTYPES[dtype])
  assert_same_stream(ours, theirs.as_numpy_iterator())
  assert ours.cardinality() == int(theirs.cardinality())


def test_range_accepts_keywords_and_tf_dtypes():
  node = RangeNode(start=2, stop=9, step=3, dtype=tf.int32)
  assert list(node.make_iterator()) == [2, 5, 8]
  assert node.dtype == np.int32


def test_spec_params_rebuild_an_equal_range():
  node = RangeNode(10, 0, -3, dtype="float32")
  params = json.loads(json.dumps(node.spec_params()))
  rebuilt = RangeNode(**params)
  assert rebuilt.fingerprint() == node.fingerprint()
  assert_same_stream(rebuilt.make_iterator(), node.make_iterator())
  assert RangeNode(10, 0, -2).fingerprint() != node.fingerprint()


@pytest.mark.parametrize(
  "args, kwargs, error, pattern",
  [
    ((0, 5, 0), {}, ValueError, "step must be a non-zero"),
    ((), {}, TypeError, "stop"),
    ((1, 2, 3, 4), {}, TypeError, "4 arguments"),
    ((1.5,), {}, ValueError, "stop must be an integer.*1.5"),
    (("3",), {}, ValueError, "stop must be an integer.*'3'"),
    ((0, True), {}, ValueError, "stop must be an integer.*True"),
    ((3,), {"stop": 4}, TypeError, "positionally or by keyword"),
    ((3,), {"dtype": "nonsense"}, ValueError, "dtype.*nonsense"),
    ((3,), {"dtype": np.bool_}, ValueError, "integer or floating.*bool"),
  ],
)
def test_bad_arguments_raise_clear_errors(args, kwargs, error, pattern):
  with pytest.raises(error, match=pattern):
    RangeNode(*args, **kwargs)


def test_step_zero_is_rejected_by_tf_too():
  with pytest.raises(tf.errors.InvalidArgumentError):
    list(tf.data.Dataset.range(0, 5, 0))


@pytest.mark.parametrize("args", [(7,), (10, -4, -3), (0,)])
def test_state_resumes_exactly_at_every_cut(args):
  resumed = check_resume(lambda: Dataset.range(*args), into_same_iterator=True)
  assert [state["own"] for state in resumed.states] == [
    {"index": cut} for cut in range(len(resumed.expected) + 1)
  ]


def test_last_seed_is_the_default_sampler_seed_of_the_index():
  iterator = Dataset.range(5, 15).make_iterator()
  seeds = []
  for _ in range(10):
    next(iterator)
    seeds.append(iterator.last_seed)
  assert seeds == [mix_seed(0, 0, i) for i in range(10)]


def test_skip_elements_moves_the_index_without_yielding():
  iterator = Dataset.range(10).make_iterator()
  assert iterator.skip_elements(4) == 4
  assert next(iterator) == 4
  assert iterator.skip_elements(100) == 5
  assert list(iterator) == []


@pytest.mark.parametrize(
  "state",
  [
    {"op": "take", "own": {"taken": 0}, "parents": []},
    {"op": "range", "own": {"index": 11}, "parents": []},
    {"op": "range", "own": {"index": -1}, "parents": []},
    {"op": "range", "own": {"position": 1}, "parents": []},
    {"op": "range", "own": {"index": 1}, "parents": [{}]},
    "not a state",
  ],
)
def test_foreign_or_corrupt_state_raises_pipeline_state_error(state):
  iterator = Dataset.range(10).make_iterator()
  with pytest.raises(PipelineStateError):
    iterator.set_state(state)


# ---------------------------------------------------------------------------
# the batched-read protocol (next_batch) and the chunked element-wise reads
# ---------------------------------------------------------------------------
NEXT_BATCH_CASES = [
  ((1000,), None),
  ((10, -4, -3), np.int32),
  ((0, 10**15, 10**14), np.float32),
  ((120, 135, 5), np.int8),  # wraps around like tf.data
  ((-3, 300, 7), np.uint8),
  ((2**53 + 1, 2**53 + 40, 3), np.float32),
  ((2**63, 2**63 + 3), np.uint64),  # beyond int64: built one by one
  ((600,), np.float16),
  ((0,), None),
]


@pytest.mark.parametrize("args, dtype", NEXT_BATCH_CASES)
@pytest.mark.parametrize("sizes", [[1], [7], [256], [1000], [3, 0, 0, 300, 0, 5]])
def test_next_batch_equals_stacked_next_calls_with_seeds_and_state(args, dtype, sizes):
  check_next_batch(
    lambda: RangeNode(*args, dtype=dtype).make_iterator(), sizes, same_element=assert_same_element
  )


def test_next_batch_of_an_unrepresentable_element_fails_like_next():
  plain = RangeNode(2**63 - 2, 2**63 + 2).make_iterator()
  assert [next(plain), next(plain)] == [2**63 - 2, 2**63 - 1]
  with pytest.raises(OverflowError):
    next(plain)
  assert plain.get_state()["own"] == {"index": 3}  # Counts as read.
  fast = RangeNode(2**63 - 2, 2**63 + 2).make_iterator()
  with pytest.raises(OverflowError):
    fast.next_batch(4)
  assert fast.get_state() == plain.get_state()


@pytest.mark.parametrize("cut", [0, 1, 255, 256, 257, 700, 999, 1000])
def test_restore_inside_and_outside_the_current_chunk(cut):
  full = list(Dataset.range(1000).node.make_iterator())
  iterator = Dataset.range(1000).node.make_iterator()
  for _ in range(300):
    next(iterator)  # Leaves a chunk of computed values behind.
  iterator.set_state({"op": "range", "own": {"index": cut}, "parents": []})
  assert list(iterator) == full[cut:]
  assert iterator.last_seed == mix_seed(0, 0, 999)


def test_batch_of_a_range_reads_with_next_batch_and_equals_tf_data():
  ours = list(Dataset.range(3, 2000, 2).batch(64, drop_remainder=True))
  theirs = list(
    tf.data.Dataset.range(3, 2000, 2).batch(64, drop_remainder=True).as_numpy_iterator()
  )
  assert_same_stream(ours, theirs)


@pytest.mark.parametrize("args,dtype", [((300_000,), None), ((7, 900_000, 3), np.float32)])
def test_element_wise_reads_keep_the_gil(args, dtype):
  # np.arange per chunk handed the GIL over every 256 elements: a thread
  # waiting for it (the stats' sampler after each sleep) then woke at every
  # hand-over and lost the race, which slowed the read by 5-25%.
  iterator = RangeNode(*args, dtype=dtype).make_iterator()
  got = []
  assert spinner_count_during(lambda: got.extend(iterator)) < 100
  np.testing.assert_array_equal(np.asarray(got), np.arange(*args).astype(dtype or np.int64))
