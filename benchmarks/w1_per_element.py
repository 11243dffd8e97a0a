r"""W1 written per element: the augmentation as a per-image Python function.

20,000 uint8 64x64x3 images + int32 labels in memory -> random 56x56 crop,
random horizontal flip, normalize to float32 (`workloads.augment`, one image
per call) -> batches of 128. Rows, all in this run:

  * bare loop: the same function over the images in one thread, batches
    stacked with np.stack per key (no pipeline at all);
  * jaxfeed: `random_map(augment, num_parallel_calls=AUTOTUNE).batch(128)`,
    as users write it; AUTOTUNE picks threads or worker processes (the row
    says which and why); plus rows forcing each backend, and processes
    returning copies instead of shared-memory views;
  * tf.data: `map` of the same function through `tf.numpy_function`,
    num_parallel_calls=AUTOTUNE, batch 128, prefetch AUTOTUNE.

Each row runs one iterator over 1 + `--epochs` epochs (jaxfeed: a sampler
with that many epochs; tf.data: repeat); the rows take turns, one epoch each,
so that changes of the machine's load hit all of them. A row reports the
median images/s of its epochs after the first (start-up and AUTOTUNE's
trial fall in the warm-up epoch, whose time is reported too), the images
per CPU second and the cores it kept busy (this process and its children:
on a shared machine the scheduler's share, not the code, can be the limit).
Memory is measured after, one system at a time over two epochs: the peak RSS
of this process plus its children (worker processes), and of their PSS
(shared pages counted once), data set included.
The jaxfeed rows report the ratio to tf.data and to (cores x bare loop).

  python -m benchmarks.w1_per_element [--epochs 3] [--scale 1.0] [--no-tf]
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time

import numpy as np
import psutil

from benchmarks import record
from benchmarks import workloads

BATCH = 128


class PeakMemory:
  """Samples RSS and PSS of this process and its children while a row runs."""

  def __init__(self, interval_s: float = 0.25):
    self._interval = interval_s
    self._stop = threading.Event()
    self.peak_rss = self.peak_pss = 0

  def _sample(self) -> None:
    processes = [psutil.Process()]
    processes += processes[0].children(recursive=True)
    rss = pss = 0
    for process in processes:
      try:
        if "forkserver" in " ".join(process.cmdline()):
          continue  # multiprocessing's helper, not the row's
        info = process.memory_full_info()
      except (psutil.Error, OSError):
        continue
      rss += info.rss
      pss += getattr(info, "pss", info.rss)
    self.peak_rss, self.peak_pss = max(self.peak_rss, rss), max(self.peak_pss, pss)

  def __enter__(self) -> "PeakMemory":
    self._stop.clear()

    def run():
      while not self._stop.wait(self._interval):
        self._sample()
    self._sample()
    self._thread = threading.Thread(target=run, name="peak-memory", daemon=True)
    self._thread.start()
    return self

  def __exit__(self, *exc) -> None:
    self._stop.set()
    self._thread.join()


def _cpu_s() -> float:
  """CPU seconds used so far by this process and its live children."""
  me = psutil.Process()
  total = sum(me.cpu_times()[:2])
  for child in me.children(recursive=True):
    try:
      total += sum(child.cpu_times()[:2])
    except psutil.Error:
      pass
  return total


class _Row:
  """One system: its iterator over all epochs, and what its epochs took."""

  def __init__(self, make, extra=None):
    self.iterator = make()
    self.extra = extra
    self.times, self.cpu = [], []
    self.read = 0

  def epoch(self, images: int) -> None:
    """Reads one epoch's batches (`images` images), timed."""
    # Batches may span epochs (a sampler's epochs follow each other).
    target = images * (len(self.times) + 1)
    cpu, start = _cpu_s(), time.perf_counter()
    while self.read < target:
      batch = next(self.iterator)
      self.read += len(batch["label"]) if isinstance(batch, dict) else len(batch[1])
    self.times.append(time.perf_counter() - start)
    self.cpu.append(_cpu_s() - cpu)

  def result(self, images: int) -> dict:
    timed, cpu = self.times[1:], self.cpu[1:]
    out = {"rate": statistics.median(images / t for t in timed),
           "rates": [round(images / t, 1) for t in timed],
           "images_per_cpu_s": round(images * len(cpu) / sum(cpu), 1),
           "cores_used": round(sum(cpu) / sum(timed), 2),
           "warmup_epoch_s": round(self.times[0], 2)}
    if self.extra is not None:
      out.update(self.extra(self.iterator))
    close = getattr(self.iterator, "close", None)
    if close is not None:
      close()
    return out


def _bare_loop(data: dict, epochs: int):
  images, labels = data["image"], data["label"]
  rng = np.random.default_rng(0)
  for _ in range(epochs):
    for start in range(0, len(images), BATCH):
      outs = [workloads.augment({"image": images[i], "label": labels[i]}, rng)
              for i in range(start, min(start + BATCH, len(images)))]
      yield {key: np.stack([o[key] for o in outs]) for key in outs[0]}


def _jaxfeed(data: dict, epochs: int, backend: str = "auto", copy: bool = False):
  import jaxfeed
  from jaxfeed.ops import process_batch
  source = jaxfeed.ArraySource(data)
  ds = jaxfeed.Dataset.from_source(
      source, jaxfeed.IndexSampler(len(source), num_epochs=epochs))
  ds = ds.random_map(workloads.augment, num_parallel_calls=jaxfeed.AUTOTUNE,
                     backend="auto" if backend == "auto" else "thread").batch(BATCH)
  if backend == "process":
    node = process_batch.ProcessBatchNode(ds.node, backend="process", copy=copy)
    return node.make_iterator()
  return ds.prefetch(2).make_iterator()


def _fused(iterator):
  """The process_batch iterator inside a jaxfeed pipeline, if there is one."""
  from jaxfeed.ops import process_batch
  stack = [getattr(iterator, "root", iterator)]
  while stack:
    it = stack.pop()
    if isinstance(it, process_batch.ProcessBatchIterator):
      return it
    stack.extend(it.parents)
  return None


def _tf_data(data: dict, epochs: int):
  import tensorflow as tf
  rng = np.random.default_rng(0)

  def augment(image, label):
    out = workloads.augment({"image": image, "label": label}, rng)
    return out["image"], out["label"]

  def tf_augment(image, label):
    image, label = tf.numpy_function(augment, [image, label], [tf.float32, tf.int32])
    image.set_shape([workloads.CROP, workloads.CROP, 3])
    label.set_shape([])
    return image, label

  return (tf.data.Dataset.from_tensor_slices((data["image"], data["label"]))
          .repeat(epochs).map(tf_augment, num_parallel_calls=tf.data.AUTOTUNE)
          .batch(BATCH).prefetch(tf.data.AUTOTUNE).as_numpy_iterator())


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--epochs", type=int, default=3)
  parser.add_argument("--scale", type=float, default=1.0)
  parser.add_argument("--no-tf", action="store_true", help="skip tf.data")
  args = parser.parse_args()

  data = workloads.w1_data(args.scale)
  n = len(data["label"])
  epochs = args.epochs + 1
  cores = os.cpu_count() or 1
  def picked(iterator):
    fused = _fused(iterator)
    return {"picked": (fused.stats()["ops"][-1] if fused is not None
                       else "thread (not fused)")}

  makers = {
      "bare loop": (lambda: _bare_loop(data, epochs), None),
      "jaxfeed": (lambda: _jaxfeed(data, epochs), picked),
      "jaxfeed threads": (lambda: _jaxfeed(data, epochs, "thread"), None),
      "jaxfeed processes": (lambda: _jaxfeed(data, epochs, "process"),
                            lambda it: {"picked": it.stats()["ops"][-1]}),
      "jaxfeed processes (copies)": (
          lambda: _jaxfeed(data, epochs, "process", copy=True),
          lambda it: {"picked": it.stats()["ops"][-1]}),
  }
  if not args.no_tf:
    makers["tf.data"] = (lambda: _tf_data(data, epochs), None)
  live = {name: _Row(make, extra) for name, (make, extra) in makers.items()}
  # Epochs round-robin over the systems, so that a change of the machine's
  # load while the benchmark runs is shared by all of them.
  for _ in range(epochs):
    for row in live.values():
      row.epoch(n)
  rows = {name: row.result(n) for name, row in live.items()}
  # Memory, one system at a time (nothing else alive): two epochs each.
  for name, (make, _) in makers.items():
    with PeakMemory() as memory:
      iterator = make()
      for _ in zip(range(2 * -(-n // BATCH)), iterator):
        pass
      close = getattr(iterator, "close", None)
      if close is not None:
        close()
      del iterator
    rows[name]["peak_rss_mb"] = round(memory.peak_rss / 2**20, 1)
    rows[name]["peak_pss_mb"] = round(memory.peak_pss / 2**20, 1)

  bare = rows["bare loop"]["rate"]
  load = [round(x, 2) for x in os.getloadavg()]
  for name, result in rows.items():
    line = {"workload": "W1 per-element", "system": name, "unit": "images/s",
            "rate": round(result.pop("rate"), 1), **result,
            "cores": cores, "load_avg": load}
    if name.startswith("jaxfeed"):
      line["vs_cores_x_bare_loop"] = round(line["rate"] / (cores * bare), 3)
      if "tf.data" in rows:
        line["vs_tf_data"] = round(line["rate"] / rows["tf.data"]["rate"], 3)
    record.row(line)


if __name__ == "__main__":
  with record.run("w1_per_element"):
    main()
