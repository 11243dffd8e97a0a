"""The arguments map-like ops share: `num_parallel_calls`, `deterministic`,
`backend`, `writes_out`, the user's function, and how a function is called
on an element (a tuple element unpacked into arguments, as in tf.data)."""

from __future__ import annotations

import functools
import os
from typing import Any, Callable

import numpy as np

from jaxfeed.ops.base import AUTOTUNE

__all__ = [
  "BACKENDS",
  "MAX_AUTOTUNE_PARALLELISM",
  "call_unpacked",
  "check_backend",
  "check_callable",
  "check_deterministic",
  "check_num_parallel_calls",
  "check_writes_out",
  "default_autotune_parallelism",
  "resolve_parallelism",
  "usable_cores",
  "with_writes_out",
  "without_out",
]

MAX_AUTOTUNE_PARALLELISM = 256
"""The most threads the autotuner may give a map-like op."""


def usable_cores() -> int:
  """The cores this process may run on (its CPU affinity, which a
  container or `taskset` may make fewer than the machine's)."""
  if hasattr(os, "sched_getaffinity"):
    return max(1, len(os.sched_getaffinity(0)))
  return os.cpu_count() or 1


def default_autotune_parallelism() -> int:
  """The parallelism AUTOTUNE starts from until the autotuner adjusts it."""
  return max(1, min(usable_cores(), 8))


def check_num_parallel_calls(value: Any, op_name: str) -> int | None:
  """Validates `num_parallel_calls`: None, AUTOTUNE (-1) or an int >= 1."""
  if value is None:
    return None
  if (
    isinstance(value, (int, np.integer))
    and not isinstance(value, bool)
    and (value == AUTOTUNE or value >= 1)
  ):
    return int(value)
  raise ValueError(
    f"{op_name}: num_parallel_calls must be None, jaxfeed.AUTOTUNE (-1) or "
    f"an integer >= 1, got {value!r}."
  )


def resolve_parallelism(num_parallel_calls: int | None) -> int:
  """The number of threads to start for a validated `num_parallel_calls`."""
  if num_parallel_calls is None:
    return 1
  if num_parallel_calls == AUTOTUNE:
    return default_autotune_parallelism()
  return num_parallel_calls


def call_unpacked(fn: Callable, element: Any) -> Any:
  """Calls fn like tf.data: a tuple element is unpacked into arguments."""
  if type(element) is tuple:  # Not namedtuples, as in tf.data.
    return fn(*element)
  return fn(element)


BACKENDS = ("auto", "thread", "process")


def check_backend(value: Any, op_name: str) -> str:
  """Validates a parallelism backend name (see `MapNode`'s `backend`)."""
  if value not in BACKENDS:
    raise ValueError(
      f"{op_name}: backend must be one of {', '.join(map(repr, BACKENDS))}, got {value!r}."
    )
  return value


def check_deterministic(value: Any, op_name: str) -> bool:
  """Validates `deterministic`: a bool, or None for the default (True)."""
  if value is None:
    return True
  if not isinstance(value, (bool, np.bool_)):
    raise TypeError(f"{op_name}: deterministic must be a bool or None, got {value!r}.")
  return bool(value)


def check_writes_out(value: Any, op_name: str) -> bool:
  """Validates `writes_out`: a bool."""
  if not isinstance(value, bool):
    raise TypeError(f"{op_name}: writes_out must be a bool, got {value!r}.")
  return value


def without_out(fn: Callable, writes_out: bool) -> Callable:
  """`fn` called with `out=None` when it writes out (a picklable partial)."""
  return functools.partial(fn, out=None) if writes_out else fn


def with_writes_out(params: dict, writes_out: bool) -> dict:
  """`spec_params` with `writes_out` when it is set: left out when False, so
  that the fingerprints of the maps that existed before it stay the same."""
  if writes_out:
    params["writes_out"] = True
  return params


def check_callable(fn: Any, op_name: str, name: str = "fn") -> Callable:
  """Validates that a user function is callable."""
  if not callable(fn):
    raise TypeError(f"{op_name}: {name} must be callable, got {type(fn).__name__}: {fn!r}.")
  return fn
