"""cache, snapshot and the sources' paths go through etils.epath: a `gs://`
bucket (kept in a local folder by epath's mock backend) works like a folder."""

import os

import numpy as np

from jaxfeed.dataset import Dataset
from epath_testing import bucket_in
from op_testing import check_resume, run


def test_an_on_disk_cache_in_a_bucket_is_written_then_read(tmp_path):
  calls = []

  def note(x):
    calls.append(int(x))
    return {"x": x, "v": np.arange(int(x) % 4)}

  with bucket_in(tmp_path) as bucket:
    ds = Dataset.range(10).map(note).cache(f"{bucket}/cache")
    first = run(ds)
    assert os.path.isfile(tmp_path / "cache" / "manifest.json")
    second = run(ds)
  assert len(calls) == 10
  assert [int(e["x"]) for e in second] == [int(e["x"]) for e in first] == list(range(10))


def test_a_snapshot_in_a_bucket_resumes_exactly(tmp_path):
  with bucket_in(tmp_path) as bucket:
    check_resume(lambda: Dataset.range(12).snapshot(f"{bucket}/snaps"))
  (snapshot,) = os.listdir(tmp_path / "snaps")
  assert os.path.isfile(tmp_path / "snaps" / snapshot / "manifest.json")
