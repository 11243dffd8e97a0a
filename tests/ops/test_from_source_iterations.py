"""`from_source` iterations at the op level: the positions of each iteration,
their states, and worker processes (process_batch) reading them."""

import json

import numpy as np
import pytest

import jaxfeed
from jaxfeed import Dataset, IndexSampler
from jaxfeed.ops import base, index_ranges
from jaxfeed.ops.from_source import SourceNode
from op_testing import graph_iterator
from process_udfs import jitter


def _node(reshuffle=True, num_epochs=1):
  return SourceNode(
    jaxfeed.ArraySource({"x": np.arange(10)}),
    IndexSampler(
      10, shuffle=True, seed=4, num_epochs=num_epochs, reshuffle_each_iteration=reshuffle
    ),
  )


def _values(iterator):
  return [int(e["x"]) for e in iterator]


def test_each_begun_iteration_reads_its_sampler_iteration():
  node = _node()
  orders = []
  for iteration in range(3):
    base.begin_iteration(node)
    orders.append(_values(node.make_iterator()))
    _, records, _ = node.sampler.for_iteration(iteration).get_many(np.arange(10))
    assert orders[-1] == records.tolist()
  assert len({tuple(o) for o in orders}) == 3


def test_bookkeeping_iterators_of_one_iteration_read_the_same_order():
  node = _node()
  base.begin_iteration(node)
  base.begin_iteration(node)
  assert _values(node.make_iterator()) == _values(node.make_iterator())


def test_range_positions_of_iteration_i_follow_those_of_iteration_i_minus_1():
  node = _node()
  base.begin_iteration(node)
  base.begin_iteration(node)  # iteration 1
  expected = _values(node.make_iterator())
  assert _values(node.range_iterator(10, 20)) == expected
  assert _values(node.range_iterator(13, 16)) == expected[3:6]
  with pytest.raises(ValueError, match="within one iteration"):
    node.range_iterator(15, 25)


def test_a_sampler_that_does_not_reshuffle_has_one_iteration():
  node = _node(reshuffle=False)
  base.begin_iteration(node)
  first = _values(node.make_iterator())
  base.begin_iteration(node)
  it = node.make_iterator()
  assert _values(it) == first
  assert "iteration" not in it.get_state()["own"]


def test_iteration_span_and_own_state_at_map_states_to_index_positions():
  node = _node()
  own = {"position": 3, "iteration": 2, "identity": node.identity}
  assert index_ranges.iteration_span(node, own) == (23, 30)
  assert index_ranges.own_state_at(node, own, 30) == {**own, "position": 10}
  assert index_ranges.iteration_span(node, {**own, "resharded": {}}) is None


def test_state_restored_into_another_iteration_reads_that_iteration():
  node = _node()
  for _ in range(3):
    base.begin_iteration(node)
  it = node.make_iterator()  # iteration 2
  for _ in range(4):
    next(it)
  state = json.loads(json.dumps(it.get_state()))
  assert state["own"]["iteration"] == 2
  rest = _values(it)
  fresh = _node()
  restored = graph_iterator(Dataset(fresh))
  restored.set_state(state)
  assert _values(restored) == rest
  base.begin_iteration(fresh)  # the next iteration is 3, as in the first run
  base.begin_iteration(node)
  assert _values(fresh.make_iterator()) == _values(node.make_iterator())


def test_process_workers_read_the_iteration_of_their_parent():
  def build(backend):
    sampler = IndexSampler(64, shuffle=True, seed=5)
    return (
      Dataset.from_source(jaxfeed.ArraySource({"x": np.arange(64)}), sampler)
      .random_map(jitter, num_parallel_calls=2, backend=backend)
      .batch(8)
    )

  threads, processes = build("thread"), build("process")
  orders = []
  for _ in range(2):
    want = list(threads)
    got = list(processes)
    assert len(got) == len(want)
    for g, w in zip(got, want):
      for key in w:
        np.testing.assert_array_equal(g[key], w[key])
    orders.append([b["k"].tolist() for b in got])
  assert orders[0] != orders[1]
  # A state of the second iteration restores into the process backend.
  ds = build("process")
  list(ds)
  it = ds.make_iterator()
  next(it)
  state = json.loads(json.dumps(it.get_state()))
  rest = [b["k"].tolist() for b in it]
  it.close()
  fresh = build("process").make_iterator()
  fresh.set_state(state)
  assert [b["k"].tolist() for b in fresh] == rest
  fresh.close()


def test_a_mixture_under_process_workers_runs_on_threads_and_saves_its_state():
  # Its state holds more than a position (the mixture's frontier), which
  # workers reading positions could not save: it ran on processes and
  # failed in get_state().
  def build():
    parts = [
      Dataset.from_source(
        jaxfeed.ArraySource({"x": np.arange(n)}), IndexSampler(n, shuffle=True, seed=n)
      )
      for n in (40, 24)
    ]
    return (
      Dataset.mix(parts, [1, 1])
      .random_map(jitter, num_parallel_calls=2, backend="process")
      .batch(8)
    )

  want = list(graph_iterator(build()))
  it = build().make_iterator()
  first = next(it)
  state = json.loads(json.dumps(it.get_state()))
  rest = list(it)
  it.close()
  assert [b["k"].tolist() for b in [first] + rest] == [b["k"].tolist() for b in want]
  resumed = build().make_iterator()
  resumed.set_state(state)
  assert [b["k"].tolist() for b in resumed] == [b["k"].tolist() for b in rest]
  resumed.close()


@pytest.mark.parametrize(
  "parallel",
  [{"num_parallel_calls": jaxfeed.AUTOTUNE}, {"num_parallel_calls": 2, "backend": "process"}],
)
def test_parallel_epochs_read_what_no_parallelism_reads(parallel):
  # Worker processes rebuild the input and read positions of the epoch the
  # consumer's iterator is in; the chunks of one reader span the epochs.
  def build(**kw):
    return (
      Dataset.from_source(
        jaxfeed.ArraySource({"x": np.arange(300)}), IndexSampler(300, shuffle=True, seed=7)
      )
      .random_map(jitter, **kw)
      .batch(10)
    )

  plain, ours = build(), build(**parallel)
  orders = []
  for _ in range(2):
    want = [b["k"].tolist() for b in plain]
    orders.append([b["k"].tolist() for b in ours])
    assert orders[-1] == want
  assert orders[0] != orders[1]
  ours.close()
