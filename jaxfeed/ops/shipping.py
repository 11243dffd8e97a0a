"""Functions and data shipped to worker processes by value.

`dumps` pickles with cloudpickle, as Ray, Dask and loky do: functions and
classes defined in `__main__` (a script, `python -c`, `python - <<EOF`, a
notebook), lambdas and closures travel by value (their code and the globals
and cells they use); functions of importable modules travel by reference,
and the worker imports their module. So a worker never needs the user's main
module, and never runs it.

numpy arrays of `SHARED_ARRAY_BYTES` or more are not copied into the pickle:
each goes into a memfd (`jaxfeed.ops.memfd`) handed to the worker as a file
descriptor and mapped read-only there, so an in-memory source is in memory
once however many workers read it.
"""

from __future__ import annotations

import io
import os
import pickle
import weakref
from typing import Any

import cloudpickle
import numpy as np

from jaxfeed.ops import memfd

__all__ = ["Shipment", "dumps", "loads", "why_not_shippable", "SHARED_ARRAY_BYTES"]

SHARED_ARRAY_BYTES = 1 << 20
"""Arrays at least this big go through shared memory, not the pickle."""


def _is_shared(obj: Any) -> bool:
  return type(obj) is np.ndarray and obj.nbytes >= SHARED_ARRAY_BYTES and not obj.dtype.hasobject


class _Pickler(cloudpickle.Pickler):
  """cloudpickle, with large arrays as indices into a list of memfds."""

  def __init__(self, file: Any, fds: list[int] | None):
    super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
    self._fds = fds  # None: a dry run (arrays are left out)

  def reducer_override(self, obj: Any) -> Any:
    if _is_shared(obj):
      if self._fds is None:
        return _placeholder, ()
      fd = memfd.anonymous_file("array", obj.nbytes)
      self._fds.append(fd)
      mapping = memfd.map_file(fd, obj.nbytes)
      try:
        np.ndarray(obj.shape, obj.dtype, buffer=mapping)[...] = obj
      finally:
        mapping.close()
      return _shared_array, (len(self._fds) - 1, obj.dtype.str, obj.shape)
    return super().reducer_override(obj)


def _placeholder() -> None:
  return None


class Shipment:
  """A pickled object and the memfds of its large arrays (closed with it)."""

  def __init__(self, data: bytes, fds: list[int]):
    self.data = data
    self.fds = fds
    self._finalizer = weakref.finalize(self, _close_fds, fds)

  def close(self) -> None:
    self._finalizer()


def _close_fds(fds: list[int]) -> None:
  for fd in fds:
    os.close(fd)
  fds.clear()


def dumps(obj: Any) -> Shipment:
  """`obj` pickled for a worker process (see the module docstring).

  Raises:
    Exception: whatever pickling raises for an object that cannot be
      shipped (a lock, an open file, a generator, ...).
  """
  fds: list[int] = []
  buffer = io.BytesIO()
  try:
    _Pickler(buffer, fds).dump(obj)
  except BaseException:
    _close_fds(fds)
    raise
  return Shipment(buffer.getvalue(), fds)


class _Sink:
  def write(self, data: Any) -> None:
    del data


def why_not_shippable(obj: Any) -> str | None:
  """None if `dumps(obj)` works, else why not (a dry run: nothing is
  copied into shared memory)."""
  try:
    _Pickler(_Sink(), None).dump(obj)
  except Exception as exc:  # noqa: BLE001 -- the reason is the answer
    return f"{type(exc).__name__}: {exc}"
  return None


# -- the worker's side ---------------------------------------------------------
_loading_fds: list[int] = []  # the descriptors of the shipment being loaded


def loads(data: bytes, fds: list[int]) -> Any:
  """The object `dumps` shipped, its arrays mapped from `fds` (which are
  closed; the mappings live as long as the arrays)."""
  _loading_fds[:] = fds
  try:
    return pickle.loads(data)
  finally:
    _loading_fds.clear()
    for fd in fds:
      os.close(fd)


def _shared_array(index: int, dtype: str, shape: tuple) -> np.ndarray:
  dtype_ = np.dtype(dtype)
  size = int(np.prod(shape)) * dtype_.itemsize
  mapping = memfd.map_file(_loading_fds[index], size, readonly=True)
  # A read-only mapping gives a read-only array that keeps the mapping.
  return np.frombuffer(mapping, dtype_, int(np.prod(shape))).reshape(shape)
