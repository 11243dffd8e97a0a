r"""Per-record cost of parsing a typical tf.train.Example: jaxfeed vs TF.

The Example: a ~20 KB JPEG-sized bytes feature, an int64 label, a 4-float
bounding box, a 10-value int64 list (VarLen) and a short text feature.
Measured, as microseconds per record (best of `--repeats` timed loops):

  * jaxfeed-single: `jaxfeed.parse_single_example` per record;
  * jaxfeed-batch: `jaxfeed.parse_example` on batches of `--batch`;
  * tf-batch: `tf.io.parse_example` on the same batches (TensorFlow's C++
    parser; eager, one op call per batch);
  * tf-single-graph: `tf.io.parse_single_example` inside a `tf.data` map
    (the way tf.data pipelines call it), drained in a loop.

Prints one JSON line with each figure and jaxfeed's ratio to TF (TF's
microseconds over jaxfeed's: above 1 means jaxfeed is faster), by wall time
and (`cpu_*`) by this process's CPU time, all threads, which a machine
shared with other work disturbs less. tf-single-graph includes tf.data's
per-element iterator cost, so it bounds a pipeline, not the parser.

  python -m benchmarks.parse_example_speed [--records 4096] [--batch 128]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from benchmarks import record


def make_records(count: int) -> list[bytes]:
  """`count` typical Examples (random payloads, fixed layout)."""
  import jaxfeed

  rng = np.random.default_rng(0)
  return [
    jaxfeed.make_example(
      {
        "image/encoded": rng.bytes(20_000),
        "image/class/label": int(rng.integers(1000)),
        "image/object/bbox": rng.random(4).astype(np.float32),
        "image/object/class": rng.integers(0, 1000, 10),
        "image/filename": f"n{i:08d}.JPEG",
      }
    )
    for i in range(count)
  ]


def jaxfeed_features() -> dict:
  import jaxfeed

  return {
    "image/encoded": jaxfeed.FixedLenFeature([], bytes),
    "image/class/label": jaxfeed.FixedLenFeature([], np.int64),
    "image/object/bbox": jaxfeed.FixedLenFeature([4], np.float32),
    "image/object/class": jaxfeed.VarLenFeature(np.int64),
    "image/filename": jaxfeed.FixedLenFeature([], bytes),
  }


def tf_features() -> dict:
  import tensorflow as tf

  return {
    "image/encoded": tf.io.FixedLenFeature([], tf.string),
    "image/class/label": tf.io.FixedLenFeature([], tf.int64),
    "image/object/bbox": tf.io.FixedLenFeature([4], tf.float32),
    "image/object/class": tf.io.VarLenFeature(tf.int64),
    "image/filename": tf.io.FixedLenFeature([], tf.string),
  }


def best_us_per_record(run, records: int, repeats: int, clock=time.perf_counter) -> float:
  run()  # warm-up
  best = float("inf")
  for _ in range(repeats):
    start = clock()
    run()
    best = min(best, clock() - start)
  return round(best / records * 1e6, 2)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--records", type=int, default=4096)
  parser.add_argument("--batch", type=int, default=128)
  parser.add_argument("--repeats", type=int, default=3)
  args = parser.parse_args()
  import jaxfeed
  import tensorflow as tf

  records = make_records(args.records)
  batches = [records[i : i + args.batch] for i in range(0, len(records), args.batch)]
  features, specs = jaxfeed_features(), tf_features()
  tf_batches = [tf.constant(batch) for batch in batches]
  dataset = tf.data.Dataset.from_tensor_slices(tf.constant(records)).map(
    lambda r: tf.io.parse_single_example(r, specs)
  )

  def jaxfeed_single():
    for serialized in records:
      jaxfeed.parse_single_example(serialized, features)

  def jaxfeed_batch():
    for batch in batches:
      jaxfeed.parse_example(batch, features)

  def tf_batch():
    for batch in tf_batches:
      tf.io.parse_example(batch, specs)

  def tf_single_graph():
    for _ in dataset:
      pass

  n = len(records)
  runs = (
    ("jaxfeed-single", jaxfeed_single),
    ("jaxfeed-batch", jaxfeed_batch),
    ("tf-batch", tf_batch),
    ("tf-single-graph", tf_single_graph),
  )
  result = {}
  for clock_name, clock in (("", time.perf_counter), ("cpu_", time.process_time)):
    for name, run in runs:
      result[clock_name + name] = best_us_per_record(run, n, args.repeats, clock)
    result[clock_name + "ratio_batch_vs_tf-batch"] = round(
      result[clock_name + "tf-batch"] / result[clock_name + "jaxfeed-batch"], 3
    )
    result[clock_name + "ratio_single_vs_tf-single-graph"] = round(
      result[clock_name + "tf-single-graph"] / result[clock_name + "jaxfeed-single"], 3
    )
  record.row(
    {"workload": "parse_example", "unit": "us/record", "records": n, "batch": args.batch, **result}
  )


if __name__ == "__main__":
  with record.run("parse_example_speed"):
    main()
