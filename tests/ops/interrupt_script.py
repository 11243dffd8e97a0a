"""Run by test_interrupt.py: a parallel pipeline interrupted by SIGINT."""

import json
import signal
import sys
import time

import numpy as np

import jaxfeed


def slow_square(x):
  time.sleep(0.01)
  return {"y": np.full((256,), x * x, np.int64)}


def main(report_path: str) -> None:
  # Ctrl-C as in a terminal: a shell that starts a job in the background
  # hands it SIGINT ignored, and the test must not depend on how it was run.
  signal.signal(signal.SIGINT, signal.default_int_handler)
  ds = (
    jaxfeed.Dataset.range(10**9)
    .map(slow_square, num_parallel_calls=2, backend="process")
    .map(slow_square_of_dict, num_parallel_calls=2)
    .prefetch(4)
  )
  it = iter(ds)
  next(it)
  pool = _find_pool(it)
  with open(report_path, "w") as f:
    json.dump({"pids": pool.pids()}, f)
  print("ready", flush=True)
  for _ in it:  # runs until SIGINT arrives
    pass


def slow_square_of_dict(element):
  return {"y": element["y"] + 1}


def _find_pool(it):
  stack = [it]
  while stack:
    node = stack.pop()
    pool = getattr(node, "_pool", None)
    if pool is not None:
      return pool
    stack.extend(getattr(node, "parents", []))
    root = getattr(node, "root", None)
    if root is not None:
      stack.append(root)
  raise RuntimeError("no process pool found")


if __name__ == "__main__":
  main(sys.argv[1])
