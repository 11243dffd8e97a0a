"""One process of the multi-process shared-service-job test (run by
test_shared_service_job.py).

Usage: python shared_service_worker.py PROCESS_ID NUM_PROCESSES PORT
DISPATCHER JOB_NAME END_OF_INPUT

Both processes read one shared `distributed_epoch` job of RECORDS records in
batches of BATCH (BATCHES batches, an odd number: the processes' counts
differ), with a jitted global sum (a cross-process collective) in the loop,
and print one JSON line with what they saw.
"""

import json
import os
import time
import pathlib
import sys

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

global_sum = jax.jit(lambda batch: jnp.sum(batch["x"]))
masked_sums = jax.jit(
    lambda batch: (jnp.sum(batch["x"] * batch["valid"]), jnp.sum(batch["valid"])))


def main() -> None:
  process_id, num_processes, port = map(int, sys.argv[1:4])
  dispatcher, job_name, end_of_input = sys.argv[4:7]
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=num_processes,
                             process_id=process_id, initialization_timeout=60)
  import jaxfeed  # pylint: disable=g-import-not-at-top
  import service_udfs  # pylint: disable=g-import-not-at-top
  # One split per batch (the dispatcher's --split_size is BATCH), so the
  # job's batches are dealt out to both consumers as they ask.
  dataset = jaxfeed.Dataset.range(RECORDS).map(service_udfs.paced).batch(BATCH).distribute(
      dispatcher, "distributed_epoch", job_name=job_name, visitation="exactly_once",
      max_outstanding_requests=1)
  # Process 1 joins the job LATE_S after process 0: a head start in which
  # process 0 could take much of the job.
  multihost_utils.sync_global_devices("before the read")
  if process_id:
    time.sleep(LATE_S)
  steps, sums, valid_rows = 0, [], 0
  with jaxfeed.Loader(dataset, end_of_input=end_of_input) as loader:
    for batch in loader:
      if end_of_input == "pad":
        total, rows = masked_sums(batch)
        sums.append(int(total))
        valid_rows += int(rows)
      else:
        sums.append(int(global_sum(batch)))
      steps += 1
    state = loader.get_state()
  print(json.dumps({"steps": steps, "sums": sums, "valid_rows": valid_rows,
                    "batches": state["batches"]}), flush=True)
  jax.distributed.shutdown()


if __name__ == "__main__":
  main()
