"""Parallel map -> batch: the workers write each output into its batch row."""

import weakref

import numpy as np
import pytest

import op_testing
from jaxfeed.dataset import Dataset
from jaxfeed.ops import batch_placement
from jaxfeed.ops import parallel
from jaxfeed.ops import parallel_executor


DEFAULT_MIN_ELEMENT_BYTES = batch_placement.MIN_ELEMENT_BYTES


@pytest.fixture(autouse=True)
def on_threads(monkeypatch):
  """Every element's work on the worker threads (none in the consumer), and
  small elements placed too."""
  monkeypatch.setattr(parallel_executor, "INLINE_BELOW_S", 0.0)
  monkeypatch.setattr(batch_placement, "MIN_ELEMENT_BYTES", 0)


def image_like(x):
  return {
    "pixels": np.full((5, 6, 3), x % 251, np.uint8),
    "label": np.int64(x),
    "extra": (np.float32(x) / 2, np.arange(x, x + 2)),
  }


def noisy(x, rng):
  return {"noise": rng.random(4).astype(np.float32) + x, "x": np.asarray(x)}


def strings_and_ints(x):
  return {"name": b"n%d" % x, "x": x}


def fails_on_5_and_17(x):
  if x in (5, 17):
    raise ValueError(f"element {x} is bad")
  return image_like(x)


def grows_every_10(x):
  return np.zeros(x // 10 + 1, np.float32) + x


def outcomes(dataset: Dataset) -> list:
  """Each next() of the dataset's iterator: a batch, or the error's text."""
  with dataset.make_iterator() as iterator:
    return op_testing.next_outcomes(iterator)


assert_same_outcomes = op_testing.assert_same_outcomes


def parallel_and_sequential(fn, n, batch_size, threads=2, random=False, skip=0):
  def build(calls):
    dataset = Dataset.range(n)
    if random:
      dataset = dataset.random_map(fn, num_parallel_calls=calls, seed=3)
    else:
      dataset = dataset.map(fn, num_parallel_calls=calls)
    return dataset.skip(skip).batch(batch_size)

  return build(threads), build(None)


@pytest.mark.parametrize(
  "fn,random", [(image_like, False), (noisy, True), (strings_and_ints, False)]
)
@pytest.mark.parametrize("batch_size,threads", [(4, 2), (7, 3), (1, 2)])
def test_batches_equal_those_stacked_from_sequential_outputs(fn, random, batch_size, threads):
  ours, theirs = parallel_and_sequential(fn, 50, batch_size, threads, random)
  assert_same_outcomes(outcomes(ours), outcomes(theirs))


def test_whole_batches_are_views_of_one_block():
  ours, _ = parallel_and_sequential(image_like, 44, 8)
  batches = list(ours)
  assert batches[-1]["pixels"].base is None  # the short last one is stacked
  for batch in batches[:-1]:  # the first one too: copied into a block
    block = batch["pixels"].base
    assert block is not None and block.dtype == np.uint8
    assert batch["label"].base is block and batch["extra"][1].base is block


def test_small_elements_are_stacked_and_large_ones_placed(monkeypatch):
  monkeypatch.setattr(batch_placement, "MIN_ELEMENT_BYTES", DEFAULT_MIN_ELEMENT_BYTES)
  small, _ = parallel_and_sequential(image_like, 40, 8)
  assert all(batch["pixels"].base is None for batch in small)
  large, theirs = parallel_and_sequential(
    lambda x: np.full(DEFAULT_MIN_ELEMENT_BYTES, x % 251, np.uint8), 40, 8
  )
  batches = list(large)
  assert all(batch.base is not None for batch in batches)
  assert_same_outcomes(batches, list(theirs))


def test_batches_the_user_holds_are_never_written_again():
  ours, theirs = parallel_and_sequential(image_like, 200, 4)
  held = list(ours)  # far more batches than the blocks kept for reuse
  assert len(held) > 4 * batch_placement.POOL_BLOCKS
  assert_same_outcomes(held, list(theirs))


def test_memory_of_dropped_batches_is_written_again():
  ours, theirs = parallel_and_sequential(image_like, 200, 4)
  expected = list(theirs)
  seen, reused = [], 0
  for i, batch in enumerate(ours):
    op_testing.assert_identical_batch(batch, expected[i])
    if i:
      block = batch["pixels"].base
      reused += any(ref() is block for ref in seen)
      seen.append(weakref.ref(block))
      del block
    del batch
  assert reused >= len(seen) - batch_placement.POOL_BLOCKS - 1


def test_failing_elements_end_their_batch_like_sequential_batching():
  ours, theirs = parallel_and_sequential(fails_on_5_and_17, 40, 4)
  got = outcomes(ours)
  assert "element 5 is bad" in got and "element 17 is bad" in got
  assert_same_outcomes(got, outcomes(theirs))


def test_outputs_changing_shape_batch_or_fail_like_sequential_batching():
  ours, theirs = parallel_and_sequential(grows_every_10, 60, 4)
  got = outcomes(ours)
  assert any(isinstance(o, str) and "different shapes" in o for o in got)
  assert_same_outcomes(got, outcomes(theirs))


def test_skipped_elements_before_the_batch_keep_batches_aligned():
  ours, theirs = parallel_and_sequential(image_like, 50, 4, skip=3)
  assert_same_outcomes(outcomes(ours), outcomes(theirs))


def test_resumes_exactly_from_every_batch():
  op_testing.check_resume(
    lambda: Dataset.range(30).map(image_like, num_parallel_calls=2).batch(4),
    into_same_iterator=True,
  )


ROWS_HANDED_OUT = []  # the `out` arrays the functions below wrote into


def image_like_into(x, out=None):
  """image_like, its pixels written into `out` when there is one."""
  value = image_like(x)
  if out is not None:
    ROWS_HANDED_OUT.append(out["pixels"])
    np.copyto(out["pixels"], value["pixels"])
    value["pixels"] = out["pixels"]
  return value


def noisy_into(x, rng, out=None):
  noise = rng.random(4).astype(np.float32)
  if out is not None:
    ROWS_HANDED_OUT.append(out["noise"])
  return {"noise": np.add(noise, x, out=None if out is None else out["noise"]), "x": np.asarray(x)}


def fails_on_5_and_17_into(x, out=None):
  if x in (5, 17):
    raise ValueError(f"element {x} is bad")
  return image_like_into(x, out)


def grows_every_10_into(x, out=None):
  del out  # another shape every 10 elements: the rows do not fit
  return grows_every_10(x)


def writing_and_plain(fn_into, fn, n, batch_size, threads=2, random=False, skip=0):
  """The pipeline with `fn_into` writing into its rows, and with `fn`."""

  def build(f, calls, writes_out):
    dataset = Dataset.range(n)
    if random:
      dataset = dataset.random_map(f, num_parallel_calls=calls, seed=3, writes_out=writes_out)
    else:
      dataset = dataset.map(f, num_parallel_calls=calls, writes_out=writes_out)
    return dataset.skip(skip).batch(batch_size)

  return build(fn_into, threads, True), build(fn, None, False)


@pytest.mark.parametrize(
  "fn_into,fn,random,skip",
  [
    (image_like_into, image_like, False, 0),
    (noisy_into, noisy, True, 0),
    (image_like_into, image_like, False, 3),
    (fails_on_5_and_17_into, fails_on_5_and_17, False, 0),
    (grows_every_10_into, grows_every_10, False, 0),
  ],
)
@pytest.mark.parametrize("batch_size,threads", [(4, 2), (7, 3), (1, 2)])
def test_functions_writing_into_their_rows_give_the_plain_batches(
  fn_into, fn, random, skip, batch_size, threads
):
  ROWS_HANDED_OUT.clear()
  ours, theirs = writing_and_plain(fn_into, fn, 50, batch_size, threads, random, skip)
  got = outcomes(ours)
  assert_same_outcomes(got, outcomes(theirs))
  if fn_into is grows_every_10_into or skip:
    return  # rows that do not fit; a skip between the map and the batch
  # From the third batch on (the first two were on their way before the
  # first output showed the rows), the batches returned are the very rows
  # the function wrote into, with no copy of their own, except around an
  # error (the batch it ends is stacked, and so is the next one).
  handed_out = {row.__array_interface__["data"][0] for row in ROWS_HANDED_OUT}
  full = [
    b for b in got if isinstance(b, dict) and len(b["x" if random else "label"]) == batch_size
  ]
  key = "noise" if random else "pixels"
  written = [
    all(row.__array_interface__["data"][0] in handed_out for row in batch[key]) for batch in full
  ]
  errors = sum(isinstance(b, str) for b in got)
  assert sum(written) >= len(full) - 2 - 2 * errors


def test_without_a_batch_or_threads_the_function_gets_no_row():
  ROWS_HANDED_OUT.clear()
  for calls in (None, 2):
    got = list(Dataset.range(12).map(image_like_into, num_parallel_calls=calls, writes_out=True))
    assert [int(e["label"]) for e in got] == list(range(12))
  assert not ROWS_HANDED_OUT


def test_writing_functions_are_not_fused_away_from_their_rows():
  # Map fusion, map-and-filter fusion and the process chains would call fn
  # without its row; a map writing into its rows stays a map on threads.
  ROWS_HANDED_OUT.clear()
  dataset = (
    Dataset.range(40)
    .map(image_like_into, num_parallel_calls=parallel.AUTOTUNE, writes_out=True)
    .batch(4)
  )
  want = list(Dataset.range(40).map(image_like).batch(4))
  assert_same_outcomes(list(dataset), want)
  assert ROWS_HANDED_OUT
  ROWS_HANDED_OUT.clear()  # views of the chain's slots: they go with it
  dataset.close()
  plus_one = lambda e: {**e, "label": e["label"] + 1}
  got = list(
    Dataset.range(8)
    .map(image_like_into, num_parallel_calls=2, writes_out=True)
    .map(plus_one, num_parallel_calls=2)
  )
  assert [int(e["label"]) for e in got] == list(range(1, 9))


def test_writes_out_is_checked():
  with pytest.raises(TypeError, match="writes_out must be a bool, got 1"):
    Dataset.range(4).random_map(noisy_into, writes_out=1)


def test_resumes_exactly_when_writing_into_rows():
  op_testing.check_resume(
    lambda: Dataset.range(30).map(image_like_into, num_parallel_calls=2, writes_out=True).batch(4),
    into_same_iterator=True,
  )


def test_writes_out_is_kept_by_rebuilds_and_fingerprinted_only_when_set():
  from jaxfeed.ops.map import MapNode

  node = MapNode(Dataset.range(4).node, image_like_into, writes_out=True)
  assert MapNode(*node.parents, **node.spec_params()).writes_out
  plain = MapNode(Dataset.range(4).node, image_like_into)
  assert "writes_out" not in plain.spec_params()
  assert plain.fingerprint() != node.fingerprint()
