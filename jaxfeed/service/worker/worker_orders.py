"""`parallel_epochs`: each worker streams the pipeline in its own order.

In a `parallel_epochs` job every worker runs the whole pipeline. Run as the
client built it, every worker would stream the same sequence, so a trainer
reading two workers would get each element twice in lock-step. tf.data
service's workers each read in their own order; so do jaxfeed's: the
dispatcher gives each task of such a job a worker index (0, 1, 2, ...: the
smallest one no other task of the job holds, so a worker that replaces a
lost one takes its index; see `jaxfeed.service.dispatcher.workers`), and the
worker of index i > 0 runs the pipeline with the seeds that decide its
order re-keyed by i:

- the `from_source` sampler's seed (`IndexSampler(shuffle=True, seed=s)`
  gives worker i the permutation of seed `mix_seed(s, ORDER_DOMAIN, i)`, and
  the per-record seeds that come with it), and those of the samplers a
  `Dataset.mix` mixes (the mixture keeps its own: each position reads the
  component it reads locally, another record of it);
- the seeds of `shuffle` and `sample_from_datasets`.

Worker 0 runs the pipeline as the client built it, so its stream is the
local run's. The order is a function of the pipeline and the index only:
the same job, index and seeds give the same stream on any worker, in any
run, which is what a resumed read relies on (`jaxfeed.service.protocol.stream_state`).
Each stream is still the whole pipeline: with `num_epochs=1` each element
once per worker. `distribute(..., identical_worker_streams=True)` gives every
task index 0: all workers stream the pipeline's own order, as before.
"""

from __future__ import annotations

from typing import Any

from jaxfeed.seeding import mix_seed
from jaxfeed.service.protocol import spec as spec_lib

# Separates worker orders from every other seed derived from a pipeline's.
ORDER_DOMAIN = 0x574F5244  # "WORD"
# Ops whose `seed` parameter decides the order of what they emit.
ORDER_OPS = frozenset({"shuffle", "sample_from_datasets"})
SOURCE_OP = "from_source"


def worker_seed(seed: int, worker_index: int) -> int:
  """The seed worker `worker_index` uses in place of `seed` (index 0: `seed`).

  Args:
    seed: a seed of the pipeline, in [0, 2**64).
    worker_index: the task's worker index, >= 0.

  Returns:
    A seed in [0, 2**64).
  """
  if worker_index == 0:
    return seed
  return mix_seed(seed, ORDER_DOMAIN, worker_index)


def _is_seed(value: Any) -> bool:
  return isinstance(value, int) and not isinstance(value, bool)


def reorder(worker_index: int) -> spec_lib.NodeRewrite | None:
  """The rewrite (see `spec.from_dataset_def`) that gives a pipeline the
  order of worker `worker_index`; None for index 0 (the pipeline's own)."""
  if worker_index == 0:
    return None

  def rewrite(cls: type, params: dict) -> tuple[type, dict]:
    op_name = getattr(cls, "op_name", None)
    if op_name in ORDER_OPS and _is_seed(params.get("seed")):
      return cls, {**params, "seed": worker_seed(int(params["seed"]), worker_index)}
    sampler: Any = params.get("sampler")
    if op_name == SOURCE_OP and _is_sampler(sampler):
      return cls, {**params, "sampler": reseeded(sampler, worker_index)}
    return cls, params

  return rewrite


def _is_sampler(value: Any) -> bool:
  return value is not None and hasattr(value, "spec_params")


def reseeded(sampler: Any, worker_index: int) -> Any:
  """`sampler` (anything with `spec_params()` that rebuild it) with its seed
  re-keyed by the index; a sampler that mixes others (`components`, see
  `Dataset.mix`) keeps its own seed, which picks the component of each
  position (so the mixture's proportions stay those of every prefix), and
  re-keys its components'."""
  params = dict(sampler.spec_params())
  components = params.get("components")
  if isinstance(components, list):
    params["components"] = [reseeded(c, worker_index) if _is_sampler(c) else c for c in components]
  elif _is_seed(params.get("seed")):
    params["seed"] = worker_seed(params["seed"], worker_index)
  return type(sampler)(**params)
