"""Fixtures of the source tests."""

import pytest

from source_helpers import ARRAY_RECORD, TFRECORD, FileFormat


@pytest.fixture(params=[TFRECORD, ARRAY_RECORD], ids=lambda f: f.name)
def file_format(request) -> FileFormat:
  return request.param
