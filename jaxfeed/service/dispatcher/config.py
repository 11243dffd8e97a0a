"""The dispatcher's options (`DispatcherConfig`), validated at construction."""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxfeed.service.dispatcher import autoscale as autoscale_lib
from jaxfeed.service.dispatcher import heartbeat_pacing
from jaxfeed.service.protocol import import_paths
from jaxfeed.service.protocol import rpc
from jaxfeed.service.protocol import split_failures
from jaxfeed.service.storage import journal_replay


@dataclasses.dataclass(frozen=True)
class DispatcherConfig:
  """Options of a dispatcher.

  Attributes:
    port: TCP port; 0 lets the OS pick one (read it from `DispatchServer.port`).
    host: Interface to bind; loopback unless set.
    work_dir: Folder of the write-ahead journal; None keeps state in memory.
    heartbeat_timeout_s: A worker silent this long is declared dead.
    client_timeout_s: A client silent this long is released from its job;
      exactly-once jobs issue the splits it had not acknowledged again.
    job_gc_timeout_s: A named job left without clients is kept this long,
      so a consumer that joins late still shares it (it gets what is left,
      or the end of the job) instead of starting the job over.
    auth_token: The clients' token: registering datasets and reading jobs
      need it (gRPC metadata). Set together with worker_token.
    worker_token: The workers' token: registering, heartbeats and splits
      need it. Different from auth_token, so that a client cannot pose as a
      worker nor a worker as a client; clients read from workers with
      per-task tickets the dispatcher hands them instead.
    split_size: Sampler positions per DYNAMIC split (where the positions are
      files, a split is always one file).
    max_message_bytes: Largest gRPC message accepted or sent.
    pickled_udf_secret: Shared secret that signs pickled UDFs; None refuses them.
    udf_modules: Modules (or package prefixes ending in ".") whose UDFs and
      classes pipelines may use beyond `import_paths.DEFAULT_UDF_MODULES`; a dataset
      naming any other import path is refused when registered.
    insecure: Allow binding beyond loopback without authentication.
    max_jobs_per_host: Most jobs one client host may read at once.
    num_workers: Static sharding and round-robin jobs wait for this many
      workers; None takes the workers registered when the job starts.
    worker_addresses: Static sharding (FILE, DATA, FILE_OR_DATA, HINT) with
      fixed worker indices, as tf.data service's: the worker at entry i
      reads shard i of len(worker_addresses), whenever it registers, and a
      job ends once every shard was read. An entry is "host:port" (the
      address a worker registers: its advertised host and port), "host" or
      "host:%port%" (any port on the host). Empty: the workers registered
      when the job starts (see num_workers).
    tls: Server key and certificate for TLS; None serves plaintext. With a
      client CA, callers must present certificates it signed.
    journal_fsync: fsync the journal before answering a change that must be
      durable (across power loss; one fsync shared by the changes that commit
      together, never with the state's lock held). Heartbeats wait for none:
      their changes are fsynced within ~20 ms, and the splits they
      acknowledge are sent again until they are. Without it a change
      survives a crash of the dispatcher process but not of the machine.
    journal_damage: What a restart does with damage in the journal before
      valid records (a checksum that does not match): "refuse" to start
      (the error names the file and offset), or "truncate": cut the journal
      there, losing every change after it (logged loudly). A torn last
      line is always cut; a damaged snapshot always refuses.
    snapshot_every_records: Compact the journal into a snapshot of the live
      state once it holds this many records (0: never by count). A restart
      reads the snapshot plus at most about this many records.
    snapshot_every_bytes: The same by journal size in bytes (0: never by size).
    dataset_gc_timeout_s: A dataset no job reads is deleted after this long;
      a later read of its id gets NOT_FOUND (registering the pipeline again
      works and may give a new id).
    autoscale: Start and resize a pool of workers (local processes, Ray
      actors or a Kubernetes Deployment: `AutoscaleConfig.backend`) from the
      clients' reports (see `jaxfeed.service.dispatcher.autoscale`); None: workers are
      started by hand.
    heartbeat_pacing: How often workers and clients are asked to heartbeat,
      and how DYNAMIC splits grow, as their numbers grow.
    max_split_attempts: Exactly-once jobs: a split whose worker was lost
      while it made the split this many times is handed out no more and
      the job fails, naming it (`jaxfeed.service.protocol.split_failures`):
      a record that kills every worker it reaches kills only this many.
  """

  port: int = 0
  host: str = "127.0.0.1"
  work_dir: str | None = None
  heartbeat_timeout_s: float = 10.0
  client_timeout_s: float = 60.0
  job_gc_timeout_s: float = 300.0
  auth_token: str | None = None
  worker_token: str | None = None
  split_size: int = 256
  max_message_bytes: int = rpc.DEFAULT_MAX_MESSAGE_BYTES
  pickled_udf_secret: bytes | None = None
  udf_modules: tuple[str, ...] = ()
  insecure: bool = False
  max_jobs_per_host: int = 256
  num_workers: int | None = None
  worker_addresses: tuple[str, ...] = ()
  tls: rpc.TLSConfig | None = None
  journal_fsync: bool = True
  journal_damage: str = journal_replay.REFUSE
  snapshot_every_records: int = 50_000
  snapshot_every_bytes: int = 32 << 20
  dataset_gc_timeout_s: float = 24 * 3600.0
  autoscale: autoscale_lib.AutoscaleConfig | None = None
  heartbeat_pacing: heartbeat_pacing.HeartbeatPacing = heartbeat_pacing.HeartbeatPacing()
  max_split_attempts: int = split_failures.DEFAULT_MAX_SPLIT_ATTEMPTS

  def __post_init__(self):
    if not isinstance(self.heartbeat_pacing, heartbeat_pacing.HeartbeatPacing):
      raise ValueError(
        "DispatcherConfig: heartbeat_pacing must be a HeartbeatPacing, "
        f"got {self.heartbeat_pacing!r}."
      )
    if not isinstance(self.port, int) or not 0 <= self.port < 65536:
      raise ValueError(f"DispatcherConfig: port must be in [0, 65535], got {self.port!r}.")
    for name in (
      "heartbeat_timeout_s",
      "client_timeout_s",
      "job_gc_timeout_s",
      "dataset_gc_timeout_s",
    ):
      value = getattr(self, name)
      if not isinstance(value, (int, float)) or value <= 0:
        raise ValueError(f"DispatcherConfig: {name} must be > 0 seconds, got {value!r}.")
    if self.journal_damage not in journal_replay.DAMAGE_POLICIES:
      raise ValueError(
        f"DispatcherConfig: journal_damage must be one of "
        f"{journal_replay.DAMAGE_POLICIES}, got {self.journal_damage!r}."
      )
    for name in ("snapshot_every_records", "snapshot_every_bytes"):
      value = getattr(self, name)
      if not isinstance(value, int) or value < 0:
        raise ValueError(
          f"DispatcherConfig: {name} must be an integer >= 0 (0: off), got {value!r}."
        )
    if not isinstance(self.split_size, int) or self.split_size < 1:
      raise ValueError(
        f"DispatcherConfig: split_size must be an integer >= 1, got {self.split_size!r}."
      )
    if not isinstance(self.max_message_bytes, int) or self.max_message_bytes < 1024:
      raise ValueError(
        "DispatcherConfig: max_message_bytes must be an integer "
        f">= 1024, got {self.max_message_bytes!r}."
      )
    if self.num_workers is not None and (
      not isinstance(self.num_workers, int) or self.num_workers < 1
    ):
      raise ValueError(
        f"DispatcherConfig: num_workers must be None or >= 1, got {self.num_workers!r}."
      )
    object.__setattr__(self, "worker_addresses", _worker_addresses(self.worker_addresses))
    if (
      self.num_workers is not None
      and self.worker_addresses
      and (self.num_workers != len(self.worker_addresses))
    ):
      raise ValueError(
        f"DispatcherConfig: num_workers={self.num_workers} but worker_addresses lists "
        f"{len(self.worker_addresses)}; give one of them (or equal counts)."
      )
    for name in ("auth_token", "worker_token"):
      value = getattr(self, name)
      if value is not None and (not isinstance(value, str) or not value):
        raise ValueError(f"DispatcherConfig: {name} must be a non-empty string or None.")
    if (self.auth_token is None) != (self.worker_token is None):
      raise ValueError(
        "DispatcherConfig: set both auth_token (for clients) and worker_token "
        "(for workers), or neither: with one token only, anyone could take "
        "the other role."
      )
    if self.auth_token is not None and self.auth_token == self.worker_token:
      raise ValueError(
        "DispatcherConfig: auth_token and worker_token must differ, "
        "so that clients cannot pose as workers."
      )
    if (
      isinstance(self.max_split_attempts, bool)
      or not isinstance(self.max_split_attempts, int)
      or self.max_split_attempts < 1
    ):
      raise ValueError(
        "DispatcherConfig: max_split_attempts must be an integer >= 1, "
        f"got {self.max_split_attempts!r}."
      )
    if not isinstance(self.max_jobs_per_host, int) or self.max_jobs_per_host < 1:
      raise ValueError(
        "DispatcherConfig: max_jobs_per_host must be an integer >= 1, "
        f"got {self.max_jobs_per_host!r}."
      )
    object.__setattr__(self, "udf_modules", import_paths.check_udf_modules(self.udf_modules))
    rpc.check_bind_is_safe(
      "Dispatcher",
      self.host,
      self.authenticates,
      self.insecure,
      "register pipelines that run their code on every worker, or pose as a worker",
    )

  @property
  def authenticates(self) -> bool:
    """Whether every caller must prove who it is (tokens, or client certificates)."""
    return bool(self.auth_token) or bool(self.tls is not None and self.tls.verifies_clients)


def _worker_addresses(value: object) -> tuple[str, ...]:
  """`worker_addresses` as a tuple of distinct non-empty strings."""
  if isinstance(value, str):
    value = [value]
  try:
    entries: tuple[Any, ...] = tuple(value)  # type: ignore[arg-type]
  except TypeError:
    entries = (value,)
  for entry in entries:
    if not isinstance(entry, str) or not entry or entry != entry.strip() or "," in entry:
      raise ValueError(
        "DispatcherConfig: worker_addresses must be a list of \"host:port\", "
        f"\"host\" or \"host:%port%\" strings, got {entry!r} in {value!r}."
      )
  repeated = sorted({e for e in entries if entries.count(e) > 1})
  if repeated:
    raise ValueError(
      f"DispatcherConfig: worker_addresses lists {repeated} more than "
      "once; each worker has one index."
    )
  return entries
