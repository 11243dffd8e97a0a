"""What `jaxfeed.service` exports stays importable from it, wherever it is defined."""

from __future__ import annotations

import jaxfeed
from jaxfeed import service

PUBLIC_NAMES = (
  "AutoscaleConfig",
  "CrossTrainerCache",
  "DispatchServer",
  "DispatcherConfig",
  "DistributedNode",
  "PoisonSplitError",
  "PositionsLostWarning",
  "SHARD_HINT",
  "ServiceError",
  "ShardingPolicy",
  "SpecError",
  "TLSConfig",
  "UDFImportError",
  "WireFormatError",
  "WorkerConfig",
  "WorkerServer",
  "distribute",
  "distributed_save",
  "from_dataset_id",
  "register_dataset",
  "serve_client_metrics",
)


def test_every_public_name_of_the_service_resolves_to_what_it_names():
  assert service.__all__ == sorted(PUBLIC_NAMES)
  for name in PUBLIC_NAMES:
    if name.isupper():  # a constant
      continue
    assert getattr(service, name).__name__ == name
  assert service.SHARD_HINT == -1  # tf.data's value


def test_dataset_distribute_reads_through_the_service_client():
  node = jaxfeed.Dataset.range(4).distribute("127.0.0.1:1").node
  assert isinstance(node, service.DistributedNode)
