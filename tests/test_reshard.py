"""Resuming an IndexSampler-based pipeline on another number of shards:
`ReshardedSampler` and the `from_source` / Loader state that carries it."""

import collections

import numpy as np
import pytest

import jaxfeed
from jaxfeed import reshard_loader_states
from jaxfeed.ops.reshard import reshard_states
from jaxfeed.resharded_sampler import ReshardedSampler
from jaxfeed.sampler import IndexSampler, ShardOptions


def sampler(num_records, shard, count, num_epochs, shuffle=True):
  return IndexSampler(
    num_records,
    shuffle=shuffle,
    seed=3,
    num_epochs=num_epochs,
    shard_options=ShardOptions(shard, count),
  )


def reads(s, count):
  """(epoch, record, seed) of the first `count` positions of sampler `s`."""
  epochs, records, seeds = s.get_many(np.arange(count, dtype=np.int64))
  return collections.Counter(zip(epochs.tolist(), records.tolist(), seeds.tolist()))


@pytest.mark.parametrize("trial", range(40))
def test_new_shards_read_every_unread_position_exactly_once(trial):
  rng = np.random.default_rng(trial)
  num_records = int(rng.integers(1, 50))
  old, new = (int(c) for c in rng.integers(1, 6, 2))
  num_epochs = int(rng.integers(1, 4))
  shuffle = bool(trial % 2)
  olds = [sampler(num_records, h, old, num_epochs, shuffle) for h in range(old)]
  positions = [int(rng.integers(0, len(s) + 1)) for s in olds]
  unread = sum((reads(s, len(s)) for s in olds), collections.Counter())
  unread -= sum((reads(s, p) for s, p in zip(olds, positions)), collections.Counter())
  got = collections.Counter()
  lengths = []
  for i in range(new):
    resharded = ReshardedSampler(sampler(num_records, i, new, num_epochs, shuffle), old, positions)
    got += reads(resharded, resharded.num_positions)
    lengths.append(resharded.num_positions)
  assert got == unread
  # Dealt round-robin per epoch: lengths differ by at most one per epoch.
  assert max(lengths) - min(lengths) <= num_epochs


@pytest.mark.parametrize("trial", range(40))
def test_unread_positions_below_the_old_positions_are_dealt_out_too(trial):
  # An op (pack) held records of these positions: they count as unread.
  rng = np.random.default_rng(100 + trial)
  num_records = int(rng.integers(1, 50))
  old, new = (int(c) for c in rng.integers(1, 6, 2))
  num_epochs = int(rng.integers(1, 4))
  olds = [sampler(num_records, h, old, num_epochs) for h in range(old)]
  positions = [int(rng.integers(0, len(s) + 1)) for s in olds]
  holes = [
    sorted(rng.choice(p, int(rng.integers(0, min(p, 6) + 1)), replace=False).tolist())
    for p in positions
  ]
  unread = sum((reads(s, len(s)) for s in olds), collections.Counter())
  unread -= sum((reads(s, p) for s, p in zip(olds, positions)), collections.Counter())
  for s, h in zip(olds, holes):
    epochs, records, seeds = s.get_many(np.array(h, np.int64))
    unread.update(zip(epochs.tolist(), records.tolist(), seeds.tolist()))
  got = collections.Counter()
  for i in range(new):
    resharded = ReshardedSampler(sampler(num_records, i, new, num_epochs), old, positions, holes)
    got += reads(resharded, resharded.num_positions)
    assert resharded.reshard_state()["unread"] == holes
  assert got == unread


def test_unread_positions_must_lie_below_the_old_positions():
  with pytest.raises(ValueError, match="old_unread must be 2 lists"):
    ReshardedSampler(sampler(10, 0, 1, 1), 2, [3, 2], [[1], [2]])


def test_bad_old_positions_are_rejected():
  with pytest.raises(ValueError, match="must be 2 integers >= 0"):
    ReshardedSampler(sampler(10, 0, 1, 1), 2, [3])


def pipeline(shard, count, shuffle_buffer=False):
  source = jaxfeed.ArraySource({"x": np.arange(60)})
  ds = jaxfeed.Dataset.from_source(source, sampler(60, shard, count, num_epochs=2)).filter(
    lambda e: e["x"] % 4 != 0
  )
  if shuffle_buffer:
    ds = ds.shuffle(8, seed=1)
  return ds.batch(3)


def test_resharded_state_reads_the_rest_then_saves_a_plain_position():
  iterators = [pipeline(h, 2).make_iterator() for h in range(2)]
  for it, steps in zip(iterators, (2, 5)):
    for _ in range(steps):
      next(it)
  state = reshard_states([it.get_state() for it in iterators])
  for it in iterators:
    it.close()
  resumed = pipeline(0, 3).make_iterator()
  resumed.set_state(state)
  own = resumed.get_state()["parents"][0]["parents"][0]["own"]
  assert own["resharded"] == {
    "version": 2,
    "shard_count": 2,
    "positions": own["resharded"]["positions"],
    "unread": [[], []],
  }
  list(resumed)  # To the end: past the dealt-out epochs.
  own = resumed.get_state()["parents"][0]["parents"][0]["own"]
  assert set(own) == {"position", "identity"}
  resumed.close()


def test_shuffle_buffer_cannot_be_resharded():
  it = pipeline(0, 1, shuffle_buffer=True).make_iterator()
  next(it)
  with pytest.raises(ValueError, match="op 'shuffle' cannot be resumed"):
    reshard_states([it.get_state()])
  it.close()


def test_loader_states_at_different_steps_are_rejected():
  with pytest.raises(ValueError, match="different numbers of batches"):
    reshard_loader_states([{"pipeline": {}, "batches": 1}, {"pipeline": {}, "batches": 2}])


def test_state_saved_inside_the_dealt_out_epochs_resumes_exactly():
  iterators = [pipeline(h, 2).make_iterator() for h in range(2)]
  for it in iterators:
    next(it)
  state = reshard_states([it.get_state() for it in iterators])
  for it in iterators:
    it.close()
  first = pipeline(1, 3).make_iterator()
  first.set_state(state)
  next(first)
  saved = first.get_state()
  assert "resharded" in saved["parents"][0]["parents"][0]["own"]
  rest = [b["x"].tolist() for b in first]
  second = pipeline(1, 3).make_iterator()
  second.set_state(saved)
  assert [b["x"].tolist() for b in second] == rest
  first.close()
  second.close()
