"""The seed of a random op: given by the user, or drawn and then carried.

An op built with `seed=None` draws a seed when its node is built. The seed is
saved in its iterators' states and a restored iterator adopts the saved one,
so an unseeded pipeline resumes exactly (in a new process too); a seed the
user gave that differs from the saved one is a `PipelineStateError`. Nodes
rebuilt from `spec_params` (the optimizer, service workers) get the seed and
whether it was given (`seed_given`), so they behave alike.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from jaxfeed.ops.base import PipelineStateError, state_int

__all__ = ["OpSeed"]


class OpSeed:
  """`seed` (an int in [0, 2**64)) and whether the user gave it."""

  __slots__ = ("seed", "given")

  def __init__(self, seed: Any, op_name: str, seed_given: bool | None = None):
    if seed is None:
      self.seed, self.given = int.from_bytes(os.urandom(8), "little"), False
      return
    if not isinstance(seed, (int, np.integer)) or isinstance(seed, bool) or not 0 <= seed < 2**64:
      raise ValueError(f"{op_name}: seed must be None or an integer in [0, 2**64), got {seed!r}.")
    self.seed = int(seed)
    self.given = True if seed_given is None else bool(seed_given)

  def params(self) -> dict:
    """The `spec_params` entries that rebuild it."""
    return {"seed": self.seed, "seed_given": self.given}

  def restored(self, state: dict, op_name: str) -> int:
    """The seed of a saved own state (`state["seed"]`), checked against a
    given seed; a drawn seed is replaced by it, so the iterators made after
    a restore (later epochs) go on as in the run that saved it."""
    seed = state_int(state, "seed", op_name, high=2**64 - 1)
    if self.given and seed != self.seed:
      raise PipelineStateError(
        f"Cannot restore op {op_name!r}: the state was saved with seed "
        f"{seed}, this pipeline has seed {self.seed}; restore into a "
        "pipeline built with the same seed (or seed=None to adopt the "
        "saved one)."
      )
    self.seed = seed
    return seed
