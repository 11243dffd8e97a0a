"""The record store unpickles only block files this user (or root) wrote, in
a folder only its owner may write, and computes a damaged block again."""

import logging
import re
import zlib
import os

import numpy as np
import pytest

from jaxfeed.ops import record_store

N = 200


def compute(start, stop):
  return [np.full(8, i, np.int64) for i in range(start, stop)]


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


@pytest.mark.parametrize("damage", [_garbage, _flipped_bit, _truncated])
def test_a_damaged_block_is_computed_again_with_a_warning_naming_it(tmp_path, caplog, damage):
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


def test_an_intact_block_that_cannot_be_unpickled_is_named(tmp_path):
  folder = filled_store(tmp_path)
  block = block_file(folder)
  payload = b"cjaxfeed_no_such_module\nRecords\n."  # a class that is gone
  header = record_store._HEADER.pack(len(payload), zlib.crc32(payload))  # pylint: disable=protected-access
  block.write_bytes(record_store._MAGIC + header + payload)  # pylint: disable=protected-access
  with pytest.raises(ValueError, match=f"cannot unpickle block file {re.escape(str(block))}"):
    reopened(folder).get(3)
