"""jaxfeed service: run pipelines on remote workers (tf.data service's model).

A dispatcher keeps the metadata (datasets, jobs, workers, splits); stateless
workers run the pipelines and serve batches; clients read them with
`Dataset.distribute(...)` or `register_dataset` + `from_dataset_id`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# Loaded on first use, not imported here: every import of a module under
# jaxfeed.service runs this file first, and `jaxfeed.Loader` imports
# `protocol.read_state` alone. Importing the exports here would bring gRPC,
# protobuf and both servers along (python -X importtime -c "import
# jaxfeed.loader": jaxfeed.service takes 0.3 ms so, 75 to 160 ms eagerly).
_EXPORTS = {
  "ShardingPolicy": "jaxfeed.service.protocol.sharding",
  "SHARD_HINT": "jaxfeed.ops.shard",
  "DispatchServer": "jaxfeed.service.dispatcher.server",
  "DispatcherConfig": "jaxfeed.service.dispatcher.config",
  "WorkerServer": "jaxfeed.service.worker.server",
  "WorkerConfig": "jaxfeed.service.worker.config",
  "TLSConfig": "jaxfeed.service.protocol.rpc",
  "AutoscaleConfig": "jaxfeed.service.dispatcher.autoscale",
  "ServiceError": "jaxfeed.service.protocol.rpc",
  "PoisonSplitError": "jaxfeed.service.protocol.split_failures",
  "PositionsLostWarning": "jaxfeed.service.protocol.split_failures",
  "SpecError": "jaxfeed.service.protocol.import_paths",
  "UDFImportError": "jaxfeed.service.protocol.import_paths",
  "WireFormatError": "jaxfeed.service.protocol.wire",
  "DistributedNode": "jaxfeed.service.client.distribute",
  "CrossTrainerCache": "jaxfeed.service.client.cross_trainer_cache",
  "distribute": "jaxfeed.service.client.distribute",
  "register_dataset": "jaxfeed.service.client.distribute",
  "from_dataset_id": "jaxfeed.service.client.distribute",
  "distributed_save": "jaxfeed.service.client.distributed_save",
  "serve_client_metrics": "jaxfeed.service.metrics",
}

if TYPE_CHECKING:
  # What type checkers and IDEs see of the lazy exports above (a test
  # checks that both name the same things).
  from jaxfeed.ops.shard import SHARD_HINT as SHARD_HINT
  from jaxfeed.service.client.cross_trainer_cache import CrossTrainerCache as CrossTrainerCache
  from jaxfeed.service.client.distribute import (
    DistributedNode as DistributedNode,
    distribute as distribute,
    from_dataset_id as from_dataset_id,
    register_dataset as register_dataset,
  )
  from jaxfeed.service.client.distributed_save import distributed_save as distributed_save
  from jaxfeed.service.dispatcher.autoscale import AutoscaleConfig as AutoscaleConfig
  from jaxfeed.service.dispatcher.config import DispatcherConfig as DispatcherConfig
  from jaxfeed.service.dispatcher.server import DispatchServer as DispatchServer
  from jaxfeed.service.metrics import serve_client_metrics as serve_client_metrics
  from jaxfeed.service.protocol.import_paths import (
    SpecError as SpecError,
    UDFImportError as UDFImportError,
  )
  from jaxfeed.service.protocol.rpc import ServiceError as ServiceError, TLSConfig as TLSConfig
  from jaxfeed.service.protocol.sharding import ShardingPolicy as ShardingPolicy
  from jaxfeed.service.protocol.split_failures import (
    PoisonSplitError as PoisonSplitError,
    PositionsLostWarning as PositionsLostWarning,
  )
  from jaxfeed.service.protocol.wire import WireFormatError as WireFormatError
  from jaxfeed.service.worker.config import WorkerConfig as WorkerConfig
  from jaxfeed.service.worker.server import WorkerServer as WorkerServer

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
  module = _EXPORTS.get(name)
  if module is None:
    raise AttributeError(f"module 'jaxfeed.service' has no attribute {name!r}")
  value = getattr(importlib.import_module(module), name)
  globals()[name] = value
  return value


def __dir__() -> list[str]:
  return __all__
