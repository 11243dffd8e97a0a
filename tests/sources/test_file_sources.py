"""The RecordSource contract, checked for both file formats."""

from __future__ import annotations

import gc
import json
import os
import pickle

from etils import epath
import numpy as np
import psutil
import pytest

from source_helpers import make_records


def _open_paths() -> set[str]:
  return {f.path for f in psutil.Process().open_files()}


@pytest.mark.parametrize("counts", [[1], [37], [5, 0, 12, 1], [3] * 9])
def test_records_read_back_equal_written_ones_across_files(tmp_path, file_format, counts):
  lists = [make_records(n, seed=i) for i, n in enumerate(counts)]
  paths = file_format.write_files(tmp_path, lists)
  expected = [r for records in lists for r in records]
  with file_format.source(paths) as source:
    assert len(source) == len(expected)
    assert [source[i] for i in range(len(source))] == expected
    assert list(source) == expected
    assert all(isinstance(source[i], bytes) for i in range(len(source)))


@pytest.mark.parametrize("size", [0, 1, 100, 12_292, 200_000])
def test_single_size_records_round_trip(tmp_path, file_format, size):
  records = make_records(5, seed=size, sizes=(size,))
  (path,) = file_format.write_files(tmp_path, [records])
  with file_format.source(path) as source:
    assert source.get_many(range(5)) == records


def test_file_with_no_records_is_an_empty_source(tmp_path, file_format):
  (path,) = file_format.write_files(tmp_path, [[]])
  with file_format.source(path) as source:
    assert len(source) == 0
    assert source.get_many([]) == []
    with pytest.raises(IndexError, match="record index 0 .* 0 records"):
      source[0]


@pytest.mark.parametrize("order", ["shuffled", "reversed", "duplicates", "single", "empty"])
def test_get_many_returns_requested_order_equal_to_single_reads(tmp_path, file_format, order):
  lists = [make_records(40, seed=1), make_records(25, seed=2)]
  paths = file_format.write_files(tmp_path, lists)
  expected = lists[0] + lists[1]
  rng = np.random.default_rng(3)
  indices = {
    "shuffled": rng.permutation(65),
    "reversed": np.arange(64, -1, -1),
    "duplicates": rng.integers(0, 65, 200),
    "single": np.array([41]),
    "empty": np.array([], np.int64),
  }[order]
  with file_format.source(paths) as source:
    got = source.get_many(indices)
    assert isinstance(got, list)
    assert got == [expected[i] for i in indices]
    assert got == [source[int(i)] for i in indices]
    assert source.get_many(indices.tolist()) == got


@pytest.mark.parametrize("bad", [-1, 10, 11, 10**12])
def test_out_of_range_index_raises_index_error_naming_index_and_length(tmp_path, file_format, bad):
  (path,) = file_format.write_files(tmp_path, [make_records(10)])
  with file_format.source(path) as source:
    with pytest.raises(IndexError, match=f"record index {bad} .* 10 records"):
      source[bad]
    with pytest.raises(IndexError, match=f"record index {bad} .* 10 records"):
      source.get_many([0, bad, 1])


@pytest.mark.parametrize("bad", [1.0, "3", True, None])
def test_non_integer_index_raises_type_error(tmp_path, file_format, bad):
  (path,) = file_format.write_files(tmp_path, [make_records(4)])
  with file_format.source(path) as source:
    with pytest.raises(TypeError, match="integer"):
      source[bad]


def test_get_many_rejects_non_integer_or_nested_indices(tmp_path, file_format):
  (path,) = file_format.write_files(tmp_path, [make_records(4)])
  with file_format.source(path) as source:
    with pytest.raises(TypeError, match="1-D sequence of integer"):
      source.get_many([0.0, 1.0])
    with pytest.raises(TypeError, match="1-D sequence of integer"):
      source.get_many([[0, 1]])


def test_missing_file_raises_file_not_found_naming_it(tmp_path, file_format):
  (path,) = file_format.write_files(tmp_path, [make_records(3)])
  missing = str(tmp_path / "nope" / f"missing{file_format.suffix}")
  with pytest.raises(FileNotFoundError, match="missing"):
    file_format.source([path, missing])


@pytest.mark.parametrize("paths", [[], 42, [42]])
def test_bad_paths_argument_is_rejected(file_format, paths):
  with pytest.raises((TypeError, ValueError), match="path"):
    file_format.source(paths)


def test_accepts_str_pathlike_and_epath(tmp_path, file_format):
  records = make_records(6)
  (path,) = file_format.write_files(tmp_path, [records])
  for p in (path, epath.Path(path), tmp_path / os.path.basename(path)):
    with file_format.source([p]) as source:
      assert source.get_many(range(6)) == records
      assert source.spec_params()["paths"] == [path]


def test_pickled_copy_reads_the_same_records(tmp_path, file_format):
  lists = [make_records(20, seed=4), make_records(9, seed=5)]
  paths = file_format.write_files(tmp_path, lists)
  with file_format.source(paths) as source:
    source.get_many([0, 25])  # open handles must not be pickled
    copy = pickle.loads(pickle.dumps(source))
    try:
      indices = np.random.default_rng(0).permutation(29)
      assert copy.get_many(indices) == source.get_many(indices)
      assert len(copy) == 29
    finally:
      copy.close()


def test_forked_child_reads_with_its_own_handles(tmp_path, file_format):
  records = make_records(30, seed=6)
  (path,) = file_format.write_files(tmp_path, [records])
  with file_format.source(path) as source:
    source.get_many([1, 2])  # the parent's handle is open before the fork
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: report what it reads, then exit without cleanup
      status = 1
      try:
        os.close(read_end)
        ok = source.get_many(range(29, -1, -1)) == records[::-1]
        os.write(write_end, b"ok" if ok else b"mismatch")
        source.close()
        status = 0
      finally:
        os._exit(status)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as pipe:
      answer = pipe.read()
    _, status = os.waitpid(pid, 0)
    assert (answer, status) == (b"ok", 0)
    # The child closed its copy of the handle; the parent's still works.
    assert source.get_many([3, 0]) == [records[3], records[0]]


def test_close_releases_file_handles_and_reads_reopen(tmp_path, file_format):
  (path,) = file_format.write_files(tmp_path, [make_records(8)])
  real = os.path.realpath(path)
  source = file_format.source(path)
  source.get_many([0, 7])
  assert real in _open_paths()
  source.close()
  assert real not in _open_paths()
  source.close()  # idempotent
  assert source[3] == make_records(8)[3]  # reads reopen lazily
  assert real in _open_paths()
  source.close()
  assert real not in _open_paths()


def test_context_manager_closes_handles(tmp_path, file_format):
  (path,) = file_format.write_files(tmp_path, [make_records(4)])
  real = os.path.realpath(path)
  with file_format.source(path) as source:
    source[1]
    assert real in _open_paths()
  assert real not in _open_paths()


def test_garbage_collected_source_releases_file_handles(tmp_path, file_format):
  (path,) = file_format.write_files(tmp_path, [make_records(4)])
  real = os.path.realpath(path)
  source = file_format.source(path)
  source[2]
  assert real in _open_paths()
  del source
  gc.collect()
  assert real not in _open_paths()


def test_spec_params_are_json_and_rebuild_an_equal_source(tmp_path, file_format):
  lists = [make_records(7, seed=8), make_records(3, seed=9)]
  paths = file_format.write_files(tmp_path, lists)
  with file_format.source([epath.Path(p) for p in paths]) as source:
    params = json.loads(json.dumps(source.spec_params()))
    assert params["paths"] == paths
    with type(source)(**params) as rebuilt:
      assert rebuilt.get_many(range(10)) == source.get_many(range(10))
      assert repr(rebuilt) == repr(source)


def test_repr_is_stable_and_has_no_memory_address(tmp_path, file_format):
  (path,) = file_format.write_files(tmp_path, [make_records(3)])
  with file_format.source(path) as a, file_format.source(path) as b:
    assert repr(a) == repr(b) == repr(pickle.loads(pickle.dumps(a)))
    assert "0x" not in repr(a)
    assert path in repr(a)
    assert type(a).__name__ in repr(a)
