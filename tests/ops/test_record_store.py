"""The record store unpickles only block files this user (or root) wrote, in
a folder only its owner may write, and computes a damaged block again. A
store larger than a reader's memory is read a record at a time."""

import logging
import os
import pickle
import random
import re
import struct
import time
import zlib

import numpy as np
import pytest

from jaxfeed.ops import autocache_policy, record_store

N = 200


def compute(start, stop):
  return [np.full(8, i, np.int64) for i in range(start, stop)]


@pytest.fixture(params=["fits in memory", "larger than memory"])
def memory(request, monkeypatch):
  """Whether the N records' blocks fit in a store object's memory (it then
  loads whole blocks) or not (it reads single records)."""
  if request.param == "larger than memory":
    monkeypatch.setattr(record_store, "_CACHED_BLOCKS", 2)
  return request.param


def filled_store(tmp_path):
  """A store of N records whose first block is on disk; its folder."""
  folder = tmp_path / "records-key"
  assert int(record_store.RecordStore(str(folder), N, compute).get(3)[0]) == 3
  return folder


def block_file(folder):
  [path] = [p for p in folder.iterdir() if p.name.startswith("block-")]
  return path


def reopened(folder):
  """A new store object on `folder` (nothing of the last one in memory)."""
  return record_store.RecordStore(str(folder), N, compute)


def test_the_store_makes_its_folder_and_blocks_for_its_owner_only(tmp_path):
  folder = filled_store(tmp_path)
  assert folder.stat().st_mode & 0o777 == 0o700
  assert block_file(folder).stat().st_mode & 0o777 == 0o600


def test_a_block_group_may_write_is_refused_naming_file_and_mode(tmp_path):
  folder = filled_store(tmp_path)
  block = block_file(folder)
  block.chmod(0o620)
  store = reopened(folder)
  with pytest.raises(
    PermissionError, match=f"{re.escape(str(block))}.*has mode 0o620.*writable by their owner only"
  ):
    store.get(3)


def test_a_folder_others_may_write_is_refused(tmp_path):
  folder = filled_store(tmp_path)
  folder.chmod(0o777)
  with pytest.raises(PermissionError, match=f"{re.escape(str(folder))}: the folder has mode 0o777"):
    reopened(folder).get(3)


def test_a_folder_made_writable_after_the_store_opened_is_refused_at_the_next_block(tmp_path):
  folder = filled_store(tmp_path)
  store = reopened(folder)
  folder.chmod(0o770)
  with pytest.raises(PermissionError, match="mode 0o770"):
    store.get(3)


def test_a_block_that_is_a_link_is_refused(tmp_path):
  folder = filled_store(tmp_path)
  block = block_file(folder)
  elsewhere = tmp_path / "elsewhere.pkl"
  block.rename(elsewhere)
  block.symlink_to(elsewhere)
  with pytest.raises(PermissionError, match=f"{re.escape(str(block))}: it is a symbolic link"):
    reopened(folder).get(3)


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
def test_a_block_another_user_owns_is_refused(tmp_path):
  folder = filled_store(tmp_path)
  block = block_file(folder)
  os.chown(block, 65534, -1)
  with pytest.raises(
    PermissionError, match=f"{re.escape(str(block))}: the block file is owned by uid 65534"
  ):
    reopened(folder).get(3)


def _garbage(data):
  return os.urandom(len(data))


def _flipped_bit(data):
  middle = len(data) // 2
  return data[:middle] + bytes([data[middle] ^ 0x10]) + data[middle + 1 :]


def _truncated(data):
  return data[: len(data) - 100]


def _older_format(data):
  """The block as version 1 wrote it: one pickle of all its records."""
  del data
  payload = pickle.dumps(compute(0, record_store.BLOCK))
  return b"JFRECv1\n" + struct.pack("<QI", len(payload), zlib.crc32(payload)) + payload


@pytest.mark.parametrize("damage", [_garbage, _flipped_bit, _truncated, _older_format])
def test_a_damaged_block_is_computed_again_with_a_warning_naming_it(
  tmp_path, caplog, damage, memory
):
  folder = filled_store(tmp_path)
  block = block_file(folder)
  block.write_bytes(damage(block.read_bytes()))
  store = reopened(folder)
  with caplog.at_level(logging.WARNING):
    assert [int(store.get(i)[0]) for i in range(record_store.BLOCK)] == list(
      range(record_store.BLOCK)
    )
  assert store.computed_blocks == 1
  assert f"block file {block} is damaged" in caplog.text
  again = reopened(folder)  # the block was written anew
  assert int(again.get(5)[0]) == 5 and again.computed_blocks == 0


def test_an_intact_block_that_cannot_be_unpickled_is_named(tmp_path, memory):
  folder = filled_store(tmp_path)
  block = block_file(folder)
  payloads = [pickle.dumps(record) for record in compute(0, record_store.BLOCK)]
  payloads[3] = b"cjaxfeed_no_such_module\nRecords\n."  # a class that is gone
  head = record_store._block_head([(len(p), zlib.crc32(p)) for p in payloads])  # pylint: disable=protected-access
  block.write_bytes(head + b"".join(payloads))
  with pytest.raises(ValueError, match=f"cannot unpickle block file {re.escape(str(block))}"):
    reopened(folder).get(3)


def record_bounds(block, position):
  """(offset, length) of record `position` in block file `block`."""
  data = block.read_bytes()
  entry = record_store._ENTRY  # pylint: disable=protected-access
  table = record_store._table_end(0)  # pylint: disable=protected-access
  offset, length, _ = entry.unpack_from(data, table + position * entry.size)
  return offset, length


def bytes_read():
  """Bytes this process has read with read-like system calls so far."""
  with open("/proc/self/io", encoding="ascii") as f:
    return int(next(line for line in f if line.startswith("rchar:")).split()[1])


KIB_RECORDS = 4 * record_store.BLOCK + 10  # 5 blocks of 4 KiB records


def compute_kib(start, stop):
  return [np.full(512, i, np.int64) for i in range(start, stop)]


def test_shuffled_reads_of_a_store_larger_than_memory_read_only_each_record(tmp_path, monkeypatch):
  monkeypatch.setattr(record_store, "_CACHED_BLOCKS", 2)
  folder = str(tmp_path / "records-key")
  writer = record_store.RecordStore(folder, KIB_RECORDS, compute_kib)
  for index in range(KIB_RECORDS):
    writer.get(index)
  assert writer.computed_blocks == 5
  order = list(range(KIB_RECORDS))
  random.Random(0).shuffle(order)
  reader = record_store.RecordStore(folder, KIB_RECORDS, compute_kib)
  before = bytes_read()
  records = [reader.get(index) for index in order]
  read = bytes_read() - before
  # Each get reads its record (4 KiB and its pickle's few bytes) and its
  # block's table (1.3 KiB), not its block (256 KiB).
  assert read < KIB_RECORDS * 8 * 1024, f"{read / KIB_RECORDS:.0f} bytes read a record"
  for index, record in zip(order, records):
    np.testing.assert_array_equal(record, np.full(512, index, np.int64))
  assert reader.computed_blocks == reader.read_blocks == 0
  assert reader.read_records == KIB_RECORDS


def test_a_store_that_fits_in_memory_loads_whole_blocks(tmp_path):
  folder = str(tmp_path / "records-key")
  record_store.RecordStore(folder, KIB_RECORDS, compute_kib).get(0)
  reader = record_store.RecordStore(folder, KIB_RECORDS, compute_kib)
  assert [int(reader.get(index)[0]) for index in range(20)] == list(range(20))
  assert reader.read_blocks == 1 and reader.read_records == 0


def test_a_flipped_bit_in_one_record_read_alone_recomputes_its_block(tmp_path, monkeypatch, caplog):
  monkeypatch.setattr(record_store, "_CACHED_BLOCKS", 2)
  folder = filled_store(tmp_path)
  block = block_file(folder)
  offset, length = record_bounds(block, 5)
  data = bytearray(block.read_bytes())
  data[offset + length // 2] ^= 0x01
  block.write_bytes(bytes(data))
  store = reopened(folder)
  assert int(store.get(4)[0]) == 4  # an intact record of it is read alone
  assert store.read_records == 1 and store.computed_blocks == 0
  with caplog.at_level(logging.WARNING):
    assert int(store.get(5)[0]) == 5
  assert store.computed_blocks == 1
  assert f"block file {block} is damaged (record 5 does not match its CRC-32)" in caplog.text
  again = reopened(folder)  # the block was written anew
  assert int(again.get(5)[0]) == 5
  assert again.computed_blocks == 0 and again.read_records == 1


def test_a_store_larger_than_memory_measures_a_read_per_record_read_alone(tmp_path, monkeypatch):
  """The policy compares reading a record alone with computing it, not a
  block's read spread over the few records of it used."""
  monkeypatch.setattr(record_store, "_CACHED_BLOCKS", 2)

  def costly(start, stop):
    spin_until = time.perf_counter() + 300e-6 * (stop - start)
    while time.perf_counter() < spin_until:
      pass
    return compute_kib(start, stop)

  folder = str(tmp_path / "records-key")
  store = record_store.RecordStore(folder, KIB_RECORDS, costly, policy="auto")
  order = list(range(KIB_RECORDS))
  random.Random(0).shuffle(order)
  for index in order[:40]:  # profiles, decides, reads on
    store.get(index)
  m = store._point.measurements  # pylint: disable=protected-access
  assert m.read_s is not None and m.compute_s is not None
  assert m.read_s < m.compute_s / 3, (
    f"read {m.read_s * 1e6:.0f} us, compute {m.compute_s * 1e6:.0f} us"
  )
  assert store._point.last[0] in (autocache_policy.READ, autocache_policy.WRITE)  # pylint: disable=protected-access
