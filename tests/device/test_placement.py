"""Tests of batch_sharding and BatchPlacer.

Tests of mesh layouts (2-D meshes, shards over 8 devices, divisibility errors,
CPU aliasing) place on the 8 CPU devices tests/conftest.py asks for, which
exist next to any accelerator, so they run the same on every machine. Tests of
the default mesh place on `jax.devices()`, whatever the default backend is:
8 CPU devices in CI, the GPUs on a GPU host.
"""

import jax
from jax.sharding import NamedSharding, PartitionSpec as P
import numpy as np
import pytest

from cpu_mesh import cpu_batch_sharding, cpus, mesh_2d
from jaxfeed.device import BatchPlacer, aligned_empty, batch_sharding


def shard_rows(array: jax.Array) -> list[tuple[int, np.ndarray]]:
  """(first row, contents) of each addressable shard, by device id."""
  return [
    (shard.index[0].start or 0, np.asarray(shard.data))
    for shard in sorted(array.addressable_shards, key=lambda s: s.device.id)
  ]


def assert_shards_match(array: jax.Array, host: np.ndarray) -> None:
  for shard in array.addressable_shards:
    np.testing.assert_array_equal(np.asarray(shard.data), host[shard.index])


def test_batch_sharding_default_splits_batch_over_all_devices():
  sharding = batch_sharding()
  assert sharding.spec == P("data")
  assert sharding.mesh.shape == {"data": jax.device_count()}
  assert list(sharding.mesh.devices) == jax.devices()
  assert {d.platform for d in sharding.device_set} == {jax.default_backend()}


@pytest.mark.parametrize("axis_name", ["data", ("data", "model")])
def test_batch_sharding_on_given_mesh_uses_axis(axis_name):
  sharding = batch_sharding(mesh_2d(), axis_name)
  assert sharding.spec == P(axis_name)
  assert sharding.mesh.axis_names == ("data", "model")


def test_batch_sharding_default_mesh_takes_custom_axis_name():
  sharding = batch_sharding(axis_name="batch")
  assert sharding.spec == P("batch")
  assert sharding.mesh.axis_names == ("batch",)
  assert list(sharding.mesh.devices) == jax.devices()


@pytest.mark.parametrize(
  "use_mesh, axis_name, match",
  [
    (True, "nope", "'nope' is not an axis of the mesh"),
    (False, ("a", "b"), "must be one name"),
    (False, "", "non-empty mesh axis name"),
  ],
)
def test_batch_sharding_rejects_bad_axis(use_mesh, axis_name, match):
  with pytest.raises(ValueError, match=match):
    batch_sharding(mesh_2d() if use_mesh else None, axis_name)


@pytest.mark.parametrize("rows_per_device", [1, 2, 8])
def test_default_placement_splits_batch_over_all_devices(rows_per_device):
  batch_size = rows_per_device * jax.device_count()
  host = np.arange(batch_size * 3, dtype=np.float32).reshape(batch_size, 3)
  out = BatchPlacer(None)({"x": host})["x"]
  assert out.shape == host.shape
  assert out.sharding == batch_sharding()
  assert out.devices() == set(jax.devices())
  rows = shard_rows(out)
  assert [start for start, _ in rows] == list(range(0, batch_size, rows_per_device))
  assert all(data.shape == (rows_per_device, 3) for _, data in rows)
  assert_shards_match(out, host)


@pytest.mark.parametrize("batch_size", [8, 16, 64])
def test_placement_splits_batch_over_eight_cpu_devices(batch_size):
  host = np.arange(batch_size * 3, dtype=np.float32).reshape(batch_size, 3)
  out = BatchPlacer(cpu_batch_sharding())({"x": host})["x"]
  assert out.shape == host.shape
  assert out.devices() == set(cpus())
  rows = shard_rows(out)
  assert [start for start, _ in rows] == list(range(0, batch_size, batch_size // 8))
  assert all(data.shape == (batch_size // 8, 3) for _, data in rows)
  assert_shards_match(out, host)


def test_placement_with_requested_named_sharding_on_2d_mesh():
  sharding = NamedSharding(mesh_2d(), P("data", "model"))
  host = np.arange(8 * 6, dtype=np.int32).reshape(8, 6)
  out = BatchPlacer(sharding)({"x": host})["x"]
  assert out.sharding == sharding
  assert all(s.data.shape == (2, 3) for s in out.addressable_shards)
  assert_shards_match(out, host)


def test_pytree_of_shardings_applies_per_leaf_and_as_prefix():
  mesh = mesh_2d()
  by_data = NamedSharding(mesh, P("data"))
  by_both = NamedSharding(mesh, P(("data", "model")))
  batch = {
    "image": np.arange(8 * 4, dtype=np.float32).reshape(8, 4),
    "meta": {"id": np.arange(8, dtype=np.int64), "mask": np.ones((8, 2), dtype=bool)},
  }
  # "meta" gets one sharding for its whole subtree (a prefix of the batch).
  out = BatchPlacer({"image": by_both, "meta": by_data})(batch)
  assert out["image"].sharding == by_both
  assert out["meta"]["id"].sharding == by_data
  assert out["meta"]["mask"].sharding == by_data
  assert len({str(s.index) for s in out["image"].addressable_shards}) == 8
  assert len({str(s.index) for s in out["meta"]["id"].addressable_shards}) == 4
  for got, want in zip(jax.tree_util.tree_leaves(out), jax.tree_util.tree_leaves(batch)):
    assert_shards_match(got, want)


def test_callable_sharding_is_asked_per_leaf():
  mesh = mesh_2d()
  seen = []

  def choose(leaf):
    seen.append(leaf.shape)
    return NamedSharding(mesh, P("data") if leaf.ndim == 1 else P("data", "model"))

  out = BatchPlacer(choose)({"a": np.zeros(4), "b": np.zeros((4, 2))})
  assert out["a"].sharding.spec == P("data")
  assert out["b"].sharding.spec == P("data", "model")
  assert sorted(seen) == [(4,), (4, 2)]


@pytest.mark.parametrize("scalar", [np.int32(7), np.float32(2.5), 3, np.array(True)])
def test_scalars_are_replicated(scalar):
  out = BatchPlacer(None)({"x": np.zeros((jax.device_count(), 2)), "step": scalar})
  assert out["step"].shape == ()
  assert out["step"].sharding.is_fully_replicated
  assert out["step"].devices() == set(jax.devices())
  assert len(out["step"].addressable_shards) == jax.device_count()
  assert all(np.asarray(s.data) == np.asarray(scalar) for s in out["step"].addressable_shards)


def test_placement_preserves_structure_and_dtypes():
  n = jax.device_count()
  batch = {
    "b": (np.zeros((n,), np.uint8), [np.ones((n, 1), np.float16)]),
    "a": np.zeros((n,), np.int64),
  }
  out = BatchPlacer(None)(batch)
  assert set(out) == {"a", "b"}
  assert isinstance(out["b"], tuple) and isinstance(out["b"][1], list)
  assert out["b"][0].dtype == np.uint8
  assert out["b"][1][0].dtype == np.float16


@pytest.mark.parametrize("batch_size", [4, 12, 1])
def test_batch_size_not_divisible_by_devices_names_leaf_size_and_count(batch_size):
  batch = {"image": np.zeros((8, 2)), "label": np.zeros((batch_size,))}
  with pytest.raises(ValueError) as info:
    BatchPlacer(cpu_batch_sharding())(batch)
  message = str(info.value)
  assert "['label']" in message
  assert f"local batch size {batch_size}" in message
  assert "divisible by 8" in message


@pytest.mark.parametrize("batch_size", [4, 12, 1])
def test_default_placement_fails_exactly_on_sizes_not_divisible_by_device_count(batch_size):
  # Every size fails over 8 CPU devices; over 1 GPU each one fits.
  n = jax.device_count()
  batch = {"image": np.zeros((n, 2)), "label": np.zeros((batch_size,))}
  if batch_size % n:
    with pytest.raises(ValueError) as info:
      BatchPlacer(None)(batch)
    message = str(info.value)
    assert "['label']" in message
    assert f"local batch size {batch_size}" in message
    assert f"divisible by {n}," in message
  else:
    out = BatchPlacer(None)(batch)
    assert out["label"].shape == (batch_size,)
    assert out["label"].devices() == set(jax.devices())


def test_divisibility_counts_only_devices_on_the_batch_axis():
  placer = BatchPlacer(NamedSharding(mesh_2d(), P("data")))
  assert placer({"x": np.zeros((4, 3))})["x"].shape == (4, 3)
  with pytest.raises(ValueError, match="local batch size 6.*divisible by 4"):
    placer({"x": np.zeros((6, 3))})


def test_sharded_feature_dimension_is_validated():
  placer = BatchPlacer(NamedSharding(mesh_2d(), P("data", "model")))
  with pytest.raises(ValueError, match=r"\['x'\].*size of dimension 1 3.*divisible by 2"):
    placer({"x": np.zeros((4, 3))})


def test_sharding_with_more_dims_than_leaf_names_leaf():
  placer = BatchPlacer(NamedSharding(mesh_2d(), P("data", "model")))
  with pytest.raises(ValueError, match=r"leaf \['ids'\] of shape \(4,\)"):
    placer({"ids": np.zeros((4,))})


def test_sharding_pytree_not_matching_batch_is_rejected():
  sharding = batch_sharding()
  placer = BatchPlacer({"x": sharding, "y": sharding})
  with pytest.raises(ValueError, match="sharding pytree does not match the batch"):
    placer({"x": np.zeros((8,)), "z": np.zeros((8,))})


@pytest.mark.parametrize("bad", ["data", [1, 2], {"x": P("data")}])
def test_non_sharding_spec_is_rejected(bad):
  with pytest.raises(TypeError, match="must be a jax.sharding.Sharding"):
    BatchPlacer(bad)


def test_callable_returning_non_sharding_is_rejected():
  with pytest.raises(TypeError, match=r"returned .*data.* for leaf \['x'\]; it must return"):
    BatchPlacer(lambda leaf: P("data"))({"x": np.zeros((8,))})


@pytest.mark.parametrize("leaf", [np.array(["a"] * 8), np.array([object()] * 8)])
def test_non_numeric_leaf_is_rejected(leaf):
  with pytest.raises(TypeError, match=r"leaf \['text'\] has dtype"):
    BatchPlacer(None)({"text": leaf, "x": np.zeros((8,))})


def test_structure_change_between_batches_is_handled():
  n = jax.device_count()
  placer = BatchPlacer(None)
  first = placer({"x": np.zeros((n,))})
  second = placer({"x": np.zeros((n, 2)), "y": np.int32(1)})
  assert first["x"].shape == (n,)
  assert second["x"].shape == (n, 2)
  assert second["y"].sharding.is_fully_replicated


def test_aligned_batch_is_aliased_by_cpu_devices_not_copied():
  # Placing in next() is cheap because of this: each device's shard of an
  # aligned batch is the host memory itself.
  # Each device holds 8 rows of 8 * 8 * 3 float32: shards start 6144 bytes
  # apart, on 64-byte boundaries like the batch.
  image = aligned_empty((64, 8, 8, 3), np.float32)
  image[...] = np.arange(image.size, dtype=np.float32).reshape(image.shape)
  placed = BatchPlacer(cpu_batch_sharding())({"image": image})["image"]
  row_bytes = image.strides[0]
  for shard in placed.addressable_shards:
    first_row = shard.index[0].start or 0
    assert shard.data.unsafe_buffer_pointer() == (image.ctypes.data + first_row * row_bytes), (
      shard.device
    )
  assert_shards_match(placed, image)


@pytest.mark.parametrize(
  "shape,dtype", [((3, 5), np.float32), ((7,), np.uint8), ((2, 3, 4), np.int64), ((), np.float64)]
)
def test_aligned_empty_is_aligned_contiguous_and_writable(shape, dtype):
  for _ in range(4):  # Fresh allocations start at varying offsets.
    array = aligned_empty(shape, dtype)
    assert array.shape == shape and array.dtype == dtype
    assert array.ctypes.data % 64 == 0
    assert array.flags.c_contiguous and array.flags.writeable
    array[...] = 1
