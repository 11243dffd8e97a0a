r"""W1 as users write it: a per-element Python function, epoch by epoch.

20,000 uint8 64x64x3 images + int32 labels in memory -> random 56x56 crop,
random horizontal flip, normalize to float32 (`augment` below, verbatim
from BENCHMARKS.md) -> batches of 128, over a shuffled `IndexSampler`,
iterated `for batch in ds:` once per epoch. Main rows, all in this run:

  * jaxfeed AUTOTUNE: `random_map(augment, num_parallel_calls=AUTOTUNE)
    .batch(128).prefetch(2)` (the row says which backend AUTOTUNE picked,
    the rates it measured and why);
  * jaxfeed with no parallelism (the same pipeline without
    `num_parallel_calls`), with threads (`num_parallel_calls=2,
    backend="thread"`) and with processes (`num_parallel_calls=2,
    backend="process"`);
  * jaxfeed AUTOTUNE, one iterator over 4 epochs (a sampler with
    `num_epochs=4`): the AUTOTUNE row's epochs 2-4 must be as fast (warm
    workers and findings are kept by the dataset);
  * tf.data as its users write it, with `tf.image` ops, `shuffle(20000)`;
  * Grain: `random_map` with its multiprocessing options, as its docs
    recommend (`ReadOptions` threads, `mp_prefetch` with
    `MultiprocessingOptions(num_workers=cores)`);
  * the bare single-thread loop: `for i in perm: augment(el_i, rng)` and
    `np.stack` into batches, the cheapest honest Python.

Extra rows, labelled: jaxfeed AUTOTUNE with the hand-tuned function
(`workloads.augment`, `out=` buffers), and tf.data running `augment`
through `tf.numpy_function`.

The rows take turns, one epoch each (warm-up epoch, then `--epochs`), so that
the machine's load drifts over all of them alike; a row reports the median
images/s of its epochs after the warm-up, images per CPU second and the
cores it kept busy (this process and its children). Then each row runs again
alone in a subprocess of its own for its peak RSS (and PSS: shared pages
counted once) over two epochs, the process tree included (worker
processes), the data set included. The AUTOTUNE row carries its ratios to
the other main rows and to (cores x the bare loop).

  python -m benchmarks.w1_per_element [--epochs 3] [--scale 1.0] [--rows a,b]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any, Callable

import numpy as np
import psutil

from benchmarks import harness
from benchmarks import record

BATCH = 128
WORKLOAD = "W1 per-element"


def augment(el, rng):
  x = el["image"]  # uint8 64x64x3
  i, j = rng.integers(0, 9, 2)
  x = x[i : i + 56, j : j + 56]
  if rng.random() < 0.5:
    x = x[:, ::-1]
  return {"image": (x.astype(np.float32) - 127.5) / 127.5, "label": el["label"]}


def _cores() -> int:
  return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


# ----------------------------------------------------------------------------
# the rows: each makes one epoch's iterable (a "for batch in ds" per epoch)
# ----------------------------------------------------------------------------
def _jaxfeed(data: dict, num_epochs: int = 1, fn: Callable = augment, **random_map_kwargs: Any):
  import jaxfeed

  n = len(data["label"])
  ds = (
    jaxfeed.Dataset.from_source(
      jaxfeed.ArraySource({"image": data["image"], "label": data["label"]}),
      jaxfeed.IndexSampler(n, shuffle=True, seed=0, num_epochs=num_epochs),
    )
    .random_map(fn, **random_map_kwargs)
    .batch(BATCH)
    .prefetch(2)
  )
  return ds


def _tf_data(data: dict):
  import tensorflow as tf

  def aug(x, y):
    x = tf.image.random_crop(x, (56, 56, 3))
    x = tf.image.random_flip_left_right(x)  # noqa: E702
    return (tf.cast(x, tf.float32) - 127.5) / 127.5, y

  imgs, labels = data["image"], data["label"]
  return (
    tf.data.Dataset.from_tensor_slices((imgs, labels))
    .shuffle(20000)
    .map(aug, num_parallel_calls=tf.data.AUTOTUNE)
    .batch(128)
    .prefetch(tf.data.AUTOTUNE)
  )  # noqa: E501


def _tf_numpy_function(data: dict):
  import tensorflow as tf

  rng = np.random.default_rng(0)

  def aug(x, y):
    out = augment({"image": x, "label": y}, rng)
    return out["image"], out["label"]

  def tf_aug(x, y):
    x, y = tf.numpy_function(aug, [x, y], [tf.float32, tf.int32])
    x.set_shape([56, 56, 3])
    y.set_shape([])
    return x, y

  return (
    tf.data.Dataset.from_tensor_slices((data["image"], data["label"]))
    .shuffle(20000)
    .map(tf_aug, num_parallel_calls=tf.data.AUTOTUNE)
    .batch(128)
    .prefetch(tf.data.AUTOTUNE)
  )


class _Records:
  """The images as Grain's users hand an in-memory data set to it: a
  sequence of records."""

  def __init__(self, data: dict):
    self.images, self.labels = data["image"], data["label"]

  def __len__(self) -> int:
    return len(self.labels)

  def __getitem__(self, i: int) -> dict:
    return {"image": self.images[i], "label": self.labels[i]}


def _grain(data: dict):
  import grain
  from absl import flags

  if not flags.FLAGS.is_parsed():  # Grain reads its flags; no absl.app here
    flags.FLAGS.mark_as_parsed()
  return (
    grain.MapDataset.source(_Records(data))
    .shuffle(seed=0)
    .random_map(augment, seed=0)
    .batch(BATCH)
    .to_iter_dataset(grain.ReadOptions(num_threads=_cores()))
    .mp_prefetch(grain.MultiprocessingOptions(num_workers=_cores()))
  )


class _BareLoop:
  """`for batch in loop:` one epoch of the bare single-thread loop."""

  def __init__(self, data: dict):
    self.images, self.labels = data["image"], data["label"]
    self.rng = np.random.default_rng(0)

  def __iter__(self):
    images, labels, rng = self.images, self.labels, self.rng
    perm = rng.permutation(len(labels))
    for start in range(0, len(perm), BATCH):
      outs = [
        augment({"image": images[i], "label": labels[i]}, rng) for i in perm[start : start + BATCH]
      ]
      yield {
        "image": np.stack([o["image"] for o in outs]),
        "label": np.stack([o["label"] for o in outs]),
      }


def _hand_tuned(data: dict):
  import jaxfeed
  from benchmarks import workloads

  return _jaxfeed(data, fn=workloads.augment, num_parallel_calls=jaxfeed.AUTOTUNE)


def _makers(epochs: int) -> dict[str, Callable[[dict], Any]]:
  """Row name -> make(data) -> an object iterated once per epoch, of
  `epochs` epochs in all."""
  import jaxfeed

  auto = jaxfeed.AUTOTUNE
  return {
    "jaxfeed AUTOTUNE": lambda d: _jaxfeed(d, num_parallel_calls=auto),
    "jaxfeed no parallelism": lambda d: _jaxfeed(d),
    "jaxfeed threads (num_parallel_calls=2)": lambda d: _jaxfeed(
      d, num_parallel_calls=2, backend="thread"
    ),
    "jaxfeed processes (num_parallel_calls=2)": lambda d: _jaxfeed(
      d, num_parallel_calls=2, backend="process"
    ),
    "jaxfeed AUTOTUNE, one iterator over 4 epochs": lambda d: _OneIterator(
      _jaxfeed(d, num_epochs=epochs, num_parallel_calls=auto), len(d["label"])
    ),
    "tf.data (tf.image ops)": _tf_data,
    "grain (multiprocessing)": _grain,
    "bare single-thread loop": _BareLoop,
    "jaxfeed AUTOTUNE, hand-tuned function (out= buffers)": _hand_tuned,
    "tf.data, tf.numpy_function": _tf_numpy_function,
  }


MAIN_ROWS = (
  "jaxfeed AUTOTUNE",
  "jaxfeed no parallelism",
  "jaxfeed threads (num_parallel_calls=2)",
  "jaxfeed processes (num_parallel_calls=2)",
  "jaxfeed AUTOTUNE, one iterator over 4 epochs",
  "tf.data (tf.image ops)",
  "grain (multiprocessing)",
  "bare single-thread loop",
)


class _OneIterator:
  """One iterator kept over every epoch: each `iter()` hands out the next
  epoch's worth of images from it (batches may span two epochs)."""

  def __init__(self, ds: Any, images: int):
    self.ds, self.images = ds, images
    self.iterator = None
    self.read = 0
    self.epochs = 0

  def __iter__(self):
    if self.iterator is None:
      self.iterator = iter(self.ds)
    self.epochs += 1
    while self.read < self.images * self.epochs:
      batch = next(self.iterator)
      self.read += _count(batch)
      yield batch

  def close(self) -> None:
    if self.iterator is not None:
      self.iterator.close()
    _close(self.ds)


def _count(batch: Any) -> int:
  return len(batch["label"]) if isinstance(batch, dict) else len(batch[1])


def _close(ds: Any) -> None:
  close = getattr(ds, "close", None)
  if close is not None:
    close()


# ----------------------------------------------------------------------------
# measuring
# ----------------------------------------------------------------------------
class _Row:
  """One system: what its epochs took."""

  def __init__(self, name: str, ds: Any):
    self.name, self.ds = name, ds
    self.times: list[float] = []
    self.cpu: list[float] = []
    self.picked: dict | None = None

  def epoch(self) -> int:
    cpu, start = harness.process_tree_cpu_s(), time.perf_counter()
    images = 0
    iterator = iter(self.ds)  # what `for batch in self.ds:` does
    for batch in iterator:
      images += _count(batch)
    self.times.append(time.perf_counter() - start)
    self.cpu.append(harness.process_tree_cpu_s() - cpu)
    self.picked = _picked(getattr(self.ds, "iterator", None) or iterator)
    return images

  def result(self, images: int) -> dict:
    timed, cpu = self.times[1:], self.cpu[1:]
    return {
      "rate": statistics.median(images / t for t in timed),
      "rates": [round(images / t, 1) for t in timed],
      "images_per_cpu_s": round(images * len(cpu) / sum(cpu), 1),
      "cores_used": round(sum(cpu) / sum(timed), 2),
      "warmup_epoch_s": round(self.times[0], 2),
    }


def _picked(iterator: Any) -> dict | None:
  """The stats row of a jaxfeed pipeline's op that chose a backend: what
  AUTOTUNE picked, the rates it measured and why."""
  stats = getattr(iterator, "stats", None)
  if stats is None:
    return None
  for row in stats()["ops"]:
    if "backend" in row:
      return {
        k: v
        for k, v in row.items()
        if k in ("op", "backend", "reason", "num_workers", "rates", "measured")
      }
  return None


class _TreeMemory:
  """Samples RSS and PSS of a process and its descendants."""

  def __init__(self, pid: int, interval_s: float = 0.1):
    self.pid, self.interval = pid, interval_s
    self.peak_rss = self.peak_pss = 0

  def sample(self) -> None:
    try:
      root = psutil.Process(self.pid)
      processes = [root] + root.children(recursive=True)
    except psutil.Error:
      return
    rss = pss = 0
    for process in processes:
      try:
        info = process.memory_full_info()
      except (psutil.Error, OSError):
        continue
      rss += info.rss
      pss += getattr(info, "pss", info.rss)
    self.peak_rss, self.peak_pss = max(self.peak_rss, rss), max(self.peak_pss, pss)


def _memory_of(name: str, scale: float) -> dict:
  """Peak RSS and PSS of the row run alone (two epochs) in a subprocess."""
  command = [
    sys.executable,
    "-m",
    "benchmarks.w1_per_element",
    "--alone",
    name,
    "--scale",
    str(scale),
  ]
  process = subprocess.Popen(command, stdout=subprocess.DEVNULL)
  memory = _TreeMemory(process.pid)
  while process.poll() is None:
    memory.sample()
    time.sleep(memory.interval)
  if process.returncode:
    return {"memory_error": f"exit code {process.returncode}"}
  return {
    "peak_rss_mb": round(memory.peak_rss / 2**20, 1),
    "peak_pss_mb": round(memory.peak_pss / 2**20, 1),
  }


def _alone(name: str, scale: float) -> None:
  """Two epochs of one row, for `_memory_of`."""
  from benchmarks import workloads

  ds = _makers(2)[name](workloads.w1_data(scale))
  for _ in range(2):
    for _ in ds:
      pass
  _close(ds)


def _load() -> list[float]:
  return [round(x, 2) for x in os.getloadavg()]


def _row_names(text: str, known) -> list[str]:
  """The rows `--rows` names, comma-separated; a row's own name may hold a
  comma ("jaxfeed AUTOTUNE, one iterator over 4 epochs"): the longest known
  name wins."""
  parts, names, i = text.split(","), [], 0
  while i < len(parts):
    j = next((j for j in range(len(parts), i, -1) if ",".join(parts[i:j]).strip() in known), i + 1)
    name = ",".join(parts[i:j]).strip()
    if name:
      names.append(name)
    i = j
  return names


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--epochs", type=int, default=3, help="timed epochs")
  parser.add_argument("--scale", type=float, default=1.0)
  parser.add_argument(
    "--rows",
    default="",
    help="comma-separated row names (default: all; rows of missing peers are skipped)",
  )
  parser.add_argument("--no-memory", action="store_true", help="skip the per-row memory runs")
  parser.add_argument("--alone", default=None, help=argparse.SUPPRESS)
  args = parser.parse_args()
  if args.alone is not None:
    _alone(args.alone, args.scale)
    return

  from benchmarks import workloads

  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
  data = workloads.w1_data(args.scale)
  n = len(data["label"])
  makers = _makers(1 + args.epochs)
  names = _row_names(args.rows, makers) or list(makers)
  unknown = sorted(set(names) - set(makers))
  if unknown:
    parser.error(f"unknown rows {unknown}; rows are {sorted(makers)}")
  rows = {}
  for name in names:
    try:
      rows[name] = _Row(name, makers[name](data))
    except ImportError as exc:  # a peer that is not installed
      print(json.dumps({"note": f"{name} skipped: {exc}"}), file=sys.stderr)
  load_before = _load()
  # Epochs round-robin over the rows, so that a change of the machine's load
  # while the benchmark runs is shared by all of them.
  for _ in range(1 + args.epochs):
    for row in rows.values():
      row.epoch()
  results = {name: row.result(n) for name, row in rows.items()}
  load_after = _load()
  for name, row in rows.items():
    if row.picked is not None:
      results[name]["picked"] = row.picked
    _close(row.ds)
  rows.clear()
  if not args.no_memory:
    for name in results:
      results[name].update(_memory_of(name, args.scale))

  rate = lambda name: results[name]["rate"] if name in results else None
  auto = "jaxfeed AUTOTUNE"
  if auto in results:
    ratios = {
      "vs_no_parallelism": rate("jaxfeed no parallelism"),
      "vs_tf_data": rate("tf.data (tf.image ops)"),
      "vs_grain": rate("grain (multiprocessing)"),
      "vs_threads": rate("jaxfeed threads (num_parallel_calls=2)"),
      "vs_processes": rate("jaxfeed processes (num_parallel_calls=2)"),
    }
    for key, other in ratios.items():
      if other:
        results[auto][key] = round(results[auto]["rate"] / other, 3)
    bare = rate("bare single-thread loop")
    if bare:
      results[auto]["vs_cores_x_bare_loop"] = round(results[auto]["rate"] / (_cores() * bare), 3)
    one = rate("jaxfeed AUTOTUNE, one iterator over 4 epochs")
    if one:
      results[auto]["epochs_2_4_vs_one_iterator"] = round(results[auto]["rate"] / one, 3)
  for name, result in results.items():
    line = {
      "workload": WORKLOAD,
      "system": name,
      "unit": "images/s",
      "rate": round(result.pop("rate"), 1),
      **result,
      "main_row": name in MAIN_ROWS,
      "cores": _cores(),
      "load_avg_before": load_before,
      "load_avg_after": load_after,
    }
    record.row(line)


if __name__ == "__main__":
  if "--alone" in sys.argv:  # a row's memory run: nothing to record
    main()
  else:
    with record.run("w1_per_element"):
      main()
