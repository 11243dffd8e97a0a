"""`Dataset.save` / `Dataset.load` against tf.data's, the folder format
(`jaxfeed.ops.save_format`): checksums, incomplete saves, chunks committed
once; and the saved dataset as a random-access source."""

import json
import os
import subprocess
import sys
import threading

import numpy as np
import pytest

import jaxfeed
from jaxfeed.dataset import Dataset
from jaxfeed.ops import load as load_lib
from jaxfeed.ops import save_format
from jaxfeed.ops.element_spec import TensorSpec
from op_testing import INPUT_KINDS, assert_same_multiset, assert_same_stream, import_tensorflow, run

tf = import_tensorflow()

PIPELINES = {
  **INPUT_KINDS,
  "batch": lambda D: D.range(10).batch(3),
  "batch_drop_remainder": lambda D: D.range(10).batch(3, drop_remainder=True),
  "strings": lambda D: D.from_tensor_slices({"s": [b"a", b"bb", b""], "n": [1.5, 2.5, 3.5]}),
  "padded_batch": lambda D: (
    D.range(7).map(lambda x: (x, x)).padded_batch(2).map(lambda a, b: a)
    if D is tf.data.Dataset
    else D.range(7).padded_batch(2)
  ),
  "nested": lambda D: D.from_tensor_slices(
    ({"a": np.arange(12).reshape(4, 3)}, np.arange(4, dtype=np.float16))
  ),
}


def tf_saved(make, path, **kwargs):
  make(tf.data.Dataset).save(os.fspath(path), **kwargs)
  return tf.data.Dataset.load(os.fspath(path), compression=kwargs.get("compression"))


def as_tensor_spec(spec):
  if isinstance(spec, dict):
    return {k: as_tensor_spec(v) for k, v in spec.items()}
  if isinstance(spec, tuple):
    return tuple(as_tensor_spec(v) for v in spec)
  dtype = np.dtype(object) if spec.dtype == tf.string else spec.dtype.as_numpy_dtype
  return TensorSpec(tuple(spec.shape.as_list()), dtype)


@pytest.mark.parametrize("name", sorted(PIPELINES))
def test_a_saved_dataset_loads_as_tf_data_loads_its_own(name, tmp_path):
  make = PIPELINES[name]
  make(Dataset).save(tmp_path / "jf")
  ours = Dataset.load(tmp_path / "jf")
  # One shard: tf.data loads its elements in the order they were saved.
  theirs = tf_saved(make, tmp_path / "tf", shard_func=lambda *_: tf.constant(0, tf.int64))
  assert_same_stream(run(ours), run(theirs))
  assert_same_stream(run(ours), run(make(Dataset)))
  if run(ours):  # an empty save has no spec
    assert ours.element_spec == as_tensor_spec(theirs.element_spec)


def test_shard_func_and_compression_keep_the_multiset_as_in_tf_data(tmp_path):
  make = lambda D: D.range(100).map(lambda x: x * 3)
  make(Dataset).save(tmp_path / "jf", compression="SNAPPY", shard_func=lambda x: x % 4)
  theirs = tf_saved(make, tmp_path / "tf", compression="SNAPPY", shard_func=lambda x: x % 4)
  ours = Dataset.load(tmp_path / "jf")
  assert_same_multiset(run(ours), run(theirs))
  assert save_format.progress(tmp_path / "jf").chunks_done == 4  # one per shard
  with pytest.raises(ValueError, match="compression must be None, 'SNAPPY' or 'ZSTD'"):
    make(Dataset).save(tmp_path / "gz", compression="GZIP")
  assert not (tmp_path / "gz").exists()


def test_a_loaded_dataset_is_a_source_a_sampler_shuffles_and_shards(tmp_path):
  Dataset.range(1000).map(lambda x: {"x": x}).save(tmp_path / "s")
  source = jaxfeed.SavedDatasetSource(tmp_path / "s")
  assert len(source) == 1000 and int(source[617]["x"]) == 617
  assert [int(e["x"]) for e in source.get_many([5, 999, 5])] == [5, 999, 5]
  hosts = []
  for index in range(2):
    sampler = jaxfeed.IndexSampler(
      1000,
      shuffle=True,
      seed=3,
      shard_options=jaxfeed.ShardOptions(shard_index=index, shard_count=2),
    )
    hosts.append([int(e["x"]) for e in Dataset.load(tmp_path / "s", sampler=sampler)])
  assert sorted(hosts[0] + hosts[1]) == list(range(1000))
  assert hosts[0] != sorted(hosts[0])


def test_save_replaces_a_saved_dataset_and_refuses_other_folders(tmp_path):
  Dataset.range(5).save(tmp_path / "s")
  Dataset.range(3).save(tmp_path / "s")
  assert [int(x) for x in Dataset.load(tmp_path / "s")] == [0, 1, 2]
  (tmp_path / "other").mkdir()
  (tmp_path / "other" / "notes.txt").write_text("mine")
  with pytest.raises(FileExistsError, match="non-empty folder that holds no saved dataset"):
    Dataset.range(3).save(tmp_path / "other")
  assert (tmp_path / "other" / "notes.txt").read_text() == "mine"


def test_an_interrupted_save_is_refused_until_complete(tmp_path):
  def fails_at_7(x):
    if x == 7:
      raise RuntimeError("element 7")
    return x

  with pytest.raises(RuntimeError, match="element 7"):
    Dataset.range(10).map(fails_at_7).save(tmp_path / "s")
  with pytest.raises(
    jaxfeed.SaveFormatError, match=r"incomplete \(0 of an unknown number of chunks.*wait=True"
  ):
    Dataset.load(tmp_path / "s")
  with pytest.raises(TimeoutError, match="still incomplete after 0.3 s"):
    load_lib.wait_until_complete(tmp_path / "s", 0.3)
  loaded = []
  waiter = threading.Thread(target=lambda: loaded.extend(Dataset.load(tmp_path / "s", wait=True)))
  waiter.start()
  Dataset.range(4).save(tmp_path / "s")
  waiter.join(30)
  assert [int(x) for x in loaded] == [0, 1, 2, 3]


def test_a_damaged_manifest_or_record_is_named(tmp_path):
  Dataset.range(5).save(tmp_path / "s")
  manifest = tmp_path / "s" / save_format.MANIFEST_JSON
  content = json.loads(manifest.read_text())
  content["num_elements"] = 6
  manifest.write_text(json.dumps(content))
  with pytest.raises(jaxfeed.SaveFormatError, match="manifest.json is damaged: its checksum"):
    Dataset.load(tmp_path / "s")
  with pytest.raises(
    jaxfeed.SaveFormatError, match="element 3 of the save at .* is not a saved element"
  ):
    save_format.decode_element(b"JFE1\x02\x00\x00\x00{}", "element 3 of the save at x")


def test_a_committed_chunk_is_never_written_twice(tmp_path):
  folder = tmp_path / "s"
  folder.mkdir()
  first = save_format.write_chunk(folder, 4, [np.int64(1), np.int64(2)], None)
  second = save_format.write_chunk(folder, 4, [np.int64(9)], None)
  assert (first.num_elements, second) == (2, None)
  assert save_format.committed_chunks(folder)[4].num_elements == 2
  assert not list((folder / "tmp").iterdir())


def test_elements_keep_their_leaf_types_through_a_save(tmp_path):
  element = {
    "i": 3,
    "f": 2.5,
    "b": True,
    "bytes": b"\x00x",
    "s": "é",
    "g": np.float32(1.5),
    "a": np.arange(6, dtype=np.uint16).reshape(2, 3).T,
    "e": np.zeros((0, 2)),
    "nested": ([np.int8(-1)], (np.bool_(True),)),
  }
  Dataset.range(1).map(lambda _: element).save(tmp_path / "s")
  (loaded,) = Dataset.load(tmp_path / "s")
  assert repr(loaded) == repr(element)
  with pytest.raises(TypeError, match="object array"):
    Dataset.range(1).map(lambda _: {"o": np.array([None])}).save(tmp_path / "o")


def test_inspect_shows_a_saves_progress(tmp_path):
  Dataset.range(5).save(tmp_path / "s")
  out = subprocess.run(
    [sys.executable, "-m", "jaxfeed.cli", "inspect", str(tmp_path / "s")],
    capture_output=True,
    text=True,
    check=True,
  ).stdout
  shown = json.loads(out)
  assert (shown["complete"], shown["chunks_done"], shown["elements"]) == (True, 1, 5)
  (tmp_path / "s" / save_format.MANIFEST_JSON).unlink()
  shown = json.loads(
    subprocess.run(
      [sys.executable, "-m", "jaxfeed.cli", "inspect", str(tmp_path / "s")],
      capture_output=True,
      text=True,
      check=True,
    ).stdout
  )
  assert (shown["complete"], shown["chunks_done"], shown["elements"]) == (False, 1, 5)


def test_load_checks_a_given_element_spec_and_refuses_reader_func(tmp_path):
  Dataset.range(3).batch(2).save(tmp_path / "s")
  spec = TensorSpec((None,), np.int64)
  assert Dataset.load(tmp_path / "s", element_spec=spec).element_spec == spec
  with pytest.raises(ValueError, match=r"element_spec .*\(2,\).* differs from the saved"):
    Dataset.load(tmp_path / "s", element_spec=TensorSpec((2,), np.int64))
  with pytest.raises(ValueError, match="reader_func has no jaxfeed counterpart"):
    Dataset.load(tmp_path / "s", reader_func=lambda datasets: datasets)
  with pytest.raises(ValueError, match="checkpoint_args"):
    Dataset.range(3).save(tmp_path / "c", checkpoint_args={})


def test_a_chunk_written_after_its_save_completed_leaves_no_scratch(tmp_path):
  Dataset.range(3).save(tmp_path / "s")
  assert save_format.write_chunk(tmp_path / "s", 0, [np.int64(5)], None) is None
  assert sorted(p.name for p in (tmp_path / "s").iterdir()) == [
    "chunks",
    "manifest.json",
    "save.json",
  ]
  assert [int(x) for x in Dataset.load(tmp_path / "s")] == [0, 1, 2]
