r"""W7: JPEG tf.train.Examples -> parse -> decode + random resized crop -> batch.

10,000 Examples, each a ~256 px JPEG (a random crop of one of scikit-learn's
sample photographs, re-encoded at quality 90) and a label, in one TFRecord
file. Every system parses each Example, decodes a random resized crop to
224 x 224 (scale (0.08, 1), ratio (3/4, 4/3)), flips it at random, normalizes
it to float32 and batches 128:

  * jaxfeed: TFRecordSource -> random_map(jaxfeed.example + jaxfeed.image,
    backend="process", writes_out=True) -> batch (worker processes, one per
    core, each normalizing its image straight into the image's row of the
    shared-memory batch);
    jaxfeed-normalize-batches: the same with normalize moved after the batch
    (uint8 images, one float32 array per batch, normalized on threads);
    jaxfeed-uint8: no normalize on the host (uint8 batches, a quarter of the
    bytes, for a jitted step to normalize on the accelerator).
    Processes, not threads (`--backend thread` measures those): on the
    2-core machine of the README's table, 2 threads kept only ~1.2 cores
    busy (the per-image Python holds the GIL), and processes gave 1.49x
    their rate for float32 batches and 1.45x for uint8 ones (2,000 records,
    4 epochs of one dataset, same sitting). W7 names the backend so that
    its rows measure processes from the first epoch (AUTOTUNE measures
    inline, threads and processes first, see `jaxfeed.ops.backend_choice`).
  * tf.data: TFRecordDataset -> map(tf.io.parse_single_example,
    tf.image.sample_distorted_bounding_box + decode_and_crop_jpeg + resize,
    flip, normalize; AUTOTUNE) -> batch -> prefetch.
  * grain: MapDataset over the same records -> random_map (Pillow: draft,
    crop-resize, flip, normalize) -> batch, in worker processes.
  * limit: one core's rate in a bare loop doing the work the jaxfeed
    pipeline is asked to do, times the cores this process may use: from
    records in memory, parse, decode + random resized crop, flip, normalize
    to float32, into the rows of a batch array (as fast as one thread can:
    reused buffers, `out=` arrays, no per-image allocation);
    limit-uint8: the same without the normalize (uint8 batches), the limit
    of jaxfeed-uint8; decode-limit: decode + crop alone (uint8, a new array
    per image), for reference; limit-in-processes: the limit's loop run in
    that many processes at once, what a machine shared with other work
    actually gives it. A test checks that the limit's loop gives the
    pipeline's batches.

Prints one JSON line per system and repetition: images/s, and for the
in-process systems the CPU time per image (all threads, and jaxfeed's worker
processes, over the timed epochs), which a machine shared with other work disturbs far less than the
rate. The jaxfeed lines
have their ratio to the best peer and to the limits, by rate and by CPU time
(`cpu_ratio_vs_*`: the limit's CPU per image over the system's). With
`--repeats N` every system and limit is measured N times in one process,
in turn, and a last line gives each ratio's median.

  python -m benchmarks.w7_images [--records 10000] [--epochs 2] [--repeats 3]
      [--systems ...] [--backend process|thread] [--limit-seconds 5]
"""

from __future__ import annotations

import argparse
import io
import itertools
import os
import statistics
import time

import numpy as np

from benchmarks import harness
from benchmarks import record

SIZE = 224
BATCH = 128
SCALE = (0.08, 1.0)
RATIO = (3 / 4, 4 / 3)
MEAN = np.array([123.675, 116.28, 103.53], np.float32)
STD = np.array([58.395, 57.12, 57.375], np.float32)


def make_records(path: str, count: int) -> str:
  """Writes `count` JPEG Examples once (reused while the file exists)."""
  from examples import images_data
  import jaxfeed

  if not os.path.exists(path):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    records = (
      jaxfeed.make_example({"image/encoded": jpeg, "image/class/label": label})
      for jpeg, label in images_data.random_crop_jpegs(
        count, seed=7, sizes=(256,), min_side=128, quality=90
      )
    )
    jaxfeed.write_tfrecord(path + ".tmp", records)
    os.replace(path + ".tmp", path)
  return path


def jaxfeed_transform(record: bytes, rng: np.random.Generator, out: dict | None = None) -> dict:
  """Normalizes into `out["image"]`, the image's batch row, when given."""
  from examples import images_data
  from jaxfeed import image
  import jaxfeed

  example = jaxfeed.parse_single_example(record, images_data.FEATURES)
  pixels = image.decode_and_random_resized_crop(
    example["image/encoded"].item(), rng, SIZE, SCALE, RATIO
  )
  pixels = image.random_flip_left_right(pixels, rng)
  return {
    "image": image.normalize(pixels, out=None if out is None else out["image"]),
    "label": example["image/class/label"],
  }


def jaxfeed_uint8_transform(record: bytes, rng: np.random.Generator) -> dict:
  """`jaxfeed_transform` without the normalize: uint8 pixels."""
  from examples import images_data
  from jaxfeed import image
  import jaxfeed

  example = jaxfeed.parse_single_example(record, images_data.FEATURES)
  pixels = image.decode_and_random_resized_crop(
    example["image/encoded"].item(), rng, SIZE, SCALE, RATIO
  )
  return {"image": image.random_flip_left_right(pixels, rng), "label": example["image/class/label"]}


def normalize_batch(batch: dict) -> dict:
  from jaxfeed import image

  return {"image": image.normalize(batch["image"]), "label": batch["label"]}


BACKEND = "process"  # see the module docstring


def jaxfeed_dataset(path: str, threads: int, mode: str = "per-image", backend: str = BACKEND):
  """The pipeline. `mode`: "per-image" normalizes each image; "batches"
  normalizes each uint8 batch at once (one float32 array per batch, on
  `threads` threads); "uint8" leaves the normalize to the accelerator.
  `backend`: where the per-image work runs ("process": one worker process
  per core; "thread": `threads` threads)."""
  import jaxfeed

  source = jaxfeed.TFRecordSource(path)
  dataset = jaxfeed.Dataset.from_source(source)
  if mode == "per-image":
    return dataset.random_map(
      jaxfeed_transform, num_parallel_calls=threads, seed=0, writes_out=True, backend=backend
    ).batch(BATCH)
  dataset = dataset.random_map(
    jaxfeed_uint8_transform, num_parallel_calls=threads, seed=0, backend=backend
  ).batch(BATCH)
  if mode == "uint8":
    return dataset
  return dataset.map(normalize_batch, num_parallel_calls=threads)


def tf_dataset(path: str):
  import tensorflow as tf

  features = {
    "image/encoded": tf.io.FixedLenFeature([], tf.string),
    "image/class/label": tf.io.FixedLenFeature([], tf.int64),
  }

  def transform(record):
    example = tf.io.parse_single_example(record, features)
    data = example["image/encoded"]
    shape = tf.io.extract_jpeg_shape(data)
    begin, size, _ = tf.image.sample_distorted_bounding_box(
      shape,
      tf.zeros([0, 0, 4], tf.float32),
      min_object_covered=0.0,
      aspect_ratio_range=RATIO,
      area_range=SCALE,
      max_attempts=10,
      use_image_if_no_bounding_boxes=True,
    )
    window = tf.stack([begin[0], begin[1], size[0], size[1]])
    pixels = tf.io.decode_and_crop_jpeg(data, window, channels=3)
    pixels = tf.image.resize(pixels, [SIZE, SIZE])
    pixels = tf.image.random_flip_left_right(pixels)
    return {"image": (pixels - MEAN) / STD, "label": example["image/class/label"]}

  return (
    tf.data.TFRecordDataset(path)
    .map(transform, num_parallel_calls=tf.data.AUTOTUNE)
    .batch(BATCH)
    .prefetch(tf.data.AUTOTUNE)
  )


class PillowTransform:
  """Grain's side: the same steps with Pillow (draft decoding, crop-resize)."""

  def __call__(self, record: bytes, rng: np.random.Generator) -> dict:
    from PIL import Image
    from examples import images_data
    from jaxfeed import image
    import jaxfeed

    example = jaxfeed.parse_single_example(record, images_data.FEATURES)
    picture = Image.open(io.BytesIO(example["image/encoded"].item()))
    width, height = picture.size
    top, left, h, w = image.random_crop_box(height, width, rng, SCALE, RATIO)
    picture.draft("RGB", (max(1, width * SIZE // w), max(1, height * SIZE // h)))
    sx, sy = picture.size[0] / width, picture.size[1] / height
    picture = picture.convert("RGB").resize(
      (SIZE, SIZE), Image.BILINEAR, box=(left * sx, top * sy, (left + w) * sx, (top + h) * sy)
    )
    pixels = np.asarray(picture)
    if rng.random() < 0.5:
      pixels = pixels[:, ::-1]
    return {
      "image": (pixels.astype(np.float32) - MEAN) / STD,
      "label": example["image/class/label"],
    }


def grain_dataset(path: str, workers: int):
  from absl import flags
  import grain
  import jaxfeed

  if not flags.FLAGS.is_parsed():
    flags.FLAGS.mark_as_parsed()  # grain's workers read their absl flags
  source = jaxfeed.TFRecordSource(path)
  dataset = (
    grain.MapDataset.source(source)
    .seed(0)
    .random_map(PillowTransform())
    .batch(BATCH)
    .to_iter_dataset()
  )
  if workers > 0:
    dataset = dataset.mp_prefetch(grain.MultiprocessingOptions(num_workers=workers))
  return dataset


class BareBatches:
  """The pipeline's work in a bare loop on one thread: batches of `BATCH`
  images (float32 normalized, or uint8 without `normalized`) and labels.

  Everything is written into arrays made once: the two uint8 images between
  steps and the batch itself, which `batch()` returns and overwrites next
  time.
  """

  def __init__(self, normalized: bool):
    self.normalized = normalized
    self.cropped = np.empty((SIZE, SIZE, 3), np.uint8)
    self.flipped = np.empty((SIZE, SIZE, 3), np.uint8)
    self.images = np.empty((BATCH, SIZE, SIZE, 3), np.float32 if normalized else np.uint8)
    self.labels = np.empty(BATCH, np.int64)

  def batch(self, records, rngs) -> dict:
    """The batch of up to `BATCH` records, each with its generator."""
    from examples import images_data
    from jaxfeed import image
    import jaxfeed

    row = -1
    for row, (serialized, rng) in enumerate(zip(records, rngs)):
      example = jaxfeed.parse_single_example(serialized, images_data.FEATURES)
      pixels = image.decode_and_random_resized_crop(
        example["image/encoded"].item(), rng, SIZE, SCALE, RATIO, out=self.cropped
      )
      if self.normalized:
        image.normalize(
          image.random_flip_left_right(pixels, rng, out=self.flipped), out=self.images[row]
        )
      else:
        image.random_flip_left_right(pixels, rng, out=self.images[row])
      self.labels[row] = example["image/class/label"]
    return {"image": self.images[: row + 1], "label": self.labels[: row + 1]}


def bare_limit(path: str, cores: int, kind: str, seconds: float = 5.0, ready=None) -> dict:
  """One core's rate in a bare loop, times `cores`.

  `kind`: "limit" (the work of the jaxfeed pipeline: parse, decode + crop,
  flip, normalize, into batches), "limit-uint8" (the same without the
  normalize) or "decode-limit" (decode + crop alone). `ready()`, if given, is
  called after the warm-up, right before the timed loop.
  """
  import jaxfeed
  from jaxfeed import image
  from examples import images_data

  source = jaxfeed.TFRecordSource(path)
  records = source.get_many(np.arange(min(512, len(source))))
  jpegs = [
    jaxfeed.parse_single_example(r, images_data.FEATURES)["image/encoded"].item() for r in records
  ]
  rng = np.random.default_rng(0)
  bare = BareBatches(normalized=kind == "limit")
  # A warm-up batch maps the batch array's pages (the pipeline's first
  # epoch, a warm-up too, maps the blocks it reuses).
  bare.batch(records[:BATCH], itertools.repeat(rng))
  if ready is not None:
    ready()
  count, start, cpu = 0, time.perf_counter(), time.process_time()
  while time.perf_counter() - start < seconds:
    if kind == "decode-limit":
      for jpeg in jpegs:
        image.decode_and_random_resized_crop(jpeg, rng, SIZE, SCALE, RATIO)
    else:
      for first in range(0, len(records), BATCH):
        bare.batch(records[first : first + BATCH], itertools.repeat(rng))
    count += len(jpegs)
  one_core = count / (time.perf_counter() - start)
  return {
    "rate": one_core * cores,
    "one_core_rate": round(one_core, 1),
    "cores": cores,
    "cpu_us_per_image": round((time.process_time() - cpu) / count * 1e6, 1),
  }


def _bare_limit_worker(path, kind, seconds, barrier, results, parent) -> None:
  from jaxfeed import _lifetime  # pylint: disable=g-import-not-at-top

  _lifetime.die_with_parent(*parent)  # a killed benchmark leaves none behind
  results.put(bare_limit(path, 1, kind, seconds, ready=barrier.wait))


def bare_limit_in_processes(path: str, cores: int, kind: str, seconds: float = 5.0) -> dict:
  """The bare loop of `bare_limit` in `cores` processes at once (no GIL
  shared): what the machine gives this work now, against which "one core
  times the cores" can be checked on a machine shared with other work."""
  import multiprocessing
  from jaxfeed import _lifetime  # pylint: disable=g-import-not-at-top

  context = multiprocessing.get_context("spawn")
  barrier, results = context.Barrier(cores), context.Queue()
  parent = (os.getpid(), _lifetime.on_lasting_thread())
  workers = [
    context.Process(target=_bare_limit_worker, args=(path, kind, seconds, barrier, results, parent))
    for _ in range(cores)
  ]
  for worker in workers:
    worker.start()
  rates = [results.get() for _ in workers]
  for worker in workers:
    worker.join()
  return {
    "rate": round(sum(r["one_core_rate"] for r in rates), 1),
    "processes": cores,
    "cpu_us_per_image": round(statistics.mean(r["cpu_us_per_image"] for r in rates), 1),
  }


def pipeline_cpu_s() -> float:
  """CPU seconds of this process and of the worker processes jaxfeed's
  process backend runs (its children: those running and those reaped)."""
  return harness.process_tree_cpu_s()


def measure_cpu(make_epoch, count, epochs: int) -> dict:
  """`harness.measure` plus the pipeline's CPU time per item (this process
  and its worker processes) over the timed epochs (after the warm-up, like
  the rate and like the limits' loops)."""
  starts = []
  result = harness.measure(
    make_epoch, count, epochs, before_epoch=lambda: starts.append(pipeline_cpu_s())
  )
  result["cpu_us_per_image"] = round(
    (pipeline_cpu_s() - starts[1]) / (result["items"] * epochs) * 1e6, 1
  )
  return result


def thread_scaling(path: str, seconds: float = 3.0) -> dict:
  """decode_and_random_resized_crop images/s on 1 and on 2 threads."""
  import threading
  import jaxfeed
  from jaxfeed import image
  from examples import images_data

  source = jaxfeed.TFRecordSource(path)
  jpegs = [
    jaxfeed.parse_single_example(r, images_data.FEATURES)["image/encoded"].item()
    for r in source.get_many(np.arange(200))
  ]

  def run(threads: int) -> float:
    counts = [0] * threads
    stop = time.perf_counter() + seconds

    def work(slot):
      rng = np.random.default_rng(slot)
      while time.perf_counter() < stop:
        for jpeg in jpegs[:50]:
          image.decode_and_random_resized_crop(jpeg, rng, SIZE, SCALE, RATIO)
        counts[slot] += 50

    pool = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
    start = time.perf_counter()
    for t in pool:
      t.start()
    for t in pool:
      t.join()
    return sum(counts) / (time.perf_counter() - start)

  return {"1_thread": round(run(1), 1), "2_threads": round(run(2), 1)}


JAXFEED_MODES = (  # system, jaxfeed_dataset mode, the limit doing its work
  ("jaxfeed", "per-image", "limit"),
  ("jaxfeed-normalize-batches", "batches", "limit"),
  ("jaxfeed-uint8", "uint8", "limit-uint8"),
)


def run_once(args, path: str, cores: int, threads: int) -> dict:
  """Measures every system and limit once; prints and returns the ratios.

  Each limit is measured right before the jaxfeed systems it bounds, so that
  a ratio compares measurements taken under about the same machine load.
  """
  count = lambda batch: len(batch["label"])
  results, extra, limits = {}, {}, {}

  def measure_limit(name: str) -> None:
    if "limit" in args.systems and name not in limits:
      limits[name] = bare_limit(path, cores, name, args.limit_seconds)
      limits[name]["load_avg_1m"] = round(os.getloadavg()[0], 1)

  measure_limit("limit")
  if "limit" in args.systems:
    limits["limit-in-processes"] = bare_limit_in_processes(path, cores, "limit", args.limit_seconds)
    limits["limit-in-processes"]["load_avg_1m"] = round(os.getloadavg()[0], 1)
  if "jaxfeed" in args.systems:
    for name, mode, limit in JAXFEED_MODES:
      measure_limit(limit)
      dataset = jaxfeed_dataset(path, threads, mode, args.backend)
      results[name] = measure_cpu(lambda: iter(dataset), count, args.epochs)
      extra[name] = {
        "backend": args.backend,
        "threads": threads,
        "limit": limit,
        "load_avg_1m": round(os.getloadavg()[0], 1),
      }
    extra["jaxfeed"]["thread_scaling"] = thread_scaling(path)
  if "tf.data" in args.systems:
    dataset = tf_dataset(path)
    results["tf.data"] = measure_cpu(dataset.as_numpy_iterator, count, args.epochs)
  if "grain" in args.systems:
    dataset = grain_dataset(path, cores)
    results["grain"] = harness.measure(lambda: iter(dataset), count, args.epochs)
    extra["grain"] = {"workers": cores}
  measure_limit("decode-limit")
  ratios = {}
  for name, _, limit_name in JAXFEED_MODES:
    if name not in results:
      continue
    mine = results[name]
    for other in (limit_name, "decode-limit", "limit-in-processes"):
      if other == "limit-in-processes" and limit_name != "limit":
        continue
      if other in limits:
        ratios[f"{name} ratio_vs_{other}"] = round(mine["rate"] / limits[other]["rate"], 3)
        ratios[f"{name} cpu_ratio_vs_{other}"] = round(
          limits[other]["cpu_us_per_image"] / mine["cpu_us_per_image"], 3
        )
    if "tf.data" in results:
      ratios[f"{name} ratio_vs_tf.data"] = round(mine["rate"] / results["tf.data"]["rate"], 3)
      ratios[f"{name} cpu_ratio_vs_tf.data"] = round(
        results["tf.data"]["cpu_us_per_image"] / mine["cpu_us_per_image"], 3
      )
  for key, value in ratios.items():
    system, ratio = key.split(" ")
    extra.setdefault(system, {})[ratio] = value
  harness.report("W7", results, "images/s", extra)
  for name, limit in limits.items():
    harness.report("W7", {name: limit}, "images/s")
  return ratios


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--records", type=int, default=10_000)
  parser.add_argument("--epochs", type=int, default=2)
  parser.add_argument("--repeats", type=int, default=1)
  parser.add_argument("--data", default="/tmp/jaxfeed_w7/images.tfrecord")
  parser.add_argument("--systems", nargs="+", default=["jaxfeed", "tf.data", "grain", "limit"])
  parser.add_argument(
    "--threads", type=int, default=0, help="jaxfeed's decode threads (0: the usable cores)"
  )
  parser.add_argument(
    "--backend",
    choices=["process", "thread"],
    default=BACKEND,
    help="where jaxfeed's per-image work runs",
  )
  parser.add_argument(
    "--limit-seconds", type=float, default=5.0, help="how long each limit's bare loop runs"
  )
  args = parser.parse_args()
  cores = len(os.sched_getaffinity(0))
  threads = args.threads or cores
  path = make_records(args.data.replace(".tfrecord", f"-{args.records}.tfrecord"), args.records)
  runs = [run_once(args, path, cores, threads) for _ in range(args.repeats)]
  if args.repeats > 1:
    record.row(
      {
        "workload": "W7",
        "system": "median of repeats",
        "median_of_repeats": {key: statistics.median(run[key] for run in runs) for key in runs[0]},
        "repeats": args.repeats,
      }
    )


if __name__ == "__main__":
  with record.run("w7_images"):
    main()
