"""ArrayRecordSource: writer options and damaged files."""

from __future__ import annotations

import os
import pathlib

from array_record.python import array_record_module
import numpy as np
import pytest

from jaxfeed import Dataset
from jaxfeed.sources import ArrayRecordSource, CorruptRecordError, write_array_record
from source_helpers import make_records


def _write(path, records, **kwargs) -> str:
  path = str(path)
  assert write_array_record(path, records, **kwargs) == len(records)
  return path


def _chunk_offset_of(path: str, record: bytes) -> int:
  """Offset of a record's bytes in an uncompressed file."""
  data = pathlib.Path(path).read_bytes()
  assert data.count(record) == 1
  return data.index(record)


def test_default_writer_options_give_one_record_per_group(tmp_path):
  path = _write(tmp_path / "a.ar", make_records(5))
  reader = array_record_module.ArrayRecordReader(path)
  try:
    assert "group_size:1," in reader.writer_options_string()
  finally:
    reader.close()


@pytest.mark.parametrize(
  "options", ["group_size:1", "group_size:16", "group_size:4,uncompressed", "group_size:1,snappy"]
)
def test_writer_options_round_trip(tmp_path, options):
  records = make_records(50, seed=3)
  path = _write(tmp_path / "a.ar", records, options=options)
  with ArrayRecordSource(path) as source:
    indices = np.random.default_rng(0).permutation(50)
    assert source.get_many(indices) == [records[i] for i in indices]


def test_writer_rejects_unknown_options_naming_them(tmp_path):
  with pytest.raises(ValueError, match="bogus"):
    write_array_record(str(tmp_path / "a.ar"), [b"x"], options="bogus:1")


def test_writer_into_missing_directory_raises_file_not_found(tmp_path):
  with pytest.raises(FileNotFoundError, match="does not exist"):
    write_array_record(str(tmp_path / "no" / "a.ar"), [b"x"])


def test_writer_accepts_bytes_like_records_and_rejects_others(tmp_path):
  path = str(tmp_path / "a.ar")
  arr = np.arange(3, dtype=np.float32)
  assert write_array_record(path, [bytearray(b"ab"), arr]) == 2
  with ArrayRecordSource(path) as source:
    assert list(source) == [b"ab", arr.tobytes()]
  with pytest.raises(TypeError, match="record 0 must be bytes-like"):
    write_array_record(path, [12])


def test_reader_options_are_part_of_spec_params(tmp_path):
  path = _write(tmp_path / "a.ar", [b"a", b"b"])
  options = "readahead_buffer_size:0,max_parallelism:1"
  with ArrayRecordSource(path, reader_options=options) as source:
    assert source.spec_params() == {"paths": [path], "reader_options": options}
    assert list(source) == [b"a", b"b"]


# -- damaged files ---------------------------------------------------------------


@pytest.mark.parametrize("record", [0, 7, 19])
def test_damaged_record_chunk_raises_naming_file_offset_and_record(tmp_path, record):
  records = make_records(20, seed=1, sizes=(64, 700))
  path = _write(tmp_path / "a.ar", records, options="group_size:1,uncompressed")
  where = _chunk_offset_of(path, records[record])
  with open(path, "r+b") as f:
    f.seek(where + 3)
    f.write(b"\xff\x00")
  with ArrayRecordSource(path) as source:
    with pytest.raises(CorruptRecordError, match="hash mismatch") as info:
      source[record]
    error = info.value
    assert error.path == path and path in str(error)
    assert error.record_index == record
    assert error.offset is not None and 0 < error.offset <= where
    assert f"byte offset {error.offset}" in str(error)
    with pytest.raises(CorruptRecordError) as info:
      source.get_many([0, 1, 2, record, 19])
    assert (info.value.path, info.value.record_index) == (path, record)
    others = [i for i in range(20) if i != record]
    assert source.get_many(others) == [records[i] for i in others]


@pytest.mark.parametrize("keep", [0, 10, 65_535, 65_536, 65_600, -8, -200])
def test_truncated_file_raises_corrupt_record_error_when_opened(tmp_path, keep):
  records = make_records(300, seed=2, sizes=(100, 1000))
  path = _write(tmp_path / "a.ar", records)
  size = os.path.getsize(path)
  os.truncate(path, keep if keep >= 0 else size + keep)
  with pytest.raises(CorruptRecordError, match="not a readable array_record") as info:
    ArrayRecordSource(path)
  assert info.value.path == path and path in str(info.value)
  if info.value.offset is None:  # then the message gives the file's size
    assert f"(the file has {os.path.getsize(path)} bytes)" in str(info.value)


def test_ignore_errors_skips_exactly_the_damaged_records(tmp_path):
  records = make_records(20, seed=1, sizes=(64, 700))
  path = _write(tmp_path / "a.ar", records, options="group_size:1,uncompressed")
  for record in (3, 11):
    where = _chunk_offset_of(path, records[record])
    with open(path, "r+b") as f:
      f.seek(where + 5)
      byte = f.read(1)[0]
      f.seek(where + 5)
      f.write(bytes([byte ^ 0x5A]))
  with ArrayRecordSource(path) as source:
    dataset = Dataset.from_source(source).ignore_errors()
    with dataset.make_iterator() as iterator:
      assert list(iterator) == [r for i, r in enumerate(records) if i not in (3, 11)]
      assert iterator.stats()["ops"][-1]["errors_ignored"] == 2


@pytest.mark.parametrize("size", [0, 100, 70_000, 300_000])
def test_garbage_file_raises_corrupt_record_error_when_opened(tmp_path, size):
  path = str(tmp_path / "garbage.ar")
  with open(path, "wb") as f:
    f.write(np.random.default_rng(size).bytes(size))
  with pytest.raises(CorruptRecordError, match=f"{path}.*not a readable"):
    ArrayRecordSource(path)


def test_damaged_footer_raises_corrupt_record_error_with_offset(tmp_path):
  records = make_records(40, seed=4)
  path = _write(tmp_path / "a.ar", records)
  size = os.path.getsize(path)
  last_block = (size - 1) // 65536 * 65536  # footer chunks live here
  with open(path, "r+b") as f:
    f.seek(last_block + 70)
    f.write(b"\x00\xff\x00\xff")
  with pytest.raises(CorruptRecordError, match="hash mismatch") as info:
    ArrayRecordSource(path)
  assert info.value.offset is not None
  assert f"byte offset {info.value.offset}" in str(info.value)


def test_random_damage_never_crashes_and_reads_fail_cleanly(tmp_path):
  # Every damaged copy either opens and reads back (damage in bytes no read
  # touches) or raises CorruptRecordError; it never returns wrong records.
  records = make_records(200, seed=5, sizes=(10, 300, 3000))
  path = _write(tmp_path / "a.ar", records)
  content = pathlib.Path(path).read_bytes()
  rng = np.random.default_rng(6)
  outcomes = set()
  for trial in range(30):
    damaged = bytearray(content)
    for offset in rng.integers(0, len(content), 1 + trial % 3):
      damaged[offset] ^= 1 << int(rng.integers(8))
    target = str(tmp_path / f"damaged-{trial}.ar")
    with open(target, "wb") as f:
      f.write(bytes(damaged))
    try:
      with ArrayRecordSource(target) as source:
        got = source.get_many(range(len(source)))
      assert got == records
      outcomes.add("intact")
    except CorruptRecordError as e:
      assert e.path == target
      outcomes.add("error")
  assert "error" in outcomes
