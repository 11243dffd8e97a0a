"""One process of the two-process Loader test (run by test_distributed.py).

Usage: python distributed_loader_worker.py PROCESS_ID NUM_PROCESSES PORT CKPT_DIR
Prints one JSON line with what this process observed.
"""

import json
import os
import sys
import threading

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # pylint: disable=g-import-not-at-top
import numpy as np  # pylint: disable=g-import-not-at-top

LOCAL_BATCH = 4
NUM_BATCHES = 4
SAVED_AFTER = 1


def host_data(process_id: int) -> dict[str, np.ndarray]:
  """The rows only this process reads: distinct values per process."""
  rows = LOCAL_BATCH * NUM_BATCHES
  base = 1000 * (process_id + 1)
  return {
    "x": (base + np.arange(rows * 3, dtype=np.float32)).reshape(rows, 3),
    "label": np.arange(rows, dtype=np.int32) + base,
  }


def main() -> None:
  process_id, num_processes, port = map(int, sys.argv[1:4])
  checkpoint_dir = sys.argv[4]
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(
    f"127.0.0.1:{port}",
    num_processes=num_processes,
    process_id=process_id,
    initialization_timeout=60,
  )
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top

  import jaxfeed  # pylint: disable=g-import-not-at-top

  data = host_data(process_id)
  # Ends in prefetch: one process would place in next(); several must not,
  # since the processes agree on every step on the placement thread.
  dataset = jaxfeed.Dataset.from_tensor_slices(data).batch(LOCAL_BATCH).prefetch(2)
  global_sum = jax.jit(lambda batch: batch["x"].sum() + batch["label"].sum())
  replicated = jax.sharding.NamedSharding(
    jax.sharding.Mesh(np.array(jax.devices()), ("data",)), jax.sharding.PartitionSpec()
  )
  model_state = {"w": jax.device_put(np.arange(4, dtype=np.float32), replicated)}
  manager = ocp.CheckpointManager(checkpoint_dir)
  report = {"process_count": jax.process_count(), "device_count": jax.device_count(), "batches": []}
  with jaxfeed.Loader(dataset, prefetch=2) as loader:
    for step, batch in enumerate(loader):
      report.setdefault(
        "placement_thread", any(t.name == "jaxfeed-device-prefetch" for t in threading.enumerate())
      )
      rows = slice(step * LOCAL_BATCH, (step + 1) * LOCAL_BATCH)
      local_matches = True
      for key in ("x", "label"):
        shards = sorted(batch[key].addressable_shards, key=lambda s: s.index[0].start or 0)
        local = np.concatenate([np.asarray(s.data) for s in shards])
        local_matches &= bool(np.array_equal(local, data[key][rows]))
      expected = sum(
        float(host_data(p)["x"][rows].sum() + host_data(p)["label"][rows].sum())
        for p in range(num_processes)
      )
      report["batches"].append(
        {
          "x_shape": list(batch["x"].shape),
          "label_shape": list(batch["label"].shape),
          "local_matches": local_matches,
          "global_sum": float(global_sum(batch)),
          "expected_sum": expected,
        }
      )
      if step + 1 == SAVED_AFTER:
        jaxfeed.save_checkpoint(manager, step + 1, loader, model_state=model_state)
  manager.wait_until_finished()

  # Resume: a fresh Loader restored from the checkpoint continues this
  # process's shard right after the saved batch.
  with jaxfeed.Loader(dataset, prefetch=2) as resumed:
    restored = jaxfeed.restore_checkpoint(
      manager,
      SAVED_AFTER,
      resumed,
      model_state={"w": jax.device_put(np.zeros(4, np.float32), replicated)},
    )
    report["restored_w"] = np.asarray(restored["w"].addressable_data(0)).tolist()
    report["restored_batches"] = resumed.get_state()["batches"]
    report["resumed_labels"] = [
      np.concatenate(
        [
          np.asarray(s.data)
          for s in sorted(b["label"].addressable_shards, key=lambda s: s.index[0].start or 0)
        ]
      ).tolist()
      for b in resumed
    ]
  manager.close()
  report["expected_resumed_labels"] = [
    data["label"][i * LOCAL_BATCH : (i + 1) * LOCAL_BATCH].tolist()
    for i in range(SAVED_AFTER, NUM_BATCHES)
  ]
  print(json.dumps(report), flush=True)
  jax.distributed.shutdown()


if __name__ == "__main__":
  main()
