"""TFRecordSource over damaged files: a strict read names the file and the
offset, a read that skips damage gets exactly the intact records, and the
index cache never holds a damaged index."""

from __future__ import annotations

import logging
import os
import pickle

import pytest

from jaxfeed import Dataset, IndexSampler
from jaxfeed.sources import CorruptRecordError, TFRecordSource, write_tfrecord
from tfrecord_damage import (
  NUM_RECORDS,
  Damage,
  frame_offsets,
  make_records,
  over_every_damage,
  write_damaged,
)

RECORDS = make_records()


def _read_until_error(dataset) -> tuple[list, Exception | None]:
  out = []
  with dataset.make_iterator() as iterator:
    try:
      for record in iterator:
        out.append(record)
    except CorruptRecordError as e:
      return out, e
  return out, None


@over_every_damage
def test_strict_read_delivers_the_records_before_the_damage_then_names_it(tmp_path, damage):
  path = write_damaged(tmp_path, damage, RECORDS)
  with TFRecordSource(path) as source:
    before, error = _read_until_error(Dataset.from_source(source))
  assert before == RECORDS[: damage.record]
  assert error is not None and error.path == path
  assert error.offset == damage.damaged_offset(RECORDS)
  assert f"{path} at byte offset {error.offset}" in str(error)
  assert not os.path.exists(path + ".idx") or damage.where in (
    "data",
    "data_crc",
  )  # found on read: the headers indexed are sound


@over_every_damage
def test_ignore_errors_delivers_exactly_the_intact_records_and_counts(tmp_path, damage):
  path = write_damaged(tmp_path, damage, RECORDS)
  with TFRecordSource(path) as source:
    dataset = Dataset.from_source(source).ignore_errors()
    with dataset.make_iterator() as iterator:
      assert list(iterator) == damage.intact(RECORDS)
      stats = iterator.stats()["ops"][-1]
  assert stats["errors_ignored"] == 1
  assert stats["damaged_bytes_skipped"] > 0
  assert stats["dead_ends"] == 0


@over_every_damage
def test_skip_mode_holds_exactly_the_intact_records_and_reports_the_range(tmp_path, damage):
  path = write_damaged(tmp_path, damage, RECORDS)
  with TFRecordSource(path, on_damage="skip") as source:
    assert len(source) == len(damage.intact(RECORDS))
    assert list(source) == damage.intact(RECORDS)
    (found,) = source.damage
  offsets = frame_offsets(RECORDS)
  assert (found.path, found.start) == (path, damage.damaged_offset(RECORDS))
  if damage.where in ("cut", "garbage"):
    assert found.end == os.path.getsize(path)
  else:  # resynchronized at the next frame
    assert found.end == offsets[damage.record + 1]
  assert found.kind in ("length_crc", "data_crc", "truncated", "beyond_end")
  assert found.record_index == damage.record
  assert found.error().offset == found.start


def test_shuffled_reads_of_several_files_skip_only_the_damage(tmp_path):
  damage = Damage("length-r105", 105, "length", 3)
  path = write_damaged(tmp_path, damage, RECORDS)
  clean = str(tmp_path / "clean.tfrecord")
  write_tfrecord(clean, RECORDS[:50])
  source = TFRecordSource([clean, path, clean])
  sampler = IndexSampler(len(source), shuffle=True, seed=3)
  out = list(Dataset.from_source(source, sampler).ignore_errors())
  expected = RECORDS[:50] + damage.intact(RECORDS) + RECORDS[:50]
  assert sorted(out) == sorted(expected)
  copy = pickle.loads(pickle.dumps(source))
  assert len(copy) == len(source) == 50 + NUM_RECORDS + 50
  with pytest.raises(CorruptRecordError, match="length CRC"):
    copy[50 + 105]
  assert copy.damage == source.damage
  source.close()
  copy.close()


def test_damage_is_logged_once_per_source_with_its_size(tmp_path, caplog):
  damage = Damage("cut", 120, "cut", 20)
  path = write_damaged(tmp_path, damage, RECORDS)
  with caplog.at_level(logging.WARNING):
    TFRecordSource(path).close()
  text = caplog.text
  assert f"{path} is damaged: 1 damaged range(s)" in text
  assert f"byte offset {damage.damaged_offset(RECORDS)}" in text
  assert "ignore_errors()" in text


def test_on_damage_is_checked_and_kept_in_the_spec(tmp_path):
  path = str(tmp_path / "a.tfrecord")
  write_tfrecord(path, RECORDS[:3])
  with pytest.raises(ValueError, match='"raise" or "skip".*\'ignore\''):
    TFRecordSource(path, on_damage="ignore")
  assert "on_damage" not in TFRecordSource(path).spec_params()
  source = TFRecordSource(path, on_damage="skip")
  assert type(source)(**source.spec_params()).spec_params()["on_damage"] == "skip"


# -- the index cache ---------------------------------------------------------


def test_a_damaged_index_is_not_cached_and_a_repaired_file_is(tmp_path, scan_counter):
  path = write_damaged(tmp_path, Damage("cut", 150, "cut", 7), RECORDS)
  assert len(TFRecordSource(path)) == 151
  assert len(TFRecordSource(path)) == 151
  assert len(scan_counter) == 2 and not os.path.exists(path + ".idx")
  write_tfrecord(path, RECORDS)  # repaired: a new size and mtime
  assert len(TFRecordSource(path)) == NUM_RECORDS
  assert os.path.exists(path + ".idx")
  assert len(TFRecordSource(path)) == NUM_RECORDS and len(scan_counter) == 3


def _rot_in_place(path: str, offset: int) -> None:
  """Flips a bit without changing the file's size or mtime (bit rot)."""
  stat = os.stat(path)
  with open(path, "r+b") as f:
    f.seek(offset)
    byte = f.read(1)[0]
    f.seek(offset)
    f.write(bytes([byte ^ 4]))
  os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))


def test_skip_mode_does_not_trust_an_index_of_checked_headers_only(tmp_path, scan_counter):
  path = str(tmp_path / "a.tfrecord")
  write_tfrecord(path, RECORDS)
  TFRecordSource(path).close()  # caches an index of the headers
  data_of_7 = frame_offsets(RECORDS)[7] + 14
  _rot_in_place(path, data_of_7)
  with TFRecordSource(path) as source:  # the cached index: found on read
    with pytest.raises(CorruptRecordError, match="data CRC"):
      source[7]
  with TFRecordSource(path, on_damage="skip") as skipping:
    assert list(skipping) == RECORDS[:7] + RECORDS[8:]
  assert scan_counter.verified == [False, True]


def test_a_verified_index_is_cached_and_serves_both_modes(tmp_path, scan_counter):
  path = str(tmp_path / "a.tfrecord")
  write_tfrecord(path, RECORDS)
  assert len(TFRecordSource(path, on_damage="skip")) == NUM_RECORDS
  assert len(TFRecordSource(path, on_damage="skip")) == NUM_RECORDS
  assert len(TFRecordSource(path)) == NUM_RECORDS
  assert scan_counter.verified == [True]


def test_a_gzip_file_read_as_plain_is_refused_not_resynced(tmp_path):
  # Its incompressible records sit verbatim in stored deflate blocks, where
  # a resync would find them: the source refuses the file instead.
  path = str(tmp_path / "a.tfrecord")
  write_tfrecord(path, RECORDS[:40], compression_type="GZIP")
  with pytest.raises(CorruptRecordError, match='GZIP-compressed.*compression_type="GZIP"'):
    TFRecordSource(path)
  plain = str(tmp_path / "b.tfrecord")
  write_tfrecord(plain, RECORDS[:40])
  with pytest.raises(CorruptRecordError, match="not compressed"):
    TFRecordSource(plain, compression_type="ZLIB")
