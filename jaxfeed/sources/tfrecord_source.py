"""`TFRecordSource`: random access to TFRecord files without TensorFlow.

Random access needs the byte offset of every record. It is found once per
file by scanning the record headers and cached beside the file as
`<file>.idx`, an .npy int64 array:

    [MAGIC, VERSION, file_size, mtime_ns, num_records, offset_0, ...,
     offset_{num_records - 1}, file_size]

The cache is used only while the file's size and mtime match; otherwise it is
rebuilt. Where the directory is not writable the index stays in memory. The
VERSION says whether every record's data CRC was checked while indexing
(`on_damage="skip"` needs that) or only the headers.

Damaged files: the index holds every record up to the damage and after it
where the scan resynchronizes (see `jaxfeed.sources.tfrecord_scan`); each
damaged range takes one index entry. With `on_damage="raise"` that entry is a
record whose read raises `CorruptRecordError`, as tf.data's TFRecordDataset
raises DataLossError where it meets damage, so `ignore_errors()` downstream
skips exactly the damage. With `on_damage="skip"` the damaged ranges are left
out. A damaged index is never cached: each build of the source scans the
file again and reports the damage again.

Compressed files (`compression_type="GZIP"` or `"ZLIB"`) have no random
access: a deflate stream is read from its start. Their index (the record
count and the offsets in the uncompressed stream) costs one pass that
decompresses each whole file, cached the same way. Records are then served
in order: a read at or after the current position decompresses forward to it,
a read of a file's first record starts that file again (a new epoch), and any
other backward read raises `SequentialReadError`. So read them with an
unshuffled sampler; for shuffled access write the file uncompressed.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from jaxfeed.sources.base import (
  CorruptRecordError,
  HandleSource,
  LazyHandle,
  as_path_list,
  check_files_exist,
  file_of,
  files_fingerprint_params,
  split_by_file,
)
from jaxfeed.sources.tfrecord_file import CompressedTFRecordFile, SequentialReadError, TFRecordFile
from jaxfeed.sources.tfrecord_format import compression_wbits
from jaxfeed.sources.tfrecord_scan import DamagedRange

__all__ = ["TFRecordSource", "SequentialReadError"]

_LOG = logging.getLogger(__name__)
ON_DAMAGE = ("raise", "skip")
_NOT_READ = object()
# Damaged ranges logged one by one per file; the rest are counted.
_LOGGED_RANGES = 5


class TFRecordSource(HandleSource):
  """Records (bytes) of one or more TFRecord files, concatenated in order.

  Args:
    paths: One path or a sequence of paths (str or os.PathLike; anything
      `etils.epath` opens).
    verify_crc: Check each record's data CRC on read (record headers are
      checked when the index is built).
    cache_index: Store each file's record index beside it as `<file>.idx`
      (when the directory is writable) and reuse it while it is fresh.
    compression_type: None (or "") for plain files; "GZIP" or "ZLIB" for
      files written compressed (as `tf.io.TFRecordOptions` names them). These
      are read in order only (see the module docstring): indexing them
      decompresses each file once, and a read behind a file's position (other
      than its first record) raises `SequentialReadError`.
    on_damage: What a damaged file gives (a bad length or data CRC, a
      truncated tail, garbage). "raise" (default): each damaged range is one
      record whose read raises `CorruptRecordError` naming the file and the
      byte offset, like tf.data's DataLossError; the records before and
      after it (where a frame that verifies follows) read normally, so
      `ignore_errors()` downstream skips only the damage. "skip": damaged
      ranges are left out, so the source holds exactly the records that
      verify; indexing then reads whole files to check every data CRC (once:
      the index is cached). Either way the damage is logged and listed in
      `damage`. Damage that appears after a file was indexed is raised on
      read in both modes.

  Raises:
    FileNotFoundError: a file does not exist.
  """

  def __init__(
    self,
    paths: Any,
    verify_crc: bool = True,
    cache_index: bool = True,
    compression_type: str | None = None,
    on_damage: str = "raise",
  ):
    if not isinstance(verify_crc, bool) or not isinstance(cache_index, bool):
      raise TypeError(
        "TFRecordSource: verify_crc and cache_index must be bools, got "
        f"verify_crc={verify_crc!r}, cache_index={cache_index!r}."
      )
    if on_damage not in ON_DAMAGE:
      raise ValueError(f'TFRecordSource: on_damage must be "raise" or "skip", got {on_damage!r}.')
    wbits = compression_wbits(compression_type, "TFRecordSource")
    path_list = as_path_list(paths, "TFRecordSource")
    check_files_exist(path_list, "TFRecordSource")
    self._verify_crc = verify_crc
    self._cache_index = cache_index
    self._compression_type = compression_type or None
    self._on_damage = on_damage
    # Compressed files: a failed chunk's results (see `_read_in_order`).
    self._replay: dict[int, Any] = {}
    skip = on_damage == "skip"
    if wbits is None:
      self._files = [TFRecordFile(p, cache_index, skip) for p in path_list]
    else:
      self._files = [
        CompressedTFRecordFile(p, cache_index, skip, wbits, compression_type) for p in path_list
      ]
    counts = [f.load_index() for f in self._files]
    for f in self._files:
      _log_damage(f.damage, on_damage)
    self._file_starts = np.zeros(len(counts) + 1, np.int64)
    np.cumsum(counts, out=self._file_starts[1:])
    self._track_handles()

  def __len__(self) -> int:
    return int(self._file_starts[-1])

  def _read(self, index: int) -> bytes:
    f = file_of(index, self._file_starts)
    return self._files[f].read_one(index - int(self._file_starts[f]), self._verify_crc)

  def _read_many(self, indices: np.ndarray) -> list:
    if self._compression_type is not None:
      return self._read_in_order(indices.tolist())
    out = [None] * len(indices)
    for f, positions, slots in split_by_file(indices, self._file_starts):
      self._files[f].read_sorted(positions, slots, out, self._verify_crc)
    return out

  def _read_in_order(self, indices: list[int]) -> list:
    """Reads compressed files in the order asked: sorting a chunk that spans
    two epochs would read the second epoch's first records before the first
    one's last.

    Where a record of the chunk is damaged, the chunk's records and errors
    are kept until its indices are read again one by one (as `from_source`
    does to find the failing record): reading them from the file again
    would read backwards.
    """
    values = []
    for i in indices:
      value = self._replay.pop(i, _NOT_READ)
      if value is _NOT_READ:
        self._replay.clear()  # not a read of the failed chunk again
        try:
          value = self._read(i)
        except CorruptRecordError as e:
          value = e
      values.append(value)
    errors = [v for v in values if isinstance(v, CorruptRecordError)]
    if errors:
      if len(values) > 1:
        self._replay = dict(zip(indices, values))
      raise errors[0]
    return values

  @property
  def paths(self) -> list[str]:
    return [f.name for f in self._files]

  @property
  def damage(self) -> tuple[DamagedRange, ...]:
    """The damaged ranges found while indexing, in file order; each names
    its file, byte range, what is wrong and its index entry (`record_index`)."""
    return tuple(d for f in self._files for d in f.damage)

  def spec_params(self) -> dict:
    params = {"paths": self.paths, "verify_crc": self._verify_crc, "cache_index": self._cache_index}
    if self._compression_type is not None:
      params["compression_type"] = self._compression_type
    if self._on_damage != "raise":
      params["on_damage"] = self._on_damage
    return params

  def fingerprint_params(self) -> dict:
    return files_fingerprint_params(self.paths)

  def _handles(self) -> list[LazyHandle]:
    return [f.handle for f in self._files]

  def __getstate__(self) -> dict:
    state = super().__getstate__()
    state["_replay"] = {}
    return state


def _log_damage(damage: tuple[DamagedRange, ...], on_damage: str) -> None:
  if not damage:
    return
  outcome = (
    "left out (on_damage='skip')"
    if on_damage == "skip"
    else "each read as a record that raises CorruptRecordError "
    "(ignore_errors() skips it, or on_damage='skip')"
  )
  total = sum(d.num_bytes or 0 for d in damage)
  _LOG.warning(
    "TFRecordSource: %s is damaged: %d damaged range(s), %d bytes, %s.",
    damage[0].path,
    len(damage),
    total,
    outcome,
  )
  for d in damage[:_LOGGED_RANGES]:
    _LOG.warning("TFRecordSource: %s", d.error())
  if len(damage) > _LOGGED_RANGES:
    _LOG.warning(
      "TFRecordSource: %s: %d more damaged ranges (see TFRecordSource.damage).",
      damage[0].path,
      len(damage) - _LOGGED_RANGES,
    )
