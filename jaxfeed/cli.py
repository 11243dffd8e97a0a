"""The `jaxfeed` command.

  jaxfeed dispatcher [FLAGS]     the service's dispatcher (python -m jaxfeed.service.dispatcher)
  jaxfeed worker [FLAGS]         a service worker (python -m jaxfeed.service.worker)
  jaxfeed convert IN... OUT      TFRecord, ArrayRecord, NumPy, Parquet; sharded, parallel, resumable
  jaxfeed inspect FILE...        record count, sizes and a decoded sample
  jaxfeed inspect FOLDER         a saved dataset's progress (Dataset.save,
                                 distributed_save): chunks done of expected,
                                 elements, bytes, complete or not; or an
                                 autocache folder's entries and the autocache
                                 policy's decisions, with their reasons
  jaxfeed bench MODULE:FUNCTION  runs a user's pipeline for a while: elements/s
                                 and a table of where each op spent its time
  jaxfeed cache ls|rm DIR        an autocache folder's entries (--autocache_dir):
                                 list them, or remove those not in use

Every command takes `--help`. A command line it cannot act on (an unknown
flag, a bad value, a missing file) ends with one line naming what is wrong
and what is allowed, and exit status 2.

`dispatcher`, `worker` and `bench` put the current folder first on the
module path, as `python -m` does, so that `--udf_modules` and
MODULE:FUNCTION find modules there.

`convert` writes OUT (or OUT-SSSSS-of-NNNNN.ext with `--num_shards`); it
resumes an interrupted conversion of the same inputs and refuses outputs it
did not write unless `--overwrite` (see `jaxfeed.convert`).
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import os
import sys
import textwrap
import time
from typing import Any, Callable, NoReturn, Sequence

import numpy as np

from jaxfeed import cli_cache
from jaxfeed.convert import FORMAT_NAMES, UsageError, convert, file_format, open_source

_IMAGE_MAGIC = ((b"\xff\xd8\xff", "JPEG"), (b"\x89PNG\r\n\x1a\n", "PNG"))
_PREFIX_BYTES = 16  # of a long bytes value, shown by `inspect`


# -- inspect -------------------------------------------------------------------
def describe_bytes(data: bytes) -> str:
  """A bytes value in a line: short ones as they are, long ones as their size
  and first bytes, JPEG and PNG images as their size and decoded shape."""
  for magic, kind in _IMAGE_MAGIC:
    if data.startswith(magic):
      return f"<{kind}, {len(data)} bytes, {_decoded_shape(data)}>"
  if len(data) <= 2 * _PREFIX_BYTES:
    return repr(data)
  return f"<{len(data)} bytes: {data[:_PREFIX_BYTES]!r}...>"


def _decoded_shape(image: bytes) -> str:
  """'height x width x channels' of an image, or why it is not known."""
  from jaxfeed import image as image_lib  # pylint: disable=g-import-not-at-top

  try:
    return "x".join(map(str, image_lib.decode_image(image, channels=0).shape))
  except ImportError:
    return "shape unknown: pip install 'jaxfeed[image]' to decode it"
  except ValueError as e:
    return f"does not decode: {e}"


def describe_record(record: bytes) -> str:
  """A short readable view of a record: a tf.train.Example's features if it
  parses as one, else its size and first bytes (or text)."""
  summary = describe_example(record)
  if summary:
    return summary
  head = record[:64]
  text = head.decode("utf-8", errors="replace")
  printable = sum(ch.isprintable() or ch in "\n\t" for ch in text) / max(1, len(text))
  if printable > 0.9:
    return repr(text) + (f" ... ({len(record)} bytes)" if len(record) > 64 else "")
  return describe_bytes(record)


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
    shown = ", ".join(
      describe_bytes(v) if isinstance(v, bytes) else repr(v) for v in values[:max_values]
    )
    more = ", ..." if len(values) > max_values else ""
    parts.append(f"{name!r}: {kind[:-5]}[{len(values)}] [{shown}{more}]")
  return "{" + ", ".join(parts) + "}" if parts else None


def inspect_saved(path: str, samples: int = 1) -> dict:
  """The progress of the saved dataset at `path` (complete or being written),
  and when complete its element spec and first elements."""
  from jaxfeed.ops import load as load_lib  # pylint: disable=g-import-not-at-top
  from jaxfeed.ops import save_format  # pylint: disable=g-import-not-at-top

  try:
    progress = save_format.progress(path)
  except save_format.SaveFormatError as e:
    raise UsageError(str(e)) from None
  result: dict[str, Any] = {
    "saved_dataset": progress.path,
    "complete": progress.complete,
    "writer": progress.writer,
    "chunks_done": progress.chunks_done,
    "chunks_expected": (
      progress.chunks_expected if progress.chunks_expected >= 0 else "unknown until complete"
    ),
    "elements": progress.num_elements,
    "bytes": progress.num_bytes,
    **({"failed": progress.error} if progress.error else {}),
  }
  if progress.complete:
    source = load_lib.SavedDatasetSource(path)
    result["element_spec"] = str(source.element_spec)
    result["samples"] = [repr(source[i]) for i in range(min(samples, len(source)))]
  return result


def _check_inputs(paths: Sequence[str]) -> None:
  for path in paths:
    if not os.path.isfile(path):
      raise UsageError(
        f"No such file: {path!r}."
        if not os.path.exists(path)
        else f"{path!r} is a folder; name its files."
      )


def inspect_files(paths: Sequence[str], fmt: str | None = None, samples: int = 1) -> dict:
  """Record count and size statistics of files of one format.

  A damaged TFRecord file is described by its intact records, and its
  damaged byte ranges are listed under "damage".
  """
  _check_inputs(paths)
  source = open_source(paths, file_format(paths[0], fmt), on_damage="skip")
  count = len(source)
  sizes = np.zeros(count, np.int64)
  for first in range(0, count, 1024):
    chunk = source.get_many(np.arange(first, min(first + 1024, count)))
    sizes[first : first + len(chunk)] = [len(r) for r in chunk]
  return {
    "records": count,
    "bytes": int(sizes.sum()),
    "record_bytes": (
      {"min": int(sizes.min()), "mean": float(sizes.mean()), "max": int(sizes.max())}
      if count
      else None
    ),
    "samples": [describe_record(source[i]) for i in range(min(samples, count))],
    **(
      {
        "damage": [
          f"{d.path} bytes {d.start}-{'end' if d.end is None else d.end}: {d.reason}"
          for d in source.damage
        ]
      }
      if getattr(source, "damage", ())
      else {}
    ),
  }


# -- bench ---------------------------------------------------------------------
def load_function(target: str) -> Callable[[], Any]:
  """The function `MODULE:FUNCTION` names, MODULE found from the current
  folder first.

  Raises:
    UsageError: no such module (the module's own failed imports are raised
      as they are) or no such function in it.
  """
  module_name, _, name = target.partition(":")
  if not module_name or not name.isidentifier():
    raise UsageError(
      f"bench needs MODULE:FUNCTION (e.g. my_pipeline:make for the "
      f"function make in ./my_pipeline.py), got {target!r}."
    )
  if os.getcwd() not in sys.path:
    sys.path.insert(0, os.getcwd())
  try:
    module = importlib.import_module(module_name)
  except ModuleNotFoundError as e:
    if e.name is None or not f"{module_name}.".startswith(f"{e.name}."):
      raise  # the module is there; something it imports is not
    hint = (
      f" (a module name, not a file: {module_name[:-3]}:{name})"
      if module_name.endswith(".py")
      else ""
    )
    raise UsageError(
      f"No module {module_name!r} in the current folder ({os.getcwd()}) "
      f"or on the module path{hint}."
    ) from None
  fn = getattr(module, name, None)
  if not callable(fn):
    functions = sorted(
      k
      for k, v in vars(module).items()
      if inspect.isfunction(v) and not k.startswith("_") and v.__module__ == module.__name__
    )
    where = f"Module {module_name!r} ({getattr(module, '__file__', '?')})"
    what = (
      f"{where} has no attribute {name!r}"
      if fn is None
      else f"{where}: {name!r} is of type {type(fn).__name__}, not a function"
    )
    raise UsageError(f"{what}; its functions: {', '.join(functions) or 'none'}.")
  return fn


def bench(target: str, seconds: float, warmup_s: float = 1.0) -> dict:
  """Builds `module:function()`'s pipeline, reads it for `warmup_s`, then
  times it for `seconds`.

  A pipeline that ends during the warm-up is timed from its start (the note
  in the result says so).

  Raises:
    UsageError: `target` names no function, it returns no iterable, or the
      pipeline has no element.
  """
  dataset = load_function(target)()
  if not (hasattr(dataset, "make_iterator") or hasattr(dataset, "__iter__")):
    raise UsageError(
      f"{target}() returned a {type(dataset).__name__}; it must return "
      "a jaxfeed.Dataset or another iterable."
    )
  iterator = dataset.make_iterator() if hasattr(dataset, "make_iterator") else iter(dataset)
  warm = elements = 0
  began = start = time.perf_counter()
  ended = False
  try:
    warm_until = began + warmup_s
    while time.perf_counter() < warm_until:
      next(iterator)
      warm += 1
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
      next(iterator)
      elements += 1
  except StopIteration:
    ended = True
  finally:
    elapsed = time.perf_counter() - start
    stats = getattr(iterator, "stats", None)
    result = {"stats": stats()} if callable(stats) else {}
    close = getattr(iterator, "close", None)
    if close is not None:
      close()
  if ended and elements == 0:
    if warm == 0:
      raise UsageError(f"{target}()'s pipeline has no element: nothing to time.")
    # Too short for a warm-up: time the whole read, start-up included.
    elements, elapsed = warm, time.perf_counter() - began
    result["note"] = (
      f"the pipeline ended after {warm} elements, within the "
      f"{warmup_s:g} s warm-up: timed from its start, start-up "
      "included; a longer pipeline (e.g. .repeat()) gives a "
      "steady-state rate"
    )
  elif ended:
    result["note"] = f"the pipeline ended after {elapsed:.3f} of the {seconds:g} s asked for"
  return {
    "elements": elements,
    "seconds": round(elapsed, 3),
    "elements_per_s": round(elements / elapsed, 1) if elapsed else 0.0,
    **result,
  }


def bench_report(result: dict) -> str:
  """`bench`'s result as text: the rate, then the per-op table and the op
  that limits the rate."""
  from jaxfeed.ops import op_report  # pylint: disable=g-import-not-at-top

  head = (
    f"{result['elements']} elements in {result['seconds']} s: {result['elements_per_s']} elements/s"
  )
  if result.get("note"):
    head += f"\nNote: {result['note']}."
  rows = result.get("stats", {}).get("ops")
  return f"{head}\n\n{op_report.report(rows)}" if rows else head


# -- the servers ---------------------------------------------------------------
def _flag_help(flag: Any) -> str:
  """One absl flag as `--name: help (default: value)`, wrapped."""
  default = "" if flag.default is None else f" (default: {flag.default_as_str})"
  required = " (required)" if flag.default is None and not flag.name.startswith("no") else ""
  return textwrap.fill(
    f"{flag.help}{default}", width=88, initial_indent="    ", subsequent_indent="    "
  ).join([f"  --{flag.name}:{required}\n", ""])


def _server(role: str, argv: Sequence[str]) -> int:
  """Runs the dispatcher or a worker with absl flags; `--help` lists them."""
  from absl import app  # pylint: disable=g-import-not-at-top
  from absl import flags  # pylint: disable=g-import-not-at-top

  module = importlib.import_module(f"jaxfeed.service.{role}.server")
  known = set(flags.FLAGS)
  module.define_flags()
  prog = f"jaxfeed {role}"
  if any(arg in ("-h", "--help", "-help", "--helpshort") for arg in argv):
    print(
      f"usage: {prog} [FLAGS]\n\n{(inspect.getdoc(module) or role).splitlines()[0]}\n"
      "The current folder comes first on the module path (as with python -m), "
      "so --udf_modules finds modules there.\n\nflags:"
    )
    for name in sorted(set(flags.FLAGS) - known):
      print(_flag_help(flags.FLAGS[name]))
    return 0

  def parse(args: list[str]) -> list[str]:
    try:
      return flags.FLAGS(args)
    except flags.Error as e:
      _fail(prog, f"{e}")

  # As `python -m jaxfeed.service.worker` does: UDF modules in the current
  # folder import.
  if os.getcwd() not in sys.path:
    sys.path.insert(0, os.getcwd())
  app.run(module.main, argv=[prog, *argv], flags_parser=parse)
  return 0


# -- the command line ----------------------------------------------------------
def _fail(prog: str, message: str) -> NoReturn:
  print(f"{prog}: {message.rstrip('.')}. See: {prog} --help", file=sys.stderr)
  sys.exit(2)


class _Parser(argparse.ArgumentParser):
  """argparse with one-line errors (no usage block) and exit status 2."""

  def error(self, message: str) -> NoReturn:
    _fail(self.prog, message)


def _at_least(minimum: float, kind: type) -> Callable[[str], Any]:
  def parse(text: str) -> Any:
    try:
      value = kind(text)
    except ValueError:
      raise argparse.ArgumentTypeError(
        f"{text!r} is not {'an integer' if kind is int else 'a number'}"
      ) from None
    if value < minimum:
      raise argparse.ArgumentTypeError(f"{text} is less than {minimum}")
    return value

  parse.__name__ = kind.__name__
  return parse


def _parser() -> argparse.ArgumentParser:
  parser = _Parser(
    prog="jaxfeed",
    description=__doc__.split("\n\n")[0] + "\n\n" + __doc__.split("\n\n")[1],
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
  commands.add_parser(
    "dispatcher",
    help="run the service's dispatcher (its flags: jaxfeed dispatcher --help)",
    add_help=False,
  )
  commands.add_parser(
    "worker", help="run a service worker (its flags: jaxfeed worker --help)", add_help=False
  )
  conv = commands.add_parser(
    "convert",
    help="convert record files",
    description="Converts every record of the inputs, in order, to OUT: TFRecord "
    "(.tfrecord), ArrayRecord (.array_record), NumPy (.npy/.npz) or Parquet "
    "(.parquet), a tf.train.Example per table row. Prints a JSON summary. Run "
    "again after a kill, it keeps the complete shards and writes the rest; "
    "outputs it did not write make it refuse unless --overwrite.",
  )
  conv.add_argument(
    "paths", nargs="+", metavar="FILE", help="the input files, then the output file (IN... OUT)"
  )
  conv.add_argument(
    "--from",
    dest="in_format",
    choices=FORMAT_NAMES,
    help="the inputs' format (default: from their extension)",
  )
  conv.add_argument(
    "--to",
    dest="out_format",
    choices=FORMAT_NAMES,
    help="the output's format (default: from its extension)",
  )
  conv.add_argument(
    "--num_shards",
    type=_at_least(1, int),
    default=1,
    help="output files OUT-SSSSS-of-NNNNN.ext, records split evenly "
    "in order (default: 1, OUT itself)",
  )
  conv.add_argument(
    "--workers",
    type=_at_least(1, int),
    default=min(4, os.cpu_count() or 1),
    help="processes writing shards at once (default: %(default)s)",
  )
  conv.add_argument(
    "--overwrite",
    action="store_true",
    help="remove existing outputs of OUT (any shard count) first, instead of refusing",
  )
  insp = commands.add_parser(
    "inspect",
    help="describe record files, or a saved dataset's folder",
    description="Prints, as JSON, the record count, the record sizes and the first "
    "records decoded: tf.train.Example features with their types and first values "
    "(long bytes as their size and first bytes, JPEG and PNG as their decoded shape). "
    "Given one folder written by Dataset.save or distributed_save: its chunks done "
    "of those expected, elements, bytes and whether it is complete. Given an "
    "autocache folder (--autocache_dir): its entries, and for each autocache point "
    "the policy's last decision (compute, write or read), what it measured and why.",
  )
  insp.add_argument(
    "paths", nargs="+", metavar="FILE", help="files of one format, or one saved dataset's folder"
  )
  insp.add_argument(
    "--format", choices=FORMAT_NAMES, help="their format (default: from the extension)"
  )
  insp.add_argument(
    "--samples", type=_at_least(0, int), default=1, help="records to show (default: %(default)s)"
  )
  ben = commands.add_parser(
    "bench",
    help="time a pipeline: MODULE:FUNCTION",
    description="Calls FUNCTION() of MODULE (found from the current folder first), "
    "reads the jaxfeed.Dataset (or iterable) it returns for --warmup seconds, then "
    "times it for --seconds and prints elements/s, each op's time and the op that "
    "limits the rate.",
  )
  ben.add_argument(
    "target", metavar="MODULE:FUNCTION", help="e.g. my_pipeline:make for make() in ./my_pipeline.py"
  )
  ben.add_argument(
    "--seconds",
    type=_at_least(0.001, float),
    default=10.0,
    help="seconds timed after the warm-up (default: %(default)s)",
  )
  ben.add_argument(
    "--warmup",
    type=_at_least(0, float),
    default=1.0,
    help="seconds read before timing (default: %(default)s)",
  )
  ben.add_argument(
    "--json", action="store_true", help="print the result as JSON instead of a table"
  )
  cli_cache.add_parser(commands)
  return parser


def main(argv: Sequence[str] | None = None) -> int:
  """Runs `jaxfeed ARGV...`; returns the exit status."""
  argv = list(sys.argv[1:] if argv is None else argv)
  if argv and argv[0] in ("dispatcher", "worker"):
    return _server(argv[0], argv[1:])
  args = _parser().parse_args(argv)
  try:
    if args.command == "convert":
      if len(args.paths) < 2:
        raise UsageError("convert needs at least one input and an output.")
      result = convert(
        args.paths[:-1],
        args.paths[-1],
        in_format=args.in_format,
        out_format=args.out_format,
        num_shards=args.num_shards,
        workers=args.workers,
        overwrite=args.overwrite,
      )
    elif (
      args.command == "inspect"
      and len(args.paths) == 1
      and os.path.isfile(os.path.join(args.paths[0], "save.json"))
    ):
      result = inspect_saved(args.paths[0], args.samples)
    elif (
      args.command == "inspect"
      and len(args.paths) == 1
      and cli_cache.is_autocache_folder(args.paths[0])
    ):
      result = cli_cache.inspect_folder(args.paths[0])
    elif args.command == "inspect":
      result = inspect_files(args.paths, args.format, args.samples)
    elif args.command == "cache":
      return cli_cache.run(args)
    else:
      result = bench(args.target, args.seconds, args.warmup)
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
