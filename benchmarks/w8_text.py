r"""W8 of BENCHMARKS.md: real text -> tokenize -> mix 70/30 -> pack 512 -> batch 32.

The two corpora ship with Python (`examples/lm_data.py`): the standard
library's source ("code") and the interactive help's topics ("prose"). Every
system tokenizes with the same function (`jaxfeed.ByteTokenizer().encode`),
reshuffles each corpus, mixes them 70/30 by document and makes batches of 32
rows of 512 tokens:

- jaxfeed (mix): `Dataset.mix` (the index-level mixture of
  docs/llm_text.md) + `map(Tokenize)` + `pack(overflow="split")` (first fit);
- jaxfeed (sample_from_datasets): each corpus tokenized, mixed by
  `sample_from_datasets`, packed the same way;
- Grain: `MapDataset.mix` + a flat map into 512-token pieces +
  `FirstFitPackIterDataset`;
- tf.data: `sample_from_datasets` + a flat map into 512-token pieces +
  `bucket_by_sequence_length` (tf.data has no packing).

Prints one JSON line per system: real (non-padding) tokens/s, the median of
the timed epochs after a warm-up (an epoch is `--batches` batches), the
padding fraction, peak RSS and `tokens_per_cpu_second` (real tokens over
this process's CPU time, warm-up epochs included: the cost, which load from
other processes does not change much; every system runs in this process);
the jaxfeed lines add the ratio to the best peer and to Grain. Every line
gives the load average before and after the run.

  python -m benchmarks.w8_text [--epochs 3] [--batches 100] [--repeats 1] [--no-peers]
"""

from __future__ import annotations

import argparse
import itertools
import os
import time

import numpy as np

from benchmarks import harness
from benchmarks import record
from examples import lm_data

ROW = 512
BATCH = 32
BINS = 32
WEIGHTS = (0.7, 0.3)
SEED = 0


def _tokens(batch: dict) -> int:
  return int(np.count_nonzero(batch["tokens_segment_ids"]))


def _slots(batch: dict) -> int:
  return int(np.size(batch["tokens_segment_ids"]))


def _jaxfeed_corpora(corpora: list[list[bytes]]):
  import jaxfeed  # pylint: disable=g-import-not-at-top

  return [
    jaxfeed.Dataset.from_source(
      documents,
      jaxfeed.IndexSampler(len(documents), shuffle=True, seed=SEED + salt, num_epochs=None),
    )
    for salt, documents in enumerate(corpora)
  ]


def _jaxfeed_rows(dataset, batches: int):
  dataset = dataset.pack({"tokens": ROW}, num_packing_bins=BINS, overflow="split").batch(
    BATCH, drop_remainder=True
  )

  def epoch():
    return itertools.islice(dataset.make_iterator(), batches)

  return epoch


def jaxfeed_mix_epochs(corpora: list[list[bytes]], batches: int):
  """The README's recipe: the index-level mixture, then tokenize."""
  import jaxfeed  # pylint: disable=g-import-not-at-top

  tokenize = jaxfeed.Tokenize(jaxfeed.ByteTokenizer())
  mixture = jaxfeed.Dataset.mix(_jaxfeed_corpora(corpora), list(WEIGHTS), seed=SEED)
  return _jaxfeed_rows(mixture.map(tokenize), batches)


def jaxfeed_sample_epochs(corpora: list[list[bytes]], batches: int):
  """The iterator-level mixture of tokenized corpora."""
  import jaxfeed  # pylint: disable=g-import-not-at-top

  tokenize = jaxfeed.Tokenize(jaxfeed.ByteTokenizer())
  parts = [part.map(tokenize) for part in _jaxfeed_corpora(corpora)]
  return _jaxfeed_rows(
    jaxfeed.Dataset.sample_from_datasets(parts, list(WEIGHTS), seed=SEED), batches
  )


class _Pieces:
  """Grain FlatMap: a tokenized document -> its 512-token pieces."""

  max_fan_out = 4096

  def flat_map(self, element):
    tokens = element["tokens"]
    return [{"tokens": tokens[i : i + ROW]} for i in range(0, len(tokens), ROW)]


def grain_epochs(corpora: list[list[bytes]], batches: int):
  import grain  # pylint: disable=g-import-not-at-top
  import jaxfeed  # pylint: disable=g-import-not-at-top

  tokenize = jaxfeed.Tokenize(jaxfeed.ByteTokenizer())
  parts = [
    grain.MapDataset.source(documents).shuffle(seed=SEED + salt).repeat().map(tokenize)
    for salt, documents in enumerate(corpora)
  ]
  pieces = grain.experimental.FlatMapIterDataset(
    grain.MapDataset.mix(parts, weights=list(WEIGHTS)).to_iter_dataset(),
    type("Pieces", (_Pieces, grain.experimental.FlatMapTransform), {})(),
  )
  packed = grain.experimental.FirstFitPackIterDataset(
    pieces, length_struct={"tokens": ROW}, num_packing_bins=BINS, shuffle_bins=False
  )
  dataset = packed.batch(BATCH, drop_remainder=True)

  def epoch():
    return itertools.islice(iter(dataset), batches)

  return epoch


def tf_data_epochs(corpora: list[list[bytes]], batches: int):
  import tensorflow as tf  # pylint: disable=g-import-not-at-top
  import jaxfeed  # pylint: disable=g-import-not-at-top

  encode = jaxfeed.ByteTokenizer().encode
  eos = np.int32(jaxfeed.ByteTokenizer.eos_id)

  def tokenize(text):
    return np.append(encode(text), eos)

  def corpus(documents, salt):
    ds = tf.data.Dataset.from_tensor_slices(np.array(documents, dtype=object))
    ds = ds.shuffle(len(documents), seed=SEED + salt).repeat()
    ds = ds.map(lambda t: tf.ensure_shape(tf.numpy_function(tokenize, [t], tf.int32), [None]))
    return ds.flat_map(lambda t: tf.data.Dataset.from_tensor_slices(t).batch(ROW))

  mixed = tf.data.Dataset.sample_from_datasets(
    [corpus(d, salt) for salt, d in enumerate(corpora)], list(WEIGHTS), seed=SEED
  )
  bucketed = mixed.bucket_by_sequence_length(
    lambda t: tf.shape(t)[0],
    bucket_boundaries=[65, 129, 257],
    bucket_batch_sizes=[BATCH] * 4,
    padding_values=-1,
    drop_remainder=True,
  )
  dataset = bucketed.map(lambda t: {"tokens_segment_ids": tf.cast(t >= 0, tf.int32)})

  def epoch():
    return itertools.islice(dataset.as_numpy_iterator(), batches)

  return epoch


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--epochs", type=int, default=3)
  parser.add_argument(
    "--batches", type=int, default=100, help="batches of 32 x 512 tokens per epoch"
  )
  parser.add_argument("--no-peers", action="store_true")
  parser.add_argument(
    "--repeats", type=int, default=1, help="runs of every system in turn; the median run counts"
  )
  args = parser.parse_args()
  corpora = [lm_data.code_documents(), lm_data.prose_documents()]
  systems = {
    "jaxfeed (mix)": jaxfeed_mix_epochs,
    "jaxfeed (sample_from_datasets)": jaxfeed_sample_epochs,
  }
  if not args.no_peers:
    systems.update({"grain": grain_epochs, "tf.data": tf_data_epochs})
  epochs = {name: make(corpora, args.batches) for name, make in systems.items()}
  runs = {name: [] for name in systems}
  padding = {name: [0, 0] for name in systems}
  cpu = {name: 0.0 for name in systems}
  load = os.getloadavg()
  # Systems take turns, so load from other processes hits them alike.
  for _ in range(args.repeats):
    for name, epoch in epochs.items():

      def count(batch, padding=padding[name]):
        tokens = _tokens(batch)
        padding[0] += tokens
        padding[1] += _slots(batch)
        return tokens

      # CPU time from the first epoch on: the collection the harness runs
      # before it walks every object of TensorFlow and Grain (0.2 s here, as
      # much as a jaxfeed run) and is no system's cost.
      started = []

      def start_cpu_clock(started=started):
        if not started:
          started.append(time.process_time())

      runs[name].append(harness.measure(epoch, count, args.epochs, before_epoch=start_cpu_clock))
      cpu[name] += time.process_time() - started[0]
  load = [round(x, 1) for x in load + os.getloadavg()]
  results, extra = {}, {}
  for name, measured in runs.items():
    results[name] = sorted(measured, key=lambda r: r["rate"])[len(measured) // 2]
    extra[name] = {
      "padding_fraction": round(1 - padding[name][0] / padding[name][1], 4),
      "tokens_per_cpu_second": round(padding[name][0] / cpu[name]),
      "load_average_before_after": load,
    }
    if args.repeats > 1:
      extra[name]["rate_per_repeat"] = [round(r["rate"]) for r in measured]
  for name in results:
    if name.startswith("jaxfeed") and "grain" in results:
      extra[name]["ratio_vs_grain"] = round(results[name]["rate"] / results["grain"]["rate"], 2)
  harness.report("W8", results, "tokens/s", extra)


if __name__ == "__main__":
  with record.run("w8_text"):
    main()
