"""Tests of `IndexSampler(replacement=True)`: sampling with replacement."""

import math

import numpy as np
import pytest

import jaxfeed
from jaxfeed.resharded_sampler import ReshardedSampler
from jaxfeed.sampler import IndexSampler, ShardOptions
from jaxfeed.sampler_replacement import draw_record, draw_records
from jaxfeed.seeding import mix_seed


def _records(sampler: IndexSampler) -> np.ndarray:
  return sampler.get_many(np.arange(len(sampler)))[1]


def test_same_arguments_give_the_same_draws_and_other_seeds_other_draws():
  first = _records(IndexSampler(500, seed=3, num_epochs=2, replacement=True))
  again = _records(IndexSampler(500, seed=3, num_epochs=2, replacement=True))
  other = _records(IndexSampler(500, seed=4, num_epochs=2, replacement=True))
  np.testing.assert_array_equal(first, again)
  assert (first != other).mean() > 0.9
  # Each epoch draws anew.
  assert (first[:500] != first[500:]).mean() > 0.9


@pytest.mark.parametrize("num_records", [1, 2, 7, 1000, 2**40 + 3, 2**62 + 1])
def test_vectorized_draws_equal_scalar_draws_and_stay_in_range(num_records):
  epochs = np.repeat(np.arange(3), 200)
  positions = np.tile(np.arange(200), 3) * 7919
  vector = draw_records(11, epochs, positions, num_records)
  scalar = [draw_record(11, int(e), int(g), num_records) for e, g in zip(epochs, positions)]
  np.testing.assert_array_equal(vector, scalar)
  assert vector.dtype == np.int64
  assert vector.min() >= 0 and vector.max() < num_records


def test_random_access_equals_sequential_iteration():
  sampler = IndexSampler(97, seed=5, num_epochs=3, replacement=True)
  sequential = [meta for meta in sampler]
  assert len(sequential) == 3 * 97
  rng = np.random.default_rng(0)
  for position in rng.permutation(len(sampler)):
    assert sampler[int(position)] == sequential[position]
  epochs, records, seeds = sampler.get_many(np.arange(len(sampler))[::-1])
  assert [int(r) for r in records[::-1]] == [m.record_index for m in sequential]
  assert [int(s) for s in seeds[::-1]] == [mix_seed(5, m.epoch, m.record_index) for m in sequential]
  # A pipeline reads the records the sampler draws, in its order.
  source = jaxfeed.ArraySource({"x": np.arange(97) * 10})
  read = [int(e["x"]) for e in jaxfeed.Dataset.from_source(source, sampler)]
  assert read == [10 * m.record_index for m in sequential]


def test_an_epoch_reads_about_one_minus_one_over_e_of_the_records():
  n = 200_000
  records = _records(IndexSampler(n, seed=1, replacement=True))
  distinct = np.unique(records).size / n
  assert abs(distinct - (1 - 1 / math.e)) < 0.005, distinct
  counts = np.bincount(records, minlength=n)
  # Poisson(1): P(k) = e^-1 / k!; the draws spread evenly over the records.
  for k in range(4):
    expected = math.exp(-1) / math.factorial(k)
    assert abs((counts == k).mean() - expected) < 0.005, (k, (counts == k).mean())
  halves = np.bincount(records * 2 // n, minlength=2) / n
  assert abs(halves[0] - 0.5) < 0.01


@pytest.mark.parametrize("drop_remainder", [False, True])
def test_host_shards_take_disjoint_positions_that_cover_the_epoch(drop_remainder):
  n, hosts = 1001, 4
  whole = IndexSampler(n, seed=9, num_epochs=2, replacement=True)
  seen: dict[tuple[int, int], int] = {}
  for h in range(hosts):
    shard = IndexSampler(
      n,
      seed=9,
      num_epochs=2,
      replacement=True,
      shard_options=ShardOptions(h, hosts, drop_remainder),
    )
    for k, meta in enumerate(shard):
      local = k % shard.records_per_epoch
      global_position = h + local * hosts
      key = (meta.epoch, global_position)
      assert key not in seen
      seen[key] = meta.record_index
      # The shards together read the epoch one host reads.
      assert meta.record_index == whole[meta.epoch * n + global_position].record_index
  per_epoch = n - n % hosts if drop_remainder else n
  assert sorted(seen) == [(e, g) for e in range(2) for g in range(per_epoch)]


def test_a_pipeline_resumes_from_a_saved_position():
  source = jaxfeed.ArraySource({"x": np.arange(50)})

  def make():
    sampler = IndexSampler(50, seed=2, num_epochs=2, replacement=True)
    return jaxfeed.Dataset.from_source(source, sampler).batch(4).make_iterator()

  with make() as iterator:
    whole = [b["x"].tolist() for b in iterator]
  with make() as iterator:
    head = [next(iterator)["x"].tolist() for _ in range(7)]
    state = iterator.get_state()
  with make() as resumed:
    resumed.set_state(state)
    assert head + [b["x"].tolist() for b in resumed] == whole


def test_iterations_keep_replacement_and_draw_anew():
  sampler = IndexSampler(300, seed=2, replacement=True)
  second = sampler.for_iteration(1)
  assert second.replacement and second.seed != sampler.seed
  assert (_records(second) != _records(sampler)).mean() > 0.9
  fixed = IndexSampler(300, seed=2, replacement=True, reshuffle_each_iteration=False)
  assert fixed.for_iteration(1) is fixed


def test_spec_params_and_identity_rebuild_and_name_replacement():
  sampler = IndexSampler(10, seed=1, replacement=True, num_epochs=None)
  assert IndexSampler(**sampler.spec_params()) == sampler
  assert sampler != IndexSampler(10, seed=1, num_epochs=None)
  assert sampler.identity()["replacement"] is True
  assert "replacement" not in IndexSampler(10).spec_params()
  assert "replacement=True" in repr(sampler)


def test_a_resharded_sampler_keeps_the_draws():
  base = IndexSampler(40, seed=6, num_epochs=2, replacement=True, shard_options=ShardOptions(0, 1))
  old = [
    IndexSampler(40, seed=6, num_epochs=2, replacement=True, shard_options=ShardOptions(h, 2))
    for h in range(2)
  ]
  # Two old shards read 5 positions each; one new shard reads the rest.
  resharded = ReshardedSampler(base, old_shard_count=2, old_positions=[5, 5])
  read = {(m.epoch, m.record_index) for s in old for m in list(s)[:5]}
  rest = [resharded[k] for k in range(resharded.num_positions)]
  assert len(rest) == 2 * 40 - 10
  whole = list(IndexSampler(40, seed=6, num_epochs=2, replacement=True))
  assert sorted(read | {(m.epoch, m.record_index) for m in rest}) == sorted(
    {(m.epoch, m.record_index) for m in whole}
  )


def test_an_empty_source_gives_no_positions():
  assert len(IndexSampler(0, replacement=True)) == 0


@pytest.mark.parametrize(
  "kwargs, pattern",
  [
    ({"replacement": "yes"}, r"replacement must be True or False, got 'yes'"),
    ({"replacement": 1}, r"replacement must be True or False, got 1"),
    (
      {"replacement": True, "shuffle": True},
      r"replacement=True draws every position at random already; it needs "
      r"shuffle=False, got shuffle=True",
    ),
  ],
)
def test_bad_replacement_arguments_are_refused_by_name(kwargs, pattern):
  with pytest.raises(ValueError, match=pattern):
    IndexSampler(10, **kwargs)


def test_a_service_worker_rebuilds_the_sampler_with_its_draws():
  from jaxfeed import service  # pylint: disable=g-import-not-at-top
  from jaxfeed.service.protocol import spec  # pylint: disable=g-import-not-at-top

  source = jaxfeed.ArraySource({"x": np.arange(60)})
  dataset = jaxfeed.Dataset.from_source(
    source, IndexSampler(60, seed=4, num_epochs=2, replacement=True)
  )
  local = [int(e["x"]) for e in dataset]
  rebuilt = spec.from_dataset_def(spec.to_dataset_def(dataset.node))
  with rebuilt.make_iterator() as iterator:
    assert [int(e["x"]) for e in iterator] == local
  with service.DispatchServer(service.DispatcherConfig()) as dispatcher:
    with service.WorkerServer(
      service.WorkerConfig(dispatcher_address=dispatcher.target, heartbeat_interval_s=0.1)
    ):
      served = [int(e["x"]) for e in dataset.distribute(dispatcher.target, "distributed_epoch")]
  assert sorted(served) == sorted(local)
