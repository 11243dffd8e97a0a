"""`Dataset.mix` / `MixtureSampler`: the index-level mixture — a pure function
of (seed, position, weights), exact proportions, weights changed at a
checkpoint, resumes in a new process and on another number of processes."""

import collections
import json
import os
import pickle
import subprocess
import sys

import numpy as np
import pytest

import jaxfeed
from jaxfeed import reshard_loader_states
from jaxfeed.mixture import MixtureSampler
from jaxfeed.ops.reshard import reshard_states

SIZES = (60, 25, 40)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def component(i, num_epochs=1, size=None):
  return jaxfeed.IndexSampler(
    SIZES[i] if size is None else size, shuffle=True, seed=10 + i, num_epochs=num_epochs
  )


def sources():
  # Component i's record r is 1000 * i + r, so outputs name their origin.
  return [jaxfeed.ArraySource({"x": 1000 * i + np.arange(n)}) for i, n in enumerate(SIZES)]


def mixture(weights, shard=0, count=1, num_epochs=1, seed=5):
  parts = [
    jaxfeed.Dataset.from_source(src, component(i, num_epochs)) for i, src in enumerate(sources())
  ]
  return jaxfeed.Dataset.mix(
    parts, weights, seed=seed, shard_options=jaxfeed.ShardOptions(shard, count)
  )


def values(elements):
  return [int(e["x"]) for e in elements]


def take(iterator, count):
  return [int(next(iterator)["x"]) for _ in range(count)]


def test_mixture_is_a_pure_function_of_seed_and_position():
  code = (
    "import numpy as np; from jaxfeed.mixture import MixtureSampler; "
    "import jaxfeed; c = [jaxfeed.IndexSampler(n, shuffle=True, seed=s, "
    "num_epochs=None) for n, s in ((7, 1), (11, 2))]; "
    "print(MixtureSampler(c, [0.6, 0.4], seed=9).get_many("
    "np.arange(5000))[1].tolist())"
  )
  here = MixtureSampler(
    [jaxfeed.IndexSampler(n, shuffle=True, seed=s, num_epochs=None) for n, s in ((7, 1), (11, 2))],
    [0.6, 0.4],
    seed=9,
  )
  out = subprocess.run(
    [sys.executable, "-c", code], capture_output=True, text=True, check=True
  ).stdout
  assert json.loads(out) == here.get_many(np.arange(5000))[1].tolist()
  # Lookups in any order and batching agree with the sequential order.
  positions = np.random.default_rng(0).permutation(5000)
  records = here.get_many(positions)[1]
  assert records.tolist() == [here[int(p)].record_index for p in positions]


@pytest.mark.parametrize(
  "weights", [[0.7, 0.3], [1, 2, 3], [0.05, 0.9, 0.05], [1 / 3, 1 / 3, 1 / 3], [5, 0, 1]]
)
def test_proportions_hold_at_every_prefix(weights):
  parts = [jaxfeed.IndexSampler(10, num_epochs=None) for _ in weights]
  sampler = MixtureSampler(parts, weights, seed=3)
  components, _ = sampler.locate(np.arange(20_000))
  share = np.asarray(weights) / np.sum(weights)
  counts = np.cumsum(components[:, None] == np.arange(len(weights)), axis=0)
  expected = np.arange(1, 20_001)[:, None] * share
  # Within one per level of the component tree at every prefix, so far
  # inside 1% over 20k draws.
  assert np.abs(counts - expected).max() <= 2 + 1e-3
  assert np.allclose(counts[-1] / 20_000, share, atol=0.01)


def test_each_component_reads_its_own_shuffled_order_once():
  ds = mixture([2, 1, 1])
  out = values(ds)
  assert len(out) == len(set(out))
  for i in range(3):
    mine = [v - 1000 * i for v in out if v // 1000 == i]
    order = component(i).get_many(np.arange(len(mine)))[1].tolist()
    assert mine == order
  # It ended when a component had nothing left: component 1 (25 records at
  # a quarter of the positions) before component 0 (60 at a half).
  assert sum(v // 1000 == 1 for v in out) == SIZES[1]
  assert 98 <= len(out) <= 102


def test_shards_split_one_global_mixture():
  whole = values(mixture([0.5, 0.2, 0.3]))
  shards = [values(mixture([0.5, 0.2, 0.3], h, 3)) for h in range(3)]
  assert [shards[p % 3][p // 3] for p in range(len(whole))] == whole


def read_run(weights, count, steps, batch=4, num_epochs=1):
  """Iterators of `count` shards after each read `steps[h]` batches."""
  iterators = [
    mixture(weights, h, count, num_epochs).map(lambda e: e).batch(batch).make_iterator()
    for h in range(count)
  ]
  read = []
  for it, n in zip(iterators, steps):
    for _ in range(n):
      read += next(it)["x"].tolist()
  return iterators, read


@pytest.mark.parametrize("num_epochs", [1, 2])
def test_resume_on_three_processes_reads_the_rest_exactly_once(num_epochs):
  weights = [0.5, 0.2, 0.3]
  whole = collections.Counter(values(mixture(weights, num_epochs=num_epochs)))
  iterators, read = read_run(weights, 2, (3, 5), num_epochs=num_epochs)
  state = reshard_loader_states([{"pipeline": it.get_state(), "batches": 4} for it in iterators])
  for it in iterators:
    it.close()
  for i in range(3):
    resumed = mixture(weights, i, 3, num_epochs).map(lambda e: e).batch(4).make_iterator()
    resumed.set_state(state["pipeline"])
    read += [x for b in resumed for x in b["x"].tolist()]
    resumed.close()
  assert collections.Counter(read) == whole


def test_new_weights_apply_from_the_checkpoint_on():
  first = mixture([0.8, 0.1, 0.1], num_epochs=None).make_iterator()
  before = take(first, 50)
  state = first.get_state()
  resumed = mixture([0.1, 0.1, 0.8], num_epochs=None).make_iterator()
  with pytest.raises(ValueError, match="align_mixture_states first"):
    resumed.set_state(state)
  [state] = jaxfeed.align_mixture_states([state])
  resumed.set_state(state)
  after = take(resumed, 2000)
  # The positions before the checkpoint kept their mapping...
  again = mixture([0.8, 0.1, 0.1], num_epochs=None).make_iterator()
  assert take(again, 50) == before
  # ... the new proportions hold from it on ...
  share = np.bincount([v // 1000 for v in after], minlength=3) / len(after)
  assert np.allclose(share, [0.1, 0.1, 0.8], atol=0.01)
  # ... and each component goes on where it stopped: nothing repeated or
  # skipped in its order.
  for i in range(3):
    mine = [v - 1000 * i for v in before + after if v // 1000 == i]
    expected = component(i, None).get_many(np.arange(len(mine)))[1].tolist()
    assert mine == expected
  # The history travels on: a later checkpoint resumes exactly.
  saved = resumed.get_state()
  assert saved["own"]["mixture"]["segments"] == [[0, [8, 1, 1]], [50, [1, 1, 8]]]
  again = mixture([0.1, 0.1, 0.8], num_epochs=None).make_iterator()
  again.set_state(saved)
  assert take(again, 100) == take(resumed, 100)


def test_new_weights_on_several_processes_need_their_merged_state():
  iterators, read = read_run([0.5, 0.2, 0.3], 2, (3, 5))
  states = [it.get_state() for it in iterators]
  for it in iterators:
    it.close()
  own = mixture([0.2, 0.2, 0.6], 0, 2).map(lambda e: e).batch(4).make_iterator()
  with pytest.raises(ValueError, match="align_mixture_states first"):
    own.set_state(states[0])
  own.close()
  merged = reshard_states(states)
  for h in range(2):
    resumed = mixture([0.2, 0.2, 0.6], h, 2).map(lambda e: e).batch(4).make_iterator()
    resumed.set_state(merged)
    read += [x for b in resumed for x in b["x"].tolist()]
    resumed.close()
  assert len(read) == len(set(read))
  # Each component was read as a prefix of its order: nothing skipped.
  for i in range(3):
    mine = sorted(v - 1000 * i for v in read if v // 1000 == i)
    assert mine == sorted(component(i).get_many(np.arange(len(mine)))[1])


@pytest.mark.parametrize(
  "weights, message",
  [
    ([1, -1, 1], "finite, >= 0 and not all 0"),
    ([0, 0, 0], "finite, >= 0 and not all 0"),
    ([1, float("nan"), 1], "finite, >= 0 and not all 0"),
    ([1, 2], "got 2 weights for 3 components"),
    ("abc", "weights must be a list of numbers"),
    ([1, 1e-9, 1], "below 2\\*\\*-20 of the total"),
  ],
)
def test_bad_weights_are_rejected(weights, message):
  with pytest.raises((TypeError, ValueError), match=message):
    mixture(weights)


def test_components_must_be_unsharded_from_source_datasets():
  src = jaxfeed.ArraySource({"x": np.arange(5)})
  plain = jaxfeed.Dataset.from_source(src)
  with pytest.raises(TypeError, match=r"datasets\[1\] is op 'map'.*no op after"):
    jaxfeed.Dataset.mix([plain, plain.map(lambda e: e)])
  with pytest.raises(TypeError, match=r"datasets\[0\] is op 'range'"):
    jaxfeed.Dataset.mix([jaxfeed.Dataset.range(3), plain])
  sharded = jaxfeed.Dataset.from_source(
    src, jaxfeed.IndexSampler(5, shard_options=jaxfeed.ShardOptions(0, 2))
  )
  with pytest.raises(ValueError, match=r"components\[1\] is sharded"):
    jaxfeed.Dataset.mix([plain, sharded])


def test_state_of_another_number_of_components_is_rejected():
  it = mixture([1, 1, 1]).make_iterator()
  next(it)
  state = it.get_state()
  state["own"]["mixture"]["segments"] = [[0, [1, 1]]]
  with pytest.raises(ValueError, match="3 integer weights"):
    mixture([1, 1, 1]).make_iterator().set_state(state)


def test_mixture_travels_to_service_workers_as_a_spec():
  from jaxfeed.service.protocol import spec  # pylint: disable=g-import-not-at-top

  ds = mixture([0.5, 0.2, 0.3], 1, 2).batch(4)
  rebuilt = jaxfeed.Dataset(spec.from_dataset_def(spec.to_dataset_def(ds.node)))
  assert [b["x"].tolist() for b in rebuilt] == [b["x"].tolist() for b in ds]


def packed(weights, shard, count):
  def tokens(e):
    return {"tokens": np.full(int(e["x"]) % 5 + 1, e["x"], np.int32)}

  return mixture(weights, shard, count).map(tokens).pack({"tokens": 8}, num_packing_bins=2).batch(2)


@pytest.mark.parametrize("count", [1, 2])
def test_packing_processes_take_new_weights_from_their_aligned_states(count):
  iterators = [packed([0.5, 0.2, 0.3], h, count).make_iterator() for h in range(count)]
  tokens = []
  for it, steps in zip(iterators, (2, 4)):
    for _ in range(steps):
      tokens += next(it)["tokens"].ravel().tolist()
  states = [{"pipeline": it.get_state(), "batches": 9} for it in iterators]
  for it in iterators:
    it.close()
  # Pack's open rows are replayed from an older snapshot of the mixture.
  assert '"anchor"' in json.dumps(states)
  aligned = jaxfeed.align_mixture_states(states)
  assert aligned[0]["batches"] == 9
  frontiers = set()
  for state in aligned:
    node = state["pipeline"]
    while node["op"] != "from_source":
      node = node["parents"][0]
    frontiers.add(node["own"]["mixture"]["frontier"])
  assert len(frontiers) == 1
  for h in range(count):
    resumed = packed([0.1, 0.1, 0.8], h, count).make_iterator()
    resumed.set_state(aligned[h]["pipeline"])
    tokens += [t for b in resumed for t in b["tokens"].ravel().tolist()]
    resumed.close()
  counts = collections.Counter(t for t in tokens if t)
  # Every record read was read once (all of its tokens, no more), and each
  # component was read as a prefix of its order.
  assert all(n == x % 5 + 1 for x, n in counts.items())
  for i in range(3):
    mine = sorted(x - 1000 * i for x in counts if x // 1000 == i)
    assert mine == sorted(component(i).get_many(np.arange(len(mine)))[1])


RESTORE_IN_NEW_PROCESS = """
import json, pickle, sys
sys.path.insert(0, "tests")
import test_mixture
shard, count, states = json.loads(sys.stdin.read())
rest = []
for state in states:
  with test_mixture.packed([0.5, 0.2, 0.3], shard, count).make_iterator() as it:
    it.set_state(state)
    rest.append([b["tokens"].tolist() for b in it])
sys.stdout.buffer.write(pickle.dumps(rest))
"""


@pytest.mark.parametrize("shard, count", [(0, 1), (1, 2)])
def test_a_packed_mixture_resumes_exactly_in_a_new_process(shard, count):
  expected = [b["tokens"].tolist() for b in packed([0.5, 0.2, 0.3], shard, count)]
  cuts = [0, 1, 3, len(expected) // 2, len(expected) - 1, len(expected)]
  states = []
  for cut in cuts:
    with packed([0.5, 0.2, 0.3], shard, count).make_iterator() as it:
      for _ in range(cut):
        next(it)
      states.append(it.get_state())
  done = subprocess.run(
    [sys.executable, "-c", RESTORE_IN_NEW_PROCESS],
    input=json.dumps([shard, count, states]).encode(),
    capture_output=True,
    cwd=REPO,
    timeout=120,
    check=False,
  )
  assert done.returncode == 0, done.stderr.decode()[-3000:]
  for cut, rest in zip(cuts, pickle.loads(done.stdout)):
    assert rest == expected[cut:], cut
