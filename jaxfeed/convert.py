"""`jaxfeed convert`: records from one file format to another, sharded,
parallel and resumable.

The output is OUT, or OUT-SSSSS-of-NNNNN.ext with `num_shards`; each shard
is written under a temporary name and renamed into place when complete. A
temporary is `.NAME.tmp-<random hex>` beside the shard and locked while it
is written: a later conversion removes only those of its own shards whose
writer is gone, never another running conversion's files.

A conversion never mixes its records with another's. It records what it
converts (the inputs' paths, sizes and modification times, the formats and
the shard count) in `.OUT.convert` beside the output, and removes that
record once every shard is complete. Run again with the same inputs and
options, a killed conversion keeps its complete shards and writes the rest.
Outputs it did not write (an earlier, complete conversion, another set of
shards of OUT, any file of that name) make it refuse, like tf.data's `save`
and most tools, unless `overwrite=True` (`--overwrite`), which removes them
first.

NumPy (.npy/.npz) and Parquet files are tables whose rows are
tf.train.Example records, a feature per column (see `jaxfeed.tables`).
"""

from __future__ import annotations

import concurrent.futures
import fcntl
import functools
import glob
import json
import multiprocessing
import os
import re
from typing import Any, Sequence
import uuid

import numpy as np

from jaxfeed import _lifetime
from jaxfeed import progress as progress_lib

__all__ = [
  "FORMATS",
  "FORMAT_NAMES",
  "UsageError",
  "file_format",
  "open_source",
  "shard_paths",
  "convert",
]

FORMATS = {
  ".tfrecord": "tfrecord",
  ".tfrecords": "tfrecord",
  ".array_record": "array_record",
  ".arrayrecord": "array_record",
  ".npy": "numpy",
  ".npz": "numpy",
  ".parquet": "parquet",
}
FORMAT_NAMES = ("tfrecord", "array_record", "numpy", "parquet")


class UsageError(ValueError):
  """A command line the command cannot act on; printed without a traceback."""


def file_format(path: str, given: str | None = None) -> str:
  """One of FORMAT_NAMES, from `given` or the file name."""
  if given:
    if given not in FORMAT_NAMES:
      raise UsageError(f"Unknown format {given!r}; use one of {', '.join(FORMAT_NAMES)}.")
    return given
  suffix = os.path.splitext(path)[1].lower()
  if suffix not in FORMATS:
    raise UsageError(
      f"Cannot tell the format of {path!r} from its extension {suffix!r}: "
      f"use one of {', '.join(sorted(FORMATS))} or pass --from/--to."
    )
  return FORMATS[suffix]


def open_source(paths: Sequence[str], fmt: str, on_damage: str = "raise") -> Any:
  """A source over `paths` of format `fmt`; `on_damage` as `TFRecordSource`'s."""
  import jaxfeed  # pylint: disable=g-import-not-at-top
  from jaxfeed import tables  # pylint: disable=g-import-not-at-top

  try:
    if fmt == "tfrecord":
      return jaxfeed.TFRecordSource(list(paths), on_damage=on_damage)
    if fmt == "array_record":
      return jaxfeed.ArrayRecordSource(list(paths))
    return tables.TableSource(paths, fmt)
  except (ImportError, ValueError) as e:  # an extra not installed, a bad table file
    raise UsageError(str(e)) from None


def _writer(fmt: str, path: str) -> Any:
  """write(file, records) of `fmt` for the output `path`."""
  import jaxfeed  # pylint: disable=g-import-not-at-top
  from jaxfeed import tables  # pylint: disable=g-import-not-at-top

  if fmt == "numpy":
    return functools.partial(tables.write_numpy, single_array=path.endswith(".npy"))
  return {
    "tfrecord": jaxfeed.write_tfrecord,
    "array_record": jaxfeed.write_array_record,
    "parquet": tables.write_parquet,
  }[fmt]


def _read_range(source: Any, start: int, stop: int) -> Any:
  """Records start..stop-1 of `source`, streamed."""
  if hasattr(source, "records"):  # a table: reads row groups once each
    yield from source.records(start, stop)
    return
  for first in range(start, stop, 256):
    yield from source.get_many(np.arange(first, min(first + 256, stop)))


def shard_paths(out: str, num_shards: int) -> list[str]:
  """OUT itself for one shard, else OUT-00000-of-0000N.ext ... ."""
  if num_shards == 1:
    return [out]
  stem, ext = os.path.splitext(out)
  return [f"{stem}-{i:05d}-of-{num_shards:05d}{ext}" for i in range(num_shards)]


def _temporary_pattern(path: str) -> re.Pattern:
  """The names of `path`'s temporaries (see `_locked_temporary`)."""
  return re.compile(re.escape(f".{os.path.basename(path)}.tmp-") + "[0-9a-f]{32}")


def _locked_temporary(path: str) -> tuple[str, int]:
  """A new empty temporary beside `path` and a descriptor holding its lock.

  The lock (released by the kernel when the process ends, however it ends)
  tells a conversion starting later that the file is still being written.
  """
  folder, name = os.path.split(path)
  while True:
    tmp = os.path.join(folder, f".{name}.tmp-{uuid.uuid4().hex}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
      if os.stat(tmp).st_ino == os.fstat(fd).st_ino:
        return tmp, fd
    except FileNotFoundError:
      pass  # removed as stale between its creation and the lock: take another
    os.close(fd)


def _remove_stale_temporaries(path: str) -> None:
  """Removes the temporaries of `path` that no living process writes (what
  a killed conversion left half written)."""
  folder = os.path.dirname(path) or "."
  pattern = _temporary_pattern(path)
  for name in os.listdir(folder):
    if not pattern.fullmatch(name):
      continue
    stale = os.path.join(folder, name)
    try:
      fd = os.open(stale, os.O_RDONLY)
    except FileNotFoundError:
      continue
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
      os.remove(stale)  # locked by us: its writer is gone
    except BlockingIOError:
      pass  # another conversion of the same shard is writing it
    except FileNotFoundError:
      pass  # another conversion removed it first
    finally:
      os.close(fd)


def _convert_shard(job: tuple) -> int:
  """Writes records [start, stop) of the input to `path`; returns the count."""
  inputs, in_fmt, out_fmt, path, start, stop = job
  source = open_source(inputs, in_fmt)
  tmp, lock = _locked_temporary(path)
  try:
    _writer(out_fmt, path)(tmp, _read_range(source, start, stop))
    os.replace(tmp, path)
  except ValueError as e:  # records that do not fit the output format
    raise UsageError(str(e)) from None
  finally:
    if os.path.exists(tmp):
      os.remove(tmp)
    os.close(lock)
  return stop - start


def _job_record_path(out: str) -> str:
  """Where a conversion into `out` records what it converts."""
  folder, name = os.path.split(out)
  return os.path.join(folder, f".{name}.convert")


def _job_of(inputs: Sequence[str], in_fmt: str, out_fmt: str, num_shards: int, total: int) -> dict:
  """What identifies a conversion: run again, the same dict means the same
  records in the same shards."""
  files = []
  for path in inputs:
    info = os.stat(path)
    files.append(
      {"path": os.path.abspath(path), "bytes": info.st_size, "mtime_ns": info.st_mtime_ns}
    )
  return {
    "inputs": files,
    "from": in_fmt,
    "to": out_fmt,
    "num_shards": num_shards,
    "records": total,
  }


def _read_job(out: str) -> dict | None:
  try:
    with open(_job_record_path(out)) as f:
      return json.load(f)
  except (FileNotFoundError, ValueError):
    return None  # none, or torn: a torn record resumes nothing


def _write_job(out: str, job: dict) -> None:
  path = _job_record_path(out)
  tmp = f"{path}.tmp-{uuid.uuid4().hex}"
  with open(tmp, "w") as f:
    json.dump(job, f)
  os.replace(tmp, path)


def _other_shard_sets(out: str, paths: Sequence[str]) -> list[str]:
  """Files named as shards of `out` that are not `paths`: the output of a
  conversion into `out` with another shard count."""
  stem, ext = os.path.splitext(out)
  digits = "[0-9]" * 5
  pattern = f"{glob.escape(stem)}-{digits}-of-{digits}{glob.escape(ext)}"
  named = set(paths)
  return sorted(p for p in [out, *glob.glob(pattern)] if p not in named and os.path.exists(p))


def _refusal(
  out: str, existing: list[str], num_shards: int, unfinished: dict | None, job: dict
) -> UsageError:
  """Why a conversion into `out` cannot go on without `--overwrite`."""
  first = existing[0]
  if unfinished is not None and unfinished != job:
    changed = [k for k in job if unfinished.get(k) != job[k]]
    why = (
      f"an unfinished conversion of other {' and '.join(changed)} into {out!r} "
      f"left {len(existing)} file(s) there, first {first!r}"
    )
  else:
    why = (
      f"{first!r} already exists ({len(existing)} file(s) named as outputs of "
      f"{out!r} with --num_shards={num_shards} or another shard count), and no "
      "unfinished conversion of these inputs wrote it"
    )
  return UsageError(
    f"{why}; a conversion never mixes its records with another's: pass "
    "--overwrite to replace them, or write to another name."
  )


def convert(
  inputs: Sequence[str],
  out: str,
  *,
  in_format: str | None = None,
  out_format: str | None = None,
  num_shards: int = 1,
  workers: int = 1,
  progress: bool | None = None,
  overwrite: bool = False,
) -> dict:
  """Converts every record of `inputs` to `out`.

  Args:
    inputs: The input files, read in order as one sequence of records.
    out: The output file (its name with `-SSSSS-of-NNNNN` for shards).
    in_format: One of FORMAT_NAMES; None: from the inputs' extension.
    out_format: One of FORMAT_NAMES; None: from `out`'s extension.
    num_shards: Output files; records are split evenly and in order.
    workers: Processes writing shards at once.
    progress: Draw a progress bar; None: when stderr is a terminal.
    overwrite: Remove outputs of `out` that this conversion did not write
      (see the module docstring) instead of refusing.

  Returns:
    {"records": total records, "shards": paths, "skipped": complete shards
    of an interrupted run of this conversion, kept, "replaced": outputs
    removed by `overwrite`}.

  Raises:
    UsageError: a bad argument, an unreadable input, or outputs this
      conversion did not write without `overwrite`.
  """
  in_fmt = file_format(inputs[0], in_format)
  out_fmt = file_format(out, out_format)
  if num_shards < 1 or workers < 1:
    raise UsageError(f"--num_shards and --workers must be >= 1, got {num_shards} and {workers}.")
  missing = [p for p in inputs if not os.path.exists(p)]
  if missing:
    raise UsageError(f"No such input file: {missing[0]!r}.")
  total = len(open_source(inputs, in_fmt))
  paths = shard_paths(out, num_shards)
  bounds = [total * i // num_shards for i in range(num_shards + 1)]
  job = _job_of(inputs, in_fmt, out_fmt, num_shards, total)
  unfinished = _read_job(out)
  others = _other_shard_sets(out, paths)
  existing = [p for p in paths if os.path.exists(p)]
  replaced = 0
  if overwrite:
    _write_job(out, job)  # before the removals: a kill from here on resumes
    for path in [*existing, *others]:
      os.remove(path)
    replaced, existing = len(existing) + len(others), []
  elif others or (existing and unfinished != job):
    raise _refusal(out, others + existing, num_shards, unfinished, job)
  else:
    _write_job(out, job)
  jobs = [
    (list(inputs), in_fmt, out_fmt, path, bounds[i], bounds[i + 1])
    for i, path in enumerate(paths)
    if path not in existing
  ]
  for shard in jobs:
    _remove_stale_temporaries(shard[3])
  with progress_lib.Progress(f"convert -> {os.path.basename(out)}", total, enabled=progress) as bar:
    bar.advance(total - sum(j[5] - j[4] for j in jobs))
    if workers == 1 or len(jobs) <= 1:
      for shard in jobs:
        bar.advance(_convert_shard(shard))
    else:
      # Spawned, not forked: a fork copies the caller's threads' locks
      # (pyarrow's, gRPC's, jax's) mid-use and can crash the child.
      with concurrent.futures.ProcessPoolExecutor(
        workers,
        mp_context=multiprocessing.get_context("spawn"),
        # A killed caller never shuts the pool down: its processes end
        # with it instead of converting on unseen and waiting forever.
        initializer=_lifetime.die_with_parent,
        initargs=(os.getpid(), _lifetime.on_lasting_thread()),
      ) as pool:
        for count in pool.map(_convert_shard, jobs):
          bar.advance(count)
  try:
    os.remove(_job_record_path(out))
  except FileNotFoundError:
    pass  # a conversion of the same job running beside this one ended first
  return {"records": total, "shards": paths, "skipped": len(existing), "replaced": replaced}
