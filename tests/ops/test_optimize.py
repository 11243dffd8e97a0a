"""The static optimizer: each rewrite happens, keeps outputs, can be switched off."""

import dataclasses
import json
import threading

import numpy as np
import pytest

import jaxfeed
from jaxfeed.ops import optimize

NO_OPT = jaxfeed.Options(optimize=False)


def double(x):
  return x * 2


def add_three(x):
  return x + 3


def is_even(x):
  return x % 2 == 0


def not_div_by_three(x):
  return x % 3 != 0


def below_150(x):
  return x < 150


def pair(x):
  return x, x * 10


def add_pair(a, b):
  return a + b


class CountingFn:
  """A vectorizable fn that counts its calls."""

  def __init__(self):
    self.calls = 0
    self.lock = threading.Lock()

  def __call__(self, x):
    with self.lock:
      self.calls += 1
    return x * 3 + 1


def ops_of(node):
  names = []
  while True:
    names.append(node.op_name)
    if not node.parents:
      return names[::-1]
    node = node.parents[0]


def as_list(dataset):
  it = dataset.make_iterator()
  try:
    return [np.asarray(x).tolist() for x in it]
  finally:
    it.close()


PIPELINES = {
  "map_map": lambda d: d.map(double).map(add_three),
  "map_map_parallel": lambda d: d.map(double, num_parallel_calls=3).map(
    add_three, num_parallel_calls=3
  ),
  "map_map_mixed": lambda d: d.map(double).map(add_three, num_parallel_calls=2),
  "map_filter": lambda d: d.map(double).filter(not_div_by_three),
  "map_filter_parallel": lambda d: d.map(add_three, num_parallel_calls=4).filter(is_even),
  "filter_filter": lambda d: d.filter(is_even).filter(not_div_by_three),
  "map_filter_filter": lambda d: d.map(add_three).filter(is_even).filter(not_div_by_three),
  "tuple_map_map": lambda d: d.map(pair).map(add_pair),
  "noops": lambda d: d.skip(0).take(-1).repeat(1).prefetch(0).map(double),
  "batched_map_batch": lambda d: d.map(double, batched=True).batch(4),
  "batched_map_batch_drop": lambda d: d.map(double, batched=True).batch(3, drop_remainder=True),
  "everything": lambda d: (
    d.skip(0)
    .map(double)
    .map(add_three)
    .filter(below_150)
    .filter(not_div_by_three)
    .map(add_three, batched=True)
    .batch(5)
  ),
}


@pytest.mark.parametrize("name", sorted(PIPELINES))
@pytest.mark.parametrize("n", [0, 1, 17, 60])
def test_optimized_outputs_equal_unoptimized(name, n):
  build = PIPELINES[name]
  optimized = build(jaxfeed.Dataset.range(n))
  plain = build(jaxfeed.Dataset.range(n)).with_options(NO_OPT)
  assert as_list(optimized) == as_list(plain)


@pytest.mark.parametrize(
  "name,expected",
  [
    ("map_map", ["range", "map"]),
    ("map_map_parallel", ["range", "map"]),
    ("map_map_mixed", ["range", "map", "map"]),  # different parallelism: kept apart
    ("map_filter", ["range", "map_and_filter"]),
    ("filter_filter", ["range", "filter"]),
    ("map_filter_filter", ["range", "map_and_filter"]),
    ("noops", ["range", "map"]),
    ("batched_map_batch", ["range", "batch", "map"]),
  ],
)
def test_rewrites_produce_expected_graph(name, expected):
  node = PIPELINES[name](jaxfeed.Dataset.range(10)).node
  assert ops_of(optimize.optimize(node)) == expected
  assert ops_of(optimize.optimize(node, NO_OPT)) == ops_of(node)


@pytest.mark.parametrize(
  "switch,name,unfused",
  [
    ("map_fusion", "map_map", ["range", "map", "map"]),
    ("map_and_filter_fusion", "map_filter", ["range", "map", "filter"]),
    ("filter_fusion", "filter_filter", ["range", "filter", "filter"]),
    ("noop_elimination", "noops", ["range", "skip", "take", "repeat", "prefetch", "map"]),
    ("map_and_batch_vectorization", "batched_map_batch", ["range", "map", "batch"]),
  ],
)
def test_each_rewrite_can_be_switched_off(switch, name, unfused):
  options = dataclasses.replace(jaxfeed.Options(), **{switch: False})
  node = PIPELINES[name](jaxfeed.Dataset.range(10)).node
  assert ops_of(optimize.optimize(node, options)) == unfused


def test_map_and_batch_vectorization_calls_fn_once_per_batch():
  fn = CountingFn()
  ds = jaxfeed.Dataset.range(100).map(fn, batched=True).batch(10)
  out = as_list(ds)
  assert fn.calls == 10
  assert out == [[x * 3 + 1 for x in range(i, i + 10)] for i in range(0, 100, 10)]

  per_element = CountingFn()
  as_list(jaxfeed.Dataset.range(100).map(per_element, batched=True).batch(10).with_options(NO_OPT))
  assert per_element.calls == 100


def test_inject_prefetch_adds_prefetch_at_the_end():
  options = jaxfeed.Options(inject_prefetch=True)
  node = jaxfeed.Dataset.range(10).map(double).node
  assert ops_of(optimize.optimize(node, options))[-1] == "prefetch"
  ds = jaxfeed.Dataset.range(10).map(double).with_options(options)
  assert as_list(ds) == [2 * x for x in range(10)]


def test_optimizer_leaves_the_input_graph_unchanged():
  ds = PIPELINES["everything"](jaxfeed.Dataset.range(10))
  before = ops_of(ds.node)
  fingerprint = ds.fingerprint()
  optimize.optimize(ds.node)
  assert ops_of(ds.node) == before
  assert ds.fingerprint() == fingerprint


@pytest.mark.parametrize("cut", [0, 3, 7])
def test_optimized_pipeline_resumes_exactly(cut):
  build = PIPELINES["everything"]
  ds = build(jaxfeed.Dataset.range(80))
  full = as_list(ds)
  it = ds.make_iterator()
  head = [np.asarray(next(it)).tolist() for _ in range(cut)]
  state = json.loads(json.dumps(it.get_state()))
  it.close()
  resumed = ds.make_iterator()
  resumed.set_state(state)
  tail = [np.asarray(x).tolist() for x in resumed]
  resumed.close()
  assert head + tail == full


def test_options_reject_bad_values():
  with pytest.raises(TypeError, match="map_fusion"):
    jaxfeed.Options(map_fusion="yes")
  with pytest.raises(ValueError, match="autotune_cpu_budget"):
    jaxfeed.Options(autotune_cpu_budget=-2)


def test_cache_below_a_rewrite_is_reused_across_iterations_of_one_dataset():
  fn = CountingFn()
  ds = jaxfeed.Dataset.range(10).map(fn).map(fn).cache()  # the maps get fused
  first = as_list(ds)
  assert fn.calls == 20
  assert as_list(ds) == first
  assert fn.calls == 20  # the second pass reads the cache
