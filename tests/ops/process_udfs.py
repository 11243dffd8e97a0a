"""Functions for the process_batch tests, importable by worker processes.

Kept apart from the test module, which imports the test helpers: a worker
imports the module of every function it runs, and this one is light.
"""

import numpy as np


def plus_ten(x):
  return {"x": x["x"] + 10, "name": f"n{int(x['x'])}"} if isinstance(x, dict) else x + 10


def jitter(x, rng):
  value = x["x"] if isinstance(x, dict) else x
  return {"v": np.float32(value) + rng.random(2, dtype=np.float32),
          "k": rng.integers(0, 100)}


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
