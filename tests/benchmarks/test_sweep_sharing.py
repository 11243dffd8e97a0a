"""The sweep benchmark's jobs, at a tiny scale: shared preprocessing runs
each record once for the whole sweep, and every job reads its own order."""

import os

import numpy as np

import jaxfeed
from benchmarks import sweep_sharing


def test_a_shared_sweep_preprocesses_each_record_once(tmp_path, monkeypatch):
  monkeypatch.setenv("SWEEP_SIZE", "32768")  # ~0.3 ms: worth keeping
  path = str(tmp_path / "records.tfrecord")
  jaxfeed.write_tfrecord(path, [np.full(16, i, np.float32).tobytes() for i in range(300)])
  results = {}
  for shared in (True, False):
    folder = tmp_path / ("shared" if shared else "not")
    folder.mkdir()
    results[shared] = sweep_sharing.sweep(path, 3, shared, str(folder))
  assert results[True]["exact"] and results[False]["exact"]
  assert (results[True]["calls"], results[True]["read"]) == (300, 300)
  assert (results[False]["calls"], results[False]["read"]) == (900, 900)
  assert os.listdir(tmp_path / "shared" / "store")
