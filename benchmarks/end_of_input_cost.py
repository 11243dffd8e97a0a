r"""Per-step cost of the multi-process end-of-input agreement.

Starts N JAX processes on loopback (jax.distributed, CPU, gloo), each with one
CPU device, and measures:

  (a) `agreement_us`: one `StepAgreement.step` (publish this process's message,
      read the others') on the caller's thread, averaged over --steps steps;
  (a') `device_allgather_us`, the alternative not taken: a device collective
      of one flag per step (`multihost_utils.process_allgather`), which would
      have to run on the training loop's thread to keep the order of
      collectives equal on every process, and waits for the device queue;
  (b) `loader_step_us`: a Loader step (next() plus a jitted global sum, i.e. a
      cross-process collective) with the agreement on and, as the baseline,
      with `StepAgreement.step` replaced by a pass-through; both for prefetch=0
      (the agreement on the training loop's thread) and prefetch=2 (on the
      prefetch thread, overlapped with the loop).

Prints one JSON line per process.

  python -m benchmarks.end_of_input_cost [--processes=2] [--steps=2000]
      [--model_ms=0]
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

from absl import app
from absl import flags

from benchmarks import record
from jaxfeed import _lifetime

FLAGS = flags.FLAGS
flags.DEFINE_integer("processes", 2, "JAX processes.")
flags.DEFINE_integer("steps", 2000, "Timed steps per measurement.")
flags.DEFINE_float(
  "model_ms",
  0.0,
  "Host time the training loop spends per step besides the "
  "global sum (a sleep standing in for a model step).",
)
flags.DEFINE_integer("process_id", -1, "Internal: this process's index.")
flags.DEFINE_integer("port", 0, "Internal: the coordinator's port.")


def _measure() -> dict:
  os.environ["JAX_PLATFORMS"] = "cpu"
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top

  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(
    f"127.0.0.1:{FLAGS.port}",
    num_processes=FLAGS.processes,
    process_id=FLAGS.process_id,
    initialization_timeout=60,
  )
  import jaxfeed  # pylint: disable=g-import-not-at-top
  from jaxfeed.device import agreement  # pylint: disable=g-import-not-at-top

  steps = FLAGS.steps
  batch = {"x": np.ones((8, 16), np.float32), "y": np.ones(8, np.int32)}
  report = {
    "process": jax.process_index(),
    "processes": jax.process_count(),
    "model_ms": FLAGS.model_ms,
  }

  step_agreement = agreement.StepAgreement(
    "stop_at_shortest", "bench/raw", agreement.distributed_client()
  )
  for _ in range(50):
    step_agreement.step(batch)
  start = time.perf_counter()
  for _ in range(steps):
    step_agreement.step(batch)
  report["agreement_us"] = (time.perf_counter() - start) / steps * 1e6

  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top

  flag = np.ones(1, np.int32)
  for _ in range(20):
    multihost_utils.process_allgather(flag)
  start = time.perf_counter()
  for _ in range(steps):
    multihost_utils.process_allgather(flag)
  report["device_allgather_us"] = (time.perf_counter() - start) / steps * 1e6

  global_sum = jax.jit(lambda b: jnp.sum(b["x"]))
  dataset = jaxfeed.Dataset.from_tensor_slices(
    {"x": np.ones((8 * (steps + 50), 16), np.float32)}
  ).batch(8)
  agreed_step = agreement.StepAgreement.step
  for mode in ("on", "off"):
    if mode == "off":  # The baseline: no agreement at all.
      agreement.StepAgreement.step = lambda self, b, stop=None: b
    for prefetch in (0, 2):
      with jaxfeed.Loader(dataset, prefetch=prefetch) as loader:
        for i, b in enumerate(loader):
          if i == 50:
            start = time.perf_counter()
          global_sum(b).block_until_ready()
          if FLAGS.model_ms:
            time.sleep(FLAGS.model_ms / 1000)
        seconds = time.perf_counter() - start
      report[f"loader_step_us_prefetch{prefetch}_{mode}"] = seconds / steps * 1e6
  agreement.StepAgreement.step = agreed_step
  jax.distributed.shutdown()
  return report


def main(argv):
  del argv
  if FLAGS.process_id >= 0:
    _lifetime.die_with_parent_from_env()
    print(json.dumps(_measure()), flush=True)
    return
  with socket.socket() as sock:
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  procs = [
    _lifetime.popen(
      [
        sys.executable,
        "-m",
        "benchmarks.end_of_input_cost",
        f"--processes={FLAGS.processes}",
        f"--steps={FLAGS.steps}",
        f"--model_ms={FLAGS.model_ms}",
        f"--process_id={i}",
        f"--port={port}",
      ],
      env=env,
      stdout=subprocess.PIPE,
      text=True,
    )
    for i in range(FLAGS.processes)
  ]
  try:
    for i, proc in enumerate(procs):
      output, _ = proc.communicate(timeout=600)
      for line in output.splitlines():
        if not line.startswith("{"):  # jax's own messages
          print(line, flush=True)
          continue
        record.row(
          {
            "workload": "end of input",
            "system": f"process {i} of {FLAGS.processes}",
            **json.loads(line),
          }
        )
  finally:
    for proc in procs:
      if proc.poll() is None:
        proc.kill()
        proc.wait()


if __name__ == "__main__":
  with record.run("end_of_input_cost"):
    app.run(main)
