"""Module-level UDFs the service tests ship to worker processes by import path."""

import numpy as np


def add_one(x):
  return x + 1


def add_one_to_x(element):
  return {**element, "x": element["x"] + 1}


def slow_add_one_to_x(element):
  import time  # pylint: disable=g-import-not-at-top
  time.sleep(0.002)
  return {**element, "x": element["x"] + 1}


def decode_record(record):
  """TFRecord payload: 4-byte int32 label then the raw bytes of x (int64)."""
  data = np.frombuffer(record, dtype=np.uint8)
  return {"label": data[:4].view(np.int32)[0], "x": data[4:].view(np.int64)[0]}
