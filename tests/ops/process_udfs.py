"""Functions for the process_batch tests, importable by worker processes.

Kept apart from the test module, which imports the test helpers: a worker
imports the module of every function it runs, and this one is light.
"""

import numpy as np


def plus_ten(x):
  return {"x": x["x"] + 10, "name": f"n{int(x['x'])}"} if isinstance(x, dict) else x + 10


def jitter(x, rng):
  value = x["x"] if isinstance(x, dict) else x
  return {"v": np.float32(value) + rng.random(2, dtype=np.float32), "k": rng.integers(0, 100)}


def not_multiple_of_three(x):
  value = x["x"] if isinstance(x, dict) else x
  return value % 3 != 0


def fails_on_seven(x):
  if x == 7:
    raise ValueError("bad element 7")
  return np.array([x, x])


def busy_python(x):
  total = 0
  for i in range(300):
    total += i * int(x)
  return np.array([total], np.int64)


def wide_after_400(x):
  return np.full(1 if x < 400 else 4096, x, np.int64)  # 8 B, then 32 KiB


def image_rows(x, out=None, dtype="float32", log=None):
  """A 64 KiB image (and a label) written into `out` when given; with `log`,
  a line per element saying whether it had a row."""
  value = x["x"] if isinstance(x, dict) else x
  side = 128 if dtype == "uint8" else 64
  pixels = np.full((side, side // 2, 8), int(value) % 251, dtype)
  if log is not None:
    with open(log, "a") as file:
      file.write(f"{int(out is not None)}\n")
  if out is not None:
    np.copyto(out["pixels"], pixels)
    pixels = out["pixels"]
  return {"pixels": pixels, "label": np.int64(value)}


def image_rows_widen_at_18(x, out=None):
  """64 KiB images, then from element 18 on (mid-batch) twice as wide."""
  value = image_rows(x)
  if x >= 18:
    value["pixels"] = np.concatenate([value["pixels"]] * 2, axis=1)
  if out is not None and out["pixels"].shape == value["pixels"].shape:
    np.copyto(out["pixels"], value["pixels"])
    value["pixels"] = out["pixels"]
  return value


def image_rows_fail_at_13(x, out=None):
  if x == 13:
    raise ValueError("bad image 13")
  return image_rows(x, out)


_BUFFER = []


def image_in_one_buffer(x):
  """An image in the same array each call: the next call overwrites it."""
  if not _BUFFER:
    _BUFFER.append(np.empty((64, 32, 8), np.float32))
  _BUFFER[0][...] = x
  return {"pixels": _BUFFER[0]}
