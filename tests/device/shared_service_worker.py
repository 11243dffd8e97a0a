"""One process of the multi-process shared-service-job test (run by
test_shared_service_job.py).

Usage: python shared_service_worker.py PROCESS_ID NUM_PROCESSES PORT
DISPATCHER JOB_NAME POLICIES [save|restore|restore_ahead CHECKPOINT_DIR]

Both processes read one shared exactly-once `distributed_epoch` job of
RECORDS records in batches of BATCH (BATCHES batches, an odd number: the
processes' counts differ), with a jitted global sum (a cross-process
collective) in the loop, once per Loader `end_of_input` policy in the comma-separated POLICIES (job
JOB_NAME-POLICY), and print one JSON line per read with what they saw. `save`
saves an orbax checkpoint of the Loader after step SAVE_AT, reads AHEAD
more steps and stops; `restore` restores it and reads to the end;
`restore_ahead` restores it, reads AHEAD steps and stops (preempted again).
"""

import json
import os
import pathlib
import sys
import time

if __name__ == "__main__":  # The test imports this module for its constants.
  os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
  os.environ["JAX_PLATFORMS"] = "cpu"
  # The pipeline's UDF (service_udfs.paced) lives beside the service tests.
  sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "service"))

import jax  # pylint: disable=g-import-not-at-top
import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top

RECORDS = 60
BATCH = 4
BATCHES = RECORDS // BATCH  # 15
LATE_S = 2.0
SAVE_AT = 3
AHEAD = 2

global_sum = jax.jit(lambda batch: jnp.sum(batch["x"]))
masked_sums = jax.jit(lambda batch: (jnp.sum(batch["x"] * batch["valid"]), jnp.sum(batch["valid"])))


def read(
  process_id: int, dispatcher: str, job_name: str, end_of_input: str, mode: str, checkpoint_dir: str
) -> dict:
  """Reads the shared job through a Loader; what this process saw."""
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top

  import jaxfeed  # pylint: disable=g-import-not-at-top
  import service_udfs  # pylint: disable=g-import-not-at-top

  manager = ocp.CheckpointManager(checkpoint_dir) if checkpoint_dir else None
  # One split per batch (the dispatcher's --split_size is BATCH), so the
  # job's batches are dealt out to both consumers as they ask.
  dataset = (
    jaxfeed.Dataset.range(RECORDS)
    .map(service_udfs.paced)
    .batch(BATCH)
    .distribute(
      dispatcher,
      "distributed_epoch",
      job_name=job_name,
      visitation="exactly_once",
      max_outstanding_requests=1,
    )
  )
  # Process 1 joins the job LATE_S after process 0: a head start in which
  # process 0 could take much of the job.
  multihost_utils.sync_global_devices("before the read")
  if process_id:
    time.sleep(LATE_S)
  steps, sums, valid_rows = 0, [], []
  with jaxfeed.Loader(dataset, end_of_input=end_of_input) as loader:
    if mode in ("restore", "restore_ahead"):
      manager.restore(SAVE_AT, args=ocp.args.Composite(loader=jaxfeed.LoaderRestore(loader)))
    for batch in loader:
      if end_of_input == "pad":
        total, rows = masked_sums(batch)
        sums.append(int(total))
        valid_rows.append(int(rows))
      else:
        sums.append(int(global_sum(batch)))
      steps += 1
      if mode == "save" and steps == SAVE_AT:
        manager.save(SAVE_AT, args=ocp.args.Composite(loader=jaxfeed.LoaderSave(loader)))
      if (mode == "save" and steps == SAVE_AT + AHEAD) or (
        mode == "restore_ahead" and steps == AHEAD
      ):
        break
    state = loader.get_state()
  if manager is not None:
    manager.wait_until_finished()
    manager.close()
  return {"steps": steps, "sums": sums, "valid_rows": valid_rows, "batches": state["batches"]}


def main() -> None:
  process_id, num_processes, port = map(int, sys.argv[1:4])
  dispatcher, job_name, policies = sys.argv[4:7]
  mode, checkpoint_dir = (sys.argv[7:9] + ["read", ""])[:2]
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(
    f"127.0.0.1:{port}",
    num_processes=num_processes,
    process_id=process_id,
    initialization_timeout=60,
  )
  for end_of_input in policies.split(","):
    report = read(
      process_id, dispatcher, f"{job_name}-{end_of_input}", end_of_input, mode, checkpoint_dir
    )
    print(json.dumps({"end_of_input": end_of_input, **report}), flush=True)
  jax.distributed.shutdown()


if __name__ == "__main__":
  main()
