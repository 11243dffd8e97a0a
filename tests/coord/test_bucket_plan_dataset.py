"""Tests for Dataset.from_bucket_plan / BucketPlanNode."""

from __future__ import annotations

import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np
import pytest
import tensorflow as tf

import jaxfeed
from jaxfeed.coord import BucketPlan, BucketPlanNode, RecordLengthMismatchError
from jaxfeed.ops.base import PipelineStateError, mix_seed
from jaxfeed.sampler import ShardOptions

BOUNDARIES = [8, 16, 24]
BATCH_SIZES = [8, 4, 4, 4]


def _tf_bucketed(lengths, pad_to_bucket_boundary, padding_value):
  """tf.data's bucket_by_sequence_length over records read in index order."""
  lengths_t = tf.constant(lengths, tf.int64)

  @tf.autograph.experimental.do_not_convert
  def make_record(i):
    return {"tokens": tf.fill([tf.gather(lengths_t, i)], tf.cast(i, tf.int32)), "id": i}

  @tf.autograph.experimental.do_not_convert
  def record_length(record):
    return tf.shape(record["tokens"])[0]

  ds = tf.data.Dataset.range(len(lengths)).map(make_record)
  ds = ds.bucket_by_sequence_length(
    record_length,
    BOUNDARIES,
    BATCH_SIZES,
    padding_values={"tokens": tf.constant(padding_value, tf.int32), "id": tf.constant(0, tf.int64)},
    pad_to_bucket_boundary=pad_to_bucket_boundary,
    drop_remainder=True,
  )
  return list(ds.as_numpy_iterator())


@pytest.mark.parametrize("pad_to_bucket_boundary", [False, True])
def test_single_host_unshuffled_batches_equal_tf_bucket_by_sequence_length(
  sequence_source_cls, pad_to_bucket_boundary
):
  lengths = np.random.default_rng(1).integers(1, 24, 400)
  plan = BucketPlan(lengths, BOUNDARIES, BATCH_SIZES, shuffle=False)
  ds = jaxfeed.Dataset.from_bucket_plan(
    sequence_source_cls(lengths),
    plan,
    padding_values=-1,
    pad_to_bucket_boundary=pad_to_bucket_boundary,
  )
  ours = list(ds)
  expected = _tf_bucketed(lengths, pad_to_bucket_boundary, -1)
  assert len(ours) == len(expected) == len(plan)
  for step, (mine, theirs) in enumerate(zip(ours, expected)):
    for key in ("tokens", "id"):
      assert mine[key].dtype == theirs[key].dtype, (step, key)
      np.testing.assert_array_equal(mine[key], theirs[key], err_msg=f"{step}")


@pytest.mark.parametrize("pad_to_bucket_boundary", [False, True])
def test_hosts_pad_to_the_same_length_and_stitch_into_the_global_batch(
  sequence_source_cls, make_lengths, pad_to_bucket_boundary
):
  hosts = 4
  lengths = make_lengths(2000, seed=3, high=63)
  boundaries, sizes = [16, 32, 64], [16, 8, 8, 4]
  single = BucketPlan(lengths, boundaries, sizes, seed=5)
  plans = [
    BucketPlan(lengths, boundaries, sizes, seed=5, shard_options=ShardOptions(h, hosts))
    for h in range(hosts)
  ]
  source = sequence_source_cls(lengths)
  iterators = [
    BucketPlanNode(
      source, p, padding_values=-1, pad_to_bucket_boundary=pad_to_bucket_boundary
    ).make_iterator()
    for p in plans
  ]
  whole = BucketPlanNode(
    source, single, padding_values=-1, pad_to_bucket_boundary=pad_to_bucket_boundary
  ).make_iterator()
  local_max_differs = False
  for step, expected in enumerate(whole):
    batches = [next(it) for it in iterators]
    assert len({b["tokens"].shape for b in batches}) == 1, f"step {step}"
    assert len({it.last_bucket_id for it in iterators}) == 1
    local_max = [int((b["tokens"] >= 0).sum(axis=1).max()) for b in batches]
    local_max_differs |= len(set(local_max)) > 1
    for key in ("tokens", "id"):
      np.testing.assert_array_equal(np.concatenate([b[key] for b in batches]), expected[key])
  for it in iterators:
    with pytest.raises(StopIteration):
      next(it)
  # The check above means something only if hosts' own maxima disagreed.
  assert local_max_differs


def test_batches_are_padded_records_of_the_plan(sequence_source_cls, make_lengths):
  lengths = make_lengths(500, seed=2, high=40)
  plan = BucketPlan(lengths, BOUNDARIES, BATCH_SIZES, seed=1, shard_options=ShardOptions(1, 2))
  iterator = BucketPlanNode(sequence_source_cls(lengths), plan, padding_values=-1).make_iterator()
  for step, batch in enumerate(iterator):
    bucket, records = plan[step]
    np.testing.assert_array_equal(batch["id"], records)
    assert batch["tokens"].shape == (len(records), plan.padded_length(step))
    for row, record in enumerate(records):
      n = lengths[record]
      assert (batch["tokens"][row, :n] == record).all()
      assert (batch["tokens"][row, n:] == -1).all()
    assert iterator.last_bucket_id == bucket and iterator.last_step == step
    assert iterator.last_seed == mix_seed(plan.seed, step)


@pytest.mark.parametrize("stop_after", [0, 1, 7, 40])
def test_restoring_a_saved_state_continues_identically(
  sequence_source_cls, make_lengths, stop_after
):
  lengths = make_lengths(600, seed=4, high=40)
  plan = BucketPlan(lengths, BOUNDARIES, BATCH_SIZES, seed=8, num_epochs=2)
  ds = jaxfeed.Dataset.from_bucket_plan(sequence_source_cls(lengths), plan)
  reference = list(ds)
  iterator = ds.make_iterator()
  for _ in range(stop_after):
    next(iterator)
  state = json.loads(json.dumps(iterator.get_state()))
  iterator.close()

  restored = ds.make_iterator()
  restored.set_state(state)
  rest = list(restored)
  assert len(rest) == len(reference) - stop_after
  for mine, expected in zip(rest, reference[stop_after:]):
    np.testing.assert_array_equal(mine["tokens"], expected["tokens"])
    np.testing.assert_array_equal(mine["id"], expected["id"])


def test_state_is_the_next_step(sequence_source_cls, make_lengths):
  lengths = make_lengths(300, high=40)
  plan = BucketPlan(lengths, BOUNDARIES, BATCH_SIZES)
  iterator = BucketPlanNode(sequence_source_cls(lengths), plan).make_iterator()
  for step in range(3):
    assert iterator.get_state() == {"op": "from_bucket_plan", "own": {"step": step}, "parents": []}
    next(iterator)


@pytest.mark.parametrize(
  "state",
  [
    {"op": "from_bucket_plan", "own": {"step": -1}, "parents": []},
    {"op": "from_bucket_plan", "own": {"step": 10**9}, "parents": []},
    {"op": "from_bucket_plan", "own": {"step": "3"}, "parents": []},
    {"op": "batch", "own": {"step": 1}, "parents": []},
    {"step": 3},
  ],
)
def test_foreign_or_invalid_state_raises_pipeline_state_error(
  sequence_source_cls, make_lengths, state
):
  lengths = make_lengths(300, high=40)
  plan = BucketPlan(lengths, BOUNDARIES, BATCH_SIZES)
  iterator = BucketPlanNode(sequence_source_cls(lengths), plan).make_iterator()
  with pytest.raises(PipelineStateError):
    iterator.set_state(state)


def test_source_of_another_size_than_the_length_index_raises(sequence_source_cls, make_lengths):
  lengths = make_lengths(300, high=40)
  plan = BucketPlan(lengths, BOUNDARIES, BATCH_SIZES)
  with pytest.raises(ValueError, match="300 lengths .* 299 records"):
    jaxfeed.Dataset.from_bucket_plan(sequence_source_cls(lengths[:-1]), plan)


def test_pad_to_bucket_boundary_with_records_in_the_last_bucket_raises(sequence_source_cls):
  lengths = np.arange(1, 41)
  plan = BucketPlan(lengths, BOUNDARIES, BATCH_SIZES)
  with pytest.raises(ValueError, match="last bucket boundary 24, .* length 40"):
    jaxfeed.Dataset.from_bucket_plan(
      sequence_source_cls(lengths), plan, pad_to_bucket_boundary=True
    )


def test_record_longer_than_its_length_index_entry_raises(sequence_source_cls):
  lengths = np.full(64, 5)
  stale = lengths.copy()
  stale[:] = 4  # the index under-reports every record
  plan = BucketPlan(stale, BOUNDARIES, BATCH_SIZES, shuffle=False)
  iterator = BucketPlanNode(sequence_source_cls(lengths), plan).make_iterator()
  with pytest.raises(
    RecordLengthMismatchError, match=r"record 0 feature 'tokens' .* longer than 4"
  ):
    next(iterator)


def test_plan_argument_must_be_a_bucket_plan(sequence_source_cls):
  with pytest.raises(TypeError, match="BucketPlan"):
    BucketPlanNode(sequence_source_cls([1, 2]), object())


def test_reads_through_get_many_once_per_step(sequence_source_cls, make_lengths):
  lengths = make_lengths(300, high=40)
  source = sequence_source_cls(lengths)
  plan = BucketPlan(lengths, BOUNDARIES, BATCH_SIZES)
  steps = len(list(BucketPlanNode(source, plan).make_iterator()))
  assert source.get_many_calls == steps and source.getitem_calls == 0


def test_sources_without_get_many_are_read_by_index(sequence_source_cls, make_lengths):
  lengths = make_lengths(300, high=40)
  source = sequence_source_cls(lengths, with_get_many=False)
  plan = BucketPlan(lengths, BOUNDARIES, BATCH_SIZES)
  batches = list(BucketPlanNode(source, plan).make_iterator())
  assert source.getitem_calls == sum(len(b["id"]) for b in batches) > 0


def test_padded_shapes_mark_sequence_dims_and_fix_the_others():
  rng = np.random.default_rng(0)
  lengths = rng.integers(1, 20, 200)
  records = [
    {"tokens": np.ones((n, 3), np.float32) * i, "tags": np.arange(i % 5, dtype=np.int16)}
    for i, n in enumerate(lengths)
  ]

  class Records:
    def __len__(self):
      return len(records)

    def __getitem__(self, i):
      return records[i]

  plan = BucketPlan(lengths, [10], [8, 8], seed=2)
  ds = jaxfeed.Dataset.from_bucket_plan(
    Records(),
    plan,
    padded_shapes={"tokens": [None, 4], "tags": [6]},
    padding_values={"tokens": -1.0, "tags": 7},
  )
  for step, batch in enumerate(ds):
    _, indices = plan[step]
    length = plan.padded_length(step)
    assert batch["tokens"].shape == (8, length, 4)
    assert batch["tags"].shape == (8, 6)
    for row, i in enumerate(indices):
      n = lengths[i]
      assert (batch["tokens"][row, :n, :3] == i).all()
      assert (batch["tokens"][row, n:] == -1).all()
      assert (batch["tokens"][row, :, 3] == -1).all()
      assert (batch["tags"][row, i % 5 :] == 7).all()


def test_decode_fn_turns_encoded_records_into_arrays():
  lengths = np.array([3, 5, 2, 9, 4, 4, 1, 6])
  encoded = [np.arange(n, dtype=np.int32).tobytes() for n in lengths]

  class Encoded:
    def __len__(self):
      return len(encoded)

    def get_many(self, indices):
      return [encoded[i] for i in indices]

  plan = BucketPlan(lengths, [], [4], shuffle=False)
  node = BucketPlanNode(Encoded(), plan, decode_fn=lambda b: np.frombuffer(b, np.int32))
  first, second = list(node.make_iterator())
  assert first.shape == (4, 9) and second.shape == (4, 6)
  np.testing.assert_array_equal(first[3], np.arange(9))
  np.testing.assert_array_equal(first[2], [0, 1, 0, 0, 0, 0, 0, 0, 0])


def test_cardinality_is_the_plan_length_or_infinite(sequence_source_cls, make_lengths):
  lengths = make_lengths(300, high=40)
  finite = BucketPlan(lengths, BOUNDARIES, BATCH_SIZES, num_epochs=3)
  endless = BucketPlan(lengths, BOUNDARIES, BATCH_SIZES, num_epochs=None)
  source = sequence_source_cls(lengths)
  assert jaxfeed.Dataset.from_bucket_plan(source, finite).cardinality() == len(finite)
  assert jaxfeed.Dataset.from_bucket_plan(source, endless).cardinality() == -1


def test_fingerprint_depends_on_the_plan(sequence_source_cls, make_lengths):
  lengths = make_lengths(300, high=40)
  source = sequence_source_cls(lengths)

  def fingerprint(seed):
    plan = BucketPlan(lengths, BOUNDARIES, BATCH_SIZES, seed=seed)
    return jaxfeed.Dataset.from_bucket_plan(source, plan).fingerprint()

  assert fingerprint(1) == fingerprint(1) != fingerprint(2)


def _trim_to_length(record):
  return {"tokens": record["tokens"][: int(record["length"])]}


def test_array_source_of_fixed_width_rows_is_read_through_decode_fn():
  rng = np.random.default_rng(6)
  lengths = rng.integers(1, 30, 300)
  tokens = np.zeros((300, 32), np.int32)
  for i, n in enumerate(lengths):
    tokens[i, :n] = i + 1
  source = jaxfeed.ArraySource({"tokens": tokens, "length": lengths})
  plan = BucketPlan(lengths, BOUNDARIES, BATCH_SIZES, seed=4, shard_options=ShardOptions(0, 2))
  ds = jaxfeed.Dataset(BucketPlanNode(source, plan, decode_fn=_trim_to_length))
  steps = 0
  for step, batch in enumerate(ds):
    _, records = plan[step]
    expected = tokens[records, : plan.padded_length(step)]
    np.testing.assert_array_equal(batch["tokens"], expected)
    steps += 1
  assert steps == len(plan)
