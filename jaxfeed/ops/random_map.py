"""`random_map`: fn(element, rng) with a per-record random generator."""

from __future__ import annotations

import threading
from typing import Any, Callable

import numpy as np

from jaxfeed.ops import parallel, process_pool
from jaxfeed.ops.base import Node, OpIterator, mix_seed
from jaxfeed.seeding import continue_mix

__all__ = [
  "RandomMapNode",
  "RandomMapIterator",
  "RandomMapCall",
  "ElementGenerators",
  "element_rng",
]


def element_rng(op_seed: int, record_seed: int) -> np.random.Generator:
  """The generator handed to fn for one element.

  Args:
    op_seed: the op's `seed` (0 when None).
    record_seed: the element's seed (`last_seed` of the parent, which
      sources set from the sampler's per-record seed).

  Returns:
    `np.random.Generator(np.random.Philox(key=mix_seed(op_seed, record_seed)))`.
  """
  key = mix_seed(op_seed, record_seed)
  # A key array equals key=int (low word first) and skips int conversion.
  return np.random.Generator(np.random.Philox(key=np.array([key, 0], dtype=np.uint64)))


class ElementGenerators:
  """Hands out `element_rng(op_seed, record_seed)`, reusing one per thread.

  Re-keying a thread's Philox generator gives the very stream a new one
  would, at a quarter of the cost of building it. A generator is therefore
  only valid during the call it was handed to.
  """

  def __init__(self, op_seed: int):
    self._op_prefix = mix_seed(op_seed)  # mixed once, continued per element
    self._local = threading.local()

  def __call__(self, record_seed: int) -> np.random.Generator:
    key = continue_mix(self._op_prefix, record_seed)
    local = self._local
    try:
      generator, state, key_words = local.cached
    except AttributeError:
      key_words = np.zeros(2, np.uint64)
      state = {
        "bit_generator": "Philox",
        "state": {"counter": np.zeros(4, np.uint64), "key": key_words},
        "buffer": np.zeros(4, np.uint64),
        "buffer_pos": 4,
        "has_uint32": 0,
        "uinteger": 0,
      }
      generator = np.random.Generator(np.random.Philox(key=0))
      local.cached = (generator, state, key_words)
    key_words[0] = key  # the state setter copies the arrays it is given
    generator.bit_generator.state = state
    return generator


class RandomMapNode(Node):
  """fn(element, rng) where rng depends only on the op seed and the record.

  The element is passed as one argument (tuples are not unpacked). Outputs
  do not depend on `num_parallel_calls`, on thread timing or on resuming
  from a checkpoint, because each element's generator is derived from its own
  record seed. `rng` is only valid during the call: do not keep it.

  Args:
    parent: the input node.
    fn: fn(element, rng) -> new element.
    num_parallel_calls: as for `map`.
    deterministic: as for `map` (only the order of outputs can change).
    seed: the op seed mixed into every element's generator (None: 0).
    backend: as for `map`; worker processes build the same generators.
    writes_out: fn takes a keyword argument `out` (see `Dataset.map`).
  """

  op_name = "random_map"

  def __init__(
    self,
    parent: Node,
    fn: Callable,
    num_parallel_calls: int | None = None,
    deterministic: bool = True,
    seed: int | None = None,
    backend: str = "auto",
    writes_out: bool = False,
  ):
    super().__init__([parent])
    self.fn = parallel.check_callable(fn, self.op_name)
    self.num_parallel_calls = parallel.check_num_parallel_calls(num_parallel_calls, self.op_name)
    self.deterministic = parallel.check_deterministic(deterministic, self.op_name)
    if seed is not None and (not isinstance(seed, (int, np.integer)) or isinstance(seed, bool)):
      raise TypeError(f"random_map: seed must be an int or None, got {seed!r}.")
    self.seed = None if seed is None else int(seed)
    self.backend = parallel.check_backend(backend, self.op_name)
    self.writes_out = parallel.check_writes_out(writes_out, self.op_name)

  def make_iterator(self) -> "RandomMapIterator":
    return RandomMapIterator(
      self.parents[0].make_iterator(),
      self.fn,
      self.num_parallel_calls,
      self.deterministic,
      self.seed or 0,
      self.backend,
      self.writes_out,
    )

  def spec_params(self) -> dict:
    params = {
      "fn": self.fn,
      "num_parallel_calls": self.num_parallel_calls,
      "deterministic": self.deterministic,
      "seed": self.seed,
      "backend": self.backend,
    }
    return parallel.with_writes_out(params, self.writes_out)

  def cardinality(self) -> int | None:
    return self.parents[0].cardinality()


def _random_map_work(
  fn: Callable, generators: ElementGenerators, writes_out: bool
) -> Callable[..., Any]:
  if writes_out:

    def work_into(element: Any, seed: int, out: Any = None) -> Any:
      return fn(element, generators(seed), out=out)

    return work_into

  def work(element: Any, seed: int) -> Any:
    return fn(element, generators(seed))

  return work


class RandomMapCall:
  """fn(element, rng) as a picklable callable of (element, record seed).

  What worker processes run, so that they build exactly the generator the
  thread path builds.
  """

  def __init__(self, fn: Callable, op_seed: int):
    self.fn = fn
    self.op_seed = op_seed

  def __call__(self, element: Any, record_seed: int) -> Any:
    return self.fn(element, element_rng(self.op_seed, record_seed))


def _process_work(pool: process_pool.ProcessPool) -> Callable[[Any, int], Any]:
  def work(element: Any, seed: int) -> Any:
    # The pool unpacks the tuple into RandomMapCall(element, seed).
    return pool((element, seed), seed)

  return work


class RandomMapIterator(parallel.ParallelMapIterator):
  """Iterator of `RandomMapNode`."""

  places_batches = True

  op_name = "random_map"

  def __init__(
    self,
    parent: OpIterator,
    fn: Callable,
    num_parallel_calls: int | None,
    deterministic: bool,
    op_seed: int,
    backend: str = "auto",
    writes_out: bool = False,
  ):
    self._fn = fn
    self._generators = ElementGenerators(op_seed)
    self._pool = None
    if backend == "process":
      # Outside a fused chain (`process_batch`) there is no row to hand out.
      self._pool = process_pool.pool_or_threads(
        RandomMapCall(parallel.without_out(fn, writes_out), op_seed), self.op_name
      )
    if self._pool is not None:
      work = _process_work(self._pool)
      writes_out = False
    else:
      work = _random_map_work(fn, self._generators, writes_out)
    self._work = work
    super().__init__(parent, work, num_parallel_calls, deterministic, writes_out)

  def _apply(self, element: Any) -> Any:
    return self._work(element, self._parent.last_seed)

  def skip_elements(self, count: int) -> int:
    """Skips up to `count` elements, without calling fn where possible."""
    return self._skip_one_to_one(count)
