"""The source protocol helpers: exports, errors, lazily opened handles."""

from __future__ import annotations

import os
import pickle

import numpy as np
import pytest

import jaxfeed
from jaxfeed import sources
from jaxfeed.sources import base


@pytest.mark.parametrize(
  "name",
  [
    "ArraySource",
    "ArrayRecordSource",
    "TFRecordSource",
    "write_array_record",
    "write_tfrecord",
    "CorruptRecordError",
    "RecordSource",
  ],
)
def test_public_names_resolve_from_the_package_root(name):
  assert getattr(jaxfeed, name) is getattr(sources, name)


def test_corrupt_record_error_names_file_offset_and_record():
  error = sources.CorruptRecordError("/d/f.rec", 77, "bad CRC", 3)
  assert str(error) == (
    "Corrupt record file /d/f.rec at byte offset 77 (record 3 of the file): bad CRC"
  )
  assert "unknown byte offset" in str(sources.CorruptRecordError("/d/f.rec", None, "bad"))


@pytest.mark.parametrize("index", [0, 4, np.int64(2), np.uint8(1)])
def test_check_index_accepts_integers_in_range(index):
  assert base.check_index(index, 5, "S") == int(index)


@pytest.mark.parametrize(
  "indices,dtype", [([], np.int64), ((1, 2), np.int64), (np.arange(3, dtype=np.uint32), np.int64)]
)
def test_check_indices_returns_int64_arrays(indices, dtype):
  out = base.check_indices(indices, 5, "S")
  assert out.dtype == dtype
  np.testing.assert_array_equal(out, np.asarray(indices, np.int64))


def test_split_by_file_groups_sorted_positions_and_output_slots():
  starts = np.array([0, 3, 3, 8])  # file 1 is empty
  indices = np.array([7, 0, 3, 2, 7, 4])
  groups = [(f, p.tolist(), s.tolist()) for f, p, s in base.split_by_file(indices, starts)]
  assert groups == [(0, [0, 2], [1, 3]), (2, [0, 1, 4, 4], [2, 5, 0, 4])]
  assert [base.file_of(i, starts) for i in (0, 2, 3, 7)] == [0, 0, 2, 2]


class _Opener:
  """A picklable opener that counts opens and closes (in a shared list)."""

  def __init__(self):
    self.log = []

  def open(self):
    self.log.append("open")
    return len(self.log)

  def close(self, handle):
    self.log.append(f"close {handle}")


def test_lazy_handle_opens_once_and_reopens_after_close():
  opener = _Opener()
  handle = base.LazyHandle(opener.open, opener.close)
  assert opener.log == [] and not handle.is_open
  first = handle.get()
  assert handle.get() == first and handle.is_open
  handle.close()
  handle.close()
  assert handle.get() != first
  assert opener.log == ["open", f"close {first}", "open"]


def test_lazy_handle_in_another_process_drops_the_inherited_handle(monkeypatch):
  opener = _Opener()
  handle = base.LazyHandle(opener.open, opener.close)
  inherited = handle.get()
  real_pid = os.getpid()
  monkeypatch.setattr(os, "getpid", lambda: real_pid + 1)  # as after fork
  assert not handle.is_open
  own = handle.get()
  assert own != inherited
  assert opener.log == ["open", f"close {inherited}", "open"]


def test_lazy_handle_pickles_without_its_handle():
  opener = _Opener()
  handle = base.LazyHandle(opener.open, opener.close)
  handle.get()
  copy = pickle.loads(pickle.dumps(handle))
  assert not copy.is_open
  copy.get()
  assert copy.is_open
