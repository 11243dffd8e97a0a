"""The `jaxfeed` command.

  jaxfeed dispatcher [FLAGS]     the service's dispatcher (python -m jaxfeed.service.dispatcher)
  jaxfeed worker [FLAGS]         a service worker (python -m jaxfeed.service.worker)
  jaxfeed convert IN... OUT      TFRecord, ArrayRecord, NumPy, Parquet; sharded, parallel, resumable
  jaxfeed inspect FILE...        record count, sizes and a decoded sample
  jaxfeed bench MODULE:FUNCTION  runs a user's pipeline for a while: elements/s
                                 and a table of where each op spent its time

`convert` writes OUT (or OUT-SSSSS-of-NNNNN.ext with `--num_shards`), each
shard under a temporary name renamed into place when complete, so a killed
conversion starts again where it stopped: complete shards are kept. A
temporary is `.NAME.tmp-<random hex>` beside the shard and locked while it is
written: a later conversion removes only those of its own shards whose writer
is gone, never another running conversion's files.
NumPy (.npy/.npz) and Parquet files are tables whose rows are tf.train.Example
records, a feature per column (see `jaxfeed.tables`).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import fcntl
import functools
import importlib
import multiprocessing
import os
import re
import sys
import time
from typing import Any, Sequence
import uuid

import numpy as np

from jaxfeed import _lifetime

FORMATS = {".tfrecord": "tfrecord", ".tfrecords": "tfrecord",
           ".array_record": "array_record", ".arrayrecord": "array_record",
           ".npy": "numpy", ".npz": "numpy", ".parquet": "parquet"}
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
        f"use one of {', '.join(sorted(FORMATS))} or pass --from/--to.")
  return FORMATS[suffix]


def open_source(paths: Sequence[str], fmt: str) -> Any:
  import jaxfeed  # pylint: disable=g-import-not-at-top
  from jaxfeed import tables  # pylint: disable=g-import-not-at-top
  try:
    if fmt == "tfrecord":
      return jaxfeed.TFRecordSource(list(paths))
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
  return {"tfrecord": jaxfeed.write_tfrecord, "array_record": jaxfeed.write_array_record,
          "parquet": tables.write_parquet}[fmt]


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


def convert(inputs: Sequence[str], out: str, *, in_format: str | None = None,
            out_format: str | None = None, num_shards: int = 1,
            workers: int = 1, progress: bool | None = None) -> dict:
  """Converts every record of `inputs` to `out`; skips shards already there.

  Returns:
    {"records": total records, "shards": paths, "skipped": shards kept}.
  """
  from jaxfeed import progress as progress_lib  # pylint: disable=g-import-not-at-top
  in_fmt = file_format(inputs[0], in_format)
  out_fmt = file_format(out, out_format)
  if num_shards < 1 or workers < 1:
    raise UsageError(f"--num_shards and --workers must be >= 1, got "
                     f"{num_shards} and {workers}.")
  missing = [p for p in inputs if not os.path.exists(p)]
  if missing:
    raise UsageError(f"No such input file: {missing[0]!r}.")
  total = len(open_source(inputs, in_fmt))
  paths = shard_paths(out, num_shards)
  bounds = [total * i // num_shards for i in range(num_shards + 1)]
  jobs = [(list(inputs), in_fmt, out_fmt, path, bounds[i], bounds[i + 1])
          for i, path in enumerate(paths) if not os.path.exists(path)]
  skipped = num_shards - len(jobs)
  for job in jobs:
    _remove_stale_temporaries(job[3])
  with progress_lib.Progress(f"convert -> {os.path.basename(out)}", total,
                             enabled=progress) as bar:
    bar.advance(total - sum(j[5] - j[4] for j in jobs))
    if workers == 1 or len(jobs) <= 1:
      for job in jobs:
        bar.advance(_convert_shard(job))
    else:
      # Spawned, not forked: a fork copies the caller's threads' locks
      # (pyarrow's, gRPC's, jax's) mid-use and can crash the child.
      with concurrent.futures.ProcessPoolExecutor(
          workers, mp_context=multiprocessing.get_context("spawn"),
          # A killed caller never shuts the pool down: its processes end
          # with it instead of converting on unseen and waiting forever.
          initializer=_lifetime.die_with_parent,
          initargs=(os.getpid(), _lifetime.on_lasting_thread())) as pool:
        for count in pool.map(_convert_shard, jobs):
          bar.advance(count)
  return {"records": total, "shards": paths, "skipped": skipped}


def describe_record(record: bytes) -> str:
  """A short readable view of a record: a tf.train.Example's features if it
  parses as one, else its first bytes."""
  summary = describe_example(record)
  if summary:
    return summary
  head = record[:64]
  text = head.decode("utf-8", errors="replace")
  printable = sum(ch.isprintable() or ch in "\n\t" for ch in text) / max(1, len(text))
  return repr(text if printable > 0.9 else head) + (" ..." if len(record) > 64 else "")


def describe_example(record: bytes, max_values: int = 4) -> str | None:
  """`{name: type[count] [first values], ...}` of a tf.train.Example, or None
  when `record` does not parse as one with features."""
  from google.protobuf import message  # pylint: disable=g-import-not-at-top
  from jaxfeed.protos import example_pb2  # pylint: disable=g-import-not-at-top
  try:
    features = example_pb2.Example.FromString(record).features.feature
  except message.DecodeError:
    return None
  parts = []
  for name in sorted(features):
    kind = features[name].WhichOneof("kind")
    if kind is None:
      return None  # random bytes can parse as an Example, but not as features
    values = list(getattr(features[name], kind).value)
    shown = ", ".join(repr(v) for v in values[:max_values])
    more = ", ..." if len(values) > max_values else ""
    parts.append(f"{name!r}: {kind[:-5]}[{len(values)}] [{shown}{more}]")
  return "{" + ", ".join(parts) + "}" if parts else None


def inspect_files(paths: Sequence[str], fmt: str | None = None,
                  samples: int = 1) -> dict:
  """Record count and size statistics of files of one format."""
  source = open_source(paths, file_format(paths[0], fmt))
  count = len(source)
  sizes = np.zeros(count, np.int64)
  for first in range(0, count, 1024):
    chunk = source.get_many(np.arange(first, min(first + 1024, count)))
    sizes[first:first + len(chunk)] = [len(r) for r in chunk]
  return {
      "records": count, "bytes": int(sizes.sum()),
      "record_bytes": ({"min": int(sizes.min()), "mean": float(sizes.mean()),
                        "max": int(sizes.max())} if count else None),
      "samples": [describe_record(source[i]) for i in range(min(samples, count))],
  }


def bench(target: str, seconds: float, warmup_s: float = 1.0) -> dict:
  """Builds `module:function()`'s pipeline and reads it for `seconds`."""
  if ":" not in target:
    raise UsageError(f"bench needs MODULE:FUNCTION, got {target!r}.")
  module_name, name = target.split(":", 1)
  sys.path.insert(0, os.getcwd())
  fn = getattr(importlib.import_module(module_name), name)
  dataset = fn()
  iterator = dataset.make_iterator() if hasattr(dataset, "make_iterator") else iter(dataset)
  elements, start = 0, time.perf_counter()
  try:
    warm_until = start + warmup_s
    while time.perf_counter() < warm_until:
      next(iterator)
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
      next(iterator)
      elements += 1
  except StopIteration:
    pass
  finally:
    elapsed = time.perf_counter() - start
    close = getattr(iterator, "close", None)
    if close is not None:
      close()
  result = {"elements": elements, "seconds": round(elapsed, 3),
            "elements_per_s": round(elements / elapsed, 1) if elapsed else 0.0}
  stats = getattr(iterator, "stats", None)
  if callable(stats):
    result["stats"] = stats()
  return result


def bench_report(result: dict) -> str:
  """`bench`'s result as text: the rate, then the per-op table and the op
  that limits the rate."""
  from jaxfeed.ops import op_stats  # pylint: disable=g-import-not-at-top
  head = (f"{result['elements']} elements in {result['seconds']} s: "
          f"{result['elements_per_s']} elements/s")
  rows = result.get("stats", {}).get("ops")
  return f"{head}\n\n{op_stats.report(rows)}" if rows else head


def _server(role: str, argv: Sequence[str]) -> None:
  from absl import app  # pylint: disable=g-import-not-at-top
  module = importlib.import_module(f"jaxfeed.service.{role}.server")
  module.define_flags()
  app.run(module.main, argv=[f"jaxfeed {role}", *argv])


def main(argv: Sequence[str] | None = None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  if argv and argv[0] in ("dispatcher", "worker"):
    _server(argv[0], argv[1:])
    return 0
  parser = argparse.ArgumentParser(prog="jaxfeed", description=__doc__.split("\n\n")[0])
  commands = parser.add_subparsers(dest="command", required=True)
  commands.add_parser("dispatcher", help="run the service's dispatcher (flags: --help)")
  commands.add_parser("worker", help="run a service worker (flags: --help)")
  conv = commands.add_parser("convert", help="convert record files")
  conv.add_argument("paths", nargs="+", help="input files, then the output")
  conv.add_argument("--from", dest="in_format", choices=FORMAT_NAMES)
  conv.add_argument("--to", dest="out_format", choices=FORMAT_NAMES)
  conv.add_argument("--num_shards", type=int, default=1)
  conv.add_argument("--workers", type=int, default=min(4, os.cpu_count() or 1))
  insp = commands.add_parser("inspect", help="describe record files")
  insp.add_argument("paths", nargs="+")
  insp.add_argument("--format", choices=FORMAT_NAMES)
  insp.add_argument("--samples", type=int, default=1)
  ben = commands.add_parser("bench", help="time a pipeline: MODULE:FUNCTION")
  ben.add_argument("target")
  ben.add_argument("--seconds", type=float, default=10.0)
  ben.add_argument("--json", action="store_true",
                   help="print the result as JSON instead of a table")
  args = parser.parse_args(argv)
  import json  # pylint: disable=g-import-not-at-top
  try:
    if args.command == "convert":
      if len(args.paths) < 2:
        raise UsageError("convert needs at least one input and an output.")
      result = convert(args.paths[:-1], args.paths[-1], in_format=args.in_format,
                       out_format=args.out_format, num_shards=args.num_shards,
                       workers=args.workers)
    elif args.command == "inspect":
      result = inspect_files(args.paths, args.format, args.samples)
    else:
      result = bench(args.target, args.seconds)
      if not args.json:
        print(bench_report(result))
        return 0
  except UsageError as e:
    print(f"jaxfeed {args.command}: {e}", file=sys.stderr)
    return 2
  print(json.dumps(result, indent=1, default=str))
  return 0


if __name__ == "__main__":
  sys.exit(main())
