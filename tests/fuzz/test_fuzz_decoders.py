"""The service's decoders refuse damaged and hostile input with their own
errors: never another exception, a hang or an allocation the input asks for."""

from __future__ import annotations

import base64
import json
import os
import pathlib
import resource
import struct
import subprocess
import sys

import lz4.frame
import numpy as np
import pytest

import jaxfeed
from jaxfeed.service.dispatcher import server as dispatcher_lib
from jaxfeed.service.protocol import spec
from jaxfeed.service.protocol import wire
from jaxfeed.service.protocol.protos import service_pb2 as pb
from jaxfeed.service.storage import journal_lines
from jaxfeed.service.storage import journal_records
from jaxfeed.service.storage import journal_replay

pytestmark = pytest.mark.timeout(240)

FUZZ_TARGETS = pathlib.Path(__file__).resolve().parent / "fuzz_targets.py"
CASES = {
  "wire_frame": 1000,
  "element_chunks": 1000,
  "data_socket_client": 500,
  "dataset_spec": 400,
  "journal_replay": 250,
}


@pytest.mark.parametrize("target", sorted(CASES))
def test_mutated_inputs_get_the_decoders_own_errors_within_bounded_memory(target):
  env = {
    **os.environ,
    "PYTHONPATH": os.pathsep.join([str(FUZZ_TARGETS.parents[2]), os.environ.get("PYTHONPATH", "")]),
  }
  # The child caps its address space: a decoder allocating what an input
  # declares dies with MemoryError (a crash) instead of swapping the machine.
  result = subprocess.run(
    [
      sys.executable,
      str(FUZZ_TARGETS),
      f"--targets={target}",
      f"--cases={CASES[target]}",
      "--seed=20261123",
      "--rlimit_mb=1024",
    ],
    capture_output=True,
    text=True,
    timeout=200,
    env=env,
    check=False,
  )
  assert result.returncode == 0, result.stderr[-3000:]
  (stats,) = json.loads(result.stdout)
  assert stats["cases"] > CASES[target]
  assert (stats["crashes"], stats["hangs"]) == (0, 0), stats["failures"]
  assert stats["max_rss_growth_mb"] < 512, stats
  assert sum(n for kind, n in stats["outcomes"].items() if kind != "ok") > 0  # it fuzzed


# -- frames ----------------------------------------------------------------------
def frame_with(header, body: bytes = b"") -> bytes:
  header_bytes = header if isinstance(header, bytes) else json.dumps(header).encode()
  return wire.MAGIC + struct.pack("<I", len(header_bytes)) + header_bytes + body


GOOD_HEADER = {
  "structure": None,
  "paths": [""],
  "leaves": [["<f4", [2], 0, 8]],
  "payload_bytes": 8,
  "compression": "",
}


@pytest.mark.parametrize(
  "frame, message",
  [
    (frame_with(b'{"structure":null,"leaves":[],"payload_bytes":1e400}'), "payload of inf"),
    (frame_with(b"[" * 100000 + b"]" * 100000), "not valid JSON"),
    (
      frame_with(
        (
          '{"structure":' + '{"l":[' * 450 + "null" + "]}" * 450 + ',"leaves":[],"payload_bytes":0}'
        ).encode()
      ),
      "deeper than|not valid JSON",
    ),
    (frame_with({**GOOD_HEADER, "compression": ["zstd"]}, bytes(8)), "unknown compression"),
    (frame_with({**GOOD_HEADER, "leaves": [[",i4", [2], 0, 8]]}, bytes(8)), "not a dtype"),
    (
      frame_with({**GOOD_HEADER, "leaves": [["<f4", [-1, -2], 0, 8]]}, bytes(8)),
      "non-negative integers",
    ),
    (frame_with({**GOOD_HEADER, "leaves": [["<f4", [1 << 62, 4], 0, 16]]}, bytes(8)), "too large"),
    (frame_with({**GOOD_HEADER, "leaves": [["<f4", [4], 0, 16]]}, bytes(8)), "does not fit"),
    (frame_with({**GOOD_HEADER, "leaves": [["<f4", [0, 1 << 63], 0, 0]]}, bytes(8)), "too large"),
    (frame_with({**GOOD_HEADER, "payload_bytes": 1 << 40}, bytes(8)), "max_frame_bytes"),
    (
      frame_with(
        {
          "structure": {"d": [["a", None], [1, None]]},
          "leaves": [["<f4", [], 0, 4], ["<f4", [], 0, 4]],
          "payload_bytes": 4,
        },
        bytes(4),
      ),
      "Bad tree structure",
    ),
  ],
)
def test_a_malformed_frame_header_raises_wire_format_error(frame, message):
  with pytest.raises(wire.WireFormatError, match=message):
    wire.decode(frame)


def lz4_bomb(size: int) -> bytes:
  """`size` zero bytes as an lz4 frame that declares its size, made a MiB at
  a time."""
  compressor = lz4.frame.LZ4FrameCompressor()
  parts = [compressor.begin(source_size=size)]
  zeros = bytes(1 << 20)
  parts += [compressor.compress(zeros) for _ in range(size >> 20)]
  return b"".join(parts) + compressor.flush()


def test_an_lz4_payload_is_decompressed_only_up_to_the_declared_size():
  frame = frame_with({**GOOD_HEADER, "compression": "lz4"}, lz4_bomb(768 << 20))
  before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
  with pytest.raises(wire.WireFormatError, match="more than 8 bytes"):
    wire.decode(frame)
  assert (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) < (256 << 10)  # KiB


def test_frames_of_every_fixed_size_dtype_still_round_trip():
  value = {
    name: np.zeros((2, 3), name)
    for name in (
      "bool",
      "int8",
      "uint64",
      "float16",
      "complex128",
      "S5",
      "U3",
      "datetime64[ms]",
      "timedelta64[10s]",
      "V4",
    )
  }
  for compression in ("", "lz4", "zstd"):
    decoded = wire.decode(wire.encode(value, compression))
    for name, array in value.items():
      assert decoded[name].dtype == array.dtype and decoded[name].shape == array.shape


# -- dataset specs ---------------------------------------------------------------
def dataset_def(graph, arrays: bytes = b"") -> pb.DatasetDef:
  return pb.DatasetDef(graph_json=json.dumps(graph).encode(), arrays=arrays)


def range_node(**params) -> dict:
  return {
    "class": "jaxfeed.ops.range:RangeNode",
    "op": "range",
    "params": {"start": 0, "stop": 4, "step": 1, **params},
    "parents": [],
  }


def nested_lists(depth: int):
  value = 0
  for _ in range(depth):
    value = [value]
  return value


@pytest.mark.parametrize(
  "graph, message",
  [
    ({"class": "jaxfeed.ops.range:RangeNode", "parents": []}, "malformed op node"),
    ([range_node()], "malformed op node"),
    (range_node(stop={"__array__": 5}), "malformed __array__"),
    (range_node(stop={"__array__": "0"}), "malformed __array__"),
    (range_node(stop={"__pickled__": 0}), "malformed __pickled__"),
    (range_node(stop={"__dtype__": ["f4"]}), "invalid dtype"),
    (range_node(stop={"__dtype__": "no-such-dtype"}), "invalid dtype"),
    (range_node(stop={"__dtype__": ",i4"}), "invalid dtype"),
    (range_node(stop={"__bytes__": "zz"}), "malformed hex"),
    (range_node(stop={"__tuple__": 5}), "malformed __tuple__"),
    (range_node(stop={"__dict__": [[1, 2, 3]]}), "malformed __dict__"),
    (range_node(stop={"__dict__": [[[[1]], 2]]}), "not hashable"),
    (range_node(stop={"__object__": "jaxfeed.sampler:IndexSampler"}), "Unknown value tag"),
    (
      range_node(stop={"__object__": "jaxfeed.sampler:IndexSampler", "params": 3}),
      "malformed object",
    ),
    (range_node(stop=nested_lists(600)), "deeper than|too deeply"),
  ],
)
def test_a_malformed_spec_raises_spec_error(graph, message):
  with pytest.raises(spec.SpecError, match=message):
    spec.from_dataset_def(dataset_def(graph))


def test_a_spec_nested_past_the_json_parsers_limit_raises_spec_error():
  raw = pb.DatasetDef(graph_json=b"[" * 200000 + b"]" * 200000)
  with pytest.raises(spec.SpecError, match="not valid JSON"):
    spec.from_dataset_def(raw)


def test_a_spec_with_a_garbled_array_table_raises_spec_error():
  good = spec.to_dataset_def(jaxfeed.Dataset.from_tensor_slices(np.arange(6)).node)
  graph = json.loads(good.graph_json)
  with pytest.raises(spec.SpecError, match="array table"):
    spec.from_dataset_def(dataset_def(graph, good.arrays[:-3]))
  with pytest.raises(spec.SpecError, match="array table"):
    spec.from_dataset_def(dataset_def(graph, wire.encode({"not": np.arange(3)})))


def test_a_long_chain_of_ops_still_round_trips():
  dataset = jaxfeed.Dataset.range(10)
  for _ in range(400):
    dataset = dataset.skip(0)
  node = spec.from_dataset_def(spec.to_dataset_def(dataset.node))
  assert list(jaxfeed.Dataset(node)) == list(range(10))


# -- journal replay --------------------------------------------------------------
def replay(tmp_path, records: list) -> dispatcher_lib.DispatcherState:
  """Replays a journal of one line per record (checksums included)."""
  lines = [r if isinstance(r, str) else json.dumps(r) for r in records]
  (tmp_path / "journal.jsonl").write_bytes(
    journal_lines.encode_all(
      [json.dumps(journal_replay.header(0)).encode(), *(l.encode() for l in lines)]
    )[0]
  )
  return dispatcher_lib.DispatcherState(dispatcher_lib.DispatcherConfig(work_dir=str(tmp_path)))


DATASET = {
  "kind": "dataset",
  "id": "1",
  "dataset_id": "1",
  "def": base64.b64encode(pb.DatasetDef(graph_json=b"{}").SerializeToString()).decode(),
}
JOB = {
  "kind": "job",
  "id": 2,
  "dataset_id": "1",
  "policy": "OFF",
  "job_name": "",
  "num_consumers": 0,
  "num_positions": 8,
}


@pytest.mark.parametrize(
  "bad, message",
  [
    ({"kind": "task_finished", "job_id": 99, "task_id": 1}, "names job 99"),
    ({**JOB, "id": 3, "num_consumers": "2"}, "malformed field 'num_consumers'"),
    ({**JOB, "id": 3, "policy": ["OFF"]}, "malformed field 'policy'"),
    ({**JOB, "id": 3, "exactly_once": "yes"}, "malformed field 'exactly_once'"),
    (
      {"kind": "splits_issued", "job_id": 2, "task_id": 4, "ranges": [[0, "8"]]},
      "malformed field 'ranges'",
    ),
    ({"kind": "splits_acked", "job_id": 2, "starts": [{}]}, "malformed field 'starts'"),
    ({"kind": "fix_workers", "job_id": 2, "workers": [["a:1"]]}, "malformed field 'workers'"),
    ({"kind": "client", "id": 5}, "lacks its field 'job_id'"),
    ({**DATASET, "id": "2", "dataset_id": "2", "def": "!!not base64"}, "malformed field 'def'"),
    ({**DATASET, "id": [2]}, "want an integer"),
  ],
)
def test_a_malformed_journal_record_stops_the_replay_naming_it(tmp_path, bad, message):
  with pytest.raises(ValueError, match=f"corrupt at line 4.*{message}") as raised:
    replay(tmp_path, [DATASET, JOB, bad, {"kind": "job_deleted", "job_id": 2}])
  assert isinstance(raised.value.__cause__, journal_records.JournalRecordError)


def test_a_journal_batch_holding_a_non_record_stops_the_replay_naming_it(tmp_path):
  # A line is a batch (a JSON list of records); a list inside it is no record.
  with pytest.raises(ValueError, match=r"corrupt at line 4 \(byte \d+\): expected a record"):
    replay(tmp_path, [DATASET, JOB, [["kind", "job"]], {"kind": "job_deleted", "job_id": 2}])


def test_a_too_deeply_nested_journal_line_is_reported_as_corrupt(tmp_path):
  with pytest.raises(ValueError, match=r"damaged at byte \d+ \(line 3\).*no JSON"):
    replay(tmp_path, [DATASET, "[" * 100000 + "]" * 100000, JOB])


def test_a_well_formed_journal_still_replays(tmp_path):
  state = replay(tmp_path, [DATASET, JOB, {"kind": "splits", "job_id": 2, "next_position": 4}])
  try:
    assert state.jobs[2].next_position == 4 and "1" in state.datasets
  finally:
    state.close()


def test_the_dispatcher_refuses_a_spec_nested_too_deeply_with_a_spec_error(tmp_path):
  # Found by the server soak: the allowlist walk parsed the graph JSON with a
  # RecursionError escaping, which the dispatcher answered as INTERNAL.
  from jaxfeed.service.dispatcher import server as dispatcher_lib
  from jaxfeed.service.protocol import import_paths
  from jaxfeed.service.protocol import spec as spec_lib
  from jaxfeed.service.protocol.protos import service_pb2 as pb

  nested = pb.DatasetDef(graph_json=("[" * 100_000 + "]" * 100_000).encode())
  with pytest.raises(spec_lib.SpecError, match="not valid JSON"):
    import_paths.check_spec_paths(nested, ())
  state = dispatcher_lib.DispatcherState(dispatcher_lib.DispatcherConfig())
  try:
    with pytest.raises(spec_lib.SpecError):
      state.register_dataset(nested)
  finally:
    state.close()
