"""The 8 CPU devices tests/conftest.py asks for, whatever the default backend.

Tests of CPU-only behaviour (a 4 x 2 mesh, divisibility by 8, CPU devices
aliasing host memory) place on these, so they run alike in CI and next to
an accelerator, where `jax.devices()` is the accelerator's.
"""

import jax
from jax.sharding import Mesh, NamedSharding
import numpy as np

from jaxfeed.device import batch_sharding


def cpus() -> list[jax.Device]:
  devices = jax.devices("cpu")
  assert len(devices) == 8, "tests/conftest.py must set XLA_FLAGS before jax is imported"
  return devices


def mesh_2d() -> Mesh:
  return Mesh(np.array(cpus()).reshape(4, 2), ("data", "model"))


def cpu_batch_sharding() -> NamedSharding:
  """The batch split over the 8 CPU devices."""
  return batch_sharding(Mesh(np.array(cpus()), ("data",)))
