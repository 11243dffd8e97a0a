"""Pytrees of numpy arrays and Python scalars as JSON-able values, for the
states of ops that carry values between elements (scan, unique)."""

from __future__ import annotations

import base64
from typing import Any

import numpy as np

from jaxfeed.ops.base import PipelineStateError

__all__ = ["encode", "decode"]


def encode(value: Any) -> Any:
  """A JSON-able form of `value` that `decode` turns back into an equal value."""
  if isinstance(value, (np.ndarray, np.generic)):
    array = np.asarray(value)
    if array.dtype.hasobject:
      raise TypeError(f"Cannot save an object array in a pipeline state: {value!r:.80}.")
    return {
      "__nd__": array.dtype.str,
      "shape": list(array.shape),
      "scalar": isinstance(value, np.generic),
      "b64": base64.b64encode(np.ascontiguousarray(array).tobytes()).decode(),
    }
  if isinstance(value, bytes):
    return {"__bytes__": base64.b64encode(value).decode()}
  if value is None or isinstance(value, (bool, int, float, str)):
    return value
  if isinstance(value, tuple):
    return {"__tuple__": [encode(v) for v in value]}
  if isinstance(value, list):
    return [encode(v) for v in value]
  if isinstance(value, dict):
    return {"__dict__": [[encode(k), encode(v)] for k, v in value.items()]}
  raise TypeError(
    f"Cannot save a {type(value).__name__} in a pipeline state "
    f"(arrays, scalars, bytes, str and containers of them can be "
    f"saved): {value!r:.80}."
  )


def decode(obj: Any) -> Any:
  """Inverse of `encode`; PipelineStateError for a malformed value."""
  try:
    if isinstance(obj, list):
      return [decode(v) for v in obj]
    if not isinstance(obj, dict):
      return obj
    if "__nd__" in obj:
      data = base64.b64decode(obj["b64"])
      array = np.frombuffer(data, np.dtype(obj["__nd__"])).reshape(obj["shape"]).copy()
      return array[()] if obj.get("scalar") else array
    if "__bytes__" in obj:
      return base64.b64decode(obj["__bytes__"])
    if "__tuple__" in obj:
      return tuple(decode(v) for v in obj["__tuple__"])
    if "__dict__" in obj:
      return {_key(decode(k)): decode(v) for k, v in obj["__dict__"]}
  except (KeyError, TypeError, ValueError) as e:
    raise PipelineStateError(f"Cannot restore a saved value {obj!r:.120}: {e}") from e
  raise PipelineStateError(f"Cannot restore a saved value {obj!r:.120}.")


def _key(key: Any) -> Any:
  return tuple(key) if isinstance(key, list) else key
