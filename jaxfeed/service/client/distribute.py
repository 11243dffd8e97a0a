"""Reading a pipeline through the service: `distribute`, `from_dataset_id`.

The returned `Dataset` wraps a `DistributedNode`; ops chained after it run
locally on the client. Iterating it joins (or creates) a job at the
dispatcher, then fetches batches from all of the job's workers at once into
a bounded buffer. A worker that dies is dropped and the others go on. A
connection to a live worker that breaks or stalls is made again, and the
worker goes on after the last batch the client received: nothing is lost or
repeated (see `jaxfeed.service.worker.delivery`). The read's parts: its shared
state, job and heartbeats (`client.read`), a fetcher per task
(`client.fetcher`) and its iterator (`client.iterator`).

Round-robin reads (`num_consumers=K`, `consumer_index=i`, a shared
`job_name`): coordinated reads, one batch per consumer per step, all K from
the same bucket. The job's workers are fixed when it starts (W of them).
Global round r is served by worker r mod W (its local round r // W);
consumer i receives batch i of that round. A worker builds each round from K
batches that share a bucket key, the shapes of their leaves without the batch
dimension, so the K consumers' batches of one round have the same padded
length; partial windows are dropped at the end of the input or when too many
batches wait (`WorkerConfig.max_window_batches`), as
`jaxfeed.service.worker.round_assembly` describes. Every consumer of a job must pass
the same `num_consumers` (and `round_timeout_s`, if any).

Late consumers: once the first consumer took its batch of a round, the
others have `round_timeout_s` (default 60 s) to take theirs. Then the round
closes and the late consumers' batches are dropped; later rounds do not wait
for a consumer that missed one until it reads again. When it does, it goes on
at the oldest round still open on each worker: its iterator skips the rounds
it missed (`DistributedIterator.stats()["rounds_skipped"]`) and reports each
batch's global round (`last_round`). "Took" is seen from the worker: a batch
is taken once the worker queued it for the consumer's connection, so what
already sits in the client's buffer (`max_outstanding_requests` per worker)
or on its way (up to `delivery.DEFAULT_WINDOW` batches not yet acknowledged,
sent again over a new connection if one breaks) stays the consumer's; a
consumer that stops reading becomes late when those are full, a killed one
at once. The timeout must exceed the longest pause of
a training loop (a checkpoint save, say). Rounds of a worker that ended or
died are skipped by every consumer alike, so the consumers stay aligned; a
read ends when every worker's stream ended.
"""

from __future__ import annotations

import difflib
import inspect
import threading
from typing import Any, Iterable

from jaxfeed.dataset import Dataset
from jaxfeed.ops import base
from jaxfeed.ops import index_ranges
from jaxfeed.service.client import cross_trainer_cache as cross_trainer_cache_lib
from jaxfeed.service.client.cross_trainer_cache import CrossTrainerCache
from jaxfeed.service.client.iterator import DistributedIterator
from jaxfeed.service.client.job_calls import call_dispatcher, dispatcher_caller
from jaxfeed.service.protocol import rpc
from jaxfeed.service.protocol import spec as spec_lib
from jaxfeed.service.protocol import target_workers as target_workers_lib
from jaxfeed.service.protocol import wire
from jaxfeed.service.protocol.protos import service_pb2 as pb
from jaxfeed.service.protocol.sharding import ShardingPolicy, to_sharding_policy
from jaxfeed.service.worker import task_pipeline

DATA_TRANSFERS = ("auto", "socket", "grpc")
VISITATIONS = ("at_most_once", "exactly_once")


def _target(service: str) -> str:
  if not isinstance(service, str) or not service:
    raise ValueError(f"service must be a 'host:port' string, got {service!r}.")
  for prefix in ("grpc://", "grpcs://"):
    if service.startswith(prefix):
      return service[len(prefix) :]
  return service


def register_dataset(
  service: str,
  dataset: Any,
  compression: str | None = "AUTO",
  dataset_id: str | None = None,
  *,
  auth_token: str | None = None,
  udf_secret: bytes | None = None,
  tls: rpc.TLSConfig | None = None,
  timeout_s: float = 60.0,
  wait_for_dispatcher: bool = False,
) -> str:
  """Registers a pipeline with the dispatcher and returns its dataset id.

  Equal pipelines (same fingerprint) get the same id, unless a `dataset_id`
  is given.

  Args:
    service: the dispatcher's "host:port" (a "grpc://" prefix is accepted).
    dataset: a jaxfeed Dataset (or op node).
    compression: how `from_dataset_id` reads that name no compression get
      its batches: "AUTO" (tf.data's default: the service picks per
      transport, see `wire.resolve_compression`), None (none), "lz4" or
      "zstd". A pipeline already registered keeps its first compression.
    dataset_id: an id to register it under (tf.data's user-chosen ids).
      Registering the same pipeline under it again returns it, so trainers
      that share a dataset may all register it; a different pipeline under
      an id already taken is refused (ServiceError naming both
      fingerprints). None: the dispatcher picks the id.
    auth_token: the clients' token, if the deployment requires one (workers
      are read with per-task tickets from the dispatcher, never with it).
    udf_secret: the deployment's shared secret; UDFs without an import path
      are then shipped pickled and signed. None refuses such UDFs.
    tls: root certificates for a TLS dispatcher.
    timeout_s: how long to wait for (and retry reaching) the dispatcher.
    wait_for_dispatcher: keep trying for `timeout_s` when nothing answers at
      `service` (a dispatcher still starting); False: fail after
      `UNANSWERED_S` (5 s) with an error naming the address.

  Returns:
    The dataset id.

  Raises:
    ServiceError: the dispatcher did not register it, or nothing answers at
      `service` (see `wait_for_dispatcher`).
  """
  compression = wire.check_compression(compression)
  if dataset_id is not None and (not isinstance(dataset_id, str) or not dataset_id):
    raise ValueError(f"dataset_id must be a non-empty string or None, got {dataset_id!r}.")
  node = task_pipeline.pipeline_node(dataset, "register_dataset")
  dataset_def = spec_lib.to_dataset_def(
    node,
    udf_secret,
    num_positions=task_pipeline.num_positions(node),
    positions_are_files=index_ranges.reads_files(node),
  )
  channel = rpc.make_channel(_target(service), tls=tls)
  try:
    caller = dispatcher_caller(channel, "RegisterDataset", pb.RegisterDatasetResponse, auth_token)
    response = call_dispatcher(
      caller,
      pb.RegisterDatasetRequest(
        dataset=dataset_def, dataset_id=dataset_id or "", compression=compression
      ),
      _target(service),
      timeout_s,
      wait_for_dispatcher,
      f"Registering dataset with {service}",
    )
    return str(response.dataset_id)
  finally:
    channel.close()


def _check_read_options(
  policy: ShardingPolicy,
  job_name: str | None,
  num_consumers: int | None,
  consumer_index: int | None,
  compression: str | None,
  max_outstanding_requests: int | None,
  data_transfer: str,
  round_timeout_s: float | None,
  visitation: str,
  ephemeral_sharing: bool,
  target: str,
  identical_worker_streams: bool,
) -> None:
  if job_name is not None and (not isinstance(job_name, str) or not job_name):
    raise ValueError(f"job_name must be a non-empty string or None, got {job_name!r}.")
  if num_consumers is not None:
    if job_name is None:
      raise ValueError(
        f"num_consumers={num_consumers} needs a job_name: the consumers of a "
        "round-robin read share one job."
      )
    if not isinstance(num_consumers, int) or num_consumers < 1:
      raise ValueError(f"num_consumers must be an integer >= 1, got {num_consumers!r}.")
    if consumer_index is None:
      raise ValueError("num_consumers needs consumer_index in [0, num_consumers).")
  if consumer_index is not None and (
    num_consumers is None
    or not isinstance(consumer_index, int)
    or not 0 <= consumer_index < num_consumers
  ):
    raise ValueError(
      f"consumer_index must be an integer in [0, num_consumers="
      f"{num_consumers}), got {consumer_index!r}."
    )
  if round_timeout_s is not None:
    if num_consumers is None:
      raise ValueError(
        f"round_timeout_s={round_timeout_s!r} applies to round-robin "
        "reads only: pass num_consumers and consumer_index too."
      )
    if (
      isinstance(round_timeout_s, bool)
      or not isinstance(round_timeout_s, (int, float))
      or not round_timeout_s > 0
    ):
      raise ValueError(f"round_timeout_s must be a number of seconds > 0, got {round_timeout_s!r}.")
  wire.check_compression(compression)
  if max_outstanding_requests is not None and (
    not isinstance(max_outstanding_requests, int) or max_outstanding_requests < 1
  ):
    raise ValueError(
      f"max_outstanding_requests must be an integer >= 1 or None, got {max_outstanding_requests!r}."
    )
  if data_transfer not in DATA_TRANSFERS:
    raise ValueError(f"data_transfer must be one of {DATA_TRANSFERS}, got {data_transfer!r}.")
  if visitation not in VISITATIONS:
    raise ValueError(f"visitation must be one of {VISITATIONS}, got {visitation!r}.")
  if visitation == "exactly_once" and (
    policy != ShardingPolicy.DYNAMIC or num_consumers is not None
  ):
    raise ValueError(
      "visitation='exactly_once' needs processing_mode='distributed_epoch' "
      f"(DYNAMIC) and no num_consumers; got {policy.name} and "
      f"num_consumers={num_consumers}."
    )
  if target == target_workers_lib.LOCAL and num_consumers is not None:
    raise ValueError(
      "Coordinated reads require non-local workers, but target_workers "
      f"is 'local' (num_consumers={num_consumers})."
    )
  if not isinstance(ephemeral_sharing, bool):
    raise ValueError(f"ephemeral_sharing must be True or False, got {ephemeral_sharing!r}.")
  if ephemeral_sharing and (policy != ShardingPolicy.OFF or num_consumers is not None):
    raise ValueError(
      "ephemeral_sharing=True needs processing_mode='parallel_epochs' (OFF) and "
      f"no num_consumers; got {policy.name} and num_consumers={num_consumers}."
    )
  if not isinstance(identical_worker_streams, bool):
    raise ValueError(
      f"identical_worker_streams must be True or False, got {identical_worker_streams!r}."
    )
  if identical_worker_streams and policy != ShardingPolicy.OFF:
    raise ValueError(
      "identical_worker_streams=True applies to processing_mode='parallel_epochs' "
      f"(OFF), where every worker runs the whole pipeline; got {policy.name}."
    )


class DistributedNode(base.Node):
  """Reads the output of a pipeline that runs on service workers."""

  op_name = "distribute"

  def __init__(
    self,
    *,
    service: str,
    processing_mode: Any = "parallel_epochs",
    dataset: Any = None,
    dataset_id: str | None = None,
    job_name: str | None = None,
    num_consumers: int | None = None,
    consumer_index: int | None = None,
    compression: str | None = None,
    max_outstanding_requests: int | None = None,
    auth_token: str | None = None,
    udf_secret: bytes | None = None,
    tls: rpc.TLSConfig | None = None,
    data_transfer: str = "auto",
    timeout_s: float = 60.0,
    round_timeout_s: float | None = None,
    visitation: str = "at_most_once",
    ephemeral_sharing: bool = False,
    max_frame_bytes: int = wire.DEFAULT_MAX_FRAME_BYTES,
    wait_for_dispatcher: bool = False,
    target_workers: str = "auto",
    cross_trainer_cache: CrossTrainerCache | None = None,
    identical_worker_streams: bool = False,
  ):
    super().__init__(())
    if (dataset is None) == (dataset_id is None):
      raise ValueError("DistributedNode needs exactly one of dataset and dataset_id.")
    self.service = _target(service)
    self.policy = to_sharding_policy(processing_mode)
    self.target_workers = target_workers_lib.check_target_workers(target_workers)
    self.cross_trainer_cache = cross_trainer_cache
    if cross_trainer_cache is not None:  # tf.data's name for ephemeral sharing
      job_name = cross_trainer_cache_lib.trainer_job_name(
        cross_trainer_cache, job_name, self.policy, num_consumers
      )
      ephemeral_sharing = True
    _check_read_options(
      self.policy,
      job_name,
      num_consumers,
      consumer_index,
      compression,
      max_outstanding_requests,
      data_transfer,
      round_timeout_s,
      visitation,
      ephemeral_sharing,
      self.target_workers,
      identical_worker_streams,
    )
    self.visitation = visitation
    self.identical_worker_streams = identical_worker_streams
    self.ephemeral_sharing = ephemeral_sharing
    self.max_frame_bytes = wire.check_max_frame_bytes(max_frame_bytes)
    self.dataset = (
      None if dataset is None else task_pipeline.pipeline_node(dataset, "distribute", self.policy)
    )
    if self.dataset is not None:
      spec_lib.to_dataset_def(self.dataset, udf_secret)  # fail early on bad UDFs
    self.dataset_id = dataset_id
    self.job_name = job_name
    self.num_consumers = num_consumers
    self.consumer_index = consumer_index
    self.compression = compression or None
    self.max_outstanding_requests = max_outstanding_requests
    self.auth_token = auth_token
    self.udf_secret = udf_secret
    self.tls = tls
    self.data_transfer = data_transfer
    self.timeout_s = timeout_s
    if not isinstance(wait_for_dispatcher, bool):
      raise ValueError(f"wait_for_dispatcher must be True or False, got {wait_for_dispatcher!r}.")
    self.wait_for_dispatcher = wait_for_dispatcher
    self.round_timeout_s = None if round_timeout_s is None else float(round_timeout_s)
    self._lock = threading.Lock()

  def spec_params(self) -> dict[str, Any]:
    return {
      "service": self.service,
      "processing_mode": self.policy.value,
      "dataset": self.dataset,
      "dataset_id": self.dataset_id,
      "job_name": self.job_name,
      "num_consumers": self.num_consumers,
      "consumer_index": self.consumer_index,
      "compression": self.compression,
      "max_outstanding_requests": self.max_outstanding_requests,
      "data_transfer": self.data_transfer,
      "timeout_s": self.timeout_s,
      "round_timeout_s": self.round_timeout_s,
      "visitation": self.visitation,
      "ephemeral_sharing": self.ephemeral_sharing,
      "max_frame_bytes": self.max_frame_bytes,
      "wait_for_dispatcher": self.wait_for_dispatcher,
      "target_workers": self.target_workers,
      "identical_worker_streams": self.identical_worker_streams,
    }

  def resolve_dataset_id(self) -> str:
    """Registers the pipeline on each read (so the dispatcher may start later,
    and a dataset it collected in between is registered again)."""
    with self._lock:
      if self.dataset is not None:
        self.dataset_id = register_dataset(
          self.service,
          self.dataset,
          self.compression,
          auth_token=self.auth_token,
          udf_secret=self.udf_secret,
          tls=self.tls,
          timeout_s=self.timeout_s,
          wait_for_dispatcher=self.wait_for_dispatcher,
        )
      assert self.dataset_id is not None  # distribute() or from_dataset_id() sets one
      return self.dataset_id

  def make_iterator(self) -> "DistributedIterator":
    return DistributedIterator(self)


def _check_options(
  function: str, own: Iterable[str], other_input: str, options: dict[str, Any]
) -> None:
  """Refuses a keyword in `options` (what `function` passes on to
  `DistributedNode`) that `function` does not take, in the words of
  `function`, with the closest keyword it takes: a misspelled `visitation`
  otherwise surfaced as DistributedNode.__init__'s error."""
  node_keywords = set(inspect.signature(DistributedNode.__init__).parameters) - {"self"}
  passed_on = node_keywords - set(own) - {other_input}
  for key in options:
    if key not in passed_on:
      takes = sorted((set(own) | passed_on) - {"options"})
      close = difflib.get_close_matches(key, takes, n=1)
      hint = f"; did you mean {close[0]!r}?" if close else "."
      raise TypeError(
        f"{function}() got an unexpected keyword argument {key!r}{hint} "
        f"It takes: {', '.join(takes)}."
      )


def distribute(
  dataset: Any,
  service: str,
  processing_mode: Any = "parallel_epochs",
  job_name: str | None = None,
  num_consumers: int | None = None,
  consumer_index: int | None = None,
  compression: str | None = None,
  max_outstanding_requests: int | None = None,
  round_timeout_s: float | None = None,
  **options: Any,
) -> Any:
  """Runs `dataset` on the service's workers; returns a Dataset reading its output.

  Args:
    dataset: the pipeline to run remotely.
    service: the dispatcher's "host:port".
    processing_mode: "parallel_epochs" / "distributed_epoch" or a ShardingPolicy.
    job_name: readers with the same job name share one job (each element goes
      to one of them).
    num_consumers: coordinated round-robin reads by this many consumers
      (needs job_name): at every round, one worker serves all of them one
      batch each, all with the same bucket key (padded shapes); see the
      module docstring.
    consumer_index: this consumer's index in [0, num_consumers).
    compression: None, "AUTO" (the service picks per transport: lz4 over
      gRPC when installed, none on the data socket and in memory), "lz4" or
      "zstd" for batches on the wire.
    max_outstanding_requests: batches buffered on the client (default 8;
      per worker for round-robin reads).
    round_timeout_s: round-robin reads: once the first consumer took its
      batch of a round, the others have this long to take theirs; then the
      round closes without them and a late consumer later goes on at the
      current round, counting what it skipped in its iterator's `stats`.
      None: the job's value, 60 s for a new job. Every consumer of a job
      passes the same value or None.
    **options: auth_token, udf_secret, tls, data_transfer ("auto", "socket",
      "grpc"), timeout_s (how long a read goes without progress or without
      the parties it needs before it fails: the dispatcher when it starts,
      a worker the dispatcher lists as alive whose connection broke, the
      dispatcher when no worker is left; a read goes on from its workers
      however long the dispatcher is away, see docs/service.md),
      wait_for_dispatcher (True: when nothing answers at `service`, keep
      trying for timeout_s, for a dispatcher that is still starting; by
      default the read fails after 5 s with an error naming the address),
      visitation: "at_most_once" (default: what a lost worker had buffered
      or in flight is lost) or "exactly_once" (distributed_epoch without
      num_consumers: the pipeline runs split by split on the workers, so a
      batch never spans two splits; the client hands a split's elements on
      only once all of them arrived and acknowledges it; a lost worker's
      unacknowledged splits are read again by the others, and so are those
      of a client of a shared job that left or was silent for the
      dispatcher's client_timeout_s, so every record arrives once per epoch;
      such a read resumes from its iterator's (or Loader's) state on a new
      job, see `jaxfeed.service.protocol.read_state`; a shared job's client takes
      one split at a time from each worker),
      ephemeral_sharing: parallel_epochs jobs of one dataset that all pass
      True share each worker's pipeline through a byte-bounded window, each
      job at its own position; a job that falls behind the window skips
      ahead (see `jaxfeed.service.worker.shared_stream`),
      max_frame_bytes: the largest batch (its frame, after decompression)
      accepted from a worker, 2 GiB by default; a bigger one fails the read,
      target_workers: which workers to read (tf.data's; any case): "auto"
      (default: all but the "COLOCATED"-tagged workers of other processes),
      "any" (all) or "local" (only the `WorkerServer`s of this process,
      through memory; the read fails at once when there is none); see
      `jaxfeed.service.protocol.target_workers`. Consumers of a named job
      pass the same value,
      cross_trainer_cache: a `CrossTrainerCache(trainer_id)`: tf.data's name
      for ephemeral sharing (needs job_name and parallel_epochs; see
      `jaxfeed.service.client.cross_trainer_cache`),
      identical_worker_streams: parallel_epochs only. False (default): each
      worker streams the pipeline in its own order, worker i's samplers and
      shuffles seeded from the pipeline's seeds and i (worker 0: the
      pipeline's own order), as tf.data service's workers each read in
      their own order; True: every worker streams the pipeline's own order,
      so the reader gets identical streams interleaved (see
      `jaxfeed.service.worker.worker_orders`). Consumers of a named job pass
      the same value.

  Returns:
    A jaxfeed Dataset.

  Raises:
    TypeError: a keyword that is none of the above, with the closest one.
  """
  _check_options("distribute", inspect.signature(distribute).parameters, "dataset_id", options)
  node = DistributedNode(
    service=service,
    processing_mode=processing_mode,
    dataset=dataset,
    job_name=job_name,
    num_consumers=num_consumers,
    consumer_index=consumer_index,
    compression=compression,
    max_outstanding_requests=max_outstanding_requests,
    round_timeout_s=round_timeout_s,
    **options,
  )
  return Dataset(node, getattr(dataset, "options", None))


def from_dataset_id(
  processing_mode: Any,
  service: str,
  dataset_id: str,
  job_name: str | None = None,
  num_consumers: int | None = None,
  consumer_index: int | None = None,
  compression: str | None = None,
  max_outstanding_requests: int | None = None,
  round_timeout_s: float | None = None,
  **options: Any,
) -> Any:
  """Reads a dataset registered with `register_dataset` (see `distribute`)."""
  _check_options(
    "from_dataset_id", inspect.signature(from_dataset_id).parameters, "dataset", options
  )
  if not isinstance(dataset_id, str) or not dataset_id:
    raise ValueError(f"dataset_id must be a non-empty string, got {dataset_id!r}.")
  return Dataset(
    DistributedNode(
      service=service,
      processing_mode=processing_mode,
      dataset_id=dataset_id,
      job_name=job_name,
      num_consumers=num_consumers,
      consumer_index=consumer_index,
      compression=compression,
      max_outstanding_requests=max_outstanding_requests,
      round_timeout_s=round_timeout_s,
      **options,
    )
  )
