r"""W6 (BENCHMARKS.md): coordinated reads against uncoordinated bucketing.

W3's 50,000 token sequences (lengths lognormal(4.5, 0.8) clipped to [8, 512])
are read by 4 simulated hosts with a per-host batch of 32 (global 128) and
bucket boundaries every 8 tokens up to 512. A step's time is modelled as the
padded tokens of the SLOWEST host at that step (rows x padded length), since
a synchronous step waits for every host. Three ways to read:

  (a) coordinated: `jaxfeed.coord.BucketPlan` + `Dataset.from_bucket_plan`,
      run for every host; all hosts read the same bucket and pad to the
      global batch's longest sequence;
  (b) per-host bucketing: every host buckets its own shard of a global
      shuffle (tf.data `bucket_by_sequence_length` semantics, batch 32 per
      bucket, emitted when a bucket fills); the hosts' i-th batches form step i;
  (c) no bucketing: every host pads its next 32 sequences to their maximum.

Prints one JSON line per way (padding fraction, modelled time, bucket
agreement, ...) and one line of ratios. Since the ways leave out different
numbers of sequences (bucket remainders), ratios are given both for the total
modelled time and per real token; the targets are checked per real token.

  python -m benchmarks.w6_coordinated [--scale=1.0] [--epochs=3] [--seed=0]
"""

from __future__ import annotations

import time

from absl import app
from absl import flags
import numpy as np

from benchmarks import harness
from benchmarks import record
from benchmarks import workloads

FLAGS = flags.FLAGS
flags.DEFINE_float("scale", 1.0, "Fraction of W3's 50,000 sequences.")
flags.DEFINE_integer("epochs", 3, "Timed epochs of the host pipeline.")
flags.DEFINE_integer("seed", 0, "Seed of the plans and of the host shuffles.")

HOSTS = 4
PER_HOST_BATCH = 32
GLOBAL_BATCH = HOSTS * PER_HOST_BATCH
BOUNDARIES = list(range(8, 513, 8))
TARGETS = {"vs_per_host_bucketing": 1.5, "vs_no_bucketing": 3.0, "max_padding_fraction": 0.05}


def _summary(
  way: str,
  padded_lengths: np.ndarray,
  real_tokens: np.ndarray,
  buckets: np.ndarray | None,
  sequences: int,
  lengths: np.ndarray,
) -> dict:
  """Statistics of a (steps x hosts) schedule of padded lengths."""
  padded_tokens = PER_HOST_BATCH * padded_lengths
  slowest = padded_tokens.max(axis=1)  # the modelled time of each step
  real, padded, modelled = (int(real_tokens.sum()), int(padded_tokens.sum()), int(slowest.sum()))
  line = {
    "workload": "W6",
    "way": way,
    "hosts": HOSTS,
    "per_host_batch": PER_HOST_BATCH,
    "steps": int(len(slowest)),
    "sequences": int(sequences),
    "real_tokens": real,
    "padded_tokens": padded,
    # Bucket remainders are left out of the epoch; this says how much.
    "token_coverage": round(real / int(lengths.sum()), 4),
    "padding_fraction": round(1 - real / padded, 4),
    # Idle rows of hosts waiting for the slowest one count as padding too.
    "padding_fraction_incl_waiting": round(1 - real / (HOSTS * modelled), 4),
    "modelled_time_tokens": modelled,
    "modelled_time_per_real_token": round(modelled / real, 5),
  }
  if buckets is not None:
    agree = (buckets == buckets[:, :1]).all(axis=1)
    line["bucket_agreement"] = round(float(agree.mean()), 4)
  return line


def _host_streams(num_records: int, seed: int) -> list[np.ndarray]:
  """Each host's record order: its shard of one global shuffle."""
  from jaxfeed.sampler import IndexSampler, ShardOptions

  streams = []
  for host in range(HOSTS):
    sampler = IndexSampler(
      num_records, shuffle=True, seed=seed, shard_options=ShardOptions(host, HOSTS)
    )
    _, records, _ = sampler.get_many(np.arange(len(sampler)))
    streams.append(records)
  return streams


def coordinated(
  lengths: np.ndarray, examples: list, seed: int, carry_remainders: bool = False
) -> dict:
  """(a): every host runs the real from_bucket_plan pipeline."""
  import jaxfeed
  from jaxfeed.coord import BucketPlan
  from jaxfeed.sampler import ShardOptions

  sizes = [GLOBAL_BATCH] * (len(BOUNDARIES) + 1)
  plans = [
    BucketPlan(
      lengths,
      BOUNDARIES,
      sizes,
      seed=seed,
      shard_options=ShardOptions(h, HOSTS),
      carry_remainders=carry_remainders,
    )
    for h in range(HOSTS)
  ]
  iterators = [jaxfeed.Dataset.from_bucket_plan(examples, p).make_iterator() for p in plans]
  padded, real, buckets = [], [], []
  for step in range(len(plans[0])):
    batches = [next(it) for it in iterators]
    padded.append([b["tokens"].shape[1] for b in batches])
    real.append([int(lengths[p[step][1]].sum()) for p in plans])
    buckets.append([p[step][0] for p in plans])
  for it in iterators:
    it.close()
  name = (
    "coordinated (BucketPlan, carry_remainders)"
    if carry_remainders
    else ("coordinated (BucketPlan)")
  )
  line = _summary(
    name, np.array(padded), np.array(real), np.array(buckets), len(plans[0]) * GLOBAL_BATCH, lengths
  )
  line["dropped_per_epoch"] = plans[0].num_dropped_per_epoch
  return line


def per_host_bucketing(lengths: np.ndarray, streams: list[np.ndarray]) -> dict:
  """(b): each host buckets its own stream, tf.data style, no coordination."""
  from jaxfeed.coord import BucketPlan

  sizes = [PER_HOST_BATCH] * (len(BOUNDARIES) + 1)
  # An unshuffled one-host plan over a host's stream is exactly tf.data's
  # bucket_by_sequence_length on it: a batch is emitted when its bucket
  # fills, padded to its longest sequence, remainders dropped.
  host_plans = [BucketPlan(lengths[stream], BOUNDARIES, sizes, shuffle=False) for stream in streams]
  steps = min(len(p) for p in host_plans)
  padded = np.stack([p.epoch_max_lengths(0)[:steps] for p in host_plans], 1)
  buckets = np.stack([p.epoch_buckets(0)[:steps] for p in host_plans], 1)
  real = np.array(
    [
      [int(lengths[stream][p[s][1]].sum()) for p, stream in zip(host_plans, streams)]
      for s in range(steps)
    ]
  )
  line = _summary(
    "per-host bucketing (uncoordinated)", padded, real, buckets, steps * GLOBAL_BATCH, lengths
  )
  line["dropped_per_epoch"] = len(lengths) - steps * GLOBAL_BATCH
  return line


def no_bucketing(lengths: np.ndarray, streams: list[np.ndarray]) -> dict:
  """(c): each host pads its next 32 sequences to their maximum."""
  steps = min(len(s) for s in streams) // PER_HOST_BATCH
  per_host = [lengths[s[: steps * PER_HOST_BATCH]].reshape(steps, PER_HOST_BATCH) for s in streams]
  padded = np.stack([b.max(axis=1) for b in per_host], 1)
  real = np.stack([b.sum(axis=1) for b in per_host], 1)
  line = _summary("no bucketing", padded, real, None, steps * GLOBAL_BATCH, lengths)
  line["dropped_per_epoch"] = len(lengths) - steps * GLOBAL_BATCH
  return line


def host_pipeline_rate(lengths: np.ndarray, examples: list, seed: int, epochs: int) -> dict:
  """Sequences/s of one host's from_bucket_plan pipeline (host 0 of 4)."""
  import jaxfeed
  from jaxfeed.coord import BucketPlan
  from jaxfeed.sampler import ShardOptions

  plan = BucketPlan(
    lengths,
    BOUNDARIES,
    [GLOBAL_BATCH] * (len(BOUNDARIES) + 1),
    seed=seed,
    shard_options=ShardOptions(0, HOSTS),
  )
  dataset = jaxfeed.Dataset.from_bucket_plan(examples, plan)
  result = harness.measure(dataset.make_iterator, lambda b: b["tokens"].shape[0], epochs)
  return {
    "workload": "W6",
    "way": "coordinated host pipeline (host 0 of 4)",
    "unit": "sequences/s",
    "rate": round(result["rate"], 1),
    "rates": result["rates"],
    "peak_rss_mb": result["peak_rss_mb"],
  }


def plan_build_time(seed: int) -> dict:
  """Milliseconds to build one epoch of a plan over 1,000,000 records."""
  from jaxfeed.coord import BucketPlan
  from jaxfeed.sampler import ShardOptions

  rng = np.random.default_rng(1)
  lengths = np.clip(rng.lognormal(4.5, 0.8, 1_000_000), 8, 512).astype(np.int64)
  timings = []
  for epoch in range(3):
    plan = BucketPlan(
      lengths,
      BOUNDARIES,
      [GLOBAL_BATCH] * (len(BOUNDARIES) + 1),
      seed=seed,
      num_epochs=3,
      shard_options=ShardOptions(1, HOSTS),
    )
    start = time.perf_counter()
    plan[epoch * plan.steps_per_epoch]
    timings.append(1000 * (time.perf_counter() - start))
  return {
    "workload": "W6",
    "way": "plan epoch build, 1e6 records",
    "unit": "ms",
    "median_ms": round(float(np.median(timings)), 1),
  }


def main(argv: list[str]) -> None:
  del argv
  lengths = workloads.w3_lengths(FLAGS.scale)
  examples = [{"tokens": s} for s in workloads.w3_sequences(lengths)]
  streams = _host_streams(len(lengths), FLAGS.seed)

  a = coordinated(lengths, examples, FLAGS.seed)
  carried = coordinated(lengths, examples, FLAGS.seed, carry_remainders=True)
  b = per_host_bucketing(lengths, streams)
  c = no_bucketing(lengths, streams)
  for line in (a, carried, b, c):
    record.row(line)
  record.row(host_pipeline_rate(lengths, examples, FLAGS.seed, FLAGS.epochs))
  record.row(plan_build_time(FLAGS.seed))

  def ratio(other: dict, key: str) -> float:
    return round(other[key] / a[key], 3)

  ratios = {
    "vs_per_host_bucketing_per_token": ratio(b, "modelled_time_per_real_token"),
    "vs_no_bucketing_per_token": ratio(c, "modelled_time_per_real_token"),
    "vs_per_host_bucketing_total": ratio(b, "modelled_time_tokens"),
    "vs_no_bucketing_total": ratio(c, "modelled_time_tokens"),
  }
  met = {
    "vs_per_host_bucketing": ratios["vs_per_host_bucketing_per_token"]
    >= TARGETS["vs_per_host_bucketing"],
    "vs_no_bucketing": ratios["vs_no_bucketing_per_token"] >= TARGETS["vs_no_bucketing"],
    "padding": a["padding_fraction"] <= TARGETS["max_padding_fraction"],
    "bucket_agreement": a["bucket_agreement"] == 1.0,
  }
  record.row(
    {
      "workload": "W6",
      "way": "summary",
      "modelled_time_lower_by": ratios,
      "targets": TARGETS,
      "targets_met": met,
    }
  )


if __name__ == "__main__":
  with record.run("w6_coordinated"):
    app.run(main)
