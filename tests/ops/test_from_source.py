"""Tests of from_source: records in sampler order, seeds, reads and states."""

import collections
import itertools
import json

import numpy as np
import pytest

from jaxfeed.dataset import Dataset
from jaxfeed.ops.base import PipelineStateError
from jaxfeed.ops.from_source import SourceNode
from jaxfeed.sampler import IndexSampler, ShardOptions
from jaxfeed.sources import ArraySource
import op_testing
from op_testing import (
  assert_same_stream,
  check_next_batch,
  check_resume,
  elements_and_seeds,
  graph_iterator,
  leaves,
)

tf = op_testing.import_tensorflow()


class _ListSource:
  """A minimal source over a list that records every read."""

  def __init__(self, num, batched=True):
    self.records = [f"record-{i}" for i in range(num)]
    self.reads = []  # Record indices in read order.
    self.get_many_calls = 0
    if not batched:
      self.get_many = None

  def __len__(self):
    return len(self.records)

  def __getitem__(self, index):
    self.reads.append(index)
    return self.records[index]

  def get_many(self, indices):  # pylint: disable=method-hidden
    self.get_many_calls += 1
    self.reads.extend(int(i) for i in indices)
    return [self.records[i] for i in indices]


def _expected(source, sampler):
  _, record_indices, seeds = sampler.get_many(np.arange(len(sampler)))
  return [source.records[i] for i in record_indices], seeds.tolist()


def test_default_sampler_reads_every_record_once_in_order():
  source = _ListSource(50)
  assert list(graph_iterator(Dataset.from_source(source))) == source.records
  assert sorted(source.reads) == list(range(50))


@pytest.mark.parametrize("num", [0, 1, 17, 300])
def test_array_source_in_order_matches_tf_from_tensor_slices(num):
  data = {
    "image": np.arange(num * 6, dtype=np.uint8).reshape(num, 2, 3),
    "label": np.arange(num, dtype=np.int32),
  }
  ours = list(graph_iterator(Dataset.from_source(ArraySource(data))))
  theirs = list(tf.data.Dataset.from_tensor_slices(data).as_numpy_iterator())
  assert len(ours) == num
  assert_same_stream(ours, theirs)


@pytest.mark.parametrize(
  "num, shard, epochs",
  [
    (100, ShardOptions(0, 1), 3),
    (37, ShardOptions(2, 3), 2),
    (1, ShardOptions(0, 1), 5),
    (10, ShardOptions(1, 4, True), 4),
  ],
)
def test_shuffled_sampler_order_and_seeds(num, shard, epochs):
  source = _ListSource(num)
  sampler = IndexSampler(num, shuffle=True, seed=42, num_epochs=epochs, shard_options=shard)
  records, seeds = elements_and_seeds(graph_iterator(Dataset.from_source(source, sampler)))
  assert (records, seeds) == _expected(source, sampler)


def test_shards_together_read_every_record_of_each_epoch():
  source = _ListSource(23)
  per_shard = [
    list(
      graph_iterator(
        Dataset.from_source(
          source, IndexSampler(23, shuffle=True, seed=1, shard_options=ShardOptions(h, 3))
        )
      )
    )
    for h in range(3)
  ]
  assert sorted(itertools.chain(*per_shard)) == sorted(source.records)


def test_endless_sampler_is_infinite():
  source = _ListSource(7)
  dataset = Dataset.from_source(source, IndexSampler(7, shuffle=True, num_epochs=None))
  assert dataset.cardinality() == -1
  records = list(itertools.islice(graph_iterator(dataset), 700))
  for epoch in range(100):
    assert sorted(records[epoch * 7 : (epoch + 1) * 7]) == sorted(source.records)


def test_cardinality_is_the_number_of_sampler_positions():
  source = _ListSource(10)
  assert Dataset.from_source(source).cardinality() == 10
  sampler = IndexSampler(10, num_epochs=3, shard_options=ShardOptions(1, 4))
  assert Dataset.from_source(source, sampler).cardinality() == 9


def test_reads_are_batched_and_never_past_the_end():
  source = _ListSource(1000)
  assert len(list(graph_iterator(Dataset.from_source(source)))) == 1000
  assert sorted(source.reads) == list(range(1000))
  assert source.get_many_calls <= 10


def test_a_short_take_reads_only_the_first_chunk():
  source = _ListSource(10_000)
  assert list(graph_iterator(Dataset.from_source(source).take(3))) == (source.records[:3])
  assert len(source.reads) <= 16


def test_skip_does_not_read_the_skipped_records():
  source = _ListSource(100)
  sampler = IndexSampler(100, shuffle=True, seed=3)
  records = list(graph_iterator(Dataset.from_source(source, sampler).skip(90)))
  expected, _ = _expected(source, sampler)
  assert records == expected[90:]
  assert sorted(source.reads) == sorted(sampler.get_many(np.arange(90, 100))[1].tolist())


def test_source_without_get_many_is_read_record_by_record():
  source = _ListSource(40, batched=False)
  sampler = IndexSampler(40, shuffle=True, seed=5, num_epochs=2)
  assert (
    list(graph_iterator(Dataset.from_source(source, sampler))) == (_expected(source, sampler)[0])
  )


def test_state_resumes_exactly_at_every_cut():
  source = _ListSource(40)
  sampler = IndexSampler(40, shuffle=True, seed=8, num_epochs=2)
  dataset = Dataset.from_source(source, sampler)
  resumed = check_resume(
    lambda: dataset, make_iterator=graph_iterator, with_seeds=True, into_same_iterator=True
  )
  assert len(resumed.expected) == 80
  assert [state["own"]["position"] for state in resumed.states] == list(range(81))


def test_state_restores_inside_the_read_ahead_buffer():
  source = _ListSource(100)
  iterator = graph_iterator(Dataset.from_source(source))
  for _ in range(20):
    next(iterator)
  state = iterator.get_state()
  next(iterator)
  reads = len(source.reads)
  iterator.set_state(state)
  assert next(iterator) == source.records[20]
  assert len(source.reads) == reads  # Served from the buffer.


@pytest.mark.parametrize(
  "state",
  [
    {"op": "range", "own": {"index": 0}, "parents": []},
    {"op": "from_source", "own": {"position": 11}, "parents": []},
    {"op": "from_source", "own": {"position": -1}, "parents": []},
    {"op": "from_source", "own": {"index": 0}, "parents": []},
    {"op": "from_source", "own": {"position": 0}, "parents": [{}]},
  ],
)
def test_foreign_or_corrupt_state_raises_pipeline_state_error(state):
  iterator = graph_iterator(Dataset.from_source(_ListSource(10)))
  with pytest.raises(PipelineStateError):
    iterator.set_state(state)


def test_source_must_be_random_access():
  with pytest.raises(TypeError, match="random-access.*int"):
    SourceNode(5)
  with pytest.raises(TypeError, match="random-access.*generator"):
    SourceNode(x for x in range(3))


def test_sampler_must_cover_the_source():
  with pytest.raises(ValueError, match="12 records.*_ListSource holds 10"):
    SourceNode(_ListSource(10), IndexSampler(12))


def test_sampler_must_be_a_sampler():
  with pytest.raises(TypeError, match="sampler.*list"):
    SourceNode(_ListSource(3), [0, 1, 2])


def test_a_source_returning_too_few_records_is_reported():
  source = _ListSource(10)
  source.get_many = lambda indices: source.records[:1]
  with pytest.raises(RuntimeError, match="returned 1 records for 10"):
    next(graph_iterator(Dataset.from_source(source)))


def test_empty_source_yields_nothing():
  assert list(graph_iterator(Dataset.from_source(_ListSource(0)))) == []
  endless = IndexSampler(0, shuffle=True, num_epochs=None)
  dataset = Dataset.from_source(_ListSource(0), endless)
  assert list(graph_iterator(dataset)) == [] and dataset.cardinality() == 0


def test_spec_params_rebuild_an_equal_node():
  source = ArraySource({"x": np.arange(10)})
  node = SourceNode(source, IndexSampler(10, shuffle=True, seed=2))
  rebuilt = SourceNode(**node.spec_params())
  assert rebuilt.fingerprint() == node.fingerprint()
  other = SourceNode(source, IndexSampler(10, shuffle=True, seed=3))
  assert other.fingerprint() != node.fingerprint()


def test_last_seed_after_restore_is_that_of_the_element_before_the_position():
  sampler = IndexSampler(30, shuffle=True, seed=6)
  dataset = Dataset.from_source(_ListSource(30), sampler)
  iterator = graph_iterator(dataset)
  assert iterator.last_seed == 0  # Nothing returned yet.
  for _ in range(25):
    next(iterator)
  fresh = graph_iterator(dataset)
  fresh.set_state(iterator.get_state())
  assert fresh.last_seed == iterator.last_seed == sampler[24].rng_seed


def test_sampler_lookups_are_batched_in_blocks():
  class CountingSampler(IndexSampler):
    calls = 0

    def get_many(self, positions):
      CountingSampler.calls += 1
      return super().get_many(positions)

  source = _ListSource(10_000)
  sampler = CountingSampler(10_000, shuffle=True, num_epochs=2)
  records = list(graph_iterator(Dataset.from_source(source, sampler)))
  assert len(records) == 20_000
  assert CountingSampler.calls <= 12  # 64, 256, 1024, then 4096 positions each.


# ---------------------------------------------------------------------------
# the batched-read protocol (next_batch)
# ---------------------------------------------------------------------------
Pair = collections.namedtuple("Pair", ["left", "right"])


def _array_data(num):
  return {
    "dict": {
      "image": np.arange(num * 6, dtype=np.uint8).reshape(num, 2, 3),
      "label": np.arange(num, dtype=np.int32),
    },
    "nested": {
      "z": [np.arange(num, dtype=np.float16), (np.arange(num) % 2 == 0,)],
      "a": Pair(np.arange(num * 2).reshape(num, 2), np.arange(num, dtype=np.uint64)),
    },
    "strings": {
      "s": np.array([b"b%d" % i for i in range(num)]),
      "u": np.array(["u%d" % i for i in range(num)]),
      "o": np.array([b"o%d" % i for i in range(num)], object),
    },
    "objects": {"o": np.array([i * 10 for i in range(num)], object), "x": np.arange(num)},
    "bare_array": np.arange(num * 2, dtype=np.float32).reshape(num, 2),
  }


@pytest.mark.parametrize("kind", sorted(_array_data(1)))
@pytest.mark.parametrize("sizes", [[1], [5], [64], [500], [3, 0, 0, 40, 0]])
@pytest.mark.parametrize(
  "sampler_args",
  [
    {},
    {"shuffle": True, "seed": 4, "num_epochs": 2},
    {"shard_options": ShardOptions(1, 3), "num_epochs": 3},
  ],
)
def test_array_source_next_batch_equals_stacked_next_calls(kind, sizes, sampler_args):
  data = _array_data(97)[kind]
  source = ArraySource(data)
  sampler = IndexSampler(97, **sampler_args)
  reads = check_next_batch(
    lambda: graph_iterator(Dataset.from_source(source, sampler)), sizes, leaves(data)
  )
  assert reads >= 2


class _GatheringSource(_ListSource):
  """A list source that also gathers whole batches, counting the calls."""

  def __init__(self, num):
    super().__init__(num)
    self.get_batch_calls = []

  def get_batch(self, indices):
    self.get_batch_calls.append(len(indices))
    return np.array([self.records[i] for i in indices])


def test_sources_with_get_batch_are_gathered_once_per_batch():
  source = _GatheringSource(100)
  iterator = graph_iterator(Dataset.from_source(source))
  batches = []
  while True:
    try:
      batches.append(iterator.next_batch(32)[0])
    except StopIteration:
      break
  assert source.get_batch_calls == [32, 32, 32, 4]
  assert source.reads == []  # No record read one by one.
  assert [b.dtype for b in batches] == [object] * 4  # Strings as objects.
  assert sum((b.tolist() for b in batches), []) == source.records


@pytest.mark.parametrize("batched", [True, False])
@pytest.mark.parametrize("sizes", [[1], [7], [300], [2, 0, 20, 0, 0]])
def test_sources_without_get_batch_stack_their_records(batched, sizes):
  source = _ListSource(150, batched=batched)
  sampler = IndexSampler(150, shuffle=True, seed=9, num_epochs=2)
  check_next_batch(lambda: graph_iterator(Dataset.from_source(source, sampler)), sizes)
  # Each record is read once per epoch and iterator, whatever the sizes.
  assert len(source.reads) == 2 * 2 * 150


def test_next_batch_on_an_endless_sampler_never_ends():
  source = ArraySource({"x": np.arange(10)})
  iterator = graph_iterator(
    Dataset.from_source(source, IndexSampler(10, shuffle=True, num_epochs=None))
  )
  batches = [iterator.next_batch(7)[0]["x"] for _ in range(10)]
  assert all(len(b) == 7 for b in batches)
  values = np.concatenate(batches)
  for epoch in range(7):
    assert sorted(values[epoch * 10 : (epoch + 1) * 10]) == list(range(10))


def test_restore_after_next_batch_resumes_exactly():
  source = ArraySource({"x": np.arange(60), "y": np.arange(60) * 2.0})
  sampler = IndexSampler(60, shuffle=True, seed=1)
  dataset = Dataset.from_source(source, sampler)
  iterator = graph_iterator(dataset)
  iterator.next_batch(25)
  state = json.loads(json.dumps(iterator.get_state()))
  assert state["own"]["position"] == 25
  rest = [int(e["x"]) for e in iterator]
  fresh = graph_iterator(dataset)
  fresh.set_state(state)
  assert fresh.last_seed == sampler[24].rng_seed
  assert fresh.next_batch(100)[0]["x"].tolist() == rest
