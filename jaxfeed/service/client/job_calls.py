"""A client's calls about its job: to the dispatcher (a caller per method,
calls retried for timeout_s, joining the job with GetOrCreateJob), and
leaving the job (a goodbye through a worker when the dispatcher asks for
it, else ReleaseJobClient)."""

from __future__ import annotations

import logging
import ssl
from typing import Any, Sequence

import grpc

from jaxfeed.service.protocol import data_socket
from jaxfeed.service.protocol import read_state
from jaxfeed.service.protocol import rpc
from jaxfeed.service.protocol.protos import service_pb2 as pb

_DISPATCHER = "/jaxfeed.service.Dispatcher/"
GOODBYE_TIMEOUT_S = 1.0  # to connect to a worker, and again for its answer
RELEASE_TIMEOUT_S = 2.0  # ReleaseJobClient's deadline

UNANSWERED_S = 5.0
"""A read or `register_dataset` fails after this many seconds when nothing
answers at the dispatcher's address (unless it waits for the dispatcher)."""


def dispatcher_caller(
  channel: grpc.Channel, method: str, response_cls: type, token: str | None
) -> rpc.Caller:
  return rpc.Caller(channel, _DISPATCHER + method, response_cls, token)


def call_dispatcher(
  caller: rpc.Caller,
  request: Any,
  service: str,
  timeout_s: float,
  wait_for_dispatcher: bool,
  what: str,
) -> Any:
  """A dispatcher call retried for `timeout_s`; without `wait_for_dispatcher`,
  an error naming `service` after `UNANSWERED_S` when nothing answers there."""
  return rpc.call_with_retry(
    caller,
    request,
    timeout_s,
    what,
    target=service,
    answer_within_s=None if wait_for_dispatcher else UNANSWERED_S,
    unanswered_hint=(
      "; to keep trying for timeout_s while a dispatcher starts "
      "there, pass wait_for_dispatcher=True"
    ),
  )


def join_job(
  node: Any,
  channel: grpc.Channel,
  dataset_id: str,
  progress: read_state.SplitProgress,
  process: str,
  resume_worker_indices: Sequence[int] = (),
) -> pb.GetOrCreateJobResponse:
  """Creates or joins the job of the read of `node` (a `DistributedNode`)
  of `dataset_id`, resuming `progress` (a parallel_epochs read: the streams
  of `resume_worker_indices`); `process` is the client's
  (`target_workers.process_id`). The answer carries the first heartbeat's
  when the dispatcher gives it.

  Raises:
    ValueError: the dispatcher refused the read's options.
    rpc.ServiceError: the dispatcher failed, or did not answer in time.
  """
  job_call = dispatcher_caller(
    channel, "GetOrCreateJob", pb.GetOrCreateJobResponse, node.auth_token
  )
  job_name, done, partial = node.job_name or "", *progress.resume_ranges
  if job_name and progress.resumed_from:
    job_name = read_state.resume_job_name(job_name, progress.resumed_from, progress.restore_id)
  try:
    return call_dispatcher(
      job_call,
      pb.GetOrCreateJobRequest(
        dataset_id=dataset_id,
        sharding_policy=node.policy.value,
        resume_done=[pb.SplitRange(start=a, stop=b) for a, b in done],
        resume_partial=[pb.SplitRange(start=a, stop=b) for a, b in partial],
        job_name=job_name,
        num_consumers=node.num_consumers or 0,
        consumer_index=node.consumer_index or 0,
        round_timeout_s=node.round_timeout_s or 0.0,
        exactly_once=node.visitation == "exactly_once",
        ephemeral_sharing=node.ephemeral_sharing,
        first_heartbeat=True,
        identical_worker_streams=node.identical_worker_streams,
        resume_worker_indices=resume_worker_indices,
        target_workers=node.target_workers,
        client_process=process,
      ),
      node.service,
      node.timeout_s,
      node.wait_for_dispatcher,
      f"Creating a job for dataset {dataset_id}",
    )
  except rpc.ServiceError as e:
    cause = e.__cause__
    if isinstance(cause, grpc.RpcError) and cause.code() == grpc.StatusCode.INVALID_ARGUMENT:
      raise ValueError(
        f"distribute(job_name={node.job_name!r}, num_consumers="
        f"{node.num_consumers}, consumer_index={node.consumer_index}): the "
        f"dispatcher refused the read: {cause.details()}"
      ) from e
    raise


def leave_job(
  channel: grpc.Channel,
  node: Any,
  job_id: int,
  client_id: int,
  via_workers: list[pb.TaskInfo],
  goodbye_ticket: str,
  ssl_context: ssl.SSLContext | None,
  consumed: int = 0,
  wait_s: float = 0.0,
) -> None:
  """Leaves the job, best effort (else the dispatcher times the client out),
  with the consumer's last counts (`consumed` elements, `wait_s` waited) for
  the job's metrics.

  When the dispatcher asks for it (it serves many clients, who may all
  leave at once), `via_workers` lists the workers the read streamed from:
  one of them takes the goodbye, with `goodbye_ticket`, and forwards it in
  its next heartbeat. With none, or if that worker did not take it, the
  client calls ReleaseJobClient.
  """
  if via_workers and _goodbye_through_worker(
    via_workers,
    {"client_id": client_id, "goodbye": goodbye_ticket, "elements": consumed, "wait_s": wait_s},
    ssl_context,
  ):
    return
  try:
    dispatcher_caller(channel, "ReleaseJobClient", pb.ReleaseJobClientResponse, node.auth_token)(
      pb.ReleaseJobClientRequest(
        job_id=job_id, client_id=client_id, elements_consumed=consumed, consumer_wait_s=wait_s
      ),
      timeout=min(RELEASE_TIMEOUT_S, node.timeout_s),
    )
  except grpc.RpcError:
    pass  # the dispatcher times the client out instead


def _goodbye_through_worker(
  streaming: list[pb.TaskInfo], goodbye: dict, ssl_context: ssl.SSLContext | None
) -> bool:
  """Says `goodbye` (the hello's client_id, goodbye ticket and counts) to
  one of the workers `streaming`; False if it did not take it."""
  client_id = goodbye["client_id"]
  task = streaming[client_id % len(streaming)]
  try:
    data_socket.send_goodbye(
      task.data_address,
      {"token": task.read_ticket, "task_id": task.task_id, **goodbye},
      GOODBYE_TIMEOUT_S,
      ssl_context,
    )
  except data_socket.DataConnectionError as e:
    logging.info(
      "Worker %s did not take the goodbye of client %d (%s: %s): telling the dispatcher.",
      task.worker_address,
      client_id,
      e.status,
      e,
    )
    return False
  return True
