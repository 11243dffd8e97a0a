"""A worker's options (`WorkerConfig`), validated at construction."""

from __future__ import annotations

import dataclasses

from jaxfeed.ops import autocache_policy
from jaxfeed.ops.autocache_folder import FolderLimits
from jaxfeed.service.protocol import import_paths
from jaxfeed.service.protocol import rpc
from jaxfeed.service.worker import round_assembly


@dataclasses.dataclass(frozen=True)
class WorkerConfig:
  """Options of a worker.

  Attributes:
    dispatcher_address: host:port of the dispatcher.
    port: gRPC port; 0 lets the OS pick one.
    host: Interface to bind ("0.0.0.0" for all of them).
    advertise_host: The host part of the addresses clients are given; None:
      `host`, or this machine's host name when `host` is a wildcard.
    heartbeat_interval_s: Seconds between heartbeats to the dispatcher.
    buffer_size: Ready batches buffered per task (rounds for round-robin jobs).
    worker_token: The workers' token, sent to the dispatcher. Clients do not
      send it: they read a task with the ticket the dispatcher gave them,
      which this worker checks with a key the dispatcher gives it.
    pickled_udf_secret: Shared secret that signs pickled UDFs; None refuses them.
    udf_modules: Modules (or package prefixes ending in ".") whose UDFs and
      classes pipelines may use beyond `import_paths.DEFAULT_UDF_MODULES`; no other
      module is ever imported for a pipeline.
    insecure: Allow binding beyond loopback without authentication.
    max_message_bytes: Largest gRPC message accepted or sent.
    chunk_bytes: Largest piece of a batch per streamed gRPC message.
    data_socket: Also serve batches on a raw TCP port (fast path).
    splits_per_request: DYNAMIC split ranges fetched per dispatcher call.
    tls: Key and certificate for serving TLS (gRPC and the data socket),
      and the root CA for the dispatcher; with a client CA, clients must
      present certificates it signed.
    autocache_dir: Where `autocache` ops of parallel_epochs and static
      tasks keep their input's output, keyed by its fingerprint, for later
      tasks of any job (see `jaxfeed.ops.autocache`); None: they pass
      through. Workers may share the folder.
    autocache_max_bytes: Most bytes the autocache folder holds (least
      recently used entries not in use go first; see
      `jaxfeed.ops.autocache_folder`); None: no limit.
    autocache_ttl_s: Autocache entries nobody read for this many seconds
      are removed; None: kept.
    autocache_policy: Whether each autocache point computes, writes or
      reads its cache: "auto" decides from what each costs (see
      `jaxfeed.ops.autocache_policy`), "always" caches every point,
      "never" computes every point.
    sharing_window_bytes: Ephemeral sharing: most bytes of frames a shared
      pipeline keeps for its slower readers (see
      `jaxfeed.service.worker.shared_stream`).
    max_window_batches: Round-robin jobs: most batches a task holds in
      partial bucket windows; past it the oldest window is dropped (see
      `jaxfeed.service.worker.round_assembly`). A job's worker memory is bounded by
      this plus buffer_size rounds of num_consumers batches.
    worker_tags: Tags the dispatcher tells clients (tf.data's): "COLOCATED"
      marks a worker that runs on a trainer's host, which clients in other
      processes with target_workers="auto" do not read (see
      `jaxfeed.service.protocol.target_workers`).
    data_transfer_address: The "host:port" clients fetch batches from (the
      data socket's address), when it differs from the worker's gRPC
      address: a data-plane interface or a forwarded port. "%port%" stands
      for the data socket's own port; a number binds the data socket to
      that port. None: `advertise_host` (or `host`) and the socket's port.
    dispatcher_timeout_s: How long the worker goes on without its
      dispatcher: it serves the tasks it has meanwhile (DYNAMIC ones wait
      for more splits), and re-registers when the dispatcher is back. Past
      it, the worker stops (its clients read on from other workers, or fail
      saying so). None: for as long as it takes.
    dataset_cache_entries: Most dataset definitions the worker keeps for
      later tasks (least recently used out first).
    dataset_cache_bytes: Most bytes of dataset definitions it keeps.
  """

  dispatcher_address: str
  port: int = 0
  host: str = "127.0.0.1"
  advertise_host: str | None = None
  heartbeat_interval_s: float = 0.5
  buffer_size: int = 8
  worker_token: str | None = None
  pickled_udf_secret: bytes | None = None
  udf_modules: tuple[str, ...] = ()
  insecure: bool = False
  max_message_bytes: int = rpc.DEFAULT_MAX_MESSAGE_BYTES
  chunk_bytes: int = 4 << 20
  data_socket: bool = True
  splits_per_request: int = 2
  tls: rpc.TLSConfig | None = None
  max_window_batches: int = round_assembly.DEFAULT_MAX_WINDOW_BATCHES
  sharing_window_bytes: int = 256 << 20
  autocache_dir: str | None = None
  autocache_max_bytes: int | None = None
  autocache_ttl_s: float | None = None
  autocache_policy: str = "auto"
  worker_tags: tuple[str, ...] = ()
  data_transfer_address: str | None = None
  dispatcher_timeout_s: float | None = None
  dataset_cache_entries: int = 64
  dataset_cache_bytes: int = 128 << 20

  def __post_init__(self):
    if not isinstance(self.dispatcher_address, str) or ":" not in self.dispatcher_address:
      raise ValueError(
        f"WorkerConfig: dispatcher_address must be 'host:port', got {self.dispatcher_address!r}."
      )
    if not isinstance(self.port, int) or not 0 <= self.port < 65536:
      raise ValueError(f"WorkerConfig: port must be in [0, 65535], got {self.port!r}.")
    if not isinstance(self.heartbeat_interval_s, (int, float)) or self.heartbeat_interval_s <= 0:
      raise ValueError(
        f"WorkerConfig: heartbeat_interval_s must be > 0, got {self.heartbeat_interval_s!r}."
      )
    if self.dispatcher_timeout_s is not None and (
      not isinstance(self.dispatcher_timeout_s, (int, float)) or not self.dispatcher_timeout_s > 0
    ):
      raise ValueError(
        "WorkerConfig: dispatcher_timeout_s must be > 0 seconds, or None "
        f"(no limit), got {self.dispatcher_timeout_s!r}."
      )
    for name in (
      "buffer_size",
      "splits_per_request",
      "max_window_batches",
      "sharing_window_bytes",
      "dataset_cache_entries",
      "dataset_cache_bytes",
    ):
      value = getattr(self, name)
      if not isinstance(value, int) or value < 1:
        raise ValueError(f"WorkerConfig: {name} must be an integer >= 1, got {value!r}.")
    if (
      not isinstance(self.chunk_bytes, int)
      or not 1024 <= self.chunk_bytes <= self.max_message_bytes - 1024
    ):
      raise ValueError(
        f"WorkerConfig: chunk_bytes must be in [1024, max_message_bytes - 1024], "
        f"got {self.chunk_bytes!r}."
      )
    if self.worker_token is not None and (
      not isinstance(self.worker_token, str) or not self.worker_token
    ):
      raise ValueError("WorkerConfig: worker_token must be a non-empty string or None.")
    if isinstance(self.worker_tags, str) or not all(
      isinstance(tag, str) and tag and "," not in tag for tag in self.worker_tags
    ):
      raise ValueError(
        "WorkerConfig: worker_tags must be a sequence of non-empty strings "
        f"without commas, got {self.worker_tags!r}."
      )
    object.__setattr__(self, "worker_tags", tuple(self.worker_tags))
    if self.data_transfer_address is not None:
      data_transfer_port(self.data_transfer_address)
      if not self.data_socket:
        raise ValueError(
          f"WorkerConfig: data_transfer_address="
          f"{self.data_transfer_address!r} needs data_socket=True: it is "
          "the data socket's address."
        )
    FolderLimits(self.autocache_max_bytes, self.autocache_ttl_s)  # checks them
    if self.autocache_policy not in autocache_policy.POLICIES:
      raise ValueError(
        f"WorkerConfig: autocache_policy must be one of "
        f"{', '.join(autocache_policy.POLICIES)}, got {self.autocache_policy!r}."
      )
    if not self.autocache_dir and (
      self.autocache_max_bytes is not None or self.autocache_ttl_s is not None
    ):
      raise ValueError(
        "WorkerConfig: autocache_max_bytes and autocache_ttl_s limit the "
        "autocache folder: they need autocache_dir."
      )
    object.__setattr__(self, "udf_modules", import_paths.check_udf_modules(self.udf_modules))
    rpc.check_bind_is_safe(
      "Worker",
      self.host,
      bool(self.worker_token) or bool(self.tls is not None and self.tls.verifies_clients),
      self.insecure,
      "read every task's batches",
    )


def data_transfer_port(address: str) -> int:
  """The port to bind the data socket to for a `data_transfer_address`
  ("host:port" or "host:%port%"; 0 for the latter: a free one).

  Raises:
    ValueError: the address is not of either form.
  """
  host, _, port = address.rpartition(":") if isinstance(address, str) else ("", "", "")
  if host and port == "%port%":
    return 0
  if host and port.isdigit() and 0 < int(port) < 65536:
    return int(port)
  raise ValueError(
    f"WorkerConfig: data_transfer_address must be 'host:port' or "
    f"'host:%port%' (the data socket's own port), got {address!r}."
  )
