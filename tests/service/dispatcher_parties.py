"""Fake workers and clients of a real dispatcher process: its RPCs, sent
one by one, so that a test decides every change it journals."""

from __future__ import annotations

import time

import numpy as np

import jaxfeed
from jaxfeed import service
from jaxfeed.service.dispatcher import server as dispatcher_lib
from jaxfeed.service.protocol import rpc
from jaxfeed.service.protocol.protos import service_pb2 as pb

# A dispatcher's flags for Parties: tokens (its ticket master is journaled),
# and workers and clients that stay alive between a test's calls.
CLIENT_TOKEN = "parties-client-token"
WORKER_TOKEN = "parties-worker-token"
FLAGS = (
  f"--auth_token={CLIENT_TOKEN}",
  f"--worker_token={WORKER_TOKEN}",
  "--heartbeat_timeout_s=120",
  "--client_timeout_s=120",
  "--split_size=10",
)
WAIT_S = 60


def pipeline(num_records: int) -> jaxfeed.Dataset:
  """A pipeline per size: each has its own fingerprint."""
  source = jaxfeed.ArraySource(np.arange(num_records, dtype=np.int64))
  return jaxfeed.Dataset.from_source(source).batch(5)


class Parties:
  """Fake workers and clients of one dispatcher, speaking its RPCs."""

  def __init__(self, address: str):
    self.address = address
    self.channel = rpc.make_channel(address)

  def close(self) -> None:
    self.channel.close()

  def call(self, method: str, request, response_cls, worker: bool = False):
    caller = rpc.Caller(
      self.channel,
      f"/{dispatcher_lib.SERVICE_NAME}/{method}",
      response_cls,
      WORKER_TOKEN if worker else CLIENT_TOKEN,
    )
    return caller(request, timeout=WAIT_S, wait_for_ready=True)

  def register(self, num_records: int) -> str:
    return service.register_dataset(
      self.address, pipeline(num_records), auth_token=CLIENT_TOKEN, timeout_s=WAIT_S
    )

  def worker(
    self, address: str, incarnation: str, current=(), finished=(), held=(), leaving: bool = False
  ) -> pb.WorkerHeartbeatResponse:
    return self.call(
      "WorkerHeartbeat",
      pb.WorkerHeartbeatRequest(
        worker_address=address,
        data_address=address,
        incarnation=incarnation,
        current_tasks=list(current),
        finished_tasks=list(finished),
        leaving=leaving,
        held_splits=[pb.HeldSplits(task_id=t, client_id=c, starts=s) for t, c, s in held],
      ),
      pb.WorkerHeartbeatResponse,
      worker=True,
    )

  def job(self, dataset_id: str, policy: str, **options) -> tuple[int, int]:
    response = self.call(
      "GetOrCreateJob",
      pb.GetOrCreateJobRequest(dataset_id=dataset_id, sharding_policy=policy, **options),
      pb.GetOrCreateJobResponse,
    )
    return response.job_id, response.client_id

  def splits(self, task: pb.TaskInfo, seq: int) -> tuple[list[tuple[int, int]], bool]:
    response = self.call(
      "GetSplits",
      pb.GetSplitsRequest(job_id=task.job_id, task_id=task.task_id, max_ranges=2, request_seq=seq),
      pb.GetSplitsResponse,
      worker=True,
    )
    return [(r.start, r.stop) for r in response.ranges], response.end_of_splits

  def ack(self, job_id: int, client_id: int, starts: list[int]) -> pb.ClientHeartbeatResponse:
    """Acknowledges splits until the dispatcher has them durable."""
    while True:
      response = self.call(
        "ClientHeartbeat",
        pb.ClientHeartbeatRequest(job_id=job_id, client_id=client_id, acked_splits=starts),
        pb.ClientHeartbeatResponse,
      )
      if not getattr(response, "acks_pending", False):
        return response
      time.sleep(0.01)

  def release(self, job_id: int, client_id: int) -> None:
    self.call(
      "ReleaseJobClient",
      pb.ReleaseJobClientRequest(job_id=job_id, client_id=client_id),
      pb.ReleaseJobClientResponse,
    )
