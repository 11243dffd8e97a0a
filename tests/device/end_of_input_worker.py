"""One process of the multi-process end-of-input tests (run by
test_end_of_input.py).

Usage: python end_of_input_worker.py PROCESS_ID NUM_PROCESSES PORT SCENARIOS
SCENARIOS is a comma-separated list of names in SCENARIOS below. Each scenario
iterates a Loader whose processes have different inputs, with a jitted global
sum (a cross-process collective) in the loop, and prints one JSON line as soon
as it ends, so a hang is pinned on its scenario.
"""

import json
import os
import sys
import time

if __name__ == "__main__":  # The test imports this module for its constants.
  os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
  os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # pylint: disable=g-import-not-at-top
import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
import numpy as np  # pylint: disable=g-import-not-at-top

RECORDS = 40
BATCH = 4
SHARDED_RECORDS = 11


def keeps(process_id: int, x: int) -> bool:
  """Process 0 keeps every 2nd record (20), process 1 every 3rd (14)."""
  return x % (2 + process_id) == 0


def kept(process_id: int) -> np.ndarray:
  return np.array([x for x in range(RECORDS) if keeps(process_id, x)])


def filtered(process_id: int, drop_remainder: bool):
  import jaxfeed  # pylint: disable=g-import-not-at-top

  return (
    jaxfeed.Dataset.from_tensor_slices({"x": np.arange(RECORDS)})
    .filter(lambda e: keeps(process_id, int(e["x"])))
    .batch(BATCH, drop_remainder=drop_remainder)
  )


def uneven_shards():
  """11 records over ShardByJaxProcess() (drop_remainder=False): 6 and 5."""
  import jaxfeed  # pylint: disable=g-import-not-at-top

  sampler = jaxfeed.IndexSampler(SHARDED_RECORDS, shard_options=jaxfeed.ShardByJaxProcess())
  source = jaxfeed.ArraySource({"x": np.arange(SHARDED_RECORDS)})
  return jaxfeed.Dataset.from_source(source, sampler).batch(2, drop_remainder=True)


def ragged(process_id: int, padded_shapes):
  """Two elements per process, of length 3 on process 0 and 5 on process 1."""
  import jaxfeed  # pylint: disable=g-import-not-at-top

  length = 3 + 2 * process_id
  return jaxfeed.Dataset.from_tensor_slices({"x": np.ones((2, length), np.int64)}).padded_batch(
    2, padded_shapes=padded_shapes
  )


global_sum = jax.jit(lambda batch: jnp.sum(batch["x"]))
masked_sum = jax.jit(lambda batch: (jnp.sum(batch["x"] * batch["valid"]), jnp.sum(batch["valid"])))


def run(dataset, **loader_args) -> dict:
  """Iterates a Loader with a collective per step; reports steps and sums."""
  import jaxfeed  # pylint: disable=g-import-not-at-top

  sums, shapes = [], []
  try:
    with jaxfeed.Loader(dataset, **loader_args) as loader:
      for batch in loader:
        if "valid" in batch:
          sums.append([int(v) for v in masked_sum(batch)])
        else:
          sums.append(int(global_sum(batch)))
        shapes.append(list(batch["x"].shape))
      state = loader.get_state()
  except ValueError as e:
    return {"steps": len(sums), "sums": sums, "error": str(e)}
  return {"steps": len(sums), "sums": sums, "shapes": shapes, "batches": state["batches"]}


def gathered(batch) -> dict:
  """The global batch as numpy on every process (rows of process 0 first)."""
  return {k: np.asarray(multihost_utils.process_allgather(v, tiled=True)) for k, v in batch.items()}


def run_partial(dataset, **loader_args) -> dict:
  """Iterates a Loader with a collective per step; reports every step's
  global batch (x and, when there is one, the mask)."""
  import jaxfeed  # pylint: disable=g-import-not-at-top

  steps = []
  try:
    with jaxfeed.Loader(dataset, **loader_args) as loader:
      for batch in loader:
        global_sum(batch)  # every process enters it at every step
        steps.append({k: v.tolist() for k, v in gathered(batch).items()})
      state = loader.get_state()
  except ValueError as e:
    return {"steps": steps, "error": str(e)}
  return {
    "steps": steps,
    "batches": state["batches"],
    "end_of_epoch": state.get("end_of_epoch", False),
  }


def close_while_waiting(process_id: int) -> dict:
  """Process 0 closes its Loader while its prefetch thread waits for process
  1, which starts its Loader only later (and closes it unread)."""
  import jaxfeed  # pylint: disable=g-import-not-at-top

  if process_id:
    time.sleep(4)
  loader = jaxfeed.Loader(filtered(process_id, True))
  time.sleep(0.75)
  start = time.perf_counter()
  loader.close()
  return {"close_seconds": time.perf_counter() - start}


def scenario(name: str, process_id: int) -> dict:
  import jaxfeed  # pylint: disable=g-import-not-at-top

  if name == "filter":
    return run(filtered(process_id, True))
  if name == "filter_sync":
    return run(filtered(process_id, True), prefetch=0)
  if name == "uneven_shards":
    return run(uneven_shards())
  if name == "pad":
    # A sharding per leaf: the mask leaf gets the batch's sharding.
    return run(
      filtered(process_id, False),
      end_of_input="pad",
      sharding={"x": jaxfeed.device.batch_sharding()},
    )
  if name == "ragged":
    return run(ragged(process_id, None))
  if name == "ragged_fixed":
    return run(ragged(process_id, {"x": [8]}))
  if name == "ragged_common":
    return run(ragged(process_id, None), pad_to_common_shape=True)
  if name == "pad_empty_process":
    # Process 1 keeps nothing: it has no batch to learn the structure from.
    return run(filtered(process_id, True).take(0 if process_id else 100), end_of_input="pad")
  if name == "local_mesh":
    # Each process's batches stay on its own devices: no agreement, each
    # reads its own input to its end.
    local = jax.sharding.NamedSharding(
      jax.sharding.Mesh(np.array(jax.local_devices()), ("data",)),
      jax.sharding.PartitionSpec("data"),
    )
    return run(filtered(process_id, True), sharding=local)
  if name == "close_while_waiting":
    return close_while_waiting(process_id)
  if name.startswith("partial_"):
    # 20 and 14 records kept, batches of 4, no drop_remainder: 5 and 4
    # batches, the last of process 1 partial (2 rows).
    policy, _, end = name[len("partial_") :].partition("_")
    args = {} if policy == "default" else {"partial_batch": policy}
    if end:
      args["end_of_input"] = "stop_at_shortest"
    return run_partial(filtered(process_id, False), **args)
  raise ValueError(f"unknown scenario {name!r}")


def main() -> None:
  process_id, num_processes, port = map(int, sys.argv[1:4])
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(
    f"127.0.0.1:{port}",
    num_processes=num_processes,
    process_id=process_id,
    initialization_timeout=60,
  )
  for name in sys.argv[4].split(","):
    start = time.perf_counter()
    report = scenario(name, process_id)
    report.update(scenario=name, seconds=time.perf_counter() - start)
    print(json.dumps(report), flush=True)
  jax.distributed.shutdown()


if __name__ == "__main__":
  main()
