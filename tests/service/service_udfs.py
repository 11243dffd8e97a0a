"""Module-level UDFs the service tests ship to worker processes by import path."""

import numpy as np


def add_one(x):
  return x + 1
