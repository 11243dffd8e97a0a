"""Helpers shared by the source tests: record generators and file formats."""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np

from jaxfeed.sources import ArrayRecordSource, TFRecordSource, write_array_record, write_tfrecord

# Empty records, tiny ones, odd sizes and ones larger than a 64 KiB block.
RECORD_SIZES = (0, 1, 7, 100, 4096, 12_292, 70_000)


def make_records(count: int, seed: int = 0, sizes: tuple[int, ...] = RECORD_SIZES) -> list[bytes]:
  """`count` random records cycling through `sizes`, each one distinct."""
  rng = np.random.default_rng(seed)
  return [rng.bytes(sizes[i % len(sizes)]) for i in range(count)]


@dataclasses.dataclass(frozen=True)
class FileFormat:
  name: str
  suffix: str
  write: Callable
  source: type

  def write_files(self, directory, record_lists) -> list[str]:
    paths = []
    for i, records in enumerate(record_lists):
      path = str(directory / f"part-{i:05d}{self.suffix}")
      assert self.write(path, records) == len(records)
      paths.append(path)
    return paths


TFRECORD = FileFormat("tfrecord", ".tfrecord", write_tfrecord, TFRecordSource)
ARRAY_RECORD = FileFormat("array_record", ".array_record", write_array_record, ArrayRecordSource)
