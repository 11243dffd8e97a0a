"""Placing host-local numpy batches as global `jax.Array`s on a mesh.

A batch is a pytree of numpy arrays whose leading dimension is this process's
share of the global batch. `BatchPlacer` turns it into global arrays with
`jax.make_array_from_process_local_data` with an explicit global shape: along a
dimension split over the devices of several processes, the global size is the
local size times the number of distinct parts over all devices divided by the
number this process holds. That presumes every process holds the same local
shape; in multi-process jobs the `DevicePrefetcher`'s end-of-input agreement
checks it (see `jaxfeed.device.agreement`). When every device is this
process's, one `jax.device_put` of all leaves places the batch.

On CPU devices a leaf whose memory is 64-byte aligned and C-contiguous (with
shard boundaries on 64-byte multiples, as for a batch split along its leading
dimension) is aliased by the devices, not copied; other leaves are copied.
`aligned_empty` allocates such memory.
"""

from __future__ import annotations

from typing import Any, Callable, Union

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec, Sharding
import numpy as np

# jax 0.6 (the newest release for Python 3.10) places one array per call; the
# releases pinned for Python 3.11+ place the whole list of leaves in one call.
_PLACES_LEAF_LISTS = jax.__version_info__ >= (0, 7)

# The alignment XLA's CPU client needs to use host memory as a device buffer.
_ALIGNMENT = 64

ShardingLike = Union[Sharding, Callable[[np.ndarray], Sharding], Any]
"""A `Sharding` for every leaf, a pytree of shardings (a prefix of the batch
structure), or a callable leaf -> Sharding."""


def batch_sharding(
  mesh: Mesh | None = None, axis_name: str | tuple[str, ...] = "data"
) -> NamedSharding:
  """The sharding that splits the leading (batch) dimension over `axis_name`.

  Args:
    mesh: the device mesh; by default a 1-D mesh over all `jax.devices()`
      whose single axis is `axis_name`.
    axis_name: the mesh axis (or tuple of axes) the batch dimension is split
      over; the other dimensions are replicated.

  Returns:
    `NamedSharding(mesh, PartitionSpec(axis_name))`.
  """
  names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
  if not names or not all(isinstance(n, str) and n for n in names):
    raise ValueError(
      f"batch_sharding: axis_name must be a non-empty mesh axis name or a "
      f"tuple of them, got {axis_name!r}."
    )
  if mesh is None:
    if len(names) != 1:
      raise ValueError(
        f"batch_sharding: without a mesh, axis_name must be one name (the "
        f"default mesh is 1-D), got {axis_name!r}."
      )
    mesh = Mesh(np.array(jax.devices()), names)
  missing = [n for n in names if n not in mesh.axis_names]
  if missing:
    raise ValueError(
      f"batch_sharding: axis {missing[0]!r} is not an axis of the mesh; its "
      f"axes are {tuple(mesh.axis_names)}."
    )
  return NamedSharding(mesh, PartitionSpec(axis_name))


def aligned_empty(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
  """An uninitialized C-contiguous array whose data (if it has any) starts on
  a 64-byte boundary.

  A batch leaf written into one (e.g. the output of a batch-wise augmentation)
  is aliased by CPU devices when placed, not copied, as long as each device's
  shard also starts on a 64-byte boundary (the bytes of one device's rows are
  a multiple of 64).

  Args:
    shape: the array's shape.
    dtype: its numpy dtype.

  Returns:
    A writable array of `shape` and `dtype`, owned by a slightly larger buffer.
  """
  dtype = np.dtype(dtype)
  nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
  raw = np.empty(nbytes + _ALIGNMENT, np.uint8)
  start = -raw.ctypes.data % _ALIGNMENT
  return raw[start : start + nbytes].view(dtype).reshape(shape)


def _is_sharding(value: Any) -> bool:
  return isinstance(value, Sharding)


def _replicated(sharding: Sharding) -> Sharding:
  """A fully replicated sharding over the same devices (for 0-d leaves)."""
  if isinstance(sharding, NamedSharding):
    return NamedSharding(sharding.mesh, PartitionSpec())
  if sharding.is_fully_replicated:
    return sharding
  devices = sorted(sharding.device_set, key=lambda d: d.id)
  return NamedSharding(Mesh(np.array(devices), ("replica",)), PartitionSpec())


def _parts(sharding: Sharding, ndim: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
  """Per dimension: how many distinct slices this process's devices hold, and
  how many all devices hold.

  The local array's size along a dimension must be a multiple of the first;
  its global size is the local size times all / local. A probe shape of
  `len(device_set)` per dimension is divisible by every partition count a mesh
  can produce.
  """
  probe = (len(sharding.device_set),) * ndim

  def count(index_map: dict) -> tuple[int, ...]:
    return tuple(len({(index[d].start or 0) for index in index_map.values()}) for d in range(ndim))

  return (
    count(sharding.addressable_devices_indices_map(probe)),
    count(sharding.devices_indices_map(probe)),
  )


class BatchPlacer:
  """Turns host-local batch pytrees into global jax.Arrays.

  Scalars and 0-d leaves are replicated on the sharding's devices. Each leaf
  is validated against its sharding (cached per sharding and rank), so a batch
  size that the process's devices cannot split evenly fails with a ValueError
  naming the leaf, the size and the device count.
  """

  def __init__(self, sharding: ShardingLike = None):
    if sharding is None:
      sharding = batch_sharding()
    if _is_sharding(sharding):
      self._mode = "one"
    elif callable(sharding):
      self._mode = "fn"
    else:
      leaves = jax.tree_util.tree_leaves(sharding, is_leaf=_is_sharding)
      bad = [leaf for leaf in leaves if not _is_sharding(leaf)]
      if not leaves or bad:
        raise TypeError(
          "DevicePrefetcher: sharding must be a jax.sharding.Sharding, a "
          "pytree of Shardings matching the batch, or a callable leaf -> "
          f"Sharding; got {type(sharding).__name__} "
          f"{bad[0] if bad else sharding!r:.120}."
        )
      self._mode = "tree"
    self._sharding = sharding
    # (sharding, rank) -> (local parts, global parts) per dimension.
    self._parts: dict[tuple[Sharding, int], tuple[tuple[int, ...], ...]] = {}
    self._replicated: dict[Sharding, Sharding] = {}
    # Shardings of the last batch structure seen (key: treedef and ranks).
    self._cached_key: Any = None
    self._cached_shardings: list[Sharding] = []
    # Whether every device is this process's: then the global shape is the
    # local one and one device_put places all leaves, without the per-leaf
    # bookkeeping of make_array_from_process_local_data.
    self._local_only = not self.spans_processes()

  def __call__(self, batch: Any) -> Any:
    leaves, treedef = jax.tree_util.tree_flatten(batch)
    leaves = [leaf if isinstance(leaf, np.ndarray) else np.asarray(leaf) for leaf in leaves]
    shardings = self._shardings_for(batch, leaves, treedef)
    global_shapes = [
      self._global_shape(batch, i, leaf, sharding)
      for i, (leaf, sharding) in enumerate(zip(leaves, shardings))
    ]
    if self._local_only:
      arrays = jax.device_put(leaves, shardings)
    elif _PLACES_LEAF_LISTS:
      arrays = jax.make_array_from_process_local_data(shardings, leaves, global_shapes)
    else:
      arrays = [
        jax.make_array_from_process_local_data(sharding, leaf, shape)
        for sharding, leaf, shape in zip(shardings, leaves, global_shapes)
      ]
    return jax.tree_util.tree_unflatten(treedef, arrays)

  def spans_processes(self) -> bool:
    """Whether the shardings may place a batch over several JAX processes'
    devices (a sharding function may, whatever it returns later)."""
    if self._mode == "fn":
      return True
    shardings = jax.tree_util.tree_leaves(self._sharding, is_leaf=_is_sharding)
    return any(d.process_index != jax.process_index() for s in shardings for d in s.device_set)

  def on_cpu_devices_only(self) -> bool:
    """Whether every batch goes to CPU devices only (unknown for a sharding
    function, so False for one)."""
    if self._mode == "fn":
      return False
    shardings = jax.tree_util.tree_leaves(self._sharding, is_leaf=_is_sharding)
    return all(d.platform == "cpu" for s in shardings for d in s.device_set)

  # -- shardings per leaf ----------------------------------------------------
  def _shardings_for(self, batch: Any, leaves: list[np.ndarray], treedef: Any) -> list[Sharding]:
    if self._mode == "fn":
      shardings = []
      for i, leaf in enumerate(leaves):
        sharding = self._sharding(leaf)
        if not _is_sharding(sharding):
          raise TypeError(
            f"DevicePrefetcher: the sharding function returned "
            f"{sharding!r:.100} for leaf {_leaf_path(batch, i)}; "
            f"it must return a jax.sharding.Sharding."
          )
        shardings.append(self._for_rank(sharding, leaf.ndim))
      return shardings
    key = (treedef, tuple(leaf.ndim for leaf in leaves))
    if key != self._cached_key:
      if self._mode == "one":
        per_leaf = [self._sharding] * len(leaves)
      else:
        per_leaf = self._broadcast_tree(batch, treedef)
      self._cached_shardings = [self._for_rank(s, leaf.ndim) for s, leaf in zip(per_leaf, leaves)]
      self._cached_key = key
    return self._cached_shardings

  def _broadcast_tree(self, batch: Any, treedef: Any) -> list[Sharding]:
    """Expands the sharding pytree (a prefix of the batch) to one per leaf."""
    try:
      expanded = jax.tree_util.tree_map(
        lambda s, subtree: jax.tree_util.tree_map(lambda _: s, subtree),
        self._sharding,
        batch,
        is_leaf=_is_sharding,
      )
    except (ValueError, TypeError) as e:
      raise ValueError(
        "DevicePrefetcher: the sharding pytree does not match the batch "
        f"structure {treedef}; it must have the batch's structure or a "
        f"prefix of it. ({e})"
      ) from e
    return jax.tree_util.tree_leaves(expanded, is_leaf=_is_sharding)

  def _for_rank(self, sharding: Sharding, ndim: int) -> Sharding:
    if ndim:
      return sharding
    replicated = self._replicated.get(sharding)
    if replicated is None:
      replicated = self._replicated[sharding] = _replicated(sharding)
    return replicated

  # -- validation -------------------------------------------------------------
  def _global_shape(
    self, batch: Any, index: int, leaf: np.ndarray, sharding: Sharding
  ) -> tuple[int, ...]:
    """Checks the leaf against its sharding; returns the global shape."""
    if leaf.dtype.kind in "OUSV":
      raise TypeError(
        f"DevicePrefetcher: leaf {_leaf_path(batch, index)} has dtype "
        f"{leaf.dtype}, which cannot be placed on devices; allowed are "
        "numeric and bool arrays."
      )
    if not leaf.ndim:
      return ()
    key = (sharding, leaf.ndim)
    parts = self._parts.get(key)
    if parts is None:
      try:
        parts = self._parts[key] = _parts(sharding, leaf.ndim)
      except (ValueError, IndexError) as e:
        raise ValueError(
          f"DevicePrefetcher: leaf {_leaf_path(batch, index)} of shape "
          f"{leaf.shape} cannot use sharding {sharding}: {e}"
        ) from e
    local_parts, global_parts = parts
    for dim, (size, count) in enumerate(zip(leaf.shape, local_parts)):
      if size % count:
        what = "local batch size" if dim == 0 else f"size of dimension {dim}"
        raise ValueError(
          f"DevicePrefetcher: leaf {_leaf_path(batch, index)} has "
          f"{what} {size}, which is not divisible by {count}, the number "
          f"of this process's devices that dimension is split over "
          f"(sharding {sharding}). Use a per-process batch size that is a "
          f"multiple of {count} (e.g. batch(..., drop_remainder=True))."
        )
    return tuple(
      size // count * total for size, count, total in zip(leaf.shape, local_parts, global_parts)
    )


def _leaf_path(batch: Any, index: int) -> str:
  """The path of leaf `index` in `jax.tree_util` flatten order, e.g. "['x']"."""
  path = jax.tree_util.tree_flatten_with_path(batch)[0][index][0]
  return jax.tree_util.keystr(path) or "<batch>"
