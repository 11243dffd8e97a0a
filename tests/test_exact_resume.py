"""Exact resume: a state saved mid-run, restored in a new process, continues
with exactly the batches the uninterrupted run yields.

The pipeline covers every kind of op state: the sampler's global shuffle over
two epochs, element-wise maps (sequential and with 4 parallel calls),
per-record randomness, a filter, the windowed shuffle and batching.

Run as a script, this file is the new process: it builds the same pipeline,
restores each given state and writes the remaining batches to an .npz file.
"""

import argparse
import json
import os
import subprocess
import sys
import threading

import numpy as np
import pytest

import jaxfeed
from jaxfeed import Dataset
from jaxfeed.ops import op_stats

NUM_RECORDS = 240
BATCH_SIZE = 8
SHUFFLE_BUFFER = 16
PARALLELISM = [None, 4]
# Steps after which the state is saved: the start, the middle of a shuffle
# window (3 batches = 24 elements, window 1), window boundaries (2 batches),
# around the sampler's epoch boundary, the last batch, and the end.
CUTS = [0, 1, 2, 3, 25, 26, 27, 50, "end"]


# ---------------------------------------------------------------------------
# the pipeline (module-level functions: the same in both processes)
# ---------------------------------------------------------------------------
def _records():
  rng = np.random.default_rng(0)
  return {
    "image": rng.integers(0, 256, (NUM_RECORDS, 4, 4, 3), dtype=np.uint8),
    "label": np.arange(NUM_RECORDS, dtype=np.int32),
  }


def normalize(record):
  return {"image": record["image"].astype(np.float32) / 255.0, "label": record["label"]}


def augment(element, rng):
  image = element["image"]
  if rng.random() < 0.5:
    image = image[:, ::-1]
  return {
    "image": image + rng.normal(0, 0.01, image.shape).astype(np.float32),
    "label": element["label"],
    "noise": rng.integers(0, 1 << 30),
  }


def keep(element):
  return element["label"] % 7 != 3


def build_pipeline(num_parallel_calls, shuffle_seed=5, variant="main"):
  """The pipeline under test, or a variant that differs in one op."""
  sampler = jaxfeed.IndexSampler(NUM_RECORDS, shuffle=True, seed=17, num_epochs=2)
  ds = Dataset.from_source(jaxfeed.ArraySource(_records()), sampler)
  ds = ds.map(normalize, num_parallel_calls=num_parallel_calls)
  ds = ds.random_map(augment, num_parallel_calls=num_parallel_calls, seed=3)
  if variant != "no_filter":
    ds = ds.filter(keep)
  if variant != "no_shuffle":
    ds = ds.shuffle(SHUFFLE_BUFFER, seed=shuffle_seed)
  if variant == "padded_batch":
    return ds.padded_batch(BATCH_SIZE)
  return ds.batch(BATCH_SIZE)


def _save_batches(batches, path):
  arrays = {}
  for i, batch in enumerate(batches):
    for key, value in batch.items():
      arrays[f"{i}/{key}"] = value
  np.savez(path, num_batches=len(batches), **arrays)


def _load_batches(path):
  with np.load(path) as data:
    num = int(data["num_batches"])
    batches = [{} for _ in range(num)]
    for name in data.files:
      if name != "num_batches":
        index, key = name.split("/")
        batches[int(index)][key] = data[name]
  return batches


def _restore_and_finish(num_parallel_calls, state):
  with build_pipeline(num_parallel_calls).make_iterator() as it:
    it.set_state(state)
    return list(it)


def main(argv):
  """Restores each saved state in this (new) process; writes what follows."""
  parser = argparse.ArgumentParser()
  parser.add_argument("--states", required=True)
  parser.add_argument("--out_dir", required=True)
  parser.add_argument("--num_parallel_calls", type=int, default=0)
  args = parser.parse_args(argv)
  with open(args.states) as f:
    states = json.load(f)
  for name, state in states.items():
    batches = _restore_and_finish(args.num_parallel_calls or None, state)
    _save_batches(batches, os.path.join(args.out_dir, f"{name}.npz"))


# ---------------------------------------------------------------------------
# tests
# ---------------------------------------------------------------------------
def _assert_same_batches(ours, expected):
  assert len(ours) == len(expected)
  for i, (a, b) in enumerate(zip(ours, expected)):
    assert sorted(a) == sorted(b), i
    for key in b:
      assert a[key].dtype == b[key].dtype, (i, key)
      np.testing.assert_array_equal(a[key], b[key], err_msg=f"batch {i} {key}")


@pytest.fixture(scope="module")
def uninterrupted():
  """All batches of an uninterrupted run, per parallelism."""
  runs = {}
  for num_parallel_calls in PARALLELISM:
    with build_pipeline(num_parallel_calls).make_iterator() as it:
      runs[num_parallel_calls] = list(it)
  return runs


def _cut_steps(cut, num_batches):
  return num_batches if cut == "end" else cut


@pytest.fixture(scope="module")
def restored_in_new_process(uninterrupted, tmp_path_factory):
  """Per parallelism and cut: the batches a new process yields after restore."""
  results = {}
  for num_parallel_calls in PARALLELISM:
    num_batches = len(uninterrupted[num_parallel_calls])
    states = {}
    for cut in CUTS:
      with build_pipeline(num_parallel_calls).make_iterator() as it:
        for _ in range(_cut_steps(cut, num_batches)):
          next(it)
        states[f"cut_{cut}"] = json.loads(json.dumps(it.get_state()))
    tmp = tmp_path_factory.mktemp(f"resume_{num_parallel_calls}")
    states_path = tmp / "states.json"
    states_path.write_text(json.dumps(states))
    subprocess.run(
      [
        sys.executable,
        os.path.abspath(__file__),
        "--states",
        str(states_path),
        "--out_dir",
        str(tmp),
        "--num_parallel_calls",
        str(num_parallel_calls or 0),
      ],
      check=True,
      timeout=240,
    )
    for cut in CUTS:
      results[num_parallel_calls, cut] = _load_batches(tmp / f"cut_{cut}.npz")
  return results


def test_pipeline_yields_two_epochs_of_kept_records(uninterrupted):
  batches = uninterrupted[None]
  labels = np.concatenate([b["label"] for b in batches])
  kept = [i for i in range(NUM_RECORDS) if i % 7 != 3]
  assert sorted(labels.tolist()) == sorted(kept * 2)
  assert len(batches) == -(-len(labels) // BATCH_SIZE) > max(c for c in CUTS if c != "end")


def test_parallel_maps_yield_the_sequential_batches(uninterrupted):
  _assert_same_batches(uninterrupted[4], uninterrupted[None])


@pytest.mark.parametrize("num_parallel_calls", PARALLELISM)
@pytest.mark.parametrize("cut", CUTS)
def test_new_process_resumes_with_the_uninterrupted_batches(
  restored_in_new_process, uninterrupted, num_parallel_calls, cut
):
  expected = uninterrupted[num_parallel_calls]
  ours = restored_in_new_process[num_parallel_calls, cut]
  _assert_same_batches(ours, expected[_cut_steps(cut, len(expected)) :])


@pytest.mark.parametrize("num_parallel_calls", PARALLELISM)
@pytest.mark.parametrize("cut", [3, 27])
def test_same_process_resumes_with_the_uninterrupted_batches(
  uninterrupted, num_parallel_calls, cut
):
  threads_before = set(threading.enumerate())
  with build_pipeline(num_parallel_calls).make_iterator() as it:
    for _ in range(cut):
      next(it)
    state = json.loads(json.dumps(it.get_state()))
    # Keep reading past the saved point: the restore must rewind.
    for _ in range(5):
      next(it)
    it.set_state(state)
    ours = list(it)
  _assert_same_batches(ours, uninterrupted[num_parallel_calls][cut:])
  # The process's op-stats sampler outlives pipelines by op_stats.LINGER_S
  # (the module's leak check waits for it, as tests/ops' new_threads does).
  assert {t for t in threading.enumerate() if t.name != op_stats.THREAD_NAME} <= threads_before


@pytest.mark.parametrize(
  "other",
  [
    dict(variant="no_shuffle"),
    dict(variant="no_filter"),
    dict(variant="padded_batch"),
    dict(shuffle_seed=6),
  ],
)
def test_state_of_a_different_pipeline_raises_pipeline_state_error(other):
  with build_pipeline(None).make_iterator() as it:
    for _ in range(3):
      next(it)
    state = json.loads(json.dumps(it.get_state()))
  with build_pipeline(None, **other).make_iterator() as it:
    with pytest.raises(jaxfeed.PipelineStateError):
      it.set_state(state)


if __name__ == "__main__":
  main(sys.argv[1:])
