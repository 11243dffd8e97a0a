"""Property tests: generated (not mutated) headers, chunks, hellos, specs and
journal records get only the decoders' own errors."""

from __future__ import annotations

import json
import socket
import struct
import threading

import hypothesis
from hypothesis import strategies as st
import pytest

from jaxfeed.service.dispatcher import server as dispatcher_lib
from jaxfeed.service.protocol import data_socket
from jaxfeed.service.protocol import element_chunks
from jaxfeed.service.protocol import spec
from jaxfeed.service.protocol import wire
from jaxfeed.service.protocol.protos import service_pb2 as pb
import fuzz_targets

pytestmark = pytest.mark.timeout(120)

# Deterministic (the same examples on every run) and nothing written to disk.
FUZZ = hypothesis.settings(
  max_examples=250,
  derandomize=True,
  database=None,
  deadline=None,
  suppress_health_check=list(hypothesis.HealthCheck),
)

SCALARS = (
  st.none()
  | st.booleans()
  | st.integers(-(1 << 70), 1 << 70)
  | st.floats(allow_nan=True, allow_infinity=True)
  | st.sampled_from(
    [
      "",
      "<f4",
      "|u1",
      "O",
      "zstd",
      "lz4",
      "d",
      "l",
      "t",
      "__array__",
      "__tuple__",
      "__dict__",
      "__node__",
      "__object__",
      "jaxfeed.ops.range:RangeNode",
      "numpy:negative",
      "dataset",
      "job",
      "task",
      "splits_issued",
    ]
  )
  | st.text(max_size=8)
)
JSON = st.recursive(
  SCALARS,
  lambda inner: (
    st.lists(inner, max_size=4)
    | st.dictionaries(SCALARS.filter(lambda k: isinstance(k, str)), inner, max_size=4)
  ),
  max_leaves=30,
)


def frame(header, body: bytes) -> bytes:
  header_bytes = json.dumps(header).encode()
  return wire.MAGIC + struct.pack("<I", len(header_bytes)) + header_bytes + body


@hypothesis.settings(FUZZ, max_examples=100)
@hypothesis.given(
  structure=JSON,
  leaves=st.lists(st.lists(JSON, min_size=4, max_size=4) | JSON, max_size=3),
  payload_bytes=JSON | st.integers(0, 64),
  compression=JSON | st.sampled_from(["lz4", "zstd"]),
  body=st.binary(max_size=64),
)
def test_generated_frame_headers_get_wire_format_error(
  structure, leaves, payload_bytes, compression, body
):
  header = {
    "structure": structure,
    "leaves": leaves,
    "payload_bytes": payload_bytes,
    "compression": compression,
  }
  try:
    wire.decode(frame(header, body), max_bytes=1 << 20)
  except wire.WireFormatError:
    pass


@FUZZ
@hypothesis.given(
  st.lists(
    st.binary(max_size=40)
    | st.builds(
      lambda size, data, end: (
        element_chunks.encode([data], size)
        if not end
        else pb.ElementChunk(
          end_of_sequence=True, stats_json=data.decode("latin-1")
        ).SerializeToString()
      ),
      st.integers(0, (1 << 63) - 1),
      st.binary(max_size=40),
      st.booleans(),
    ),
    max_size=5,
  )
)
def test_generated_chunk_streams_get_wire_format_error(raws):
  frames = element_chunks.FrameAssembler(1 << 20)
  try:
    for raw in raws:
      chunk = element_chunks.parse(raw)
      if chunk.end_of_sequence:
        frames.check_ended()
        chunk.end_stats()
        return
      done = frames.add(chunk)
      if done is not None:
        wire.decode(done[0], 1 << 20)
  except wire.WireFormatError:
    pass


@FUZZ
@hypothesis.given(
  graph=JSON, arrays=st.sampled_from([b"", wire.encode([])]) | st.binary(max_size=30)
)
def test_generated_specs_get_spec_error(graph, arrays):
  dataset_def = pb.DatasetDef(graph_json=json.dumps(graph).encode(), arrays=arrays)
  try:
    spec.from_dataset_def(dataset_def)
  except spec.SpecError:
    pass


FIELD = SCALARS | st.lists(SCALARS | st.lists(SCALARS, max_size=3), max_size=3)


@hypothesis.settings(FUZZ, max_examples=100)
@hypothesis.given(
  records=st.lists(
    JSON
    | st.fixed_dictionaries(
      {
        "kind": st.sampled_from(
          [
            "dataset",
            "job",
            "task",
            "client",
            "splits",
            "splits_issued",
            "splits_acked",
            "task_lost",
            "fix_workers",
            "job_deleted",
          ]
        )
      },
      optional={
        name: FIELD
        for name in (
          "id",
          "job_id",
          "task_id",
          "ranges",
          "starts",
          "workers",
          "policy",
          "dataset_id",
          "def",
          "job_name",
          "num_consumers",
          "num_positions",
          "next_position",
        )
      },
    ),
    max_size=4,
  )
)
def test_generated_journal_records_stop_the_replay_with_value_error(tmp_path_factory, records):
  work_dir = tmp_path_factory.getbasetemp() / "generated-journal"
  work_dir.mkdir(exist_ok=True)
  for path in work_dir.iterdir():  # what the last example's replay left
    path.unlink()
  (work_dir / "journal.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
  try:
    state = dispatcher_lib.DispatcherState(dispatcher_lib.DispatcherConfig(work_dir=str(work_dir)))
  except ValueError:
    return
  state.close()


class _OneShotServer:
  """Answers one data connection with given bytes, then closes it."""

  def __init__(self, reply: bytes):
    self._listener = socket.create_server(("127.0.0.1", 0))
    self._listener.settimeout(10)
    self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
    self._thread = threading.Thread(target=self._serve, args=(reply,), daemon=True)
    self._thread.start()

  def _serve(self, reply: bytes) -> None:
    try:
      conn, _ = self._listener.accept()
    except OSError:
      return
    with conn:
      try:
        conn.sendall(reply)
        conn.shutdown(socket.SHUT_WR)
        conn.recv(1 << 16)
      except OSError:
        pass

  def close(self) -> None:
    self._thread.join(timeout=10)
    self._listener.close()


@hypothesis.settings(FUZZ, max_examples=100)
@hypothesis.given(
  st.lists(
    st.tuples(st.integers(0, 255), st.integers(0, (1 << 64) - 1), st.binary(max_size=40)),
    max_size=3,
  )
)
def test_generated_data_socket_streams_get_connection_or_wire_errors(messages):
  reply = b"".join(
    fuzz_targets.socket_message(kind, body, length=length) for kind, length, body in messages
  )
  server = _OneShotServer(reply)
  try:
    conn = data_socket.DataConnection(server.address, {"task_id": 1}, max_frame_bytes=1 << 20)
    try:
      while conn.next_item() is not None:
        pass
    except (wire.WireFormatError, data_socket.DataConnectionError):
      pass
    finally:
      conn.close()
  finally:
    server.close()
