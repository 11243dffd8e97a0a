"""Fixtures of the chaos tests, which reuse the service tests' process helpers."""

import pathlib
import sys

import pytest

_SERVICE_TESTS = str(pathlib.Path(__file__).resolve().parents[1] / "service")
if _SERVICE_TESTS not in sys.path:
  sys.path.insert(0, _SERVICE_TESTS)

from chaos_cluster import ChaosCluster  # pylint: disable=g-import-not-at-top,wrong-import-position


@pytest.fixture
def chaos(tmp_path):
  """Makes ChaosClusters in tmp_path; closes every one after the test."""
  made: list[ChaosCluster] = []

  def make(num_workers: int = 1, **options) -> ChaosCluster:
    cluster = ChaosCluster(tmp_path / f"cluster{len(made)}", num_workers, **options)
    made.append(cluster)
    return cluster

  yield make
  for cluster in made:
    cluster.close()
