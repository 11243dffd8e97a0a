"""Fixtures of the source tests."""

import pytest

from jaxfeed.sources import tfrecord_file
from source_helpers import ARRAY_RECORD, TFRECORD, FileFormat


@pytest.fixture(params=[TFRECORD, ARRAY_RECORD], ids=lambda f: f.name)
def file_format(request) -> FileFormat:
  return request.param


class Scans(list):
  """The files scanned to build a TFRecord index, in order; `verified`
  says for each scan whether it checked every data CRC too."""

  def __init__(self):
    super().__init__()
    self.verified: list[bool] = []


@pytest.fixture
def scan_counter(monkeypatch) -> Scans:
  """Counts how often a TFRecord file is scanned to build its index."""
  scans = Scans()
  original = tfrecord_file.scan_frames

  def counting_scan(read_at, size, path, verify_data):
    scans.append(path)
    scans.verified.append(verify_data)
    return original(read_at, size, path, verify_data)

  monkeypatch.setattr(tfrecord_file, "scan_frames", counting_scan)
  return scans
