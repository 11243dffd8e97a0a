"""W4 / W4t: the service on loopback, against tf.data service, in one run.

  python -m benchmarks.w4_service [--epochs=3] [--scale=1.0] [--only=W4 | --only=W4t]

W4: W1's 20,000 images in one TFRecord file (int32 label + raw image bytes),
decoded, cropped 56x56, flipped, normalized to float32 and batched by 128 by
a dispatcher and 1 or 2 worker processes; this process is the client.
W4t: transfer only: workers serve one ready float32 batch 128x56x56x3 over
and over; MB/s against a plain TCP socket moving the same bytes over
loopback from another process, one socket epoch right before each jaxfeed
W4t epoch, so that both see the same load. Every system reads DYNAMIC /
distributed_epoch (an epoch is every record once, a new job each time).
jaxfeed's splits hold 8 batches in both (W4: 1024 images; W4t: 8 ready
batches, so 2 workers share W4t's 157), each on its own dispatcher; W4t's
rows give each worker's served bytes (`served_mb_by_worker`, its
`jaxfeed_worker_bytes_served_total`) and the smallest share a worker served
of an epoch (`min_worker_share`), and the run fails if with 2 workers that
is under 25%.
Prints one JSON line per (workload, system) with the median rate, the time
from asking for an epoch to its first batch (`first_batch_ms`: a new job on
running workers; `first_batch_ms_warmup`: the warm-up epoch's, for W4 the
first job of freshly started workers), the time from its last batch to its
end (`last_batch_to_end_ms`),
and peak RSS (this process, the dispatcher and workers, and both); then one
line per worker count with W4t's fraction of the plain socket: the median
over epochs of the epoch's rate over its socket epoch's, and the ratio of
the medians.
"""

from __future__ import annotations

import os
import pathlib
import re
import socket
import subprocess
import sys
import tempfile
import time
from typing import Sequence
import urllib.request

import numpy as np

from benchmarks import harness
from benchmarks import record
from benchmarks import workloads
from jaxfeed import _lifetime

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
BATCH = 128
# Sampler positions per DYNAMIC split. W4 reads images, so its split of 1024
# positions is 8 batches; W4t reads ready batches, one per position, and its
# split holds the same 8 batches: its 157 batches are 20 splits, enough for
# both workers to serve (one split of 1024 would leave the second idle).
W4_SPLIT_SIZE = 1024
W4T_SPLIT_SIZE = W4_SPLIT_SIZE // BATCH
# Each of 2 workers must serve at least this share of every W4t epoch.
FAIR_SHARE = 0.25
_CACHED: dict = {}


# -- UDFs shipped to jaxfeed workers by import path --------------------------------
def decode_record(record: bytes) -> dict:
  data = np.frombuffer(record, dtype=np.uint8)
  return {
    "image": data[4:].reshape(workloads.IMAGE, workloads.IMAGE, 3),
    "label": data[:4].view(np.int32)[0],
  }


def cached_batch(index) -> dict:
  """W4t: the same ready batch every time (made once per worker process)."""
  del index
  if "batch" not in _CACHED:
    _CACHED["batch"] = {"image": np.ones((BATCH, workloads.CROP, workloads.CROP, 3), np.float32)}
  return _CACHED["batch"]


# -- processes ----------------------------------------------------------------------
def _env() -> dict:
  env = dict(
    os.environ,
    PYTHONPATH=str(REPO_ROOT),
    TF_CPP_MIN_LOG_LEVEL="3",
    GRPC_VERBOSITY="ERROR",
    JAX_PLATFORMS="cpu",
  )
  return env


def _spawn(args: list[str]) -> tuple[subprocess.Popen, str]:
  if args[:2] in (["-m", "jaxfeed.service.dispatcher"], ["-m", "jaxfeed.service.worker"]):
    args = [*args, "--udf_modules=benchmarks."]  # where the benchmarks' UDFs live
  # Servers end with this process, however it ends (jaxfeed._lifetime).
  proc = _lifetime.popen(
    [sys.executable, *args],
    stdout=subprocess.PIPE,
    stderr=subprocess.DEVNULL,
    env=_env(),
    text=True,
  )
  return proc, harness.printed_address(proc, args)


def jaxfeed_cluster(
  num_workers: int, split_size: int, flags: Sequence[str] = (), worker_flags: Sequence[str] = ()
) -> tuple[list, str, list[str]]:
  """A dispatcher and its workers, all with `flags`: (processes, dispatcher
  address, the workers' metrics URLs)."""
  dispatcher, address = _spawn(
    ["-m", "jaxfeed.service.dispatcher", "--port=0", f"--split_size={split_size}", *flags]
  )
  procs, metrics_urls = [dispatcher], []
  for _ in range(num_workers):
    args = [
      "-m",
      "jaxfeed.service.worker",
      f"--dispatcher_address={address}",
      "--buffer_size=8",
      "--metrics_port=0",
      *flags,
      *worker_flags,
    ]
    worker, _ = _spawn(args)
    procs.append(worker)
    metrics_urls.append(harness.printed_address(worker, args))
  return procs, address, metrics_urls


def served_bytes(metrics_urls: list[str]) -> list[dict[int, int]]:
  """Per worker, the bytes it served to clients by job id (its
  `jaxfeed_worker_bytes_served_total` counter)."""
  counts = []
  for url in metrics_urls:
    with urllib.request.urlopen(url, timeout=10) as response:
      text = response.read().decode()
    counts.append(
      {
        int(job): int(float(value))
        for job, value in re.findall(
          r'^jaxfeed_worker_bytes_served_total\{job="(\d+)"\} (\S+)$', text, re.M
        )
      }
    )
  return counts


def worker_shares(served: list[dict[int, int]], jobs: list[int]) -> list[list[float]]:
  """Per job, each worker's share of the bytes served."""
  shares = []
  for job in jobs:
    by_worker = [counts.get(job, 0) for counts in served]
    shares.append([b / max(1, sum(by_worker)) for b in by_worker])
  return shares


_TF_ROLE = r"""
import sys
from jaxfeed import _lifetime
_lifetime.die_with_parent_from_env()
import tensorflow as tf
role, arg = sys.argv[1], sys.argv[2]
if role == "dispatcher":
  server = tf.data.experimental.service.DispatchServer()
  print("tf dispatcher on", server.target.split("://")[1], flush=True)
else:
  server = tf.data.experimental.service.WorkerServer(
      tf.data.experimental.service.WorkerConfig(dispatcher_address=arg))
  print("tf worker on", arg, flush=True)
server.join()
"""


def _tf_cluster(num_workers: int) -> tuple[list, str]:
  dispatcher, address = _spawn(["-c", _TF_ROLE, "dispatcher", "-"])
  procs = [dispatcher]
  for _ in range(num_workers):
    procs.append(_spawn(["-c", _TF_ROLE, "worker", address])[0])
  return procs, address


# -- pipelines ------------------------------------------------------------------------
def _jaxfeed_w4(path: str, n: int):
  import jaxfeed  # pylint: disable=g-import-not-at-top
  from benchmarks import w4_service  # importable path for the UDFs

  return (
    jaxfeed.Dataset.from_source(
      jaxfeed.TFRecordSource(path), jaxfeed.IndexSampler(n, shuffle=True, seed=0)
    )
    .map(w4_service.decode_record)
    .batch(BATCH)
    .random_map(workloads.augment_batch, num_parallel_calls=2)
  )


def _jaxfeed_w4t(n: int):
  import jaxfeed  # pylint: disable=g-import-not-at-top
  from benchmarks import w4_service

  num_batches = -(-n // BATCH)
  source = jaxfeed.ArraySource({"i": np.arange(num_batches)})
  return jaxfeed.Dataset.from_source(source).map(w4_service.cached_batch)


def _tf_w4(path: str):
  import tensorflow as tf  # pylint: disable=g-import-not-at-top

  crop = workloads.CROP

  def parse(record):
    raw = tf.io.decode_raw(record, tf.uint8)
    label = tf.bitcast(tf.reshape(raw[:4], [4]), tf.int32)
    image = tf.reshape(raw[4:], [workloads.IMAGE, workloads.IMAGE, 3])
    image = tf.image.random_crop(image, [crop, crop, 3])
    image = tf.image.random_flip_left_right(image)
    return {"image": tf.cast(image, tf.float32) / 127.5 - 1.0, "label": label}

  return tf.data.TFRecordDataset(path).map(parse, num_parallel_calls=tf.data.AUTOTUNE).batch(BATCH)


def _tf_w4t(n: int):
  import tensorflow as tf  # pylint: disable=g-import-not-at-top

  batch = tf.ones([BATCH, workloads.CROP, workloads.CROP, 3], tf.float32)
  return tf.data.Dataset.from_tensors({"image": batch}).repeat(-(-n // BATCH)).cache()


def read_epoch(dataset, address: str):
  """An iterator over one epoch of `dataset` read through the service (a new job)."""
  return dataset.distribute(
    address, "distributed_epoch", max_outstanding_requests=8
  ).make_iterator()


def _measure_jaxfeed(make, address: str, epochs: int, procs: list, before_epoch=None) -> dict:
  return harness.measure(
    lambda: read_epoch(make(), address),
    lambda b: len(b["image"]),
    epochs,
    servers=[p.pid for p in procs],
    before_epoch=before_epoch,
  )


def _measure_tf(make, address: str, epochs: int, procs: list) -> dict:
  import tensorflow as tf  # pylint: disable=g-import-not-at-top

  def epoch():
    return (
      make()
      .apply(
        tf.data.experimental.service.distribute(
          processing_mode="distributed_epoch", service=f"grpc://{address}"
        )
      )
      .prefetch(8)
      .as_numpy_iterator()
    )

  return harness.measure(epoch, lambda b: len(b["image"]), epochs, servers=[p.pid for p in procs])


_SENDER = r"""
import socket, sys
import numpy as np
from jaxfeed import _lifetime
_lifetime.die_with_parent_from_env()
port, frames, size = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
payload = np.ones(size // 4, np.float32).tobytes()
with socket.create_connection(("127.0.0.1", port)) as s:
  for _ in range(frames):
    s.sendall(len(payload).to_bytes(8, "little")); s.sendall(payload)
"""


def _plain_socket_epoch(frames: int, size: int) -> float:
  """Bytes/s of a plain loopback TCP stream of frames from another process,
  received into fresh buffers (timed from the connection on)."""
  with socket.create_server(("127.0.0.1", 0)) as listener:
    port = listener.getsockname()[1]
    sender = _lifetime.popen([sys.executable, "-c", _SENDER, str(port), str(frames), str(size)])
    conn, _ = listener.accept()
    with conn:
      start = time.perf_counter()
      received = 0
      header = bytearray(8)
      for _ in range(frames):
        conn.recv_into(header, 8, socket.MSG_WAITALL)
        length = int.from_bytes(header, "little")
        body = bytearray(length)
        view, got = memoryview(body), 0
        while got < length:
          got += conn.recv_into(view[got:], length - got)
        received += length
      elapsed = time.perf_counter() - start
  sender.wait()
  return received / elapsed


def _served_by_worker(served: list[dict[int, int]]) -> dict:
  """The timed epochs' bytes by worker (the first job was the warm-up's) and
  the smallest share any worker served of any of them."""
  jobs = sorted(set().union(*served))[1:]
  shares = worker_shares(served, jobs)
  return {
    "served_mb_by_worker": [round(sum(c.get(j, 0) for j in jobs) / 1e6, 1) for c in served],
    "min_worker_share": round(min(min(s) for s in shares), 3),
  }


def _to_mb_per_s(result: dict, item_bytes: int) -> dict:
  """A result in items/s as MB/s."""
  return {
    **result,
    "rate": result["rate"] * item_bytes / 1e6,
    "rates": [round(r * item_bytes / 1e6, 1) for r in result["rates"]],
  }


def main(argv: list[str]) -> None:
  args = dict(a.lstrip("-").split("=", 1) for a in argv[1:] if "=" in a)
  epochs, scale = int(args.get("epochs", 3)), float(args.get("scale", 1.0))
  only = args.get("only", "")
  if only not in ("", "W4", "W4t"):
    raise SystemExit(f"--only must be W4 or W4t, got {only!r}.")
  import jaxfeed  # pylint: disable=g-import-not-at-top

  data = workloads.w1_data(scale)
  n = len(data["label"])
  image_bytes = workloads.CROP * workloads.CROP * 3 * 4
  batch_bytes = BATCH * image_bytes
  num_batches = -(-n // BATCH)
  w4, w4t, sockets = {}, {}, {}
  with tempfile.TemporaryDirectory() as tmp:
    path = os.path.join(tmp, "w4.tfrecord")
    jaxfeed.write_tfrecord(
      path, [data["label"][i].tobytes() + data["image"][i].tobytes() for i in range(n)]
    )
    for workers in (1, 2):
      name = f"jaxfeed service ({workers} workers)"
      if only != "W4t":
        procs, address, _ = jaxfeed_cluster(workers, W4_SPLIT_SIZE)
        try:
          w4[name] = _measure_jaxfeed(lambda: _jaxfeed_w4(path, n), address, epochs, procs)
        finally:
          harness.stop_processes(procs)
      if only != "W4":
        procs, address, metrics_urls = jaxfeed_cluster(workers, W4T_SPLIT_SIZE)
        try:
          socket_rates = sockets[name] = []
          w4t[name] = _to_mb_per_s(
            _measure_jaxfeed(
              lambda: _jaxfeed_w4t(n),
              address,
              epochs,
              procs,
              lambda: socket_rates.append(_plain_socket_epoch(num_batches, batch_bytes)),
            ),
            image_bytes,
          )
          w4t[name].update(_served_by_worker(served_bytes(metrics_urls)))
        finally:
          harness.stop_processes(procs)
      name = f"tf.data service ({workers} workers)"
      procs, address = _tf_cluster(workers)
      try:
        if only != "W4t":
          w4[name] = _measure_tf(lambda: _tf_w4(path), address, epochs, procs)
        if only != "W4":
          w4t[name] = _to_mb_per_s(
            _measure_tf(lambda: _tf_w4t(n), address, epochs, procs), image_bytes
          )
      finally:
        harness.stop_processes(procs)
  for result in w4.values():
    result["mb_per_s"] = round(result["rate"] * image_bytes / 1e6, 1)
  if w4:
    harness.report("W4", w4, "images/s")
  if not w4t:
    return
  # Timed epochs only (the first socket epoch went with the warm-up).
  timed = {name: [r / 1e6 for r in rates[1:]] for name, rates in sockets.items()}
  all_timed = [r for rates in timed.values() for r in rates]
  w4t["plain TCP socket"] = {
    "rate": float(np.median(all_timed)),
    "rates": [round(r, 1) for r in all_timed],
  }
  harness.report("W4t", w4t, "MB/s")
  for name, socket_rates in timed.items():
    record.row(
      {
        "workload": "W4t",
        "system": f"{name} vs plain socket",
        "fraction_of_plain_socket": round(
          float(np.median([r / s for r, s in zip(w4t[name]["rates"], socket_rates)])), 3
        ),
        "fraction_of_median_rates": round(w4t[name]["rate"] / float(np.median(socket_rates)), 3),
        "socket_rates": [round(r, 1) for r in socket_rates],
        "first_batch_ms": w4t[name]["first_batch_ms"],
        "last_batch_to_end_ms": w4t[name]["last_batch_to_end_ms"],
        "served_mb_by_worker": w4t[name]["served_mb_by_worker"],
        "min_worker_share": w4t[name]["min_worker_share"],
        "total_peak_rss_mb": w4t[name]["total_peak_rss_mb"],
      }
    )
  unfair = {
    name: result["min_worker_share"]
    for name, result in w4t.items()
    if len(result.get("served_mb_by_worker", ())) > 1 and result["min_worker_share"] < FAIR_SHARE
  }
  if unfair:
    raise SystemExit(f"W4t: a worker served less than {FAIR_SHARE:.0%} of an epoch: {unfair}.")


if __name__ == "__main__":
  with record.run("w4_service"):
    main(sys.argv)
