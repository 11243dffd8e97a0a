"""GZIP / ZLIB TFRecord files: TensorFlow interop both ways, in-order reads."""

from __future__ import annotations

import gzip
import os
import pickle

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

from etils import epath
import numpy as np
import pytest
import tensorflow as tf

from jaxfeed.sources import CorruptRecordError, TFRecordSource, write_tfrecord
from jaxfeed.sources.tfrecord_source import SequentialReadError
from source_helpers import make_records

import jaxfeed

COMPRESSIONS = ["GZIP", "ZLIB"]


def _tf_write(path, records, compression_type):
  options = tf.io.TFRecordOptions(compression_type=compression_type)
  with tf.io.TFRecordWriter(str(path), options) as writer:
    for record in records:
      writer.write(record)


@pytest.mark.parametrize("compression", COMPRESSIONS)
@pytest.mark.parametrize("count", [0, 1, 60])
def test_files_written_here_are_read_by_tf_data(tmp_path, compression, count):
  records = make_records(count, seed=count)
  path = str(tmp_path / "ours.tfrecord")
  assert write_tfrecord(path, records, compression_type=compression) == count
  got = [t.numpy() for t in tf.data.TFRecordDataset(path, compression)]
  assert got == records


@pytest.mark.parametrize("compression", COMPRESSIONS)
def test_written_files_are_byte_identical_to_tensorflows(tmp_path, compression):
  records = make_records(80, seed=8, sizes=(0, 30, 5000, 70_000))
  records += [bytes(3000)] * 5  # compressible runs
  write_tfrecord(tmp_path / "ours", records, compression_type=compression)
  _tf_write(tmp_path / "theirs", records, compression)
  assert (tmp_path / "ours").read_bytes() == (tmp_path / "theirs").read_bytes()


@pytest.mark.parametrize("compression", COMPRESSIONS)
def test_files_written_by_tensorflow_are_read_here(tmp_path, compression):
  records = make_records(60, seed=4)
  path = tmp_path / "theirs.tfrecord"
  _tf_write(path, records, compression)
  with TFRecordSource(str(path), compression_type=compression) as source:
    assert len(source) == 60
    assert list(source) == records
    assert source.get_many([0, 5, 5, 59]) == [records[i] for i in (0, 5, 5, 59)]


def test_gzip_files_are_plain_gzip_streams(tmp_path):
  records = make_records(10, seed=1)
  write_tfrecord(tmp_path / "a.gz", records, compression_type="GZIP")
  write_tfrecord(tmp_path / "a.plain", records)
  assert gzip.decompress((tmp_path / "a.gz").read_bytes()) == (tmp_path / "a.plain").read_bytes()


def test_reads_through_an_epath_path_and_many_files(tmp_path):
  paths, expected = [], []
  for i, n in enumerate([3, 0, 7]):
    records = make_records(n, seed=i)
    path = epath.Path(tmp_path) / f"shard-{i}.tfrecord.gz"
    write_tfrecord(path, records, compression_type="GZIP")
    paths.append(path)
    expected += records
  with TFRecordSource(paths, compression_type="GZIP") as source:
    assert len(source) == 10
    assert source.get_many(np.arange(10)) == expected
    # A second pass over the files starts each one again.
    assert source.get_many(np.arange(10)) == expected


def test_in_order_dataset_over_a_compressed_file_matches_tf_data(tmp_path):
  records = make_records(300, seed=2, sizes=(5, 900))
  path = str(tmp_path / "a.tfrecord.zz")
  _tf_write(path, records, "ZLIB")
  source = TFRecordSource(path, compression_type="ZLIB")
  sampler = jaxfeed.IndexSampler(len(source), num_epochs=2)
  got = list(jaxfeed.Dataset.from_source(source, sampler))
  assert got == records + records
  source.close()


def test_backward_read_is_refused_naming_the_file(tmp_path):
  records = make_records(20, seed=3)
  path = str(tmp_path / "a.tfrecord.gz")
  write_tfrecord(path, records, compression_type="GZIP")
  with TFRecordSource(path, compression_type="GZIP") as source:
    assert source[10] == records[10]
    with pytest.raises(
      SequentialReadError,
      match=r"a\.tfrecord\.gz is GZIP-compressed.*record 3 .*"
      r"after record 10.*shuffle=False",
    ):
      source[3]
    assert source[11] == records[11]
    sampler = jaxfeed.IndexSampler(20, shuffle=True, seed=1)
    with pytest.raises(SequentialReadError):
      list(jaxfeed.Dataset.from_source(source, sampler))


def test_index_is_cached_and_pickled_copies_read(tmp_path):
  records = make_records(30, seed=5)
  path = str(tmp_path / "a.tfrecord.gz")
  write_tfrecord(path, records, compression_type="GZIP")
  source = TFRecordSource(path, compression_type="GZIP")
  assert os.path.exists(path + ".idx")
  assert len(TFRecordSource(path, compression_type="GZIP")) == 30
  copy = pickle.loads(pickle.dumps(source))
  assert copy[29] == records[29] and source[0] == records[0]
  assert copy.spec_params()["compression_type"] == "GZIP"
  # The plain reader does not take the compressed file's index for its own.
  with pytest.raises(CorruptRecordError):
    TFRecordSource(path)
  source.close()
  copy.close()


@pytest.mark.parametrize("compression", COMPRESSIONS)
def test_truncated_compressed_file_raises_where_the_cut_is(tmp_path, compression):
  path = tmp_path / "a.tfrecord"
  records = make_records(40, seed=6)
  write_tfrecord(path, records, compression_type=compression)
  data = path.read_bytes()
  path.write_bytes(data[: len(data) // 2])
  with TFRecordSource(str(path), compression_type=compression) as source:
    (damage,) = source.damage
    assert damage.record_index == len(source) - 1 > 5
    intact = source.get_many(range(len(source) - 1))
    assert intact == records[: len(intact)]
    with pytest.raises(CorruptRecordError, match="a.tfrecord"):
      source[len(source) - 1]


def test_wrong_compression_type_raises_corrupt_record_error(tmp_path):
  path = tmp_path / "a.tfrecord"
  write_tfrecord(path, make_records(5), compression_type="GZIP")
  with pytest.raises(CorruptRecordError, match="compression_type"):
    TFRecordSource(str(path), compression_type="ZLIB")


def test_unknown_compression_type_is_refused(tmp_path):
  path = str(tmp_path / "a.tfrecord")
  with pytest.raises(ValueError, match="GZIP.*'BZIP2'"):
    write_tfrecord(path, [b"x"], compression_type="BZIP2")
  write_tfrecord(path, [b"x"])
  with pytest.raises(ValueError, match="compression_type must be"):
    TFRecordSource(path, compression_type="gz")
