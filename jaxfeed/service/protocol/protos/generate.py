"""Regenerates the protobuf and gRPC modules beside the .proto files.

Usage (from the repository root):

  python -m jaxfeed.service.protocol.protos.generate

Needs grpcio-tools (a test dependency). The generated `*_pb2.py` and
`*_pb2_grpc.py` are committed; a test regenerates them into a temporary folder
and fails when the committed ones are stale.
"""

from __future__ import annotations

import pathlib
import re
import sys

PROTO_DIR = pathlib.Path(__file__).resolve().parent
PROTO_FILES = ("service.proto",)


def generate(out_dir: pathlib.Path = PROTO_DIR) -> list[pathlib.Path]:
  """Writes the generated modules into out_dir and returns their paths."""
  from grpc_tools import protoc  # pylint: disable=g-import-not-at-top

  out_dir = pathlib.Path(out_dir)
  out_dir.mkdir(parents=True, exist_ok=True)
  include = pathlib.Path(protoc.__file__).resolve().parent / "_proto"
  for name in PROTO_FILES:
    code = protoc.main(
      [
        "grpc_tools.protoc",
        f"-I{PROTO_DIR}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        str(PROTO_DIR / name),
      ]
    )
    if code != 0:
      raise RuntimeError(f"protoc failed on {PROTO_DIR / name} (exit {code}).")
  written = []
  for name in PROTO_FILES:
    stem = name[: -len(".proto")]
    grpc_module = out_dir / f"{stem}_pb2_grpc.py"
    # protoc writes a top-level import; the package needs a relative one.
    text = grpc_module.read_text()
    text = re.sub(rf"^import {stem}_pb2 as", f"from . import {stem}_pb2 as", text, flags=re.M)
    grpc_module.write_text(text)
    written += [out_dir / f"{stem}_pb2.py", grpc_module]
  return written


if __name__ == "__main__":
  for path in generate(pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else PROTO_DIR):
    print(path)
