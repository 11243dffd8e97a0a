"""The reference workloads of BENCHMARKS.md, one function per workload.

Each `run_wN(systems, epochs, scale)` builds the workload's data once, runs it
through every requested system in this process, and prints the JSON lines.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from benchmarks import harness

CROP = 56
IMAGE = 64


# ----------------------------------------------------------------------------
# Data
# ----------------------------------------------------------------------------
def w1_size(scale: float) -> int:
  """W1's number of images at `scale`."""
  return max(256, int(20_000 * scale))


def w1_data(scale: float) -> dict[str, np.ndarray]:
  n = w1_size(scale)
  rng = np.random.default_rng(0)
  return {
    "image": rng.integers(0, 256, (n, IMAGE, IMAGE, 3), dtype=np.uint8),
    "label": rng.integers(0, 1000, n, dtype=np.int32),
  }


def w3_lengths(scale: float) -> np.ndarray:
  n = max(1000, int(50_000 * scale))
  rng = np.random.default_rng(3)
  return np.clip(rng.lognormal(4.5, 0.8, n), 8, 512).astype(np.int64)


def w3_sequences(lengths: np.ndarray) -> list[np.ndarray]:
  rng = np.random.default_rng(4)
  tokens = rng.integers(1, 32_000, int(lengths.sum()), dtype=np.int32)
  return np.split(tokens, np.cumsum(lengths)[:-1])


# ----------------------------------------------------------------------------
# jaxfeed UDFs (module level so they are importable by worker processes)
# ----------------------------------------------------------------------------
def augment(example: dict, rng: np.random.Generator) -> dict:
  """W1: random 56x56 crop, random horizontal flip, normalize to float32."""
  y, x = rng.integers(0, IMAGE - CROP + 1), rng.integers(0, IMAGE - CROP + 1)
  flip = rng.random() < 0.5
  crop = example["image"][y : y + CROP, x : x + CROP]
  if flip:
    crop = crop[:, ::-1]
  out = np.empty(crop.shape, np.float32)
  np.multiply(crop, np.float32(1 / 127.5), out=out, casting="unsafe")
  np.subtract(out, np.float32(1.0), out=out)
  return {"image": out, "label": example["label"]}


def augment_batch(batch: dict, rng: np.random.Generator, *, empty: Callable = np.empty) -> dict:
  """W1, vectorized: the same augmentation applied to a whole batch, written
  into `empty(shape, dtype)`."""
  images = batch["image"]
  n = images.shape[0]
  ys = rng.integers(0, IMAGE - CROP + 1, n)
  xs = rng.integers(0, IMAGE - CROP + 1, n)
  flips = rng.random(n) < 0.5
  out = empty((n, CROP, CROP, 3), np.float32)
  scale = np.float32(1 / 127.5)
  for i in range(n):
    crop = images[i, ys[i] : ys[i] + CROP, xs[i] : xs[i] + CROP]
    np.multiply(crop[:, ::-1] if flips[i] else crop, scale, out=out[i], casting="unsafe")
  np.subtract(out, np.float32(1.0), out=out)
  return {"image": out, "label": batch["label"]}


def add_one(x):
  return x + 1


def packed_sequences(batch: dict) -> int:
  """Sequences in a packed row or batch of rows (the max segment id per row)."""
  segments = batch["tokens_segment_ids"]
  return int(segments.reshape(-1, segments.shape[-1]).max(axis=1).sum())


def sequence_length(example: dict) -> int:
  return example["tokens"].shape[0]


# ----------------------------------------------------------------------------
# W1: in-memory images -> crop/flip/normalize -> batch 128
# ----------------------------------------------------------------------------
def _w1_jaxfeed(data: dict, batched: bool, augment_batched: Callable = augment_batch):
  import jaxfeed

  source = jaxfeed.ArraySource(data)
  ds = jaxfeed.Dataset.from_source(source, jaxfeed.IndexSampler(len(source)))
  if batched:
    ds = ds.batch(128).random_map(augment_batched, num_parallel_calls=2)
  else:
    ds = ds.random_map(augment, num_parallel_calls=jaxfeed.AUTOTUNE).batch(128)
  return ds.prefetch(2)


def _w1_tf(data: dict):
  import tensorflow as tf

  def tf_augment(image, label):
    image = tf.image.random_crop(image, [CROP, CROP, 3])
    image = tf.image.random_flip_left_right(image)
    return tf.cast(image, tf.float32) / 127.5 - 1.0, label

  return (
    tf.data.Dataset.from_tensor_slices((data["image"], data["label"]))
    .map(tf_augment, num_parallel_calls=tf.data.AUTOTUNE)
    .batch(128)
    .prefetch(tf.data.AUTOTUNE)
  )


def _w1_grain(data: dict):
  import grain

  images, labels = data["image"], data["label"]
  return (
    grain.MapDataset.range(len(images))
    .map(lambda i: {"image": images[i], "label": labels[i]})
    .seed(0)
    .random_map(augment)
    .batch(128)
    .to_iter_dataset()
  )


def _epochs_of(system: str, make: Callable) -> Callable:
  """A zero-arg callable returning a fresh epoch iterator for `system`."""
  if system == "tf.data":
    dataset = make()
    return dataset.as_numpy_iterator
  if system == "grain":
    dataset = make()
    return lambda: iter(dataset)
  return lambda: iter(make())


def run_w1(systems, epochs, scale):
  data = w1_data(scale)
  count = lambda b: len(b["label"]) if isinstance(b, dict) else len(b[1])
  results = {}
  if "jaxfeed" in systems:
    # "jaxfeed" augments whole batches (one random_map call per batch, every
    # image with its own crop and flip); "jaxfeed-per-element" is the
    # element-wise form the peers use.
    results["jaxfeed"] = harness.measure(
      _epochs_of("jaxfeed", lambda: _w1_jaxfeed(data, batched=True)), count, epochs
    )
    results["jaxfeed-per-element"] = harness.measure(
      _epochs_of("jaxfeed", lambda: _w1_jaxfeed(data, batched=False)), count, epochs
    )
  if "tf.data" in systems:
    results["tf.data"] = harness.measure(_epochs_of("tf.data", lambda: _w1_tf(data)), count, epochs)
  if "grain" in systems:
    results["grain"] = harness.measure(_epochs_of("grain", lambda: _w1_grain(data)), count, epochs)
  return harness.report("W1", results, "images/s")


# ----------------------------------------------------------------------------
# W2: range(200k) -> map(x + 1) -> batch 1024
# ----------------------------------------------------------------------------
def run_w2(systems, epochs, scale):
  n = max(10_000, int(200_000 * scale))
  count = len
  results = {}
  if "jaxfeed" in systems:
    import jaxfeed

    results["jaxfeed"] = harness.measure(
      lambda: iter(jaxfeed.Dataset.range(n).map(add_one, batched=True).batch(1024)), count, epochs
    )
    results["jaxfeed-per-element"] = harness.measure(
      lambda: iter(jaxfeed.Dataset.range(n).map(add_one).batch(1024)), count, epochs
    )
  if "tf.data" in systems:
    import tensorflow as tf

    ds = tf.data.Dataset.range(n).map(lambda x: x + 1).batch(1024)
    results["tf.data"] = harness.measure(ds.as_numpy_iterator, count, epochs)
  if "grain" in systems:
    import grain

    ds = grain.MapDataset.range(n).map(add_one).batch(1024).to_iter_dataset()
    results["grain"] = harness.measure(lambda: iter(ds), count, epochs)
  return harness.report("W2", results, "elements/s")


# ----------------------------------------------------------------------------
# W3: token sequences -> (a) bucketing, (b) packing
# ----------------------------------------------------------------------------
def run_w3(systems, epochs, scale):
  lengths = w3_lengths(scale)
  sequences = w3_sequences(lengths)
  examples = [{"tokens": s} for s in sequences]
  boundaries, sizes = [64, 128, 256], [256, 128, 64, 32]
  results, extra = {}, {}

  def tally(name, make_epoch, count_sequences, real_tokens, key):
    results[name] = harness.measure(make_epoch, count_sequences, epochs)
    batches = list(make_epoch())
    total = sum(np.asarray(b[key] if isinstance(b, dict) else b).size for b in batches)
    extra[name] = {"padding_fraction": round(1 - sum(real_tokens(b) for b in batches) / total, 4)}

  if "jaxfeed" in systems:
    import jaxfeed

    base = jaxfeed.Dataset.from_source(examples)
    tally(
      "jaxfeed-bucketing",
      lambda: iter(base.bucket_by_sequence_length(sequence_length, boundaries, sizes)),
      lambda b: b["tokens"].shape[0],
      lambda b: int((b["tokens"] != 0).sum()),
      "tokens",
    )
    tally(
      "jaxfeed-packing",
      lambda: iter(base.pack({"tokens": 512}, num_packing_bins=32)),
      packed_sequences,
      lambda b: int((b["tokens_segment_ids"] != 0).sum()),
      "tokens",
    )
  if "tf.data" in systems:
    import tensorflow as tf

    flat = tf.constant(np.concatenate(sequences))
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    ds = (
      tf.data.Dataset.from_tensor_slices((starts, lengths))
      .map(lambda start, length: flat[start : start + length])
      .bucket_by_sequence_length(lambda x: tf.shape(x)[0], boundaries, sizes)
    )
    tally(
      "tf.data-bucketing",
      ds.as_numpy_iterator,
      lambda b: b.shape[0],
      lambda b: int((b != 0).sum()),
      "tokens",
    )
  if "grain" in systems:
    import grain

    packed = grain.experimental.FirstFitPackIterDataset(
      grain.MapDataset.source(examples).to_iter_dataset(),
      length_struct={"tokens": 512},
      num_packing_bins=32,
    )
    tally(
      "grain-packing",
      lambda: iter(packed),
      packed_sequences,
      lambda b: int((b["tokens_segment_ids"] != 0).sum()),
      "tokens",
    )
  lines = []
  for kind in ("bucketing", "packing"):
    subset = {k: v for k, v in results.items() if k.endswith(kind)}
    if subset:
      lines += harness.report(f"W3-{kind}", subset, "sequences/s", extra)
  return lines
