"""`Options`: switches for the static optimizer and the autotuner."""

from __future__ import annotations

import dataclasses
import os


@dataclasses.dataclass(frozen=True, slots=True)
class Options:
  """How a pipeline is rewritten and tuned before it runs.

  None of them changes the pipeline's elements (the rewrites compute the same
  output, the autotuner and `stats` only change how it runs), so they are no
  part of its fingerprint: service reads of pipelines that differ only in
  their Options are reads of one dataset (they may share a job), run with the
  Options it was first registered with.

  Attributes:
    optimize: master switch for every static rewrite below.
    map_fusion: map(f).map(g) -> map(g . f).
    map_and_filter_fusion: map(f).filter(p) -> one op computing both.
    filter_fusion: filter(p).filter(q) -> filter(p and q).
    noop_elimination: drops take(-1), skip(0), repeat(1), prefetch(0).
    map_and_batch_vectorization: map(f, batched=True).batch(b) runs f once per
      batch instead of once per element.
    inject_prefetch: appends prefetch(AUTOTUNE) to the end of the pipeline
      (off by default: jaxfeed.Loader already prefetches onto the device).
    autotune: lets AUTOTUNE parallelism and buffer sizes adapt while running.
    autotune_cpu_budget: threads the autotuner may use in total (0: all cores).
    autotune_ram_budget_bytes: bytes the autotuned buffers may hold in total
      (0: half of the machine's memory).
    stats: samples where the pipeline spends its time, for the iterator's
      `stats()` (see `jaxfeed.ops.op_stats`; its cost is a thread looking at
      the stacks 10 times a second, fewer on a busy machine). Element counts
      are kept either way.
  """

  optimize: bool = True
  map_fusion: bool = True
  map_and_filter_fusion: bool = True
  filter_fusion: bool = True
  noop_elimination: bool = True
  map_and_batch_vectorization: bool = True
  inject_prefetch: bool = False
  autotune: bool = True
  autotune_cpu_budget: int = 0
  autotune_ram_budget_bytes: int = 0
  stats: bool = True

  def __post_init__(self):
    for field in dataclasses.fields(self):
      value = getattr(self, field.name)
      if field.type == "bool" and not isinstance(value, bool):
        raise TypeError(f"Options.{field.name} must be a bool, got {value!r}.")
      if field.type == "int" and (
        not isinstance(value, int) or isinstance(value, bool) or value < 0
      ):
        raise ValueError(f"Options.{field.name} must be an int >= 0, got {value!r}.")

  @property
  def cpu_budget(self) -> int:
    return self.autotune_cpu_budget or os.cpu_count() or 1

  @property
  def ram_budget_bytes(self) -> int:
    if self.autotune_ram_budget_bytes:
      return self.autotune_ram_budget_bytes
    try:
      total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
      total = 8 << 30
    return total // 2

  def without_optimizations(self) -> "Options":
    """The same options with every static rewrite switched off."""
    return dataclasses.replace(self, optimize=False)
