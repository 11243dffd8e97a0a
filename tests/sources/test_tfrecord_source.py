"""TFRecordSource: TensorFlow interop, the offset index cache, corrupt files."""

from __future__ import annotations

import concurrent.futures
import os
import pathlib
import pickle
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import numpy as np
import pytest
import tensorflow as tf

from jaxfeed.sources import CorruptRecordError, TFRecordSource, write_tfrecord
from jaxfeed.sources import tfrecord_file
from jaxfeed.sources import tfrecord_source
from jaxfeed.sources.tfrecord_format import masked_crc32c
from source_helpers import make_records


def _frame_offsets(records: list[bytes]) -> list[int]:
  """Byte offset of each record's frame in a file of `records`."""
  return np.concatenate([[0], np.cumsum([16 + len(r) for r in records])]).tolist()[:-1]


def _write(path, records) -> str:
  path = str(path)
  write_tfrecord(path, records)
  return path


# -- format and TensorFlow interop ---------------------------------------------


def test_masked_crc_matches_the_crc32c_check_value():
  crc = 0xE3069283  # CRC-32C of b"123456789", the standard check value
  assert masked_crc32c(b"123456789") == (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF
  assert masked_crc32c(b"") == 0xA282EAD8


def test_written_files_are_byte_identical_to_tensorflows(tmp_path):
  records = make_records(20, seed=9)
  ours = _write(tmp_path / "ours.tfrecord", records)
  theirs = str(tmp_path / "theirs.tfrecord")
  with tf.io.TFRecordWriter(theirs) as writer:
    for record in records:
      writer.write(record)
  assert pathlib.Path(ours).read_bytes() == pathlib.Path(theirs).read_bytes()


@pytest.mark.parametrize("count", [0, 1, 50])
def test_files_written_here_are_read_by_tf_data(tmp_path, count):
  records = make_records(count, seed=count)
  path = _write(tmp_path / "ours.tfrecord", records)
  got = [t.numpy() for t in tf.data.TFRecordDataset(path)]
  assert got == records


@pytest.mark.parametrize("count", [0, 1, 50])
def test_files_written_by_tensorflow_are_read_here(tmp_path, count):
  records = make_records(count, seed=count + 100)
  path = str(tmp_path / "theirs.tfrecord")
  with tf.io.TFRecordWriter(path) as writer:
    for record in records:
      writer.write(record)
  with TFRecordSource(path) as source:
    assert len(source) == count
    assert source.get_many(np.arange(count)[::-1]) == records[::-1]
    assert [source[i] for i in range(count)] == records


def test_many_tensorflow_files_concatenate_like_tf_data(tmp_path):
  paths = []
  for i, n in enumerate([4, 0, 9, 2]):
    path = str(tmp_path / f"shard-{i}.tfrecord")
    with tf.io.TFRecordWriter(path) as writer:
      for record in make_records(n, seed=i):
        writer.write(record)
    paths.append(path)
  expected = [t.numpy() for t in tf.data.TFRecordDataset(paths)]
  with TFRecordSource(paths) as source:
    assert list(source) == expected


def test_writer_accepts_bytes_like_records_and_rejects_others(tmp_path):
  path = str(tmp_path / "x.tfrecord")
  arr = np.arange(6, dtype=np.int16)
  assert write_tfrecord(path, [bytearray(b"ab"), memoryview(b"cd"), arr]) == 3
  with TFRecordSource(path) as source:
    assert list(source) == [b"ab", b"cd", arr.tobytes()]
  with pytest.raises(TypeError, match="record 1 must be bytes-like"):
    write_tfrecord(path, [b"ok", "text"])


# -- index cache -----------------------------------------------------------------


def test_index_is_built_once_cached_beside_the_file_and_reused(tmp_path, scan_counter):
  records = make_records(30)
  path = _write(tmp_path / "a.tfrecord", records)
  with TFRecordSource(path) as first:
    assert first.get_many(range(30)) == records
  index_file = path + ".idx"
  assert os.path.exists(index_file)
  assert scan_counter == [path]
  stamp = os.stat(index_file).st_mtime_ns
  with TFRecordSource(path) as second:
    assert second.get_many(range(30)) == records
  assert scan_counter == [path]  # not scanned again
  assert os.stat(index_file).st_mtime_ns == stamp
  assert not [n for n in os.listdir(tmp_path) if ".tmp-" in n]


def test_index_is_rebuilt_when_the_file_changes(tmp_path, scan_counter):
  path = _write(tmp_path / "a.tfrecord", make_records(10, seed=1))
  TFRecordSource(path).close()
  new_records = make_records(13, seed=2)
  _write(path, new_records)
  with TFRecordSource(path) as source:
    assert len(source) == 13
    assert list(source) == new_records
  assert scan_counter == [path, path]


def test_same_size_rewrite_with_new_mtime_rebuilds_the_index(tmp_path, scan_counter):
  path = _write(tmp_path / "a.tfrecord", [b"aaaa", b"bb"])
  TFRecordSource(path).close()
  _write(path, [b"cc", b"dddd"])  # same file size, other record boundaries
  stat = os.stat(path)
  os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
  with TFRecordSource(path) as source:
    assert list(source) == [b"cc", b"dddd"]
  assert len(scan_counter) == 2


@pytest.mark.parametrize("damage", ["garbage", "empty", "truncated"])
def test_damaged_index_cache_is_ignored_and_rebuilt(tmp_path, scan_counter, damage):
  records = make_records(12)
  path = _write(tmp_path / "a.tfrecord", records)
  TFRecordSource(path).close()
  index_file = path + ".idx"
  content = pathlib.Path(index_file).read_bytes()
  with open(index_file, "wb") as f:
    f.write(
      {"garbage": os.urandom(300), "empty": b"", "truncated": content[: len(content) - 8]}[damage]
    )
  with TFRecordSource(path) as source:
    assert list(source) == records
  assert len(scan_counter) == 2
  with TFRecordSource(path) as source:  # the rebuilt cache is good again
    assert list(source) == records
  assert len(scan_counter) == 2


def test_cache_index_false_writes_no_index_file(tmp_path, scan_counter):
  records = make_records(5)
  path = _write(tmp_path / "a.tfrecord", records)
  for _ in range(2):
    with TFRecordSource(path, cache_index=False) as source:
      assert list(source) == records
  assert os.listdir(tmp_path) == ["a.tfrecord"]
  assert len(scan_counter) == 2


def test_unwritable_index_location_keeps_the_index_in_memory(tmp_path, scan_counter):
  records = make_records(9)
  path = _write(tmp_path / "a.tfrecord", records)
  # A directory where the index file would go: writing it fails like a
  # read-only dataset directory (and this works even for root).
  os.mkdir(path + ".idx")
  with TFRecordSource(path) as source:
    assert list(source) == records
    copy = pickle.loads(pickle.dumps(source))
  with copy:
    assert copy.get_many([8, 0]) == [records[8], records[0]]
  assert sorted(os.listdir(tmp_path)) == ["a.tfrecord", "a.tfrecord.idx"]
  assert os.listdir(path + ".idx") == []
  assert scan_counter == [path]  # the pickled copy kept the in-memory index


def test_pickled_copy_reloads_the_cached_index_instead_of_rescanning(tmp_path, scan_counter):
  records = make_records(15)
  path = _write(tmp_path / "a.tfrecord", records)
  with TFRecordSource(path) as source:
    payload = pickle.dumps(source)
  assert len(payload) < 2000  # offsets are not shipped
  with pickle.loads(payload) as copy:
    assert copy.get_many([14, 2]) == [records[14], records[2]]
  assert scan_counter == [path]


def test_threads_of_a_pickled_copy_load_its_index_once(tmp_path, monkeypatch):
  # A worker process's copy is read by many threads at once; each used to
  # load the index itself (and concurrent np.load header parsing has crashed
  # CPython 3.11). A slow load widens the window in which they would meet.
  records = make_records(15)
  path = _write(tmp_path / "a.tfrecord", records)
  with TFRecordSource(path) as source:
    payload = pickle.dumps(source)
  loads = []
  original = np.load

  def slow_load(*args, **kwargs):
    loads.append(1)
    time.sleep(0.2)
    return original(*args, **kwargs)

  monkeypatch.setattr(tfrecord_source.np, "load", slow_load)
  with pickle.loads(payload) as copy:
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
      got = list(pool.map(copy.__getitem__, range(8)))
  assert got == records[:8]
  assert len(loads) == 1


def test_a_child_forked_while_a_thread_opens_the_file_opens_it_too(tmp_path):
  # The parent's lock around the first open is held at the fork (as by a
  # thread of the parent in the middle of loading the index); the child
  # must not wait for it forever.
  records = make_records(5)
  path = _write(tmp_path / "a.tfrecord", records)
  copy = pickle.loads(pickle.dumps(TFRecordSource(path)))
  held = copy._files[0]._opening_lock()  # pylint: disable=protected-access
  held.acquire()
  try:
    pid = os.fork()
    if pid == 0:
      os._exit(0 if copy[3] == records[3] else 1)
    deadline = time.monotonic() + 30
    while True:
      done, status = os.waitpid(pid, os.WNOHANG)
      if done:
        break
      if time.monotonic() > deadline:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        pytest.fail("the forked child waited for its parent's lock")
      time.sleep(0.02)
    assert os.waitstatus_to_exitcode(status) == 0
  finally:
    held.release()


# -- corrupt files ---------------------------------------------------------------


def _damage(path: str, offset: int) -> None:
  with open(path, "r+b") as f:
    f.seek(offset)
    byte = f.read(1)
    f.seek(offset)
    f.write(bytes([byte[0] ^ 0x5A]))


def _check_error(error: CorruptRecordError, path: str, offset: int) -> None:
  assert error.path == path
  assert error.offset == offset
  assert path in str(error)
  assert f"byte offset {offset}" in str(error)


# Records 0 and 6 are small (read in runs of adjacent records), record 2 is
# large (read on its own), record 4 is in between.
@pytest.mark.parametrize("record", [0, 2, 4, 6])
@pytest.mark.parametrize("where", ["first", "last"])
def test_flipped_data_byte_raises_corrupt_record_error_on_read(tmp_path, record, where):
  records = make_records(7, sizes=(5, 300, 12_292))
  path = _write(tmp_path / "a.tfrecord", records)
  start = _frame_offsets(records)[record]
  data = start + 12 + (0 if where == "first" else len(records[record]) - 1)
  _damage(path, data)
  with TFRecordSource(path) as source:
    with pytest.raises(CorruptRecordError, match="data CRC mismatch") as info:
      source[record]
    _check_error(info.value, path, start)
    assert info.value.record_index == record
    with pytest.raises(CorruptRecordError) as info:
      source.get_many([i for i in range(7) if i != record] + [record])
    _check_error(info.value, path, start)
    others = [i for i in range(7) if i != record]
    assert source.get_many(others) == [records[i] for i in others]
  with TFRecordSource(path, verify_crc=False) as unchecked:
    assert unchecked[record] != records[record]


def test_flipped_data_crc_byte_raises_corrupt_record_error(tmp_path):
  records = make_records(4, sizes=(50,))
  path = _write(tmp_path / "a.tfrecord", records)
  start = _frame_offsets(records)[2]
  _damage(path, start + 12 + 50 + 1)
  with TFRecordSource(path) as source:
    with pytest.raises(CorruptRecordError, match="data CRC mismatch") as info:
      source.get_many([2])
  _check_error(info.value, path, start)


@pytest.mark.parametrize("field_byte", [0, 3, 7, 8, 11])
@pytest.mark.parametrize("record", [0, 4])
def test_flipped_length_or_length_crc_byte_raises_on_reading_that_record(
  tmp_path, field_byte, record
):
  records = make_records(5, sizes=(10, 2000))
  path = _write(tmp_path / "a.tfrecord", records)
  start = _frame_offsets(records)[record]
  _damage(path, start + field_byte)
  with TFRecordSource(path) as source:
    with pytest.raises(CorruptRecordError, match="length CRC mismatch") as info:
      source[record]
    _check_error(info.value, path, start)
    others = [i for i in range(5) if i != record]
    assert source.get_many(others) == [records[i] for i in others]
  assert not os.path.exists(path + ".idx")


@pytest.mark.parametrize("cut", ["in_header", "in_data", "in_data_crc"])
def test_file_truncated_mid_record_raises_on_reading_the_cut_record(tmp_path, cut):
  records = make_records(6, sizes=(100,))
  path = _write(tmp_path / "a.tfrecord", records)
  last = _frame_offsets(records)[-1]
  keep = last + {"in_header": 5, "in_data": 12 + 40, "in_data_crc": 12 + 102}[cut]
  os.truncate(path, keep)
  with TFRecordSource(path) as source:
    assert source.get_many(range(5)) == records[:5]
    with pytest.raises(CorruptRecordError, match="truncated") as info:
      source[5]
  _check_error(info.value, path, last)
  assert info.value.record_index == 5


@pytest.mark.parametrize("size", [1, 11, 12, 500, 100_000])
def test_garbage_file_reads_as_one_damaged_record_at_offset_zero(tmp_path, size):
  path = str(tmp_path / "garbage.tfrecord")
  with open(path, "wb") as f:
    f.write(np.random.default_rng(size).bytes(size))
  with TFRecordSource(path) as source:
    assert len(source) == 1
    with pytest.raises(CorruptRecordError) as info:
      source[0]
  _check_error(info.value, path, 0)


@pytest.mark.parametrize("size", [1000, 50_000])
@pytest.mark.parametrize("read", ["getitem", "get_many"])
def test_file_truncated_after_indexing_raises_on_read(tmp_path, size, read):
  records = make_records(4, sizes=(size,))
  path = _write(tmp_path / "a.tfrecord", records)
  with TFRecordSource(path) as source:
    assert source[0] == records[0]  # the handle is open
    os.truncate(path, _frame_offsets(records)[3] + size // 2)
    with pytest.raises(CorruptRecordError, match="ended inside") as info:
      source[3] if read == "getitem" else source.get_many([2, 3])
  _check_error(info.value, path, _frame_offsets(records)[3])


def test_file_rewritten_with_fewer_records_after_pickling_is_detected(tmp_path):
  path = _write(tmp_path / "a.tfrecord", make_records(8))
  with TFRecordSource(path) as source:
    payload = pickle.dumps(source)
  _write(path, make_records(3))
  copy = pickle.loads(payload)
  with pytest.raises(CorruptRecordError, match="now holds 3 records.*8"):
    copy[0]


def test_corrupt_record_error_pickles_with_its_fields():
  error = CorruptRecordError("/data/x.tfrecord", 1234, "bad", record_index=7)
  copy = pickle.loads(pickle.dumps(error))
  assert (copy.path, copy.offset, copy.record_index, str(copy)) == (
    "/data/x.tfrecord",
    1234,
    7,
    str(error),
  )
  assert isinstance(copy, ValueError)


@pytest.mark.parametrize("bad", [{"verify_crc": 1}, {"cache_index": "no"}])
def test_non_bool_options_are_rejected(tmp_path, bad):
  path = _write(tmp_path / "a.tfrecord", [b"x"])
  with pytest.raises(TypeError, match="must be bools"):
    TFRecordSource(path, **bad)


def test_reads_through_the_stream_path_used_for_remote_files(tmp_path, monkeypatch):
  # Remote paths (gs://...) read through seek/read on an epath stream, not
  # os.pread; force that path on a local file.
  monkeypatch.setattr(tfrecord_file, "is_local", lambda path: False)
  records = make_records(40, sizes=(0, 10, 5000))
  path = _write(tmp_path / "a.tfrecord", records)
  with TFRecordSource(path) as source:
    indices = np.random.default_rng(0).integers(0, 40, 100)
    assert source.get_many(indices) == [records[i] for i in indices]
    assert source[39] == records[39]


def test_get_many_of_adjacent_small_records_beyond_one_read_span(tmp_path):
  # 2.5 MiB of adjacent 1000-byte records: several coalesced reads.
  records = make_records(2600, seed=3, sizes=(1000, 0, 3))
  path = _write(tmp_path / "a.tfrecord", records)
  with TFRecordSource(path) as source:
    assert source.get_many(np.arange(2600)) == records
    picked = np.arange(0, 2600, 2)
    assert source.get_many(picked) == [records[i] for i in picked]
