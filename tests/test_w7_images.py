"""W7's pipelines give the batches of the bare loop its limit is measured on."""

import numpy as np
import pytest

import jaxfeed
from benchmarks import w7_images
from jaxfeed.ops import parallel_executor
from jaxfeed.ops.random_map import element_rng


@pytest.mark.parametrize(
  "mode,normalized", [("per-image", True), ("batches", True), ("uint8", False)]
)
def test_pipeline_batches_equal_the_limits_bare_loop(tmp_path, monkeypatch, mode, normalized):
  monkeypatch.setattr(w7_images, "BATCH", 8)
  monkeypatch.setattr(parallel_executor, "INLINE_BELOW_S", 0.0)  # all on the threads
  path = w7_images.make_records(str(tmp_path / "images.tfrecord"), 30)
  got = list(w7_images.jaxfeed_dataset(path, threads=2, mode=mode))
  with jaxfeed.Dataset.from_source(jaxfeed.TFRecordSource(path)).node.make_iterator() as records:
    seeds = [records.last_seed for _ in records]
  records = jaxfeed.TFRecordSource(path).get_many(np.arange(30))
  bare = w7_images.BareBatches(normalized)
  assert [len(batch["label"]) for batch in got] == [8, 8, 8, 6]
  for i, batch in enumerate(got):
    rows = slice(8 * i, 8 * i + 8)
    want = bare.batch(records[rows], [element_rng(0, s) for s in seeds[rows]])
    assert batch["image"].dtype == want["image"].dtype
    np.testing.assert_array_equal(batch["image"], want["image"])
    np.testing.assert_array_equal(batch["label"], want["label"])
  # The draws differ from image to image: crops, and flips both ways.
  assert len({batch["image"][0].tobytes() for batch in got}) == 4
