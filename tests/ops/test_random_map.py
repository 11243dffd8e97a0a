"""Tests of random_map: per-record generators, independent of parallelism."""

import threading

import numpy as np
import pytest

import jaxfeed
from jaxfeed.dataset import Dataset
from jaxfeed.ops.base import mix_seed
from jaxfeed.ops.random_map import ElementGenerators, RandomMapNode, element_rng
import op_testing
from op_testing import (
  NUM_PARALLEL_CALLS,
  assert_same_multiset,
  assert_same_values,
  check_resume,
  graph_iterator,
  new_threads,
  seeds_of,
)

# A fixture, requested by name.
from op_testing import work_mode  # noqa: F401

tf = op_testing.import_tensorflow()


def _noisy(x, rng):
  return (int(x), float(rng.random()), int(rng.integers(0, 1 << 30)))


def _reference(n, seed):
  """What random_map must give: rng = Generator(Philox(key=mix(seed, record)))."""
  out = []
  for x, record_seed in zip(range(n), seeds_of(Dataset.range(n))):
    rng = np.random.Generator(np.random.Philox(key=mix_seed(seed or 0, record_seed)))
    out.append(_noisy(x, rng))
  return out


def test_generator_is_philox_keyed_by_the_mixed_op_and_record_seeds():
  expected = np.random.Generator(np.random.Philox(key=mix_seed(7, 12345)))
  assert (
    element_rng(7, 12345).integers(0, 1 << 62, 8).tolist()
    == expected.integers(0, 1 << 62, 8).tolist()
  )


def test_reused_generators_give_exactly_the_fresh_generator_streams():
  generators = ElementGenerators(11)
  for record_seed in (5, 2**64 - 1, 5, 123456789):
    reused, fresh = generators(record_seed), element_rng(11, record_seed)
    for g in (reused, fresh):  # leave odd 32-bit and buffered draws behind
      g.integers(0, 7, 3, dtype=np.int32)
    assert reused.random(4).tolist() == fresh.random(4).tolist()
    assert reused.normal(size=3).tolist() == fresh.normal(size=3).tolist()
    reused.bit_generator.random_raw(3)
    reused.integers(0, 2**31, 1, dtype=np.int32)


@pytest.mark.parametrize("seed", [None, 0, 3])
@pytest.mark.parametrize("deterministic", [True, False])
@pytest.mark.parametrize("num_parallel_calls", NUM_PARALLEL_CALLS)
@pytest.mark.usefixtures("work_mode")
def test_outputs_do_not_depend_on_parallelism(num_parallel_calls, deterministic, seed):
  ds = Dataset.range(40).random_map(
    _noisy, num_parallel_calls=num_parallel_calls, deterministic=deterministic, seed=seed
  )
  with graph_iterator(ds) as it:
    ours = list(it)
  expected = _reference(40, seed)
  if deterministic:
    assert ours == expected
  else:
    assert sorted(ours) == expected


def test_element_order_and_count_match_tf_data_map():
  ours = [x for x, _, _ in graph_iterator(Dataset.range(25).random_map(_noisy))]
  theirs = list(tf.data.Dataset.range(25).map(lambda x: x).as_numpy_iterator())
  assert ours == [int(x) for x in theirs]
  assert Dataset.range(25).random_map(_noisy).cardinality() == int(
    tf.data.Dataset.range(25).map(lambda x: x).cardinality()
  )


def test_op_seed_changes_every_stream_and_none_means_zero():
  zero = list(graph_iterator(Dataset.range(20).random_map(_noisy, seed=0)))
  none = list(graph_iterator(Dataset.range(20).random_map(_noisy)))
  one = list(graph_iterator(Dataset.range(20).random_map(_noisy, seed=1)))
  assert zero == none
  assert all(a[1] != b[1] for a, b in zip(zero, one))
  assert len({r for _, r, _ in zero}) == 20  # each record its own stream


def test_tuple_and_dict_elements_are_passed_whole_with_the_generator():
  a = np.arange(6)
  tuples = list(
    graph_iterator(
      Dataset.from_tensor_slices((a, a * 10)).random_map(
        lambda pair, rng: (int(pair[0] + pair[1]), rng.random() < 2.0)
      )
    )
  )
  assert tuples == [(11 * i, True) for i in range(6)]
  dicts = list(
    graph_iterator(Dataset.from_tensor_slices({"v": a}).random_map(lambda d, rng: int(d["v"]) * 2))
  )
  assert dicts == [2 * i for i in range(6)]


@pytest.mark.parametrize("deterministic", [True, False])
@pytest.mark.parametrize("num_parallel_calls", NUM_PARALLEL_CALLS)
@pytest.mark.usefixtures("work_mode")
def test_resume_at_every_cut_point_gives_the_same_random_values(num_parallel_calls, deterministic):
  ds = Dataset.range(16).random_map(
    _noisy, num_parallel_calls=num_parallel_calls, deterministic=deterministic, seed=5
  )
  resumed = check_resume(
    lambda: ds,
    make_iterator=graph_iterator,
    same=assert_same_values if deterministic else assert_same_multiset,
  )
  assert len(resumed.states) == 17
  if deterministic:
    assert resumed.expected == _reference(16, 5)
  else:
    assert sorted(resumed.expected) == _reference(16, 5)


def test_last_seed_is_the_record_seed_not_the_mixed_one():
  seeds = seeds_of(Dataset.range(10).random_map(_noisy, seed=9, num_parallel_calls=3))
  assert seeds == seeds_of(Dataset.range(10))


def test_no_threads_leak_after_close():
  before = threading.enumerate()
  it = graph_iterator(Dataset.range(100).random_map(_noisy, num_parallel_calls=3))
  next(it)
  it.close()
  assert not new_threads(before)


def test_spec_params_rebuild_an_equal_node():
  node = RandomMapNode(
    Dataset.range(3).node, _noisy, num_parallel_calls=2, deterministic=False, seed=4
  )
  assert node.spec_params() == {
    "fn": _noisy,
    "num_parallel_calls": 2,
    "deterministic": False,
    "seed": 4,
    "backend": "auto",
  }
  assert RandomMapNode(*node.parents, **node.spec_params()).fingerprint() == (node.fingerprint())
  assert RandomMapNode(node.parents[0], _noisy, seed=5).fingerprint() != (
    RandomMapNode(node.parents[0], _noisy, seed=4).fingerprint()
  )


def test_invalid_seed_is_rejected():
  with pytest.raises(TypeError, match="random_map: seed must be an int"):
    RandomMapNode(Dataset.range(3).node, _noisy, seed="7")


@pytest.mark.parametrize("num_parallel_calls", [None, 3])
def test_generators_are_keyed_by_the_samplers_record_seeds(num_parallel_calls):
  sampler = jaxfeed.IndexSampler(12, shuffle=True, seed=42, num_epochs=2)
  source = jaxfeed.ArraySource({"id": np.arange(12)})
  ds = Dataset.from_source(source, sampler).random_map(
    lambda d, rng: (int(d["id"]), int(rng.integers(0, 1 << 40))),
    num_parallel_calls=num_parallel_calls,
    seed=8,
  )
  expected = []
  for position in range(24):
    record = sampler[position]
    rng = np.random.Generator(np.random.Philox(key=mix_seed(8, record.rng_seed)))
    expected.append((int(record.record_index), int(rng.integers(0, 1 << 40))))
  with graph_iterator(ds) as it:
    assert list(it) == expected
