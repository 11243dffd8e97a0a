"""`jaxfeed cache ls|rm DIR`: the entries of an autocache folder.

  jaxfeed cache ls DIR              entries, bytes, last use and state
  jaxfeed cache rm DIR [ENTRY...]   removes entries (all of them without
                                    ENTRY); refuses those in use

See `jaxfeed.ops.autocache_folder` for what an entry is and how a process
marks one in use.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from typing import Any

from jaxfeed.convert import UsageError
from jaxfeed.ops import autocache_policy
from jaxfeed.ops.autocache_folder import AutocacheFolder, EntryInUseError

__all__ = ["add_parser", "inspect_folder", "is_autocache_folder", "run"]

_IN_USE_STATUS = 1


def add_parser(commands: Any) -> None:
  """Adds `cache` and its `ls` and `rm` commands to `jaxfeed`'s parser."""
  cache = commands.add_parser(
    "cache",
    help="list or remove the entries of an autocache folder",
    description="The entries of an autocache folder (workers fill it with "
    "--autocache_dir): "
    "`ls` lists them, `rm` removes them. An entry a process is reading or writing "
    "is never removed.",
  )
  actions = cache.add_subparsers(dest="action", required=True, metavar="ACTION")
  ls = actions.add_parser(
    "ls",
    help="entries, bytes, last use and state",
    description="Lists the entries of an autocache folder, least recently used "
    "first: name, bytes, when a read or write of it last started or ended, and "
    "its state: idle, reading, writing, or abandoned (a write that never "
    "finished).",
  )
  ls.add_argument("dir", metavar="DIR", help="the autocache folder")
  ls.add_argument("--json", action="store_true", help="print the entries as JSON")
  rm = actions.add_parser(
    "rm",
    help="remove entries (all of them without ENTRY)",
    description="Removes the named entries of an autocache folder, or all of them. "
    f"Entries in use are left and named; the status is then {_IN_USE_STATUS}.",
  )
  rm.add_argument("dir", metavar="DIR", help="the autocache folder")
  rm.add_argument(
    "entries",
    nargs="*",
    metavar="ENTRY",
    help="entry names, as `jaxfeed cache ls` shows them (default: all)",
  )


def _folder(path: str) -> AutocacheFolder:
  if not os.path.isdir(path):
    raise UsageError(
      f"no folder {path!r}"
      if not os.path.exists(path)
      else f"{path!r} is a file; give an autocache folder (--autocache_dir)"
    )
  return AutocacheFolder(path)


def _when(seconds: float, now: float) -> str:
  stamp = datetime.datetime.fromtimestamp(seconds, datetime.timezone.utc)
  return f"{stamp:%Y-%m-%d %H:%M:%S}Z ({max(0.0, now - seconds):.0f} s ago)"


def _ls(args: argparse.Namespace) -> int:
  entries = _folder(args.dir).entries()
  if args.json:
    print(
      json.dumps(
        [
          {"entry": e.name, "bytes": e.bytes, "last_used": e.last_used, "state": e.state}
          for e in entries
        ],
        indent=1,
      )
    )
    return 0
  now = time.time()
  rows = [("ENTRY", "BYTES", "LAST USED", "STATE")] + [
    (e.name, str(e.bytes), _when(e.last_used, now), e.state) for e in entries
  ]
  widths = [max(len(row[i]) for row in rows) for i in range(3)]
  for row in rows:
    print(f"{row[0]:<{widths[0]}}  {row[1]:>{widths[1]}}  {row[2]:<{widths[2]}}  {row[3]}")
  total = sum(e.bytes for e in entries)
  print(f"{len(entries)} entries, {total} bytes in {os.path.abspath(args.dir)}")
  return 0


def _rm(args: argparse.Namespace) -> int:
  folder = _folder(args.dir)
  try:
    removed = folder.remove(args.entries or None)
  except KeyError as e:
    raise UsageError(str(e.args[0])) from None
  except EntryInUseError as e:
    print(f"jaxfeed cache rm: {e}.", file=sys.stderr)
    return _IN_USE_STATUS
  print(f"removed {len(removed)} entries" + (f": {', '.join(removed)}" if removed else ""))
  return 0


def is_autocache_folder(path: str) -> bool:
  """Whether `path` is an autocache folder (it holds `.jaxfeed/`)."""
  return os.path.isdir(os.path.join(path, ".jaxfeed"))


def inspect_folder(path: str) -> dict:
  """`jaxfeed inspect DIR` of an autocache folder: its entries, and the
  autocache policy's last decision for each point, with what it measured
  and why (see `jaxfeed.ops.autocache_policy`)."""
  entries = _folder(path).entries()
  return {
    "autocache_folder": os.path.abspath(path),
    "entries": [
      {"entry": e.name, "bytes": e.bytes, "last_used": e.last_used, "state": e.state}
      for e in entries
    ],
    "decisions": [
      {
        "point": record.get("entry"),
        "job": record.get("job"),
        "decision": record.get("decision"),
        "why": record.get("reason"),
        "measurements": record.get("measurements"),
      }
      for record in autocache_policy.read_records(path)
    ],
  }


def run(args: argparse.Namespace) -> int:
  """Runs `jaxfeed cache ACTION`; returns the exit status.

  Raises:
    UsageError: DIR is no folder, or an ENTRY is not in it.
  """
  return _ls(args) if args.action == "ls" else _rm(args)
