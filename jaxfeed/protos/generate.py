"""Regenerates `example_pb2.py` beside `example.proto`.

Usage (from the repository root):

  python -m jaxfeed.protos.generate [OUT_DIR]

Needs grpcio-tools (a test dependency). The generated module is committed; a
test regenerates it into a temporary folder and fails when it is stale.
"""

from __future__ import annotations

import pathlib
import shutil
import sys
import tempfile

PROTO_DIR = pathlib.Path(__file__).resolve().parent
ROOT = PROTO_DIR.parents[1]
PROTO_FILES = ("example.proto",)


def generate(out_dir: pathlib.Path = PROTO_DIR) -> list[pathlib.Path]:
  """Writes the generated modules into out_dir and returns their paths."""
  from grpc_tools import protoc  # pylint: disable=g-import-not-at-top

  out_dir = pathlib.Path(out_dir)
  out_dir.mkdir(parents=True, exist_ok=True)
  written = []
  # Compiled relative to the repository root, so the descriptor's file name is
  # "jaxfeed/protos/example.proto": unique in the process-wide pool.
  with tempfile.TemporaryDirectory() as tmp:
    for name in PROTO_FILES:
      code = protoc.main(
        ["grpc_tools.protoc", f"-I{ROOT}", f"--python_out={tmp}", str(PROTO_DIR / name)]
      )
      if code != 0:
        raise RuntimeError(f"protoc failed on {PROTO_DIR / name} (exit {code}).")
      module = f"{name[: -len('.proto')]}_pb2.py"
      shutil.copyfile(pathlib.Path(tmp, "jaxfeed", "protos", module), out_dir / module)
      written.append(out_dir / module)
  return written


if __name__ == "__main__":
  for path in generate(pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else PROTO_DIR):
    print(path)
