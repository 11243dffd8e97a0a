"""Tests of jaxfeed.sampler: sharding, the global shuffle, seeds and lookups."""

import itertools
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from jaxfeed.sampler import (
  IndexSampler,
  NoSharding,
  RecordMetadata,
  ShardByJaxProcess,
  ShardOptions,
)
from jaxfeed.seeding import mix_seed

NUM_EPOCHS = 3


def _epoch_orders(sampler: IndexSampler) -> list[np.ndarray]:
  """The record indices of each epoch of a finite sampler."""
  _, records, _ = sampler.get_many(np.arange(len(sampler)))
  per_epoch = sampler.records_per_epoch
  return [records[e * per_epoch : (e + 1) * per_epoch] for e in range(sampler.num_epochs)]


# -- ShardOptions -------------------------------------------------------------


@pytest.mark.parametrize(
  "index, count",
  [
    (2, 2),
    (5, 3),
    (-1, 2),
    (0, 0),
    (0, -4),
    (1.0, 2),
    ("0", 1),
    (0, 2.0),
    (True, 2),
    (None, 1),
  ],
)
def test_shard_options_rejects_bad_index_or_count(index, count):
  with pytest.raises(ValueError, match="shard_(index|count)") as info:
    ShardOptions(index, count)
  assert repr(index) in str(info.value) or repr(count) in str(info.value)


def test_shard_options_message_names_allowed_range():
  with pytest.raises(ValueError, match=r"\[0, 4\).*got 4"):
    ShardOptions(4, 4)


def test_shard_options_rejects_non_bool_drop_remainder():
  with pytest.raises(ValueError, match="drop_remainder.*'yes'"):
    ShardOptions(0, 2, drop_remainder="yes")


def test_shard_options_accepts_numpy_ints_as_python_ints():
  options = ShardOptions(np.int64(1), np.int32(3))
  assert options == ShardOptions(1, 3)
  assert type(options.shard_index) is int and type(options.shard_count) is int


def test_shard_options_is_frozen():
  options = ShardOptions(0, 2)
  with pytest.raises(AttributeError):
    options.shard_index = 1


def test_no_sharding_is_shard_zero_of_one():
  options = NoSharding()
  assert (options.shard_index, options.shard_count, options.drop_remainder) == (0, 1, False)


def test_shard_by_jax_process_uses_process_index_and_count(monkeypatch):
  import jax

  assert ShardByJaxProcess().shard_index == jax.process_index()
  monkeypatch.setattr(jax, "process_index", lambda: 2)
  monkeypatch.setattr(jax, "process_count", lambda: 4)
  options = ShardByJaxProcess(drop_remainder=True)
  assert (options.shard_index, options.shard_count, options.drop_remainder) == (2, 4, True)


# -- validation ---------------------------------------------------------------


@pytest.mark.parametrize(
  "kwargs, pattern",
  [
    ({"num_records": -1}, "num_records.*-1"),
    ({"num_records": 2.5}, "num_records.*2.5"),
    ({"num_records": "10"}, "num_records.*'10'"),
    ({"num_records": True}, "num_records.*True"),
    ({"num_records": 10, "num_epochs": 0}, "num_epochs.*0"),
    ({"num_records": 10, "num_epochs": -2}, "num_epochs.*-2"),
    ({"num_records": 10, "num_epochs": 1.5}, "num_epochs.*1.5"),
    ({"num_records": 10, "seed": 1.5}, "seed.*1.5"),
    ({"num_records": 10, "seed": "7"}, "seed.*'7'"),
    ({"num_records": 10, "seed": None}, "seed.*None"),
    ({"num_records": 10, "shuffle": "yes"}, "shuffle.*'yes'"),
    ({"num_records": 10, "shard_options": (0, 2)}, "shard_options.*tuple"),
  ],
)
def test_sampler_rejects_bad_arguments_with_clear_message(kwargs, pattern):
  num_records = kwargs.pop("num_records")
  with pytest.raises(ValueError, match=pattern):
    IndexSampler(num_records, **kwargs)


def test_sampler_accepts_shard_options_as_mapping():
  sampler = IndexSampler(10, shard_options={"shard_index": 1, "shard_count": 3})
  assert sampler.shard_options == ShardOptions(1, 3)
  with pytest.raises(ValueError, match="shard_index"):
    IndexSampler(10, shard_options={"shard_index": 3, "shard_count": 3})


# -- sharding and the global shuffle --------------------------------------------

CONFIGS = [
  (num_records, shard_count, seed, drop_remainder)
  for num_records, shard_count in itertools.product((1, 3, 7, 97, 10_000), (1, 2, 3, 8))
  for seed, drop_remainder in ((0, False), (12345, True))
] + [(10_000, 8, -3, False), (2, 8, 5, True), (0, 3, 1, False)]


@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("num_records, shard_count, seed, drop_remainder", CONFIGS)
def test_every_record_once_per_epoch_over_disjoint_shards(
  num_records, shard_count, seed, drop_remainder, shuffle
):
  samplers = [
    IndexSampler(
      num_records,
      shuffle=shuffle,
      seed=seed,
      num_epochs=NUM_EPOCHS,
      shard_options=ShardOptions(h, shard_count, drop_remainder),
    )
    for h in range(shard_count)
  ]
  orders = [_epoch_orders(s) for s in samplers]
  for h, sampler in enumerate(samplers):
    if drop_remainder:
      expected = num_records // shard_count
    else:
      expected = len(range(h, num_records, shard_count))
    assert sampler.records_per_epoch == expected
    assert len(sampler) == expected * NUM_EPOCHS
  for epoch in range(NUM_EPOCHS):
    seen = np.concatenate([o[epoch] for o in orders])
    # Shards are disjoint and together read the epoch's first positions.
    assert len(np.unique(seen)) == len(seen)
    if drop_remainder:
      assert len(seen) == shard_count * (num_records // shard_count)
    else:
      np.testing.assert_array_equal(np.sort(seen), np.arange(num_records))


@pytest.mark.parametrize("num_records, shard_count, seed, drop_remainder", CONFIGS)
def test_vectorized_lookup_equals_scalar_lookup(num_records, shard_count, seed, drop_remainder):
  for h in sorted({0, shard_count - 1}):
    sampler = IndexSampler(
      num_records,
      shuffle=True,
      seed=seed,
      num_epochs=NUM_EPOCHS,
      shard_options=ShardOptions(h, shard_count, drop_remainder),
    )
    positions = np.arange(len(sampler))
    epochs, records, seeds = sampler.get_many(positions)
    scalar = [sampler[int(k)] for k in positions]
    assert [m.position for m in scalar] == positions.tolist()
    assert [m.epoch for m in scalar] == epochs.tolist()
    assert [m.record_index for m in scalar] == records.tolist()
    assert [m.rng_seed for m in scalar] == seeds.tolist()


def test_unshuffled_shard_takes_every_shard_count_th_position():
  sampler = IndexSampler(10, num_epochs=2, shard_options=ShardOptions(1, 3))
  assert [m.record_index for m in sampler] == [1, 4, 7, 1, 4, 7]
  assert [m.epoch for m in sampler] == [0, 0, 0, 1, 1, 1]


def test_drop_remainder_gives_every_shard_the_same_length():
  lengths = [len(IndexSampler(10, shard_options=ShardOptions(h, 4, True))) for h in range(4)]
  assert lengths == [2, 2, 2, 2]
  lengths = [len(IndexSampler(10, shard_options=ShardOptions(h, 4))) for h in range(4)]
  assert lengths == [3, 3, 2, 2]


@pytest.mark.parametrize("num_records", [7, 97, 10_000])
def test_each_epoch_has_a_new_order(num_records):
  orders = _epoch_orders(IndexSampler(num_records, shuffle=True, seed=1, num_epochs=NUM_EPOCHS))
  distinct = {tuple(o.tolist()) for o in orders}
  assert len(distinct) == NUM_EPOCHS


def test_shuffle_is_global_across_shards():
  num_records, shard_count = 10_000, 8
  sampler = IndexSampler(
    num_records, shuffle=True, seed=3, shard_options=ShardOptions(0, shard_count)
  )
  records = _epoch_orders(sampler)[0]
  # Shard 0 reads from the whole index range, not from a contiguous block,
  # and already its first 100 records are spread over it.
  counts = np.bincount(records * 10 // num_records, minlength=10)
  expected = len(records) / 10
  assert np.all(counts > 0.8 * expected) and np.all(counts < 1.2 * expected)
  first = records[:100]
  assert first.max() - first.min() > num_records // 2


def test_shuffled_order_is_not_the_identity_nor_a_rotation():
  records = _epoch_orders(IndexSampler(1000, shuffle=True, seed=0))[0]
  steps = np.diff(records) % 1000
  assert len(np.unique(steps)) > 100


def test_small_shuffles_reach_every_permutation():
  orders = {tuple(_epoch_orders(IndexSampler(4, shuffle=True, seed=s))[0]) for s in range(400)}
  assert len(orders) == 24


def test_seed_changes_the_order():
  a = _epoch_orders(IndexSampler(100, shuffle=True, seed=1))[0]
  b = _epoch_orders(IndexSampler(100, shuffle=True, seed=2))[0]
  assert not np.array_equal(a, b)


def test_same_arguments_give_the_same_order():
  a = IndexSampler(1000, shuffle=True, seed=9, num_epochs=2).get_many(np.arange(2000))
  b = IndexSampler(1000, shuffle=True, seed=9, num_epochs=2).get_many(np.arange(2000))
  for x, y in zip(a, b):
    np.testing.assert_array_equal(x, y)


# (num_records, seed, num_epochs, shard_index, shard_count, drop_remainder)
_SUBPROCESS_CONFIGS = [
  (1000, 3, 1, 0, 1, False),
  (97, 11, 2, 8, 9, True),
  (10_000, -5, 3, 7, 8, False),
  (1, 0, 2, 0, 1, False),
]


def _orders_for(configs) -> list:
  out = []
  for num_records, seed, epochs, index, count, drop in configs:
    sampler = IndexSampler(
      num_records,
      shuffle=True,
      seed=seed,
      num_epochs=epochs,
      shard_options=ShardOptions(index, count, drop),
    )
    e, r, s = sampler.get_many(np.arange(len(sampler)))
    out.append([e.tolist(), r.tolist(), [str(v) for v in s.tolist()]])
  return out


def test_order_is_identical_in_another_process():
  code = (
    "import json, sys\n"
    "sys.path.insert(0, sys.argv[1])\n"
    "import test_sampler as t\n"
    "print(json.dumps(t._orders_for(t._SUBPROCESS_CONFIGS)))\n"
  )
  env = dict(os.environ, PYTHONHASHSEED="12345")
  result = subprocess.run(
    [sys.executable, "-c", code, os.path.dirname(__file__)],
    capture_output=True,
    text=True,
    env=env,
    timeout=120,
    check=True,
  )
  assert json.loads(result.stdout) == _orders_for(_SUBPROCESS_CONFIGS)


# -- seeds ----------------------------------------------------------------------


def test_rng_seed_mixes_seed_epoch_and_record_index():
  sampler = IndexSampler(50, shuffle=True, seed=77, num_epochs=2)
  epochs, records, seeds = sampler.get_many(np.arange(100))
  assert seeds.dtype == np.uint64
  assert seeds.tolist() == [mix_seed(77, e, r) for e, r in zip(epochs.tolist(), records.tolist())]
  # Every (epoch, record) gets its own seed; seed+index would collide across
  # seeds and epochs.
  assert len(set(seeds.tolist())) == 100
  other = IndexSampler(50, shuffle=True, seed=78, num_epochs=2)
  assert not set(other.get_many(np.arange(100))[2].tolist()) & set(seeds.tolist())


# -- lookups, length and bounds --------------------------------------------------


def test_getitem_returns_record_metadata():
  meta = IndexSampler(10, seed=4, num_epochs=2)[13]
  assert isinstance(meta, RecordMetadata)
  assert meta == RecordMetadata(13, 1, 3, mix_seed(4, 1, 3))


@pytest.mark.parametrize("position", [10, 11, -1, 10**15])
def test_position_past_the_end_raises_index_error(position):
  sampler = IndexSampler(5, num_epochs=2)
  with pytest.raises(IndexError, match=f"Position {position} .*\\[0, 10\\)"):
    sampler[position]
  with pytest.raises(IndexError, match=str(position)):
    sampler.get_many(np.array([0, position]))


def test_non_integer_positions_raise_type_error():
  sampler = IndexSampler(5)
  with pytest.raises(TypeError, match="integers"):
    sampler[1.5]
  with pytest.raises(TypeError, match="float"):
    sampler.get_many(np.array([0.5]))


def test_iterating_a_finite_sampler_stops_at_its_length():
  assert len(list(IndexSampler(4, num_epochs=3))) == 12


def test_endless_sampler_has_no_length_but_any_position():
  sampler = IndexSampler(10, shuffle=True, seed=2, num_epochs=None)
  assert sampler.num_positions is None
  with pytest.raises(TypeError, match="endless"):
    len(sampler)
  far = np.array([10**12, 10**12 + 1, 3 * 10**15 + 7])
  epochs, records, seeds = sampler.get_many(far)
  for k, e, r, s in zip(far.tolist(), epochs, records, seeds):
    assert sampler[k] == RecordMetadata(k, int(e), int(r), int(s))
  assert epochs.tolist() == [10**11, 10**11, 3 * 10**14]


def test_endless_sampler_of_an_empty_shard_is_empty():
  sampler = IndexSampler(2, num_epochs=None, shard_options=ShardOptions(3, 4, drop_remainder=True))
  assert sampler.num_positions == 0 and len(sampler) == 0
  with pytest.raises(IndexError):
    sampler[0]


def test_empty_sampler_handles_empty_lookups():
  sampler = IndexSampler(0, shuffle=True)
  assert len(sampler) == 0
  epochs, records, seeds = sampler.get_many(np.zeros(0, np.int64))
  assert epochs.size == records.size == seeds.size == 0


def test_get_many_keeps_shape_and_dtypes():
  sampler = IndexSampler(20, shuffle=True, num_epochs=2)
  positions = np.arange(40).reshape(5, 8)
  epochs, records, seeds = sampler.get_many(positions)
  assert epochs.shape == records.shape == seeds.shape == (5, 8)
  assert (epochs.dtype, records.dtype, seeds.dtype) == (np.int64, np.int64, np.uint64)
  assert records[4, 7] == sampler[39].record_index


def test_get_many_in_any_order_equals_scalar_lookup():
  sampler = IndexSampler(1001, shuffle=True, seed=5, num_epochs=4)
  positions = np.random.default_rng(0).permutation(len(sampler))[:500]
  _, records, _ = sampler.get_many(positions)
  assert records.tolist() == [sampler[int(k)].record_index for k in positions]


# -- identity -------------------------------------------------------------------


def test_spec_params_are_json_and_rebuild_an_equal_sampler():
  sampler = IndexSampler(
    10, shuffle=True, seed=3, num_epochs=None, shard_options=ShardOptions(1, 2, True)
  )
  params = json.loads(json.dumps(sampler.spec_params()))
  rebuilt = IndexSampler(**params)
  assert rebuilt == sampler and hash(rebuilt) == hash(sampler)
  assert repr(rebuilt) == repr(sampler)
  assert rebuilt != IndexSampler(
    10, shuffle=True, seed=4, num_epochs=None, shard_options=ShardOptions(1, 2, True)
  )


def test_repr_is_stable_and_names_every_argument():
  sampler = IndexSampler(10, shuffle=True, seed=3, num_epochs=2, shard_options=NoSharding())
  assert repr(sampler) == (
    "IndexSampler(num_records=10, shuffle=True, seed=3, num_epochs=2, "
    "shard_options=ShardOptions(shard_index=0, shard_count=1, "
    "drop_remainder=False))"
  )
