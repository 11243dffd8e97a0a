"""A worker pool on Kubernetes: the autoscaler resizes a worker Deployment.

The workers are the pods of a Deployment (see `deploy/kubernetes/`), which
carries their flags and mounts their token; the pool only sets its replica
count through the Deployment's scale subresource. Pods register with the
dispatcher by themselves, and a pod that goes away (scaled down, evicted,
its node lost) is a lost worker to the dispatcher. When the dispatcher
stops, the Deployment keeps its size: its workers register again with the
restarted dispatcher.

The official `kubernetes` client is an optional dependency (`pip install
jaxfeed[kubernetes]`); only this module imports it. Inside a cluster the
dispatcher's service account needs get and patch on `deployments/scale`.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

_LOG = logging.getLogger(__name__)


def parse_deployment(value: str) -> tuple[str, str]:
  """Splits "namespace/name" into (namespace, name), naming the bad value otherwise."""
  namespace, _, name = value.partition("/")
  if not namespace or not name or "/" in name:
    raise ValueError(
      f"kubernetes_deployment must be NAMESPACE/NAME of the worker Deployment, got {value!r}."
    )
  return namespace, name


class KubernetesWorkerBackend:
  """Starts and stops workers by scaling a Deployment.

  Args:
    deployment: "namespace/name" of the worker Deployment.
    apps_api: An `AppsV1Api`-like object; None: the official client,
      configured from the pod's service account (or ~/.kube/config).
  """

  def __init__(self, deployment: str, apps_api: Any = None):
    self._namespace, self._name = parse_deployment(deployment)
    if apps_api is None:
      from kubernetes import client, config  # pylint: disable=g-import-not-at-top

      try:
        config.load_incluster_config()
      except config.ConfigException:
        config.load_kube_config()
      apps_api = client.AppsV1Api()
    self._api = apps_api
    self._lock = threading.Lock()  # one read-modify-write of the replicas at a time

  @property
  def num_workers(self) -> int:
    """The replicas the Deployment asks for."""
    scale = self._api.read_namespaced_deployment_scale(self._name, self._namespace)
    return int(scale.spec.replicas or 0)

  def _set_replicas(self, replicas: int) -> None:
    self._api.patch_namespaced_deployment_scale(
      self._name, self._namespace, {"spec": {"replicas": replicas}}
    )
    _LOG.info("Scaled Deployment %s/%s to %d workers.", self._namespace, self._name, replicas)

  def start_worker(self) -> None:
    with self._lock:
      self._set_replicas(self.num_workers + 1)

  def stop_worker(self) -> bool:
    """Removes one replica (Kubernetes picks the pod; it gets SIGTERM and
    drains); False if the Deployment has none."""
    with self._lock:
      replicas = self.num_workers
      if replicas == 0:
        return False
      self._set_replicas(replicas - 1)
      return True

  def close(self) -> None:
    """Leaves the Deployment as it is (its workers outlive a dispatcher restart)."""
