"""Dataset.from_tfrecord: tf.data.TFRecordDataset's records, in order, with
exact resume, over plain, GZIP and ZLIB files, local and gs://."""

from __future__ import annotations

import os

import pytest
import tensorflow as tf

import jaxfeed
from jaxfeed import Dataset
from jaxfeed.ops.base import PipelineStateError
from jaxfeed.sources import CorruptRecordError
from epath_testing import bucket_in

COMPRESSIONS = [None, "GZIP", "ZLIB"]


def _write_files(folder, compression, sizes=(5, 0, 7)) -> list[str]:
  """Files of records of varied lengths (an empty file in the middle)."""
  paths = []
  for f, count in enumerate(sizes):
    path = os.path.join(folder, f"part-{f}.tfrecord")
    jaxfeed.write_tfrecord(
      path, [f"file{f}-record{i}-".encode() * (i * 37 + 1) for i in range(count)], compression
    )
    paths.append(path)
  return paths


@pytest.mark.parametrize("compression", COMPRESSIONS)
def test_records_equal_tf_data_tfrecorddataset(tmp_path, compression):
  paths = _write_files(tmp_path, compression)
  expected = [r.numpy() for r in tf.data.TFRecordDataset(paths, compression_type=compression or "")]
  assert list(Dataset.from_tfrecord(paths, compression)) == expected
  assert len(expected) == 12


@pytest.mark.parametrize("compression", COMPRESSIONS)
def test_resumes_exactly_from_every_position(tmp_path, compression):
  paths = _write_files(tmp_path, compression)
  dataset = Dataset.from_tfrecord(paths, compression)
  everything = list(dataset)
  for stop in range(len(everything) + 1):
    with iter(dataset) as it:
      head = [next(it) for _ in range(stop)]
      state = it.get_state()
    with iter(dataset) as it:
      it.set_state(state)
      assert head + list(it) == everything, stop
  # The state names a file and a byte offset, not a record count alone.
  assert set(state["own"]) == {"file", "offset", "record"}


@pytest.mark.parametrize("compression", COMPRESSIONS)
def test_reads_a_gs_path_through_epath(tmp_path, compression):
  paths = _write_files(tmp_path, compression, sizes=(3, 4))
  expected = list(Dataset.from_tfrecord(paths, compression))
  with bucket_in(tmp_path) as bucket:
    remote = [f"{bucket}/{os.path.basename(p)}" for p in paths]
    dataset = Dataset.from_tfrecord(remote, compression)
    with iter(dataset) as it:
      head = [next(it) for _ in range(5)]
      state = it.get_state()
    with iter(dataset) as it:
      it.set_state(state)
      assert head + list(it) == expected


def test_unknown_compression_type_is_refused_naming_it(tmp_path):
  with pytest.raises(ValueError, match='GZIP.*BZIP2'):
    Dataset.from_tfrecord(str(tmp_path / "x"), "BZIP2")


@pytest.mark.parametrize("paths", [[], 3])
def test_bad_paths_are_refused(paths):
  with pytest.raises((ValueError, TypeError), match="from_tfrecord: paths"):
    Dataset.from_tfrecord(paths)


def test_missing_file_is_named(tmp_path):
  paths = _write_files(tmp_path, None, sizes=(2,)) + [str(tmp_path / "no")]
  it = iter(Dataset.from_tfrecord(paths))
  assert len([next(it), next(it)]) == 2
  with pytest.raises(FileNotFoundError, match="file 1 of 2.*'.*no'"):
    next(it)


@pytest.mark.parametrize("compression", COMPRESSIONS)
def test_truncated_file_raises_corrupt_record_error_naming_it(tmp_path, compression):
  (path,) = _write_files(tmp_path, compression, sizes=(6,))
  with open(path, "rb+") as f:
    f.truncate(os.path.getsize(path) - 9)
  with pytest.raises(CorruptRecordError, match="part-0.tfrecord"):
    list(Dataset.from_tfrecord(path, compression))


def test_damaged_record_data_raises_corrupt_record_error(tmp_path):
  (path,) = _write_files(tmp_path, None, sizes=(3,))
  data = bytearray(open(path, "rb").read())
  data[20] ^= 0xFF  # inside the first record's data
  open(path, "wb").write(bytes(data))
  with pytest.raises(CorruptRecordError, match="part-0.tfrecord.*CRC"):
    list(Dataset.from_tfrecord(path))


def test_wrong_compression_type_raises_naming_the_file(tmp_path):
  (path,) = _write_files(tmp_path, None, sizes=(3,))
  with pytest.raises(CorruptRecordError, match="part-0.tfrecord"):
    list(Dataset.from_tfrecord(path, "GZIP"))


@pytest.mark.parametrize("compression", COMPRESSIONS)
def test_state_past_the_files_or_off_a_record_is_refused(tmp_path, compression):
  paths = _write_files(tmp_path, compression, sizes=(4,))
  dataset = Dataset.from_tfrecord(paths, compression)
  with iter(dataset) as it:
    with pytest.raises(PipelineStateError, match="file"):
      it.set_state(
        {"op": "from_tfrecord", "parents": [], "own": {"file": 5, "offset": 0, "record": 0}}
      )
    it.set_state(
      {"op": "from_tfrecord", "parents": [], "own": {"file": 0, "offset": 3, "record": 1}}
    )
    with pytest.raises(CorruptRecordError, match="part-0.tfrecord.*offset 3"):
      next(it)
