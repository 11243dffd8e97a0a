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
dispatcher's service account needs get and patch on `deployments/scale`, and
(for the per_job policy, which removes a chosen worker) list and patch on
`pods`.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

_LOG = logging.getLogger(__name__)

# The annotation by which a ReplicaSet deletes its cheapest pods first when
# it shrinks, and the cost the pod to remove gets.
DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"
_CHEAPEST = -(2**31)


def parse_deployment(value: str) -> tuple[str, str]:
  """Splits "namespace/name" into (namespace, name), naming the bad value otherwise."""
  namespace, _, name = value.partition("/")
  if not namespace or not name or "/" in name:
    raise ValueError(
      f"kubernetes_deployment must be NAMESPACE/NAME of the worker Deployment, got {value!r}."
    )
  return namespace, name


def _client() -> Any:
  """The official client's `client` module, configured from the pod's
  service account (or ~/.kube/config)."""
  from kubernetes import client, config  # pylint: disable=g-import-not-at-top

  try:
    config.load_incluster_config()
  except config.ConfigException:
    config.load_kube_config()
  return client


class KubernetesWorkerBackend:
  """Starts and stops workers by scaling a Deployment.

  Args:
    deployment: "namespace/name" of the worker Deployment.
    apps_api: An `AppsV1Api`-like object; None: the official client,
      configured from the pod's service account (or ~/.kube/config).
    core_api: A `CoreV1Api`-like object (for `stop_worker_at`); None: the
      official client, configured as apps_api, once needed.
  """

  def __init__(self, deployment: str, apps_api: Any = None, core_api: Any = None):
    self._namespace, self._name = parse_deployment(deployment)
    self._api = apps_api if apps_api is not None else _client().AppsV1Api()
    self._core = core_api
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

  def stop_worker_at(self, address: str, pid: int = 0) -> bool:
    """Removes the replica whose pod registered as `address` (its pod IP):
    the pod gets the lowest deletion cost, then the Deployment one replica
    less, and Kubernetes deletes that pod (among ready pods it deletes the
    cheapest first); it gets SIGTERM and drains. False if no pod of the
    Deployment has that IP."""
    del pid  # of the pod's node, not this one
    host = address.rsplit(":", 1)[0]
    if self._core is None:
      self._core = _client().CoreV1Api()
    pods = self._core.list_namespaced_pod(
      self._namespace, field_selector=f"status.podIP={host}"
    ).items
    mine = [p.metadata.name for p in pods if p.metadata.name.startswith(f"{self._name}-")]
    if len(mine) != 1:
      return False
    with self._lock:
      self._core.patch_namespaced_pod(
        mine[0], self._namespace, {"metadata": {"annotations": {DELETION_COST: str(_CHEAPEST)}}}
      )
      replicas = self.num_workers
      if replicas == 0:
        return False
      self._set_replicas(replicas - 1)
    _LOG.info(
      "Removing pod %s (%s) from Deployment %s/%s.", mine[0], address, self._namespace, self._name
    )
    return True

  def close(self) -> None:
    """Leaves the Deployment as it is (its workers outlive a dispatcher restart)."""
