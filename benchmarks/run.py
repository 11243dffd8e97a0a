r"""Reference workloads W1, W2, W3, W5 (BENCHMARKS.md): jaxfeed against peers.

One process runs every system one after another on the same data and prints a
JSON line per (workload, system): median rate over the timed epochs after a
warm-up epoch, peak RSS, and on jaxfeed rows the ratio to the best peer.
tf.data and Grain run when installed (`pip install -e '.[benchmarks]'`).

  python -m benchmarks.run                    # all workloads
  python -m benchmarks.run --workloads=W1,W5 --epochs=3
"""

from __future__ import annotations

import os

# W5 needs 8 CPU devices; XLA reads this once, before jax is imported.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import importlib.util  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402

from absl import app  # noqa: E402
from absl import flags  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks import record  # noqa: E402
from benchmarks import w5_placement  # noqa: E402
from benchmarks import workloads  # noqa: E402

FLAGS = flags.FLAGS
flags.DEFINE_list("workloads", ["W1", "W2", "W3", "W5"], "Workloads to run.")
flags.DEFINE_list(
  "systems",
  ["jaxfeed", "tf.data", "grain"],
  "Systems to run (peers are skipped when not installed).",
)
flags.DEFINE_integer("epochs", 3, "Timed epochs after one warm-up epoch.")
flags.DEFINE_float("scale", 1.0, "Fraction of each workload's records (for smoke runs).")

RUNNERS = {
  "W1": workloads.run_w1,
  "W2": workloads.run_w2,
  "W3": workloads.run_w3,
  "W5": w5_placement.run_w5,
}


def _installed(module: str) -> bool:
  return importlib.util.find_spec(module) is not None


def _systems() -> list[str]:
  wanted = []
  for system in FLAGS.systems:
    module = {"jaxfeed": "jaxfeed", "tf.data": "tensorflow", "grain": "grain"}[system]
    if _installed(module):
      wanted.append(system)
    else:
      print(json.dumps({"note": f"{system} not installed; skipped"}), file=sys.stderr)
  return wanted


def main(argv: list[str]) -> None:
  del argv
  systems = _systems()
  epochs = FLAGS.epochs
  for workload in FLAGS.workloads:
    runner = RUNNERS.get(workload)
    if runner is None:
      raise app.UsageError(f"--workloads: unknown workload {workload!r}; known: {sorted(RUNNERS)}")
    runner(systems, epochs, FLAGS.scale)


if __name__ == "__main__":
  np.set_printoptions(precision=3)
  with record.run("run"):
    app.run(main)
