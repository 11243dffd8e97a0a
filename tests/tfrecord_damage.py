"""Damaged TFRecord files for tests: 200 records written by the writer, then
one damage at one place (a flipped bit in a header, a CRC or the data, a cut
tail, appended garbage), with what a reader must make of it."""

from __future__ import annotations

import dataclasses
import os
import random
import zlib

import numpy as np
import pytest

from jaxfeed.sources import write_tfrecord
from jaxfeed.sources.tfrecord_format import compression_wbits, encode_frame_header, masked_crc32c

NUM_RECORDS = 200


def make_records() -> list[bytes]:
  """Random records: mostly small, some empty, a few large ones (read on
  their own, scanned header first)."""
  rng = np.random.default_rng(25)
  sizes = [
    70_000
    if i % 90 == 45
    else 5_000
    if i % 20 == 3
    else 0
    if i % 17 == 0
    else int(rng.integers(1, 300))
    for i in range(NUM_RECORDS)
  ]
  return [rng.bytes(size) for size in sizes]


def frame_offsets(records: list[bytes]) -> list[int]:
  """Where each record's frame starts, then the end of the file."""
  return np.concatenate([[0], np.cumsum([16 + len(r) for r in records])]).tolist()


@dataclasses.dataclass(frozen=True)
class Damage:
  """One way to damage the file of `make_records()`.

  Attributes:
    name: The test id.
    record: The record whose frame is damaged (for garbage: NUM_RECORDS).
    where: What is damaged: "length", "length_crc", "data", "data_crc" (a
      bit flipped), "cut" (the file ends `at` bytes into the frame) or
      "garbage" (`at` random bytes appended).
    at: The bit flipped within that field, or the cut / garbage size.
  """

  name: str
  record: int
  where: str
  at: int

  def apply(self, path: str, records: list[bytes]) -> None:
    data = bytearray(open(path, "rb").read())
    if self.where == "garbage":
      data += random.Random(self.at).randbytes(self.at)
    elif self.where == "cut":
      del data[frame_offsets(records)[self.record] + self.at :]
    else:
      low, high = _fields(len(records[self.record]))[self.where]
      bit = self.at % ((high - low) * 8)
      start = frame_offsets(records)[self.record]
      data[start + low + bit // 8] ^= 1 << (bit % 8)
    with open(path, "wb") as f:
      f.write(bytes(data))

  def damaged_offset(self, records: list[bytes]) -> int:
    """Where the damaged frame (or the garbage) starts."""
    return frame_offsets(records)[self.record]

  def intact(self, records: list[bytes]) -> list[bytes]:
    """The records a reader that skips damage must deliver, in order."""
    if self.where == "cut":
      return records[: self.record]
    return [r for i, r in enumerate(records) if i != self.record]


def _fields(size: int) -> dict[str, tuple[int, int]]:
  """Byte ranges of a frame's fields, for a record of `size` bytes."""
  return {
    "length": (0, 8),
    "length_crc": (8, 12),
    "data": (12, 12 + size),
    "data_crc": (12 + size, 16 + size),
  }


def _random_flips(count: int, seed: int, records: list[bytes]) -> list[Damage]:
  """`count` single-bit flips anywhere in the file, as frame damages."""
  offsets = frame_offsets(records)
  rng = random.Random(seed)
  out = []
  for n in range(count):
    bit = rng.randrange(offsets[-1] * 8)
    record = int(np.searchsorted(offsets, bit // 8, side="right")) - 1
    within = bit - offsets[record] * 8
    for where, (low, high) in _fields(len(records[record])).items():
      if low * 8 <= within < high * 8:
        out.append(Damage(f"flip{n}-{where}-r{record}", record, where, within - low * 8))
  return out


def _random_header_flips(count: int, seed: int, records: list[bytes]) -> list[Damage]:
  """`count` single-bit flips in the 16 framing bytes of random records
  (flips anywhere mostly land in the data of the large records)."""
  rng = random.Random(seed)
  out = []
  for n in range(count):
    record, bit = rng.randrange(NUM_RECORDS), rng.randrange(16 * 8)
    where = "length" if bit < 64 else "length_crc" if bit < 96 else "data_crc"
    out.append(
      Damage(
        f"header-flip{n}-{where}-r{record}",
        record,
        where,
        bit - {"length": 0, "length_crc": 64, "data_crc": 96}[where],
      )
    )
  return out


def damages() -> list[Damage]:
  """Every damage the tests run: each field at the first, a middle and the
  last record, cuts in each part of a frame, garbage, 30 random flips."""
  records = make_records()
  out = []
  for record in (0, 3, 45, 105, NUM_RECORDS - 1):
    for where, bit in (
      ("length", 2),
      ("length", 61),
      ("length_crc", 17),
      ("data", 1000),
      ("data_crc", 5),
    ):
      if where == "data" and not records[record]:
        continue
      out.append(Damage(f"{where}-r{record}-b{bit}", record, where, bit))
  for record in (1, 105, NUM_RECORDS - 1):
    size = len(records[record])
    for part, at in (("header", 5), ("data", 12 + size // 2), ("data_crc", 14 + size)):
      out.append(Damage(f"cut-{part}-r{record}", record, "cut", at))
  for size in (5, 40, 3000):
    out.append(Damage(f"garbage{size}", NUM_RECORDS, "garbage", size))
  return out + _random_flips(30, 2025, records) + _random_header_flips(30, 2026, records)


def write_damaged(directory, damage: Damage, records: list[bytes]) -> str:
  path = os.path.join(directory, "damaged.tfrecord")
  write_tfrecord(path, records)
  damage.apply(path, records)
  return path


def write_with_bad_data_crc(
  path: str, records: list[bytes], bad: int, compression_type: str | None = None
) -> None:
  """A file of `records` whose record `bad` carries a wrong data CRC: damage
  done before compression, which the compressed stream keeps intact."""
  frames = bytearray()
  for i, record in enumerate(records):
    crc = masked_crc32c(record) ^ (1 if i == bad else 0)
    frames += encode_frame_header(len(record)) + record + crc.to_bytes(4, "little")
  wbits = compression_wbits(compression_type, "test")
  if wbits is not None:
    deflate = zlib.compressobj(6, zlib.DEFLATED, wbits)
    frames = deflate.compress(bytes(frames)) + deflate.flush()
  with open(path, "wb") as f:
    f.write(bytes(frames))


# Runs a test (with a `damage` argument) once per damage of `damages()`.
over_every_damage = pytest.mark.parametrize("damage", damages(), ids=lambda d: d.name)
