"""Epoch loops as tf.data users write them: `for epoch ...: for batch in ds`
and `for batch in loader`, each iteration its own order, and exact resume in
any epoch, in a fresh pipeline and a fresh process.

Run as a script, this file is the fresh process of the restart test: it
builds the Loader, restores the given state and writes the batches of the
rest of that epoch and of the next epoch to an .npz file.
"""

import argparse
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

import jaxfeed
from jaxfeed import Dataset, IndexSampler, ShardOptions
from jaxfeed.ops.reshard import reshard_states

NUM_RECORDS = 48
BATCH = 8  # 8 CPU devices (tests/conftest.py) divide it.
WINDOW = 16  # The restart test's pipeline also has a windowed shuffle.


def records():
  return {
    "x": np.arange(NUM_RECORDS, dtype=np.int64),
    "y": np.arange(NUM_RECORDS, dtype=np.float32) * 0.5,
  }


def noisy(element, rng):
  return {"x": element["x"], "y": element["y"] + rng.random(dtype=np.float32)}


def pipeline(
  reshuffle=True, seed=3, num_epochs=1, shard_options=None, batch=BATCH, window=None, **parallel
):
  """A globally shuffled sampler, per-record randomness (`parallel`: its
  `random_map`'s num_parallel_calls / backend), optionally a windowed
  `shuffle` (it reshuffles each iteration too), batches."""
  sampler = IndexSampler(
    NUM_RECORDS,
    shuffle=True,
    seed=seed,
    num_epochs=num_epochs,
    shard_options=shard_options,
    reshuffle_each_iteration=reshuffle,
  )
  ds = Dataset.from_source(jaxfeed.ArraySource(records()), sampler)
  ds = ds.random_map(noisy, **parallel)
  if window:
    ds = ds.shuffle(window, seed=11)
  return ds.batch(batch)


def xs(batches):
  return [np.asarray(b["x"]).tolist() for b in batches]


def flat(batches):
  return sorted(int(v) for b in xs(batches) for v in b)


def host(batches):
  return [jax.tree_util.tree_map(np.asarray, b) for b in batches]


def assert_same(got, want):
  assert len(got) == len(want)
  for g, w in zip(got, want):
    for key in w:
      np.testing.assert_array_equal(np.asarray(g[key]), np.asarray(w[key]))


# -- Dataset ------------------------------------------------------------------
def test_iterating_a_dataset_twice_gives_two_epochs_in_different_orders():
  ds = pipeline()
  first, second = list(ds), list(ds)
  assert flat(first) == flat(second) == list(range(NUM_RECORDS))
  assert xs(first) != xs(second)
  # Each iteration's per-record seeds differ too: fresh augmentation.
  assert not np.allclose(
    sorted(np.concatenate([b["y"] for b in first])),
    sorted(np.concatenate([b["y"] for b in second])),
  )
  # The orders are a function of the seed and the iteration: a new Dataset
  # gives them again.
  again = pipeline()
  assert xs(list(again)) == xs(first) and xs(list(again)) == xs(second)


def test_reshuffle_each_iteration_false_repeats_the_first_order():
  ds = pipeline(reshuffle=False)
  first, second = list(ds), list(ds)
  assert xs(first) == xs(second)
  assert_same(second, first)


def test_dataset_resumes_the_second_epoch_in_a_fresh_pipeline():
  reference = pipeline()
  epochs = [host(reference) for _ in range(3)]
  ds = pipeline()
  list(ds)
  it = ds.make_iterator()  # epoch 2
  for _ in range(2):
    next(it)
  state = json.loads(json.dumps(it.get_state()))
  it.close()
  fresh = pipeline()
  resumed = fresh.make_iterator()
  resumed.set_state(state)
  assert xs(epochs[0]) != xs(epochs[1]) != xs(epochs[2])
  assert_same(list(resumed), epochs[1][2:])
  assert_same(list(fresh), epochs[2])  # the next iteration: epoch 3


def test_repeat_gives_each_repetition_its_own_order_and_resumes():
  ds = pipeline().repeat(3)
  batches = list(ds)
  per_epoch = NUM_RECORDS // BATCH
  epochs = [xs(batches[i * per_epoch : (i + 1) * per_epoch]) for i in range(3)]
  assert epochs[0] != epochs[1] != epochs[2]
  it = pipeline().repeat(3).make_iterator()
  for _ in range(per_epoch + 1):
    next(it)
  state = json.loads(json.dumps(it.get_state()))
  it.close()
  resumed = pipeline().repeat(3).make_iterator()
  resumed.set_state(state)
  assert_same(list(resumed), batches[per_epoch + 1 :])


def test_endless_sampler_reads_the_same_stream_every_iteration():
  sampler = IndexSampler(NUM_RECORDS, shuffle=True, seed=3, num_epochs=None)
  ds = Dataset.from_source(jaxfeed.ArraySource(records()), sampler).take(100)
  assert xs(ds) == xs(ds)


def test_shards_of_two_hosts_cover_each_iteration_once_between_them():
  hosts = [pipeline(shard_options=ShardOptions(h, 2)) for h in range(2)]
  iterations = [[flat(list(ds)) for ds in hosts] for _ in range(2)]
  orders = []
  for shares in iterations:
    assert sorted(shares[0] + shares[1]) == list(range(NUM_RECORDS))
    orders.append(shares)
  assert orders[0] != orders[1]
  # Every host derives the same global order: host h reads global positions
  # h, h + 2, ... of the unsharded pipeline's iteration.
  whole = pipeline(batch=1)
  for shares, unsharded in zip(iterations, [xs(whole), xs(whole)]):
    order = [b[0] for b in unsharded]
    assert shares == [sorted(order[0::2]), sorted(order[1::2])]


def test_a_second_epoch_resumes_on_another_number_of_processes():
  def hosts(count):
    return [pipeline(shard_options=ShardOptions(h, count)) for h in range(count)]

  old = hosts(2)
  for ds in old:
    list(ds)
  iterators = [ds.make_iterator() for ds in old]  # the second epoch
  taken = [flat([next(it) for _ in range(steps)]) for it, steps in zip(iterators, (1, 2))]
  states = [json.loads(json.dumps(it.get_state())) for it in iterators]
  rest_of_old_run = [flat(it) for it in iterators]
  for it in iterators:
    it.close()
  merged = reshard_states(states)
  new = hosts(3)
  resumed = []
  for ds in new:
    it = ds.make_iterator()
    it.set_state(merged)
    resumed.append(flat(it))
    it.close()
  # The rest of the second epoch, each record once over the new processes.
  assert sorted(sum(resumed, [])) == sorted(sum(rest_of_old_run, []))
  assert sorted(sum(resumed + taken, [])) == list(range(NUM_RECORDS))
  # Then the third epoch, as three processes read it.
  third = [flat(ds) for ds in new]
  reference = hosts(3)
  for ds in reference:
    list(ds), list(ds)
  assert third == [flat(ds) for ds in reference]


def test_mixture_reshuffles_its_components_each_iteration():
  def build():
    parts = [
      Dataset.from_source(
        jaxfeed.ArraySource({"x": np.arange(n) + offset}),
        IndexSampler(n, shuffle=True, seed=offset),
      )
      for n, offset in ((20, 0), (10, 100))
    ]
    return Dataset.mix(parts, [2, 1], seed=1)

  def values(iterable):
    return [int(x["x"]) for x in iterable]

  reference = build()
  runs = [values(reference) for _ in range(4)]
  assert runs[0] != runs[1] and sorted(runs[0]) == sorted(runs[1])
  ds = build()
  list(ds), list(ds)
  it = ds.make_iterator()  # the third iteration
  taken = [next(it) for _ in range(7)]
  state = json.loads(json.dumps(it.get_state()))
  it.close()
  fresh = build()
  resumed = fresh.make_iterator()
  resumed.set_state(state)
  assert values(taken) + values(resumed) == runs[2]
  assert values(fresh) == runs[3]


# -- Loader -------------------------------------------------------------------
def loader_epochs(loader, count):
  return [host(loader) for _ in range(count)]


def dataset_epochs(count, **args):
  """What the Loader's epochs must be: the Dataset's iterations."""
  ds = pipeline(**args)
  return [host(ds) for _ in range(count)]


def test_loader_iterated_twice_gives_two_epochs_in_different_orders():
  with jaxfeed.Loader(pipeline()) as loader:
    first, second = loader_epochs(loader, 2)
  assert len(first) == len(second) == NUM_RECORDS // BATCH
  assert flat(first) == flat(second) == list(range(NUM_RECORDS))
  assert xs(first) != xs(second)
  assert_same(first + second, sum(dataset_epochs(2), []))
  with jaxfeed.Loader(pipeline(reshuffle=False)) as loader:
    first, second = loader_epochs(loader, 2)
  assert xs(first) == xs(second)


def test_loader_continues_an_epoch_a_loop_left_and_then_starts_the_next():
  epochs = dataset_epochs(2)
  with jaxfeed.Loader(pipeline()) as loader:
    a = host(b for _, b in zip(range(2), loader))
    b = host(b for _, b in zip(range(2), loader))
    rest = host(loader)
    next_epoch = host(loader)
    with pytest.raises(StopIteration):
      next(loader)  # next() alone does not start an epoch
  assert_same(a + b + rest, epochs[0])
  assert_same(next_epoch, epochs[1])


def test_loader_over_a_one_shot_iterator_says_it_cannot_start_another_epoch():
  batches = iter([{"x": np.arange(BATCH)}] * 2)
  with jaxfeed.Loader(batches) as loader:
    assert len(list(loader)) == 2
    with pytest.raises(RuntimeError, match="one-shot iterator"):
      list(loader)
  with jaxfeed.Loader([{"x": np.arange(BATCH)}] * 2) as loader:  # a list
    assert [len(list(loader)) for _ in range(3)] == [2, 2, 2]


@pytest.mark.parametrize("cut", [0, 3, "end", "after_end"])
def test_loader_resumes_in_the_second_epoch_exactly(cut):
  epochs = dataset_epochs(3)
  per_epoch = len(epochs[0])
  with jaxfeed.Loader(pipeline()) as loader:
    list(loader)
    taken = []
    steps = {0: 0, 3: 3}.get(cut, per_epoch)
    iterator = iter(loader)
    for _ in range(steps):
      taken.append(next(iterator))
    if cut == "after_end":
      assert list(loader) == []
    state = json.loads(json.dumps(loader.get_state()))
  assert ("end_of_epoch" in state) == (cut == "after_end")
  with jaxfeed.Loader(pipeline()) as resumed:  # a fresh pipeline
    resumed.set_state(state)
    rest, following = host(resumed), host(resumed)
  if cut == "after_end":
    assert_same(rest, epochs[2])
    return
  assert_same(host(taken) + rest, epochs[1])
  assert_same(following, epochs[2])


def test_loader_epochs_on_worker_processes_are_those_of_one_thread():
  # Worker processes read the positions of the epoch the Loader is in, and
  # resume in the second one exactly (AUTOTUNE moving between backends
  # epoch by epoch: tests/ops/test_process_batch.py).
  parallel = {"num_parallel_calls": 2, "backend": "process"}
  epochs = dataset_epochs(3)
  ds = pipeline(**parallel)
  with jaxfeed.Loader(ds) as loader:
    first, second = loader_epochs(loader, 2)
    assert_same(first + second, epochs[0] + epochs[1])
    iterator = iter(loader)
    taken = [next(iterator) for _ in range(3)]
    state = json.loads(json.dumps(loader.get_state()))
  ds.close()
  resumed_ds = pipeline(**parallel)
  with jaxfeed.Loader(resumed_ds) as resumed:
    resumed.set_state(state)
    rest = host(resumed)
  resumed_ds.close()
  assert_same(host(taken) + rest, epochs[2])


def _save_batches(batches, path):
  np.savez(
    path, count=len(batches), **{f"{i}_{k}": v for i, b in enumerate(batches) for k, v in b.items()}
  )


def main(argv):
  parser = argparse.ArgumentParser()
  parser.add_argument("--state", required=True)
  parser.add_argument("--out", required=True)
  args = parser.parse_args(argv)
  with open(args.state) as f:
    state = json.load(f)
  with jaxfeed.Loader(pipeline(window=WINDOW)) as loader:
    loader.set_state(state)
    _save_batches(host(loader) + host(loader), args.out)


def test_loader_resumes_the_second_epoch_after_a_process_restart(tmp_path):
  epochs = dataset_epochs(3, window=WINDOW)
  with jaxfeed.Loader(pipeline(window=WINDOW)) as loader:
    list(loader)
    iterator = iter(loader)
    for _ in range(2):
      next(iterator)
    state_path = tmp_path / "state.json"
    state_path.write_text(json.dumps(loader.get_state()))
  out = tmp_path / "rest.npz"
  subprocess.run(
    [sys.executable, os.path.abspath(__file__), "--state", str(state_path), "--out", str(out)],
    check=True,
    timeout=240,
  )
  with np.load(out) as data:
    got = [{k: data[f"{i}_{k}"] for k in ("x", "y")} for i in range(int(data["count"]))]
  assert_same(got, epochs[1][2:] + epochs[2])


if __name__ == "__main__":
  main(sys.argv[1:])
