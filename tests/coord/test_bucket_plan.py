"""Tests for jaxfeed.coord.BucketPlan: one global plan, computed per host."""

from __future__ import annotations

import numpy as np
import pytest

from jaxfeed.coord import BucketPlan
from jaxfeed.sampler import NoSharding, ShardOptions

BOUNDARIES = [16, 32, 64, 128]
BATCH_SIZES = [24, 16, 12, 8, 4]  # global sizes, divisible by 1, 2 and 4 hosts


def _lengths(n=3000, seed=0):
  rng = np.random.default_rng(seed)
  return np.clip(rng.lognormal(3.5, 0.8, n), 1, 200).astype(np.int64)


def _plans(lengths, hosts, **kwargs):
  return [
    BucketPlan(lengths, BOUNDARIES, BATCH_SIZES, shard_options=ShardOptions(h, hosts), **kwargs)
    for h in range(hosts)
  ]


def _bucket_of(lengths):
  return np.searchsorted(BOUNDARIES, lengths, side="right")


@pytest.mark.parametrize("carry", [False, True])
@pytest.mark.parametrize("hosts", [1, 2, 4])
@pytest.mark.parametrize("shuffle", [True, False])
def test_every_host_reads_the_same_bucket_at_every_step(hosts, shuffle, carry):
  lengths = _lengths()
  plans = _plans(lengths, hosts, seed=7, shuffle=shuffle, num_epochs=2, carry_remainders=carry)
  assert len({len(p) for p in plans}) == 1
  for step in range(len(plans[0])):
    buckets = {p[step][0] for p in plans}
    assert len(buckets) == 1, f"step {step}: buckets {buckets}"


@pytest.mark.parametrize("hosts", [2, 4])
def test_hosts_read_disjoint_contiguous_slices_of_the_global_batch(hosts):
  plans = _plans(_lengths(), hosts, seed=3, num_epochs=2)
  for step in range(len(plans[0])):
    bucket, global_records = plans[0].global_step(step)
    slices = [p[step][1] for p in plans]
    assert all(len(s) == BATCH_SIZES[bucket] // hosts for s in slices)
    np.testing.assert_array_equal(np.concatenate(slices), global_records)
    assert len(set(global_records.tolist())) == len(global_records)


@pytest.mark.parametrize("carry", [False, True])
@pytest.mark.parametrize("hosts", [1, 4])
@pytest.mark.parametrize("shuffle", [True, False])
def test_each_epoch_reads_every_record_once_except_the_dropped(hosts, shuffle, carry):
  lengths = _lengths()
  plans = _plans(lengths, hosts, seed=11, shuffle=shuffle, num_epochs=3, carry_remainders=carry)
  steps = plans[0].steps_per_epoch
  for epoch in range(3):
    read = np.concatenate(
      [p[s][1] for p in plans for s in range(epoch * steps, (epoch + 1) * steps)]
    )
    dropped = plans[0].dropped_per_epoch(epoch)
    assert len(dropped) == plans[0].num_dropped_per_epoch
    assert len(set(read.tolist())) == len(read), "a record read twice"
    np.testing.assert_array_equal(np.sort(np.concatenate([read, dropped])), np.arange(len(lengths)))


def test_dropped_records_are_each_buckets_remainder():
  lengths = _lengths()
  plan = BucketPlan(lengths, BOUNDARIES, BATCH_SIZES, seed=1)
  counts = np.bincount(_bucket_of(lengths), minlength=len(BATCH_SIZES))
  remainders = counts % BATCH_SIZES
  dropped = plan.dropped_per_epoch(0)
  np.testing.assert_array_equal(
    np.bincount(_bucket_of(lengths[dropped]), minlength=len(BATCH_SIZES)), remainders
  )
  assert plan.num_dropped_per_epoch == remainders.sum()
  assert plan.steps_per_epoch == (counts // BATCH_SIZES).sum()


def test_batches_hold_only_records_of_their_bucket():
  lengths = _lengths()
  plan = BucketPlan(lengths, BOUNDARIES, BATCH_SIZES, seed=5, num_epochs=2)
  for step in range(len(plan)):
    bucket, records = plan.global_step(step)
    assert len(records) == BATCH_SIZES[bucket]
    assert (_bucket_of(lengths[records]) == bucket).all()


@pytest.mark.parametrize("shuffle", [True, False])
def test_carried_remainders_join_the_next_longer_bucket(shuffle):
  lengths = _lengths()
  plan = BucketPlan(
    lengths, BOUNDARIES, BATCH_SIZES, seed=5, num_epochs=2, shuffle=shuffle, carry_remainders=True
  )
  counts = np.bincount(_bucket_of(lengths), minlength=len(BATCH_SIZES))
  carried = np.zeros(len(BATCH_SIZES), np.int64)  # into bucket b from b - 1
  for b in range(1, len(BATCH_SIZES)):
    carried[b] = (counts[b - 1] + carried[b - 1]) % BATCH_SIZES[b - 1]
  assert carried[1:].sum() > 0  # the case is exercised
  for epoch in range(2):
    from_previous = np.zeros(len(BATCH_SIZES), np.int64)
    for step in range(epoch * plan.steps_per_epoch, (epoch + 1) * plan.steps_per_epoch):
      bucket, records = plan.global_step(step)
      assert len(records) == BATCH_SIZES[bucket]
      record_buckets = _bucket_of(lengths[records])
      assert (record_buckets <= bucket).all()  # never a longer record
      from_previous[bucket] += int((record_buckets < bucket).sum())
      assert plan.max_length(step) == lengths[records].max()
    np.testing.assert_array_equal(from_previous, carried)
    dropped = plan.dropped_per_epoch(epoch)
    last = len(BATCH_SIZES) - 1
    assert len(dropped) == (counts[last] + carried[last]) % BATCH_SIZES[last]
    assert (_bucket_of(lengths[dropped]) <= last).all()
  plain = BucketPlan(lengths, BOUNDARIES, BATCH_SIZES, seed=5)
  assert plan.num_dropped_per_epoch < plain.num_dropped_per_epoch
  assert plan.fingerprint() != plain.fingerprint()


def test_same_seed_gives_the_same_plan_and_other_seeds_differ():
  lengths = _lengths()
  a = BucketPlan(lengths, BOUNDARIES, BATCH_SIZES, seed=1)
  b = BucketPlan(lengths.copy(), list(BOUNDARIES), list(BATCH_SIZES), seed=1)
  c = BucketPlan(lengths, BOUNDARIES, BATCH_SIZES, seed=2)
  same = all(a[s][0] == b[s][0] and np.array_equal(a[s][1], b[s][1]) for s in range(len(a)))
  assert same
  assert a.fingerprint() == b.fingerprint() != c.fingerprint()
  assert any(not np.array_equal(a[s][1], c[s][1]) for s in range(len(a)))


def test_epochs_are_reshuffled_and_buckets_interleave():
  plan = BucketPlan(_lengths(), BOUNDARIES, BATCH_SIZES, seed=4, num_epochs=2)
  first, second = plan.epoch_buckets(0), plan.epoch_buckets(1)
  assert not np.array_equal(first, second)
  # Interleaved: the bucket changes far more often than once per bucket.
  changes = np.count_nonzero(np.diff(first))
  assert changes > len(first) // 3
  np.testing.assert_array_equal(np.sort(first), np.sort(second))


def test_unshuffled_plan_reads_records_in_index_order_within_buckets():
  lengths = _lengths()
  plan = BucketPlan(lengths, BOUNDARIES, BATCH_SIZES, shuffle=False)
  per_bucket = {}
  for step in range(len(plan)):
    bucket, records = plan[step]
    per_bucket.setdefault(bucket, []).extend(records.tolist())
  for bucket, records in per_bucket.items():
    assert records == sorted(records)
    expected = np.flatnonzero(_bucket_of(lengths) == bucket)
    assert records == expected[: len(records)].tolist()


def test_plan_is_a_pure_function_of_the_step_so_lookups_resume_anywhere():
  lengths = _lengths()
  reference = BucketPlan(lengths, BOUNDARIES, BATCH_SIZES, seed=9, num_epochs=3)
  expected = [reference[s] for s in range(len(reference))]
  for start in [
    0,
    1,
    reference.steps_per_epoch - 1,
    reference.steps_per_epoch,
    2 * reference.steps_per_epoch + 5,
  ]:
    resumed = BucketPlan(lengths, BOUNDARIES, BATCH_SIZES, seed=9, num_epochs=3)
    for step in range(start, len(resumed)):
      bucket, records = resumed[step]
      assert bucket == expected[step][0]
      np.testing.assert_array_equal(records, expected[step][1])


def test_lookups_return_read_only_views():
  plan = BucketPlan(_lengths(), BOUNDARIES, BATCH_SIZES)
  _, records = plan[0]
  with pytest.raises(ValueError):
    records[0] = -1


def test_len_counts_all_epochs_and_endless_plans_have_none():
  lengths = _lengths()
  plan = BucketPlan(lengths, BOUNDARIES, BATCH_SIZES, num_epochs=3)
  assert len(plan) == 3 * plan.steps_per_epoch == plan.num_steps()
  endless = BucketPlan(lengths, BOUNDARIES, BATCH_SIZES, num_epochs=None)
  assert endless.num_steps() is None
  with pytest.raises(TypeError, match="endless"):
    len(endless)
  far = 50 * endless.steps_per_epoch + 3
  bucket, records = endless[far]
  assert len(records) == BATCH_SIZES[bucket]


@pytest.mark.parametrize("step", [-1, 10**9, 1.5])
def test_step_outside_the_plan_raises_index_error(step):
  plan = BucketPlan(_lengths(), BOUNDARIES, BATCH_SIZES)
  with pytest.raises(IndexError, match="out of range"):
    plan[step]


def test_padded_length_is_the_global_batch_max_or_the_bucket_boundary():
  lengths = _lengths()
  plans = _plans(lengths, 4, seed=2)
  for step in range(plans[0].steps_per_epoch):
    bucket, records = plans[0].global_step(step)
    # Each host computes the same padded length without seeing the others.
    assert {p.padded_length(step) for p in plans} == {lengths[records].max()}
    if bucket < len(BOUNDARIES):
      assert plans[0].padded_length(step, pad_to_bucket_boundary=True) == (BOUNDARIES[bucket] - 1)
    else:
      with pytest.raises(ValueError, match="last boundary"):
        plans[0].padded_length(step, pad_to_bucket_boundary=True)


def test_no_sharding_is_the_default_and_reads_whole_batches():
  lengths = _lengths()
  default = BucketPlan(lengths, BOUNDARIES, BATCH_SIZES, seed=3)
  explicit = BucketPlan(lengths, BOUNDARIES, BATCH_SIZES, seed=3, shard_options=NoSharding())
  assert default.shard_count == 1
  bucket, records = default[0]
  np.testing.assert_array_equal(records, explicit.global_step(0)[1])
  assert len(records) == BATCH_SIZES[bucket]


def test_empty_boundaries_make_one_bucket():
  plan = BucketPlan(_lengths(100), [], [10])
  assert plan.num_buckets == 1 and plan.steps_per_epoch == 10


def test_million_record_plan_builds_an_epoch():
  rng = np.random.default_rng(0)
  lengths = rng.integers(8, 512, 1_000_000)
  plan = BucketPlan(lengths, list(range(8, 513, 8)), [128] * 65, shard_options=ShardOptions(3, 4))
  bucket, records = plan[len(plan) - 1]
  assert len(records) == 32
  assert (np.searchsorted(plan.bucket_boundaries, lengths[records], side="right") == bucket).all()


# -- invalid input -----------------------------------------------------------
@pytest.mark.parametrize(
  "lengths, message",
  [
    (np.array([3, -1, 4]), "record 1 has length -1"),
    (np.zeros((2, 3), np.int64), "1-D"),
    (np.array([1.5, 2.0]), "integers"),
  ],
)
def test_bad_lengths_raise_value_error(lengths, message):
  with pytest.raises(ValueError, match=message):
    BucketPlan(lengths, [2], [1, 1])


@pytest.mark.parametrize(
  "boundaries, message",
  [
    ([32, 16, 64], "strictly increasing"),
    ([16, 16, 64], "strictly increasing"),
    ([0, 16, 64], ">= 1"),
    ([16, 2.5, 64], "integers"),
  ],
)
def test_bad_boundaries_raise_value_error(boundaries, message):
  with pytest.raises(ValueError, match=message):
    BucketPlan(_lengths(), boundaries, [4, 4, 4, 4])


@pytest.mark.parametrize(
  "batch_sizes, message",
  [
    ([8, 8, 8], "4 entries"),
    ([8, 8, 8, 8, 8], "4 entries"),
    ([8, 0, 8, 8], "integers >= 1"),
    ([8, -4, 8, 8], "integers >= 1"),
    ([8, 8, 8, True], "integers >= 1"),
  ],
)
def test_bad_batch_sizes_raise_value_error(batch_sizes, message):
  with pytest.raises(ValueError, match=message):
    BucketPlan(_lengths(), [16, 32, 64], batch_sizes)


def test_global_batch_not_divisible_by_hosts_names_size_and_host_count():
  with pytest.raises(ValueError, match=r"global batch size 10 .* 4 hosts"):
    BucketPlan(_lengths(), [16, 32], [8, 10, 4], shard_options=ShardOptions(0, 4))


@pytest.mark.parametrize(
  "kwargs, message",
  [
    ({"num_epochs": 0}, "num_epochs"),
    ({"num_epochs": 1.0}, "num_epochs"),
    ({"seed": "x"}, "seed"),
    ({"shard_options": object()}, "ShardOptions"),
  ],
)
def test_bad_options_raise(kwargs, message):
  with pytest.raises((ValueError, TypeError), match=message):
    BucketPlan(_lengths(), [16, 32], [8, 8, 4], **kwargs)


def test_plan_without_a_full_batch_raises():
  with pytest.raises(ValueError, match="no bucket holds a full global batch"):
    BucketPlan(np.arange(10), [5], [8, 8])


@pytest.mark.parametrize("epoch", [-1, 1])
def test_epoch_outside_the_plan_raises_index_error(epoch):
  plan = BucketPlan(_lengths(), BOUNDARIES, BATCH_SIZES, num_epochs=1)
  with pytest.raises(IndexError, match="epoch"):
    plan.dropped_per_epoch(epoch)
