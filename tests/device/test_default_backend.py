"""The Loader and DevicePrefetcher onto the default backend's devices.

Generic over `jax.devices()`: 8 CPU devices in CI, the GPU(s) on a GPU host.
The batch size is a multiple of the device count, so every test means the
same on either. Leaked threads are caught by tests/conftest.py's module check.
"""

import json
import threading
import traceback

import jax
import numpy as np
import pytest

import jaxfeed
from jaxfeed.device import DevicePrefetcher, batch_sharding

ROWS_PER_DEVICE = 2
NUM_BATCHES = 6
FAIL_AT_BATCH = 4


def batch_size() -> int:
  return ROWS_PER_DEVICE * jax.device_count()


def rows() -> dict[str, np.ndarray]:
  n = NUM_BATCHES * batch_size()
  return {
    "image": np.arange(n * 6, dtype=np.float32).reshape(n, 2, 3),
    "label": np.arange(n, dtype=np.int32),
  }


def add_one(element):
  return {"image": element["image"] + 1.0, "label": element["label"]}


def pipeline(reads_ahead: bool = False) -> jaxfeed.Dataset:
  """Shuffled, mapped, batched: every op has state a resume must restore."""
  dataset = (
    jaxfeed.Dataset.from_tensor_slices(rows())
    .shuffle(10, seed=5)
    .map(add_one)
    .batch(batch_size(), drop_remainder=True)
  )
  return dataset.prefetch(2) if reads_ahead else dataset


def host_batches() -> list[dict]:
  iterator = pipeline().make_iterator()
  try:
    return list(iterator)
  finally:
    iterator.close()


def device_prefetch_threads() -> list[threading.Thread]:
  return [t for t in threading.enumerate() if t.name == "jaxfeed-device-prefetch"]


def assert_on_default_devices(batch: dict, host: dict) -> None:
  assert set(batch) == set(host)
  for key, array in batch.items():
    assert isinstance(array, jax.Array)
    assert array.shape == host[key].shape and array.dtype == host[key].dtype
    assert array.sharding == batch_sharding()
    assert array.devices() == set(jax.devices())
    assert {d.platform for d in array.devices()} == {jax.default_backend()}
    assert len(array.addressable_shards) == jax.device_count()
    for shard in array.addressable_shards:
      assert shard.data.shape[0] == ROWS_PER_DEVICE
      np.testing.assert_array_equal(np.asarray(shard.data), host[key][shard.index])
    np.testing.assert_array_equal(np.asarray(array), host[key])


def assert_batches_equal(got: list, want: list) -> None:
  assert len(got) == len(want)
  for batch, host in zip(got, want):
    assert_on_default_devices(batch, host)


@pytest.mark.parametrize("reads_ahead", [False, True])
@pytest.mark.parametrize("prefetch", [0, 2])
def test_loader_yields_host_batches_as_global_arrays_on_default_devices(prefetch, reads_ahead):
  want = host_batches()
  assert len(want) == NUM_BATCHES
  with jaxfeed.Loader(pipeline(reads_ahead), prefetch=prefetch) as loader:
    got = list(loader)
  assert_batches_equal(got, want)


@pytest.mark.parametrize("reads_ahead", [False, True])
def test_read_ahead_thread_is_used_iff_default_backend_is_not_cpu(reads_ahead):
  # Placing on CPU devices is host work, done in next() when the pipeline
  # reads ahead itself; an accelerator's transfers get their own thread.
  on_cpu = jax.default_backend() == "cpu"
  want = host_batches()
  iterator = pipeline(reads_ahead).make_iterator()
  with DevicePrefetcher(iterator, None, prefetch=2, host_reads_ahead=reads_ahead) as it:
    assert it.places_inline == (reads_ahead and on_cpu)
    got = [next(it)]
    assert bool(device_prefetch_threads()) == (not it.places_inline)
    got += list(it)
  assert not device_prefetch_threads()
  assert_batches_equal(got, want)
  with jaxfeed.Loader(pipeline(reads_ahead), prefetch=2) as loader:
    got = [next(loader)]
    assert bool(device_prefetch_threads()) == (not (reads_ahead and on_cpu))
    got += list(loader)
  assert not device_prefetch_threads()
  assert_batches_equal(got, want)


@pytest.mark.parametrize("reads_ahead", [False, True])
@pytest.mark.parametrize("prefetch", [0, 2])
def test_resume_mid_epoch_gives_the_uninterrupted_batches(prefetch, reads_ahead):
  want = host_batches()
  with jaxfeed.Loader(pipeline(reads_ahead), prefetch=prefetch) as loader:
    first = [next(loader), next(loader)]
    state = json.loads(json.dumps(loader.get_state()))
    next(loader)  # Read past the checkpoint; the resume must not see it.
  assert state["batches"] == 2
  with jaxfeed.Loader(pipeline(reads_ahead), prefetch=prefetch) as resumed:
    resumed.set_state(state)
    rest = list(resumed)
  assert_batches_equal(first + rest, want)


class DecodeError(Exception):
  pass


def failing_decode(element):
  if int(element["label"]) == FAIL_AT_BATCH * batch_size():
    raise DecodeError("first record of batch 4 is corrupt")
  return element


@pytest.mark.parametrize("prefetch", [0, 2])
def test_pipeline_exception_reaches_the_consumer(prefetch):
  dataset = jaxfeed.Dataset.from_tensor_slices(rows()).map(failing_decode).batch(batch_size())
  with jaxfeed.Loader(dataset, prefetch=prefetch) as loader:
    for _ in range(FAIL_AT_BATCH):
      assert next(loader)["label"].devices() == set(jax.devices())
    with pytest.raises(DecodeError, match="batch 4 is corrupt") as info:
      next(loader)
  assert "failing_decode" in "".join(traceback.format_exception(info.value))


def test_close_stops_the_read_ahead_thread():
  loader = jaxfeed.Loader(pipeline(), prefetch=2)
  assert_on_default_devices(next(loader), host_batches()[0])
  assert len(device_prefetch_threads()) == 1
  loader.close()
  loader.close()
  assert not device_prefetch_threads()
  with pytest.raises(RuntimeError, match="after close"):
    next(loader)
