"""The Kubernetes pool backend against a fake API, and the manifests offline."""

from __future__ import annotations

import pathlib
import types

import pytest
import yaml

from jaxfeed.service.dispatcher import autoscale
from jaxfeed.service.pools import kubernetes_backend

kubernetes = pytest.importorskip("kubernetes")

MANIFESTS = pathlib.Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"


class FakeAppsApi:
  """The two AppsV1Api calls the backend makes, on one Deployment."""

  def __init__(self, replicas: int):
    self.replicas = replicas
    self.patches: list[tuple[str, str, dict]] = []

  def read_namespaced_deployment_scale(self, name, namespace):
    assert (namespace, name) == ("jaxfeed", "jaxfeed-worker")
    return types.SimpleNamespace(spec=types.SimpleNamespace(replicas=self.replicas))

  def patch_namespaced_deployment_scale(self, name, namespace, body):
    self.patches.append((namespace, name, body))
    self.replicas = body["spec"]["replicas"]


def test_scaling_patches_the_deployments_replicas():
  api = FakeAppsApi(replicas=1)
  backend = kubernetes_backend.KubernetesWorkerBackend("jaxfeed/jaxfeed-worker", api)
  assert backend.num_workers == 1
  backend.start_worker()
  backend.start_worker()
  assert backend.stop_worker()
  assert [p[2] for p in api.patches] == [{"spec": {"replicas": r}} for r in (2, 3, 2)]
  assert all(p[:2] == ("jaxfeed", "jaxfeed-worker") for p in api.patches)
  backend.close()
  assert api.replicas == 2  # the Deployment outlives its dispatcher
  api.replicas = 0
  assert not backend.stop_worker() and len(api.patches) == 3


def test_a_pool_counts_the_workers_the_deployment_already_has():
  api = FakeAppsApi(replicas=2)
  backend = kubernetes_backend.KubernetesWorkerBackend("jaxfeed/jaxfeed-worker", api)
  pool = autoscale.Autoscaler(
    autoscale.AutoscaleConfig(min_workers=3, max_workers=4), backend, lambda: None
  )
  pool.start()
  pool.close()
  assert api.replicas == 3 and len(api.patches) == 1


@pytest.mark.parametrize("value", ["", "jaxfeed", "/w", "a/b/c"])
def test_a_bad_deployment_name_is_named(value):
  with pytest.raises(ValueError, match="NAMESPACE/NAME"):
    kubernetes_backend.parse_deployment(value)
  with pytest.raises(ValueError, match="kubernetes_deployment"):
    autoscale.AutoscaleConfig(backend="kubernetes", kubernetes_deployment=value or None)


def _documents() -> list[dict]:
  docs = []
  for path in sorted(MANIFESTS.glob("*.yaml")):
    docs.extend(d for d in yaml.safe_load_all(path.read_text()) if d)
  return docs


def _validated(doc: dict):
  """The client's model of a manifest; raises for a missing required field,
  and fails for a field the model does not know (a typo would be dropped)."""
  api_client = kubernetes.client.ApiClient()
  group_version = doc["apiVersion"].split("/")[-1].capitalize()
  model = api_client._ApiClient__deserialize(doc, f"{group_version}{doc['kind']}")  # pylint: disable=protected-access
  assert api_client.sanitize_for_serialization(model) == doc, doc["kind"]
  return model


def test_every_manifest_is_a_valid_object_of_its_kind():
  models = {}
  for doc in _documents():
    models[(doc["kind"], doc["metadata"]["name"])] = _validated(doc)
  kinds = {kind for kind, _ in models}
  assert {
    "Namespace",
    "Secret",
    "StatefulSet",
    "Deployment",
    "Service",
    "NetworkPolicy",
    "Role",
    "RoleBinding",
    "ServiceAccount",
  } <= kinds
  dispatcher = models[("StatefulSet", "jaxfeed-dispatcher")]
  assert dispatcher.spec.volume_claim_templates[0].metadata.name == "journal"
  args = dispatcher.spec.template.spec.containers[0].args
  assert "--work_dir=/var/lib/jaxfeed" in args
  assert "--kubernetes_deployment=jaxfeed/jaxfeed-worker" in args
  secret = models[("Secret", "jaxfeed-tokens")]
  assert set(secret.string_data) == {"auth-token", "worker-token"}
  worker = models[("Deployment", "jaxfeed-worker")]
  assert any(
    a.startswith("--worker_token_file=") for a in worker.spec.template.spec.containers[0].args
  )


def test_the_manifest_check_refuses_missing_and_misspelled_fields():
  with pytest.raises(ValueError, match="selector"):
    _validated(
      {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "w"},
        "spec": {"replicas": 1},
      }
    )
  with pytest.raises(AssertionError):
    _validated(
      {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "s"}, "strngData": {"a": "b"}}
    )
