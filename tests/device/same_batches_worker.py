"""One process of the any-host-count determinism test (test_host_count_determinism.py).

Usage: python same_batches_worker.py PROCESS_ID NUM_PROCESSES PORT
Process 0 prints one JSON line: per step, the rows of the global batch as
(label, noise) pairs, gathered from every process.
"""

import json
import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # pylint: disable=g-import-not-at-top
import numpy as np  # pylint: disable=g-import-not-at-top

NUM_RECORDS = 96
GLOBAL_BATCH = 16
SEED = 5


def augment(element, rng):
  return {**element, "noise": rng.normal()}


def square(element):
  return {**element, "x": element["x"] ** 2}


def main() -> None:
  process_id, num_processes, port = map(int, sys.argv[1:4])
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(
    f"127.0.0.1:{port}",
    num_processes=num_processes,
    process_id=process_id,
    initialization_timeout=60,
  )
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top

  import jaxfeed  # pylint: disable=g-import-not-at-top

  source = jaxfeed.ArraySource(
    {"label": np.arange(NUM_RECORDS), "x": np.arange(NUM_RECORDS, dtype=np.float64)}
  )
  sampler = jaxfeed.IndexSampler(
    NUM_RECORDS,
    shuffle=True,
    seed=SEED,
    num_epochs=2,
    shard_options=jaxfeed.ShardByJaxProcess(drop_remainder=True),
  )
  dataset = (
    jaxfeed.Dataset.from_source(source, sampler)
    .random_map(augment, num_parallel_calls=2, seed=SEED)
    .map(square, num_parallel_calls=2)
    .batch(GLOBAL_BATCH // num_processes, drop_remainder=True)
  )
  steps = []
  with jaxfeed.Loader(dataset) as loader:
    for batch in loader:
      whole = multihost_utils.process_allgather(batch, tiled=True)
      steps.append(
        sorted(
          zip(
            np.asarray(whole["label"]).tolist(),
            np.asarray(whole["noise"]).tolist(),
            np.asarray(whole["x"]).tolist(),
          )
        )
      )
  if process_id == 0:
    print(json.dumps(steps))
  jax.distributed.shutdown()


if __name__ == "__main__":
  main()
