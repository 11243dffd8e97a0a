"""Tests of jaxfeed.Loader: sharding, resume, orbax, errors.

Tests of mesh layouts (2-D meshes, shards over 8 devices, divisibility by 8,
inline placement on CPU devices) place on the 8 CPU devices tests/conftest.py
asks for, which exist next to any accelerator. All other tests place on the
default devices (`jax.devices()`: 8 CPU devices in CI, the GPUs on a GPU
host), with batch sizes those devices divide (`batch_of`).
"""

import gc
import json
import math
import os
import threading
import time
import traceback

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
import numpy as np
import orbax.checkpoint as ocp
import pytest

import jaxfeed
from cpu_mesh import cpu_batch_sharding, cpus, mesh_2d

NUM_BATCHES = 6  # Of pipeline()'s default batch size.


def batch_of(rows: int) -> int:
  """The smallest multiple of `rows` that the default device count divides:
  `rows` itself on 1, 2, 4 or 8 devices."""
  return math.lcm(rows, jax.device_count())


def num_rows() -> int:
  """96 on 1, 2, 4 or 8 devices."""
  return NUM_BATCHES * batch_of(16)


@pytest.fixture(autouse=True)
def no_leaked_threads():
  before = set(threading.enumerate())
  yield
  gc.collect()
  deadline = time.monotonic() + 10
  while set(threading.enumerate()) - before:
    assert time.monotonic() < deadline, f"leaked threads: {set(threading.enumerate()) - before}"
    time.sleep(0.01)


def rows() -> dict[str, np.ndarray]:
  n = num_rows()
  return {
    "image": np.arange(n * 6, dtype=np.float32).reshape(n, 2, 3),
    "label": np.arange(n, dtype=np.int32),
  }


def add_one(element):
  return {"image": element["image"] + 1.0, "label": element["label"]}


def pipeline(batch_size: int | None = None, seed: int = 3) -> jaxfeed.Dataset:
  """Shuffled, mapped, batched: every op has state a resume must restore.

  The batch size defaults to `batch_of(16)`: 16 in CI, NUM_BATCHES batches."""
  return (
    jaxfeed.Dataset.from_tensor_slices(rows())
    .shuffle(20, seed=seed)
    .map(add_one)
    .batch(batch_size or batch_of(16), drop_remainder=True)
  )


def host_batches(dataset: jaxfeed.Dataset) -> list[dict]:
  iterator = dataset.make_iterator()
  try:
    return list(iterator)
  finally:
    iterator.close()


def to_host(batch) -> dict:
  return jax.tree_util.tree_map(np.asarray, batch)


def assert_batches_equal(got, want):
  assert len(got) == len(want)
  for g, w in zip(got, want):
    assert jax.tree_util.tree_structure(g) == jax.tree_util.tree_structure(w)
    for a, b in zip(jax.tree_util.tree_leaves(g), jax.tree_util.tree_leaves(w)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def assert_shards_match(array: jax.Array, host: np.ndarray) -> None:
  for shard in array.addressable_shards:
    np.testing.assert_array_equal(np.asarray(shard.data), host[shard.index])


# -- sharding ------------------------------------------------------------------
@pytest.mark.parametrize("prefetch", [0, 2])
def test_default_sharding_splits_batch_over_all_devices(prefetch):
  want = host_batches(pipeline())
  with jaxfeed.Loader(pipeline(), prefetch=prefetch) as loader:
    got = list(loader)
  assert len(got) == NUM_BATCHES
  rows_per_device = batch_of(16) // jax.device_count()  # 2 in CI.
  for batch, host in zip(got, want):
    for key in ("image", "label"):
      assert isinstance(batch[key], jax.Array)
      assert batch[key].sharding == jaxfeed.batch_sharding()
      assert batch[key].devices() == set(jax.devices())
      assert {d.platform for d in batch[key].devices()} == {jax.default_backend()}
      assert len(batch[key].addressable_shards) == jax.device_count()
      assert all(s.data.shape[0] == rows_per_device for s in batch[key].addressable_shards)
      assert_shards_match(batch[key], host[key])


def test_requested_named_sharding_is_used():
  sharding = NamedSharding(mesh_2d(), P("data"))
  want = host_batches(pipeline(batch_size=8))
  with jaxfeed.Loader(pipeline(batch_size=8), sharding=sharding) as loader:
    got = list(loader)
  for batch, host in zip(got, want):
    assert batch["image"].sharding == sharding
    assert batch["image"].devices() == set(cpus())
    assert batch["image"].addressable_shards[0].data.shape == (2, 2, 3)
    assert_shards_match(batch["image"], host["image"])
    assert_shards_match(batch["label"], host["label"])


def with_count(batch):
  return {**batch, "count": np.int32(len(batch["label"]))}


def test_pytree_of_shardings_and_replicated_scalars():
  mesh = mesh_2d()
  shardings = {
    "image": NamedSharding(mesh, P("data", None, "model")),
    "label": NamedSharding(mesh, P(("data", "model"))),
    "count": NamedSharding(mesh, P()),
  }
  dataset = (
    jaxfeed.Dataset.from_tensor_slices(
      {
        "image": np.arange(16 * 2 * 4, dtype=np.float32).reshape(16, 2, 4),
        "label": np.arange(16, dtype=np.int32),
      }
    )
    .batch(8)
    .map(with_count, batched=True)
  )
  want = host_batches(dataset)
  with jaxfeed.Loader(dataset, sharding=shardings) as loader:
    got = list(loader)
  assert len(got) == 2
  for batch, host in zip(got, want):
    for key in ("image", "label", "count"):
      assert batch[key].sharding == shardings[key]
      assert_shards_match(batch[key], np.asarray(host[key]))
    assert batch["count"].shape == ()
    assert int(batch["count"]) == 8


# -- state -----------------------------------------------------------------------
@pytest.mark.parametrize("prefetch", [0, 1, 3])
@pytest.mark.parametrize("consumed", [0, 1, 4])
def test_resume_from_state_yields_the_remaining_batches(prefetch, consumed):
  want = host_batches(pipeline())
  with jaxfeed.Loader(pipeline(), prefetch=prefetch) as loader:
    first = [to_host(next(loader)) for _ in range(consumed)]
    time.sleep(0.02)  # Let read-ahead run past the consumed batches.
    state = json.loads(json.dumps(loader.get_state()))
  assert state["batches"] == consumed
  with jaxfeed.Loader(pipeline(), prefetch=prefetch) as resumed:
    resumed.set_state(state)
    rest = [to_host(b) for b in resumed]
    assert resumed.get_state()["batches"] == len(want)
  assert_batches_equal(first + rest, want)


@pytest.mark.parametrize("prefetch", [0, 2])
def test_set_state_mid_iteration_rewinds_the_same_loader(prefetch):
  want = host_batches(pipeline())
  with jaxfeed.Loader(pipeline(), prefetch=prefetch) as loader:
    next(loader)
    next(loader)
    state = loader.get_state()
    next(loader)
    next(loader)
    loader.set_state(state)
    rest = [to_host(b) for b in loader]
  assert_batches_equal(rest, want[2:])


def test_set_state_after_exhaustion_restarts():
  with jaxfeed.Loader(pipeline()) as loader:
    start = loader.get_state()
    first_pass = [to_host(b) for b in loader]
    loader.set_state(start)
    assert_batches_equal([to_host(b) for b in loader], first_pass)


def test_state_of_another_pipeline_is_rejected():
  with jaxfeed.Loader(pipeline()) as loader:
    state = loader.get_state()
  other = jaxfeed.Dataset.from_tensor_slices(rows()).batch(batch_of(8))
  with jaxfeed.Loader(other) as loader:
    with pytest.raises(jaxfeed.PipelineStateError):
      loader.set_state(state)
    # The loader still works after the rejected restore.
    assert len(list(loader)) == num_rows() // batch_of(8)


@pytest.mark.parametrize("state", [{}, {"pipeline": {}}, {"pipeline": {}, "batches": "2"}, [1]])
def test_malformed_state_is_rejected(state):
  with jaxfeed.Loader(pipeline()) as loader:
    with pytest.raises(ValueError, match="expected the dict returned by Loader.get_state"):
      loader.set_state(state)


# -- orbax -------------------------------------------------------------------------
def model_state(value: float = 0.0) -> dict:
  return {"w": jnp.full((4, 2), value), "step": jnp.asarray(0)}


@pytest.mark.parametrize("prefetch", [0, 2])
def test_orbax_save_restore_of_model_and_loader_resumes_identically(tmp_path, prefetch):
  want = host_batches(pipeline())
  with ocp.CheckpointManager(tmp_path / "ckpt") as manager:
    with jaxfeed.Loader(pipeline(), prefetch=prefetch) as loader:
      first = [to_host(next(loader)) for _ in range(2)]
      assert jaxfeed.save_checkpoint(manager, 2, loader, model_state=model_state(1.5))
      next(loader)  # Progress after the save is not part of the checkpoint.
    manager.wait_until_finished()
    with jaxfeed.Loader(pipeline(), prefetch=prefetch) as resumed:
      restored = jaxfeed.restore_checkpoint(manager, None, resumed, model_state=model_state())
      assert resumed.get_state()["batches"] == 2
      rest = [to_host(b) for b in resumed]
  np.testing.assert_array_equal(restored["w"], np.full((4, 2), 1.5))
  assert_batches_equal(first + rest, want)


def test_orbax_composite_with_loader_items(tmp_path):
  with ocp.CheckpointManager(tmp_path / "ckpt") as manager:
    with jaxfeed.Loader(pipeline()) as loader:
      next(loader)
      saved = loader.get_state()
      manager.save(
        1,
        args=ocp.args.Composite(
          model=ocp.args.StandardSave(model_state(2.0)), loader=jaxfeed.LoaderSave(loader)
        ),
      )
      manager.wait_until_finished()
      files = sorted(p.name for p in (tmp_path / "ckpt" / "1" / "loader").iterdir())
      assert "process_0-of-1.json" in files
      restored = manager.restore(1, args=ocp.args.Composite(loader=jaxfeed.LoaderRestore()))
  assert restored["loader"] == saved


def test_orbax_restore_with_other_process_count_names_missing_files(tmp_path):
  with ocp.CheckpointManager(tmp_path / "ckpt") as manager:
    with jaxfeed.Loader(pipeline()) as loader:
      jaxfeed.save_checkpoint(manager, 0, loader, model_state=model_state())
      manager.wait_until_finished()
      loader_dir = tmp_path / "ckpt" / "0" / "loader"
      (loader_dir / "process_0-of-1.json").rename(loader_dir / "process_0-of-2.json")
      with pytest.raises(
        FileNotFoundError, match=r"written by 2 JAX processes.*process_1-of-2.json"
      ):
        jaxfeed.restore_checkpoint(manager, 0, loader, model_state=model_state())


def test_orbax_restore_with_other_process_count_names_a_shuffle_buffer(tmp_path):
  # pipeline() shuffles with a buffer: its elements belong to one process.
  with ocp.CheckpointManager(tmp_path / "ckpt") as manager:
    with jaxfeed.Loader(pipeline()) as loader:
      next(loader)
      jaxfeed.save_checkpoint(manager, 0, loader, model_state=model_state())
      manager.wait_until_finished()
      loader_dir = tmp_path / "ckpt" / "0" / "loader"
      saved = loader_dir / "process_0-of-1.json"
      for i in range(2):
        (loader_dir / f"process_{i}-of-2.json").write_text(saved.read_text())
      saved.unlink()
      with pytest.raises(ValueError, match=r"op 'shuffle' cannot be resumed"):
        jaxfeed.restore_checkpoint(manager, 0, loader, model_state=model_state())


def test_restore_without_checkpoint_is_rejected(tmp_path):
  with ocp.CheckpointManager(tmp_path / "empty") as manager:
    with jaxfeed.Loader(pipeline()) as loader:
      with pytest.raises(FileNotFoundError, match="no checkpoint"):
        jaxfeed.restore_checkpoint(manager, None, loader, model_state=model_state())


# -- stats ---------------------------------------------------------------------------
def test_stats_split_wait_and_model_time():
  with jaxfeed.Loader(pipeline(), prefetch=2) as loader:
    stats = loader.stats()
    assert [row["op"] for row in stats.pop("ops")] == [
      "from_tensor_slices",
      "shuffle",
      "map",
      "batch",
    ]
    assert stats == {
      "batches": 0,
      "wait_seconds": 0.0,
      "model_seconds": 0.0,
      "input_bound_fraction": 0.0,
    }
    next(loader)
    for _ in range(3):
      time.sleep(0.05)  # The "model step" between batches.
      next(loader)
    stats = loader.stats()
  assert stats["batches"] == 4
  assert stats["model_seconds"] >= 0.15
  assert stats["wait_seconds"] > 0.0
  assert stats["input_bound_fraction"] == pytest.approx(
    stats["wait_seconds"] / (stats["wait_seconds"] + stats["model_seconds"])
  )


def sleepy_add_one(x):
  time.sleep(0.004)  # Deliberately the slowest op by far.
  return x + 1


def test_report_says_input_bound_and_names_the_slow_op(capsys):
  dataset = (
    jaxfeed.Dataset.range(100_000)
    .map(np.negative)
    .map(np.negative)
    .map(sleepy_add_one, num_parallel_calls=2)
    .batch(batch_of(8))
    .prefetch(1)
  )
  with jaxfeed.Loader(dataset, prefetch=1) as loader:
    deadline = time.monotonic() + 60
    # Until the slow map has worked half a second and the sampler (10 looks
    # a second, fewer on a busy machine) has seen the loop wait.
    while True:
      rows = loader.stats()["ops"]
      if rows[2]["self_seconds"] >= 0.5 and rows[4]["wait_seconds"] > 0:
        break
      assert time.monotonic() < deadline, rows
      next(loader)
    text = loader.report()
    rows = loader.stats()["ops"]
  assert capsys.readouterr().out.strip() == text.strip()
  # The first two maps are fused (and named so); the slow one is not fused
  # with them (other parallelism) and is the op to fix.
  assert [row["op"] for row in rows] == ["range", "map+map", "map", "batch", "prefetch"]
  assert "Input bound" in text
  assert "Op to fix: 'map' (" in text
  assert rows[2]["parallelism"] == 2 and rows[2]["elements"] >= 50
  assert rows[4]["wait_seconds"] > 0


def test_report_on_a_model_bound_loop_says_so():
  with jaxfeed.Loader(pipeline(), prefetch=2) as loader:
    for _ in range(5):
      next(loader)
      time.sleep(0.1)  # A model step far slower than the input.
    with open(os.devnull, "w") as sink:
      text = loader.report(file=sink)
  assert "Not input bound" in text


# -- errors ----------------------------------------------------------------------------
class DecodeError(Exception):
  pass


FAIL_AT_BATCH = 5


def failing_decode(element):
  # The first record of batch FAIL_AT_BATCH of .batch(batch_of(8)): record 40 in CI.
  if int(element["label"]) == FAIL_AT_BATCH * batch_of(8):
    raise DecodeError(f"record {int(element['label'])} is corrupt")
  return element


@pytest.mark.parametrize("prefetch", [0, 2])
def test_pipeline_exception_reaches_the_training_loop(prefetch):
  dataset = jaxfeed.Dataset.from_tensor_slices(rows()).map(failing_decode).batch(batch_of(8))
  with jaxfeed.Loader(dataset, prefetch=prefetch) as loader:
    for _ in range(FAIL_AT_BATCH):
      next(loader)
    bad = FAIL_AT_BATCH * batch_of(8)
    with pytest.raises(DecodeError, match=f"record {bad} is corrupt") as info:
      next(loader)
  assert "failing_decode" in "".join(traceback.format_exception(info.value))


def assert_names_bad_batch_size(message: str, batch_size: int, devices: int) -> None:
  assert "['image']" in message or "['label']" in message
  assert f"local batch size {batch_size}" in message
  assert f"divisible by {devices}," in message


def test_batch_size_not_divisible_by_devices_is_a_clear_error():
  dataset = jaxfeed.Dataset.from_tensor_slices(rows()).batch(12)
  with jaxfeed.Loader(dataset, sharding=cpu_batch_sharding()) as loader:
    with pytest.raises(ValueError) as info:
      next(loader)
  assert_names_bad_batch_size(str(info.value), 12, 8)


@pytest.mark.parametrize("batch_size", [4, 12, 16])
def test_default_sharding_fails_exactly_on_batch_sizes_the_devices_do_not_divide(batch_size):
  # 4 and 12 fail over 8 CPU devices; over 1 GPU every size fits.
  n = jax.device_count()
  dataset = jaxfeed.Dataset.from_tensor_slices(rows()).batch(batch_size)
  with jaxfeed.Loader(dataset) as loader:
    if batch_size % n:
      with pytest.raises(ValueError) as info:
        next(loader)
      assert_names_bad_batch_size(str(info.value), batch_size, n)
    else:
      batch = next(loader)
      assert batch["label"].shape == (batch_size,)
      assert batch["label"].devices() == set(jax.devices())


def test_non_iterable_input_is_rejected():
  with pytest.raises(TypeError, match="must be a jaxfeed.Dataset or an iterable"):
    jaxfeed.Loader(42)


def test_unknown_end_of_input_policy_is_rejected():
  with pytest.raises(ValueError, match="end_of_input must be one of"):
    jaxfeed.Loader(pipeline(), end_of_input="longest")


@pytest.mark.parametrize("end_of_input", ["stop_at_shortest", "pad"])
def test_end_of_input_policy_changes_nothing_in_one_process(end_of_input):
  # No other process to agree with: no mask leaf, no padding, same batches.
  with jaxfeed.Loader(pipeline(), end_of_input=end_of_input, pad_to_common_shape=True) as loader:
    got = [to_host(batch) for batch in loader]
  assert_batches_equal(got, host_batches(pipeline()))


# -- a partial batch in one process -----------------------------------------------------
def twenty_in_eights(repeat: int = 1) -> jaxfeed.Dataset:
  """20 records in batches of 8 (one per CPU device): 8, 8 and a partial 4."""
  return (
    jaxfeed.Dataset.from_tensor_slices({"x": np.arange(20, dtype=np.int32)}).batch(8).repeat(repeat)
  )


def loaded(loader: jaxfeed.Loader) -> list[dict]:
  with loader:
    return [{k: np.asarray(v).tolist() for k, v in batch.items()} for batch in loader]


def test_a_partial_batch_in_one_process_is_dropped_by_default():
  # 4 rows cannot be split over 8 devices: before partial_batch, the epoch
  # ended in an error instead.
  for loader in (
    jaxfeed.Loader(twenty_in_eights()),
    jaxfeed.Loader(twenty_in_eights(), partial_batch="drop"),
  ):
    assert loaded(loader) == [{"x": list(range(8))}, {"x": list(range(8, 16))}]
  # Mid-stream too (batch, then repeat): only the partial steps go.
  assert [b["x"][0] for b in loaded(jaxfeed.Loader(twenty_in_eights(2)))] == [0, 8, 0, 8]


def test_a_partial_batch_in_one_process_is_padded_to_full_size_with_a_mask():
  batches = loaded(jaxfeed.Loader(twenty_in_eights(), partial_batch="pad"))
  assert batches == [
    {"x": list(range(8)), "mask": [True] * 8},
    {"x": list(range(8, 16)), "mask": [True] * 8},
    {"x": [16, 17, 18, 19, 0, 0, 0, 0], "mask": [True] * 4 + [False] * 4},
  ]


def test_a_partial_batch_in_one_process_is_an_error_naming_step_and_shape():
  with jaxfeed.Loader(twenty_in_eights(), partial_batch="error") as loader:
    assert len([next(loader), next(loader)]) == 2
    with pytest.raises(
      ValueError,
      match=r"partial_batch='error'\): the batch of "
      r"process\(es\) \[0\] at step 2 is partial: leaf \['x'\] has "
      r"local shape and dtype \(4,\) int32 on process 0, and a "
      r"complete batch has 8 rows",
    ):
      next(loader)


def test_a_loader_dropping_a_partial_batch_resumes_and_starts_the_next_epoch():
  loader = jaxfeed.Loader(twenty_in_eights(2))
  with loader:
    first = np.asarray(next(loader)["x"]).tolist()
    state = json.loads(json.dumps(loader.get_state()))
  restored = jaxfeed.Loader(twenty_in_eights(2))
  restored.set_state(state)
  rest = [b["x"][0] for b in loaded(restored)]
  assert first[0] == 0 and rest == [8, 0, 8]
  assert state["batches"] == 1


@pytest.mark.parametrize(
  "args,error",
  [
    ({"partial_batch": "fill"}, "partial_batch must be one of"),
    ({"partial_batch": "drop", "end_of_input": "pad"}, "partial_batch='drop' drops the steps"),
  ],
)
def test_partial_batch_values_are_checked(args, error):
  with pytest.raises(ValueError, match=error):
    jaxfeed.Loader(twenty_in_eights(), **args)


def test_padding_needs_dict_batches_for_its_mask():
  dataset = jaxfeed.Dataset.from_tensor_slices((np.arange(12),)).batch(8)
  with jaxfeed.Loader(dataset, partial_batch="pad") as loader:
    with pytest.raises(
      TypeError, match="padded batches must be dicts to carry the 'mask' mask leaf, got tuple"
    ):
      next(loader)


# -- plain iterables -------------------------------------------------------------------
def test_plain_iterable_of_numpy_batches_is_loaded_without_state():
  batches = [{"x": np.full((batch_of(8), 2), i, np.float32)} for i in range(3)]
  with jaxfeed.Loader(batches) as loader:
    got = [float(b["x"][0, 0]) for b in loader]
    with pytest.raises(TypeError, match="has no get_state"):
      loader.get_state()
  assert got == [0.0, 1.0, 2.0]


class StatefulBatches:
  """An iterable whose iterator checkpoints, as a non-jaxfeed pipeline might."""

  def __iter__(self):
    return StatefulBatchIterator()


class StatefulBatchIterator:
  def __init__(self):
    self.position = 0

  def __next__(self):
    if self.position == 5:
      raise StopIteration
    self.position += 1
    return {"x": np.full((batch_of(8),), self.position, np.int32)}

  def get_state(self):
    return {"position": self.position}

  def set_state(self, state):
    self.position = state["position"]


def test_iterable_with_state_methods_resumes():
  with jaxfeed.Loader(StatefulBatches(), prefetch=2) as loader:
    next(loader)
    next(loader)
    state = loader.get_state()
    assert state == {"pipeline": {"position": 2}, "batches": 2}
    next(loader)
    loader.set_state(state)
    assert [int(b["x"][0]) for b in loader] == [3, 4, 5]


# -- lifetime -------------------------------------------------------------------------
def threaded_pipeline() -> jaxfeed.Dataset:
  return (
    jaxfeed.Dataset.from_tensor_slices(rows()).map(add_one, num_parallel_calls=2).batch(batch_of(8))
  )


def test_close_is_idempotent_and_stops_iteration():
  loader = jaxfeed.Loader(threaded_pipeline(), prefetch=2)
  next(loader)
  loader.close()
  loader.close()
  with pytest.raises(RuntimeError, match="after close"):
    next(loader)


def test_unclosed_loader_releases_threads_on_gc():
  before = set(threading.enumerate())
  loader = jaxfeed.Loader(threaded_pipeline(), prefetch=2)
  next(loader)
  assert set(threading.enumerate()) - before
  del loader
  gc.collect()
  deadline = time.monotonic() + 10
  while set(threading.enumerate()) - before:
    assert time.monotonic() < deadline
    time.sleep(0.01)


def test_loader_is_exported_with_checkpoint_helpers():
  for name in (
    "Loader",
    "DevicePrefetcher",
    "batch_sharding",
    "LoaderSave",
    "LoaderRestore",
    "LoaderCheckpointHandler",
    "save_checkpoint",
    "restore_checkpoint",
  ):
    assert name in dir(jaxfeed)
    assert getattr(jaxfeed, name) is not None


# -- placement -----------------------------------------------------------------
def device_prefetch_threads():
  return [t for t in threading.enumerate() if t.name == "jaxfeed-device-prefetch"]


@pytest.mark.parametrize("ends_in_prefetch", [True, False])
def test_pipeline_that_reads_ahead_is_placed_inline_on_cpu_devices(ends_in_prefetch):
  dataset = pipeline().prefetch(2) if ends_in_prefetch else pipeline()
  want = host_batches(pipeline())
  sharding = cpu_batch_sharding()
  with jaxfeed.Loader(dataset, sharding=sharding, prefetch=2) as loader:
    got = [next(loader)]
    # A placement thread would only compete with the pipeline's own read-ahead
    # thread for the cores; without one it is what keeps batches ahead.
    assert bool(device_prefetch_threads()) != ends_in_prefetch
    got += list(loader)
  assert_batches_equal(got, want)
  assert all(b["image"].sharding == sharding for b in got)


def test_injected_prefetch_counts_as_reading_ahead():
  options = jaxfeed.Options(inject_prefetch=True)
  with jaxfeed.Loader(
    pipeline().with_options(options), sharding=cpu_batch_sharding(), prefetch=2
  ) as loader:
    next(loader)
    assert not device_prefetch_threads()
