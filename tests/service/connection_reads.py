"""The pipeline of the broken-connection tests, and a client of a shared
exactly-once job run as a process that a test kills:

  python -m connection_reads DISPATCHER JOB_NAME NUM_BATCHES

prints the values of its first NUM_BATCHES batches, one JSON list a line,
then waits to be killed.
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np

import jaxfeed
import service_udfs

NUM_RECORDS = 800


def records(num_records: int = NUM_RECORDS, slow: bool = True) -> jaxfeed.Dataset:
  """Shuffled records x + 1 (2 ms each if slow), in batches of 4. Not slow:
  each record also carries 64 KiB, so that sent batches outgrow the socket
  buffers of a client that reads slower than the workers produce."""
  source = jaxfeed.ArraySource({"x": np.arange(num_records, dtype=np.int64)})
  sampler = jaxfeed.IndexSampler(num_records, shuffle=True, seed=3)
  dataset = jaxfeed.Dataset.from_source(source, sampler)
  if slow:
    return dataset.map(service_udfs.slow_add_one_to_x).batch(4)
  return dataset.map(service_udfs.add_one_to_x).map(service_udfs.add_payload).batch(4)


def main(argv: list[str]) -> None:
  address, job_name, num_batches = argv[1], argv[2], int(argv[3])
  iterator = (
    records()
    .distribute(
      address,
      "distributed_epoch",
      job_name=job_name,
      visitation="exactly_once",
      max_outstanding_requests=2,
    )
    .make_iterator()
  )
  for _ in range(num_batches):
    print(json.dumps(next(iterator)["x"].tolist()), flush=True)
  while True:
    time.sleep(1)


if __name__ == "__main__":
  main(sys.argv)
