"""ignore_errors over damaged record files and inputs that cannot go on:
exactly the intact records, counted, never a retry loop."""

from __future__ import annotations

import logging
import time

import pytest

from jaxfeed import Dataset
from jaxfeed.sources import CorruptRecordError, write_tfrecord
from op_testing import check_resume
from tfrecord_damage import (
  NUM_RECORDS,
  Damage,
  make_records,
  over_every_damage,
  write_damaged,
  write_with_bad_data_crc,
)

RECORDS = make_records()


@over_every_damage
def test_from_tfrecord_delivers_the_records_before_the_damage_then_names_it(tmp_path, damage):
  path = write_damaged(tmp_path, damage, RECORDS)
  out = []
  with Dataset.from_tfrecord(path).make_iterator() as iterator:
    with pytest.raises(CorruptRecordError) as info:
      for record in iterator:
        out.append(record)
  assert out == RECORDS[: damage.record]
  assert info.value.path == path
  assert info.value.offset == damage.damaged_offset(RECORDS)


@over_every_damage
def test_from_tfrecord_ignore_errors_delivers_exactly_the_intact_records(tmp_path, damage):
  path = write_damaged(tmp_path, damage, RECORDS)
  dataset = Dataset.from_tfrecord(path).ignore_errors()
  with dataset.make_iterator() as iterator:
    assert list(iterator) == damage.intact(RECORDS)
    stats = iterator.stats()["ops"][-1]
  assert (stats["errors_ignored"], stats["dead_ends"]) == (1, 0)
  assert stats["damaged_bytes_skipped"] > 0


@pytest.mark.parametrize(
  "damage",
  [
    Damage("length", 100, "length", 9),
    Damage("data", 100, "data", 3),
    Damage("cut", 100, "cut", 5),
  ],
  ids=lambda d: d.name,
)
def test_from_tfrecord_resumes_exactly_around_the_damage(tmp_path, damage):
  path = write_damaged(tmp_path, damage, RECORDS)
  clean = str(tmp_path / "clean.tfrecord")
  write_tfrecord(clean, RECORDS[:10])
  dataset = Dataset.from_tfrecord([path, clean]).ignore_errors()
  assert list(dataset) == damage.intact(RECORDS) + RECORDS[:10]
  cuts = [0, 99, 100, 101, len(damage.intact(RECORDS)) + 5]
  check_resume(lambda: dataset, cuts=cuts)


@pytest.mark.parametrize("compression", ["GZIP", "ZLIB"])
def test_damage_in_a_compressed_file_ends_it_and_the_next_file_is_read(tmp_path, compression):
  paths = [str(tmp_path / f"{name}.tfrecord") for name in ("cut", "clean")]
  for path in paths:
    write_tfrecord(path, RECORDS, compression_type=compression)
  with open(paths[0], "r+b") as f:
    f.truncate(f.seek(0, 2) // 2)
  dataset = Dataset.from_tfrecord(paths, compression).ignore_errors()
  with dataset.make_iterator() as iterator:
    out = list(iterator)
    assert iterator.stats()["ops"][-1]["errors_ignored"] == 1
  assert 20 < len(out) - NUM_RECORDS < NUM_RECORDS
  assert out == RECORDS[: len(out) - NUM_RECORDS] + RECORDS


@pytest.mark.parametrize("compression", [None, "GZIP", "ZLIB"])
def test_a_bad_data_crc_in_a_compressed_file_skips_that_record_only(tmp_path, compression):
  path = str(tmp_path / "a.tfrecord")
  write_with_bad_data_crc(path, RECORDS, 77, compression)
  dataset = Dataset.from_tfrecord(path, compression).ignore_errors()
  assert list(dataset) == RECORDS[:77] + RECORDS[78:]


def test_a_gzip_file_read_as_plain_gives_no_records_found_inside_it(tmp_path):
  # Its incompressible records sit verbatim in stored deflate blocks; a
  # resync would find them there. The file is refused as a whole instead.
  path = str(tmp_path / "a.tfrecord")
  write_tfrecord(path, RECORDS, compression_type="GZIP")
  with pytest.raises(CorruptRecordError, match='compression_type="GZIP"'):
    next(iter(Dataset.from_tfrecord(path)))
  assert list(Dataset.from_tfrecord(path).ignore_errors()) == []


# -- inputs that cannot go on -------------------------------------------------


def test_the_same_message_from_elements_that_move_on_is_not_a_dead_end():
  def fails_in_the_middle(x):
    if 5 <= int(x) < 15:
      raise ValueError("bad element")  # the same message every time
    return x

  for calls in (None, 4):
    dataset = Dataset.range(20).map(fails_in_the_middle, num_parallel_calls=calls).ignore_errors()
    with dataset.make_iterator() as iterator:
      assert [int(x) for x in iterator] == [*range(5), *range(15, 20)]
      stats = iterator.stats()["ops"][-1]
    assert (stats["errors_ignored"], stats["dead_ends"]) == (10, 0)


def test_a_dead_end_is_logged_and_stays_ended_across_a_restore(caplog):
  class Stuck:
    def __init__(self):
      self.count = 0

    def __iter__(self):
      return self

    def __next__(self):
      self.count += 1
      if self.count <= 3:
        return self.count
      raise OSError("disk gone")

  dataset = Dataset.from_generator(Stuck).ignore_errors()
  started = time.monotonic()
  with caplog.at_level(logging.WARNING):
    with dataset.make_iterator() as iterator:
      assert list(iterator) == [1, 2, 3]
      state = iterator.get_state()
  assert time.monotonic() - started < 1
  assert "raised the same error again without moving on" in caplog.text
  assert "OSError: disk gone" in caplog.text
  with dataset.make_iterator() as restored:
    restored.set_state(state)
    assert list(restored) == []
    assert restored.stats()["ops"][-1]["dead_ends"] == 1


def test_a_state_saved_before_the_new_counters_restores():
  dataset = Dataset.range(6).map(lambda x: 1 // int(x % 3)).ignore_errors()
  with dataset.make_iterator() as iterator:
    state = iterator.get_state()
    state["own"] = {"errors_ignored": 4}
    iterator.set_state(state)
    assert len(list(iterator)) == 4
    stats = iterator.stats()["ops"][-1]
  assert (stats["errors_ignored"], stats["damaged_bytes_skipped"]) == (6, 0)
