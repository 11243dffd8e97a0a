"""Device layer: host-local numpy batches -> global jax.Arrays on a mesh.

Needs only the iterator protocol of its input (`__next__`, and `get_state` /
`set_state` / `close` where available); it never imports op internals.
"""

from jaxfeed.device.placement import BatchPlacer, aligned_empty, batch_sharding
from jaxfeed.device.prefetcher import DevicePrefetcher

__all__ = ["BatchPlacer", "DevicePrefetcher", "aligned_empty", "batch_sharding"]
