"""Fingerprints of file sources follow the files' content, not just paths."""

from __future__ import annotations

import os

import jaxfeed
from source_helpers import make_records


def fingerprint_of(file_format, path) -> str:
  with file_format.source(path) as source:
    return jaxfeed.Dataset.from_source(source).fingerprint()


def test_a_file_rewritten_at_the_same_path_changes_the_fingerprint(tmp_path, file_format):
  (path,) = file_format.write_files(tmp_path, [make_records(4, seed=0)])
  first = fingerprint_of(file_format, path)
  assert fingerprint_of(file_format, path) == first  # unchanged file
  # As many records as before (so the sampler is the same), other sizes.
  rewritten = make_records(4, seed=1, sizes=(3,))
  assert file_format.write_files(tmp_path, [rewritten]) == [path]
  assert fingerprint_of(file_format, path) != first


def test_a_rewrite_of_the_same_size_is_told_apart_by_its_mtime(tmp_path, file_format):
  (path,) = file_format.write_files(tmp_path, [make_records(4, seed=0)])
  stat = os.stat(path)
  first = fingerprint_of(file_format, path)
  file_format.write_files(tmp_path, [make_records(4, seed=1)])
  assert os.stat(path).st_size == stat.st_size
  # Where the filesystem clock is coarse the rewrite may keep the mtime.
  os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))
  assert fingerprint_of(file_format, path) != first


def test_a_source_built_before_the_rewrite_reports_the_new_file(tmp_path, file_format):
  (path,) = file_format.write_files(tmp_path, [make_records(4, seed=0)])
  with file_format.source(path) as source:
    dataset = jaxfeed.Dataset.from_source(source)
    first = dataset.fingerprint()
    file_format.write_files(tmp_path, [make_records(6, seed=1)])
    assert dataset.fingerprint() != first
