"""Pipelines whose fingerprints tests compare across separate processes."""

import functools

import numpy as np

import jaxfeed

SCALE = 3
LABELS = ("cat", "dog")
CALLS = {"n": 0}  # module state a UDF updates: not part of what it computes


def scaled(x):
  return x * SCALE


def counting(x):
  CALLS["n"] += 1
  return x


def calls_helper(x):
  return scaled(x) + 1


def make(k):
  return lambda x: x * k


def with_state(state):
  def lookup(x):
    return state["weights"][x % len(state["weights"])]

  return lookup


def recursive(x):
  return x if x < 1 else recursive(x - 1)


def build() -> jaxfeed.Dataset:
  """One pipeline with every kind of UDF state the fingerprint hashes."""
  weights = np.linspace(0.0, 1.0, 7)
  return (
    jaxfeed.Dataset.range(20)
    .map(make(2))
    .map(lambda x, offset=5: x + offset)
    .map(with_state({"weights": weights, "names": frozenset({"x", "y", "z"})}))
    .map(functools.partial(np.add, 1))
    .map(scaled)
    .map(counting)
    .map(calls_helper)
    .map(recursive)
    .filter(lambda x: str(x) not in {"a", "b", "c"})
  )
