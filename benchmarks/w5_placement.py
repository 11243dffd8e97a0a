r"""W5: W1's pipeline through `jaxfeed.Loader` onto 8 CPU devices vs host only.

Every round runs one epoch of each variant, in a rotated order, so that a
change in machine load hits every variant alike; the rates are medians over
the rounds after a warm-up round. Variants:

* `host-only`: the pipeline's numpy batches, nothing placed.
* `loader-prefetch0`: `Loader(prefetch=0)`, each batch placed in `next()`.
* `loader-default`: `Loader()` (prefetch=2); the pipeline ends in `prefetch`,
  so on CPU devices it also places in `next()` (`DevicePrefetcher.places_inline`).
* `loader-thread`: prefetch=2 with the placement thread (what the default did
  before), for comparison.
* `*-aligned` (with --aligned): the same with the augmentation writing into
  64-byte aligned memory, which the CPU devices alias instead of copying.

Each line gets `overhead_vs_host_only` (host rate / rate - 1, of the host-only
variant with the same augmentation), the median CPU time of all threads per
batch of 128 (steadier than rates on a loaded machine) and the peak RSS seen
while it ran.

  python -m benchmarks.w5_placement --rounds=5
"""

from __future__ import annotations

import os

# 8 CPU devices; XLA reads this once, before jax is imported.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import functools  # noqa: E402
import gc  # noqa: E402
import resource  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from typing import Callable, Iterator  # noqa: E402

from absl import app  # noqa: E402
from absl import flags  # noqa: E402

from benchmarks import harness  # noqa: E402
from benchmarks import record  # noqa: E402
from benchmarks import workloads  # noqa: E402

FLAGS = flags.FLAGS


def _define_flags() -> None:
  # Only when run as a script: benchmarks.run imports this module and has its
  # own --scale.
  flags.DEFINE_integer(
    "rounds", 5, "Timed rounds (one epoch of each variant) after a warm-up round."
  )
  flags.DEFINE_float("scale", 1.0, "Fraction of W1's 20,000 images.")
  flags.DEFINE_bool(
    "aligned", False, "Also run the variants whose augmentation writes aligned memory."
  )


def _pipeline(data: dict, aligned: bool):
  if aligned:
    from jaxfeed.device import aligned_empty

    return workloads._w1_jaxfeed(  # pylint: disable=protected-access
      data,
      batched=True,
      augment_batched=functools.partial(workloads.augment_batch, empty=aligned_empty),
    )
  return workloads._w1_jaxfeed(data, batched=True)  # pylint: disable=protected-access


def variants(data: dict, aligned: bool) -> dict[str, Callable[[], Iterator]]:
  """Name -> a function returning one epoch's iterator of batches."""
  import jax
  import jaxfeed
  from jaxfeed.device import DevicePrefetcher

  def placed(make: Callable[[], Iterator]) -> Callable[[], Iterator]:
    def epoch():
      with make() as loader:
        for batch in loader:
          jax.block_until_ready(batch)
          yield batch

    return epoch

  suffix = "-aligned" if aligned else ""
  return {
    f"host-only{suffix}": lambda: iter(_pipeline(data, aligned)),
    f"loader-prefetch0{suffix}": placed(
      lambda: jaxfeed.Loader(_pipeline(data, aligned), prefetch=0)
    ),
    f"loader-default{suffix}": placed(lambda: jaxfeed.Loader(_pipeline(data, aligned))),
    f"loader-thread{suffix}": placed(
      lambda: DevicePrefetcher(_pipeline(data, aligned).make_iterator(), prefetch=2)
    ),
  }


def _cpu_seconds() -> float:
  usage = resource.getrusage(resource.RUSAGE_SELF)
  return usage.ru_utime + usage.ru_stime


def _epoch(make_epoch: Callable[[], Iterator]) -> tuple[float, float, float]:
  """(images/s, CPU ms of all threads per 128 images, peak RSS in MB) of one
  epoch."""
  gc.collect()
  images = 0
  with harness.PeakRSS() as rss:
    start, cpu_start = time.perf_counter(), _cpu_seconds()
    for batch in make_epoch():
      images += batch["label"].shape[0]
    elapsed, cpu = time.perf_counter() - start, _cpu_seconds() - cpu_start
  return images / elapsed, cpu * 1e3 * 128 / images, rss.peak_bytes / 2**20


def run(rounds: int, scale: float, aligned: bool = False) -> list[dict]:
  """Runs the variants interleaved; prints and returns one JSON line each."""
  import jax

  data = workloads.w1_data(scale)
  runs = variants(data, False)
  if aligned:
    runs.update(variants(data, True))
  names = list(runs)
  rates: dict[str, list[float]] = {name: [] for name in names}
  cpu_ms: dict[str, list[float]] = {name: [] for name in names}
  peaks: dict[str, float] = {name: 0.0 for name in names}
  for round_ in range(rounds + 1):
    shift = round_ % len(names)
    for name in names[shift:] + names[:shift]:
      rate, cpu, peak = _epoch(runs[name])
      peaks[name] = max(peaks[name], peak)
      if round_:  # Round 0 warms up every variant.
        rates[name].append(rate)
        cpu_ms[name].append(cpu)
  results = {
    name: {
      "rate": statistics.median(rates[name]),
      "rates": [round(r) for r in rates[name]],
      "cpu_ms_per_batch": round(statistics.median(cpu_ms[name]), 2),
      "peak_rss_mb": round(peaks[name], 1),
    }
    for name in names
  }
  extra = {}
  for name in names:
    host = "host-only-aligned" if name.endswith("-aligned") else "host-only"
    extra[name] = {
      "devices": len(jax.devices()),
      "rounds": rounds,
      "overhead_vs_host_only": round(results[host]["rate"] / results[name]["rate"] - 1, 4),
    }
  # Every variant is jaxfeed: no peer ratio.
  return harness.report(
    "W5",
    {f"jaxfeed-{k}": v for k, v in results.items()},
    "images/s",
    {f"jaxfeed-{k}": v for k, v in extra.items()},
  )


def run_w5(systems, epochs, scale):
  """`benchmarks.run`'s W5: host only vs Loader prefetch=0 vs the default
  (and the placement thread), interleaved per epoch."""
  if "jaxfeed" not in systems:
    return []
  return run(epochs, scale)


def main(argv: list[str]) -> None:
  del argv
  run(FLAGS.rounds, FLAGS.scale, FLAGS.aligned)


if __name__ == "__main__":
  _define_flags()
  with record.run("w5_placement"):
    app.run(main)
