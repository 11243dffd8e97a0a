"""jaxfeed service: run pipelines on remote workers (tf.data service's model).

A dispatcher keeps the metadata (datasets, jobs, workers, splits); stateless
workers run the pipelines and serve batches; clients read them with
`Dataset.distribute(...)` or `register_dataset` + `from_dataset_id`.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "ShardingPolicy": "jaxfeed.service.sharding",
    "DispatchServer": "jaxfeed.service.dispatcher",
    "DispatcherConfig": "jaxfeed.service.dispatcher_config",
    "WorkerServer": "jaxfeed.service.worker",
    "WorkerConfig": "jaxfeed.service.worker",
    "TLSConfig": "jaxfeed.service.rpc",
    "AutoscaleConfig": "jaxfeed.service.autoscale",
    "ServiceError": "jaxfeed.service.rpc",
    "SpecError": "jaxfeed.service.spec",
    "UDFImportError": "jaxfeed.service.spec",
    "WireFormatError": "jaxfeed.service.wire",
    "DistributedNode": "jaxfeed.service.client",
    "distribute": "jaxfeed.service.client",
    "register_dataset": "jaxfeed.service.client",
    "from_dataset_id": "jaxfeed.service.client",
    "serve_client_metrics": "jaxfeed.service.metrics",
}

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
