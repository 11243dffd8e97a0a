"""W6, service mode: coordinated round-robin reads against uncoordinated ones.

W3's 50,000 token sequences (lengths lognormal(4.5, 0.8) clipped to [8, 512])
go through `bucket_by_sequence_length` (boundaries every 8 tokens up to 512,
batch 32 per consumer, padded to the batch's longest sequence) on a
dispatcher and 2 worker processes on loopback (static DATA sharding: every
sequence once). 4 consumers (threads of this process) read:

  (a) coordinated: `distribute(job_name, num_consumers=4, consumer_index=i)`;
      at every round one worker hands all 4 consumers a batch of the same
      padded length (`jaxfeed.service.worker.round_assembly`);
  (b) uncoordinated: the same job shared without num_consumers; every batch
      goes to whichever consumer asks first, and consumer i's s-th batch is
      its batch of step s.

A step's time is modelled as the padded tokens (rows x padded length) of the
SLOWEST consumer at that step. Reported per way: bucket agreement (fraction of
steps where all consumers got the same padded length), padding fraction,
modelled step time (total and per real token), sequences left out (partial
windows and bucket remainders dropped at the end), and the read rate (median
of `--epochs` epochs after a warm-up, each a fresh job; the other statistics
are the last epoch's). With `--tf_service=1` (default) the same is measured for tf.data
service's coordinated reads with the group_by_window recipe (bucket, then
group 4 consecutive batches of one padded length), which needs an endless
dataset: it runs for as many rounds as (a) had.

  python -m benchmarks.w6_service [--scale=1.0] [--seed=0] [--epochs=3] [--tf_service=1]
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Any, Callable

import numpy as np

from benchmarks import harness
from benchmarks import record
from benchmarks import w4_service
from benchmarks import workloads

CONSUMERS = 4
WORKERS = 2
PER_CONSUMER_BATCH = 32
BOUNDARIES = list(range(8, 513, 8))
BATCH_SIZES = [PER_CONSUMER_BATCH] * (len(BOUNDARIES) + 1)


# -- shipped to jaxfeed workers by import path ---------------------------------------
class RaggedTokenSource:
  """Variable-length int32 sequences stored as one flat array plus offsets."""

  def __init__(self, tokens: np.ndarray, offsets: np.ndarray):
    self.tokens = np.asarray(tokens, np.int32)
    self.offsets = np.asarray(offsets, np.int64)

  def __len__(self) -> int:
    return len(self.offsets) - 1

  def __getitem__(self, index: int) -> dict:
    return {"tokens": self.tokens[self.offsets[index] : self.offsets[index + 1]]}

  def get_many(self, indices: Any) -> list:
    starts, stops = self.offsets[indices], self.offsets[np.asarray(indices) + 1]
    return [{"tokens": self.tokens[a:b]} for a, b in zip(starts.tolist(), stops.tolist())]

  def spec_params(self) -> dict:
    return {"tokens": self.tokens, "offsets": self.offsets}


def token_count(element: dict) -> int:
  return element["tokens"].shape[0]


# -- jaxfeed ---------------------------------------------------------------------------
def _pipeline(lengths: np.ndarray, seed: int):
  import jaxfeed  # pylint: disable=g-import-not-at-top
  from benchmarks import w6_service  # importable paths, also when run as __main__

  tokens = np.concatenate(workloads.w3_sequences(lengths))
  offsets = np.concatenate([[0], np.cumsum(lengths)])
  source = w6_service.RaggedTokenSource(tokens, offsets)
  return jaxfeed.Dataset.from_source(
    source, jaxfeed.IndexSampler(len(lengths), shuffle=True, seed=seed)
  ).bucket_by_sequence_length(w6_service.token_count, BOUNDARIES, BATCH_SIZES)


def _read_in_threads(make_iterator: Callable[[int], Any]) -> tuple[list, list, float]:
  """Each consumer's [(round, rows, padded length, real tokens)] and stats."""
  batches: list = [[] for _ in range(CONSUMERS)]
  stats: list = [{} for _ in range(CONSUMERS)]
  errors: list = []

  def consume(i: int) -> None:
    try:
      with make_iterator(i) as iterator:
        for batch in iterator:
          tokens = batch["tokens"]
          batches[i].append(
            (
              getattr(iterator, "last_round", len(batches[i])),
              tokens.shape[0],
              tokens.shape[1],
              int(np.count_nonzero(tokens)),
            )
          )
        # jaxfeed's iterators have a stats() method; tf.data's have none.
        stats_of = getattr(iterator, "stats", None)
        stats[i] = stats_of() if callable(stats_of) else {}
    except BaseException as e:  # pylint: disable=broad-except
      errors.append(e)

  start = time.perf_counter()
  threads = [threading.Thread(target=consume, args=(i,)) for i in range(CONSUMERS)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  if errors:
    raise errors[0]
  return batches, stats, time.perf_counter() - start


def _steps(batches: list, by_round: bool) -> list[list[tuple]]:
  """Steps as lists of one (rows, padded length, real tokens) per consumer."""
  if by_round:
    common = set.intersection(*[{b[0] for b in consumer} for consumer in batches])
    per_round = [{b[0]: b[1:] for b in consumer} for consumer in batches]
    return [[p[r] for p in per_round] for r in sorted(common)]
  steps = min(len(consumer) for consumer in batches)
  return [[consumer[s][1:] for consumer in batches] for s in range(steps)]


def _summary(
  system: str, way: str, steps: list[list[tuple]], sequences: int, elapsed: float, total_tokens: int
) -> dict:
  if not steps:
    raise ValueError(
      f"W6 {system}, {way}: no step gave all {CONSUMERS} consumers a batch out of "
      f"{sequences} sequences (too few to fill {PER_CONSUMER_BATCH}-row batches of one "
      f"bucket for every consumer); use a larger --scale (0.1 or more)."
    )
  rows = np.array([[c[0] for c in step] for step in steps])
  padded_length = np.array([[c[1] for c in step] for step in steps])
  real = int(sum(c[2] for step in steps for c in step))
  padded_tokens = rows * padded_length
  slowest = padded_tokens.max(axis=1)
  agree = (padded_length == padded_length[:, :1]).all(axis=1)
  return {
    "workload": "W6",
    "system": system,
    "way": way,
    "consumers": CONSUMERS,
    "workers": WORKERS,
    "per_consumer_batch": PER_CONSUMER_BATCH,
    "steps": len(steps),
    "sequences": int(rows.sum()),
    "sequences_left_out": int(sequences - rows.sum()),
    "token_coverage": round(real / total_tokens, 4),
    "bucket_agreement": round(float(agree.mean()), 4),
    "padding_fraction": round(1 - real / int(padded_tokens.sum()), 4),
    # Idle rows of consumers waiting for the slowest one count as padding too.
    "padding_fraction_incl_waiting": round(1 - real / (CONSUMERS * int(slowest.sum())), 4),
    "modelled_time_tokens": int(slowest.sum()),
    "modelled_time_per_real_token": round(float(slowest.sum()) / real, 5),
    "read_seconds": round(elapsed, 2),
    "sequences_per_s": round(float(rows.sum()) / elapsed, 1),
  }


def _read_summary(
  system: str, way: str, batches: list, by_round: bool, lengths: np.ndarray, elapsed: float
) -> dict:
  """`_summary` of the consumers' `batches` of a read of all `lengths`."""
  steps = _steps(batches, by_round=by_round)
  return _summary(system, way, steps, len(lengths), elapsed, int(lengths.sum()))


def _jaxfeed_cluster() -> tuple[list, str]:
  """A dispatcher whose round-robin jobs wait for WORKERS workers, and those."""
  spawn = w4_service._spawn  # pylint: disable=protected-access
  dispatcher, address = spawn(
    ["-m", "jaxfeed.service.dispatcher", "--port=0", f"--num_workers={WORKERS}"]
  )
  procs = [dispatcher]
  for _ in range(WORKERS):
    procs.append(
      spawn(["-m", "jaxfeed.service.worker", f"--dispatcher_address={address}", "--buffer_size=8"])[
        0
      ]
    )
  return procs, address


def run_jaxfeed(lengths: np.ndarray, seed: int, epochs: int) -> tuple[dict, dict]:
  """Both ways, one warm-up and `epochs` timed epochs (one job each)."""
  procs, address = _jaxfeed_cluster()
  coordinated_rates, uncoordinated_rates = [], []
  try:
    dataset = _pipeline(lengths, seed)
    for epoch in range(epochs + 1):
      batches, stats, elapsed = _read_in_threads(
        lambda i: dataset.distribute(
          address,
          "data",
          job_name=f"coordinated-{epoch}",
          num_consumers=CONSUMERS,
          consumer_index=i,
        ).make_iterator()
      )
      coordinated = _read_summary(
        "jaxfeed service", "coordinated (num_consumers=4)", batches, True, lengths, elapsed
      )
      coordinated["rounds_skipped"] = sum(s["rounds_skipped"] for s in stats)
      for key in ("rows_dropped_at_end", "rows_dropped_over_limit", "rows_dropped_late"):
        coordinated[key] = stats[0][key]
      coordinated["peak_window_batches_per_worker"] = max(
        w["peak_window_batches"] for w in stats[0]["workers"].values()
      )
      batches, _, elapsed = _read_in_threads(
        lambda i: dataset.distribute(
          address, "data", job_name=f"uncoordinated-{epoch}"
        ).make_iterator()
      )
      uncoordinated = _read_summary(
        "jaxfeed service", "uncoordinated (shared job)", batches, False, lengths, elapsed
      )
      if epoch:
        coordinated_rates.append(coordinated["sequences_per_s"])
        uncoordinated_rates.append(uncoordinated["sequences_per_s"])
  finally:
    harness.stop_processes(procs)
  # The statistics of the last epoch, the median read rate over the epochs.
  for line, rates in ((coordinated, coordinated_rates), (uncoordinated, uncoordinated_rates)):
    line["sequences_per_s"] = round(float(np.median(rates)), 1)
    line["sequences_per_s_per_epoch"] = rates
    del line["read_seconds"]
  return coordinated, uncoordinated


# -- tf.data service -------------------------------------------------------------------
def _tf_dataset(lengths: np.ndarray, seed: int, coordinated: bool):
  import tensorflow as tf  # pylint: disable=g-import-not-at-top

  lengths_t = tf.constant(lengths, tf.int64)

  def sequence(index):
    length = lengths_t[index]
    tokens = tf.random.stateless_uniform(
      tf.reshape(length, [1]), seed=tf.stack([index, 0]), minval=1, maxval=32_000, dtype=tf.int32
    )
    return {"tokens": tokens}

  dataset = (
    tf.data.Dataset.range(len(lengths))
    .shuffle(len(lengths), seed=seed)
    .repeat()
    .map(sequence)
    .bucket_by_sequence_length(lambda e: tf.shape(e["tokens"])[0], BOUNDARIES, BATCH_SIZES)
  )
  if coordinated:  # the recipe: K consecutive batches of one padded length
    dataset = dataset.group_by_window(
      key_func=lambda e: tf.cast(tf.shape(e["tokens"])[1], tf.int64),
      reduce_func=lambda _, window: window.batch(CONSUMERS),
      window_size=CONSUMERS,
    ).unbatch()
  return dataset


def run_tf_service(lengths: np.ndarray, seed: int, rounds: int) -> tuple[dict, dict]:
  import tensorflow as tf  # pylint: disable=g-import-not-at-top

  procs, address = w4_service._tf_cluster(WORKERS)  # pylint: disable=protected-access
  service = f"grpc://{address}"
  try:
    results = []
    for coordinated in (True, False):
      dataset = _tf_dataset(lengths, seed, coordinated)
      options = dict(num_consumers=CONSUMERS) if coordinated else {}

      def make_iterator(i, dataset=dataset, options=options, coordinated=coordinated):
        distributed = dataset.apply(
          tf.data.experimental.service.distribute(
            processing_mode="parallel_epochs",
            service=service,
            job_name=f"w6-{coordinated}",
            consumer_index=i if coordinated else None,
            **options,
          )
        ).take(rounds)
        return _Closing(distributed.as_numpy_iterator())

      batches, _, elapsed = _read_in_threads(make_iterator)
      way = (
        "coordinated (num_consumers=4, group_by_window recipe)"
        if coordinated
        else "uncoordinated (shared job)"
      )
      results.append(_read_summary("tf.data service", way, batches, False, lengths, elapsed))
  finally:
    harness.stop_processes(procs)
  return results[0], results[1]


class _Closing:
  """A context manager around an iterator without one."""

  def __init__(self, iterator):
    self.iterator = iterator

  def __enter__(self):
    return self.iterator

  def __exit__(self, *exc):
    return None


def main(argv: list[str]) -> None:
  args = dict(a.lstrip("-").split("=", 1) for a in argv[1:] if "=" in a)
  scale, seed = float(args.get("scale", 1.0)), int(args.get("seed", 0))
  epochs = int(args.get("epochs", 3))
  lengths = workloads.w3_lengths(scale)
  coordinated, uncoordinated = run_jaxfeed(lengths, seed, epochs)
  lines = [coordinated, uncoordinated]
  if args.get("tf_service", "1") != "0":
    lines += list(run_tf_service(lengths, seed, coordinated["steps"]))
  for line in lines:
    record.row(line)

  def lower_by(a: dict, b: dict) -> float:
    return round(b["modelled_time_per_real_token"] / a["modelled_time_per_real_token"], 3)

  ratios = {"jaxfeed coordinated vs uncoordinated": lower_by(coordinated, uncoordinated)}
  if len(lines) == 4:
    ratios["tf.data service coordinated vs uncoordinated"] = lower_by(lines[2], lines[3])
    ratios["jaxfeed coordinated vs tf.data service coordinated"] = lower_by(coordinated, lines[2])
  record.row(
    {
      "workload": "W6",
      "mode": "service",
      "way": "summary",
      "modelled_time_per_real_token_lower_by": ratios,
    }
  )


if __name__ == "__main__":
  with record.run("w6_service"):
    main(sys.argv)
