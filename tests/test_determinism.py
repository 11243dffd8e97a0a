"""The same seed gives the same global batches however the pipeline runs:
any `num_parallel_calls`, thread or process workers (one JAX process, 8 CPU
devices, through `jaxfeed.Loader`)."""

import jax
import numpy as np
import pytest

import jaxfeed

NUM_RECORDS = 200
SEED = 11


def augment(element, rng):
  """A random augmentation: noise and a random crop offset per record."""
  return {
    "x": element["x"] + rng.normal(size=element["x"].shape),
    "offset": np.int64(rng.integers(0, 1000)),
    "label": element["label"],
  }


def square(element):
  return {**element, "x": element["x"] ** 2}


def keep(element):
  return element["offset"] % 3 != 0


def pipeline(num_parallel_calls, backend: str, seed: int = SEED) -> jaxfeed.Dataset:
  source = jaxfeed.ArraySource(
    {
      "x": np.arange(NUM_RECORDS * 4, dtype=np.float64).reshape(-1, 4),
      "label": np.arange(NUM_RECORDS),
    }
  )
  sampler = jaxfeed.IndexSampler(NUM_RECORDS, shuffle=True, seed=seed, num_epochs=2)
  return (
    jaxfeed.Dataset.from_source(source, sampler)
    .random_map(augment, num_parallel_calls=num_parallel_calls, seed=seed, backend=backend)
    .map(square, num_parallel_calls=num_parallel_calls, backend=backend)
    .filter(keep)
    .shuffle(16, seed=seed)
    .batch(16, drop_remainder=True)
  )


def global_batches(num_parallel_calls, backend: str, seed: int = SEED) -> list[dict]:
  with jaxfeed.Loader(pipeline(num_parallel_calls, backend, seed)) as loader:
    return [jax.tree_util.tree_map(np.asarray, batch) for batch in loader]


@pytest.fixture(scope="module")
def reference():
  return global_batches(None, "thread")


@pytest.mark.parametrize(
  "num_parallel_calls, backend",
  [
    (1, "thread"),
    (4, "thread"),
    (jaxfeed.AUTOTUNE, "thread"),
    (2, "process"),
    (jaxfeed.AUTOTUNE, "process"),
  ],
)
def test_same_seed_same_global_batches_with_any_parallelism_and_backend(
  reference, num_parallel_calls, backend
):
  got = global_batches(num_parallel_calls, backend)
  assert len(got) == len(reference) > 10
  for batch, want in zip(got, reference):
    assert batch.keys() == want.keys()
    for key in want:
      np.testing.assert_array_equal(batch[key], want[key])


def test_another_seed_gives_other_batches(reference):
  # Guards the comparison above: the batches do depend on the seed.
  other = global_batches(None, "thread", seed=SEED + 1)
  assert other[0]["label"].tolist() != reference[0]["label"].tolist()
