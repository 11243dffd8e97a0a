"""Fuzz targets: the service's decoders of network (and journal) input, fed
mutations of valid messages.

Each target has a corpus of valid inputs made by the real encoders, a
mutator that damages them (seeded bytes flips, inserts, truncations and
absurd integers, and structure-aware edits of their JSON parts), and a
`run` that feeds one input to the real decoder. A case passes when the
decoder returns or raises one of the target's documented errors; any other
exception is a crash, and a case running longer than `hang_s` (generous: a
loaded machine is slow, a bug loops forever) a hang.

`run_targets` runs cases for several targets and returns one `TargetStats`
each; as a script (`python fuzz_targets.py --cases=N --rlimit_mb=M`) it does
so under an address-space limit, so an unbounded allocation fails as a
MemoryError crash instead of taking the machine's memory, and prints the
statistics as JSON. The tests and `benchmarks/fuzz_soak.py` run it as a child
process, which also turns a segfault or a hang into a reported failure.
"""

from __future__ import annotations

import argparse
import collections
import copy
import dataclasses
import json
import os
import random
import resource
import socket
import struct
import sys
import tempfile
import threading
import time
import traceback
from typing import Any, Callable

import numpy as np

from jaxfeed import _lifetime
from jaxfeed.service.protocol import data_socket
from jaxfeed.service.protocol import element_chunks
from jaxfeed.service.protocol import spec
from jaxfeed.service.protocol import wire
from jaxfeed.service.protocol.protos import service_pb2 as pb
from jaxfeed.service.storage import journal_lines
from jaxfeed.service.storage import journal_records
from jaxfeed.service.storage import journal_replay

# Small enough that a decoder allocating what a peer declares (up to this
# limit) stays well inside the child's address-space limit.
MAX_FRAME_BYTES = 16 << 20

_INTERESTING_INTS = (
  0,
  1,
  -1,
  7,
  255,
  256,
  1 << 16,
  (1 << 31) - 1,
  1 << 31,
  (1 << 32) - 1,
  1 << 32,
  (1 << 63) - 1,
  1 << 63,
  (1 << 64) - 1,
  1 << 64,
  -(1 << 63),
  10**30,
)


# -- mutation -------------------------------------------------------------------
def mutate_bytes(data: bytes, rng: random.Random) -> bytes:
  """One to four random byte-level edits of `data`."""
  out = bytearray(data)
  for _ in range(rng.randint(1, 4)):
    op = rng.randrange(8)
    pos = rng.randrange(len(out) + 1)
    if op == 0 and out:  # flip a bit
      pos = min(pos, len(out) - 1)
      out[pos] ^= 1 << rng.randrange(8)
    elif op == 1 and out:  # an interesting byte
      out[min(pos, len(out) - 1)] = rng.choice((0, 1, 0x7F, 0x80, 0xFF))
    elif op == 2:  # insert random bytes
      out[pos:pos] = rng.randbytes(rng.choice((1, 2, 4, 8, 64)))
    elif op == 3 and out:  # delete a range
      del out[pos : pos + rng.choice((1, 2, 8, 64, len(out)))]
    elif op == 4:  # truncate
      del out[pos:]
    elif op == 5 and out:  # duplicate a range
      start = rng.randrange(len(out))
      out[pos:pos] = out[start : start + rng.choice((1, 8, 64, 4096))]
    elif op == 6:  # an absurd little-endian integer (a length, a count)
      value = rng.choice(_INTERESTING_INTS) & ((1 << 64) - 1)
      width = rng.choice((4, 8))
      out[pos : pos + width] = (value & ((1 << (8 * width)) - 1)).to_bytes(width, "little")
    elif op == 7:  # an absurd varint (protobuf lengths and ints)
      out[pos:pos] = element_chunks.varint(rng.choice(_INTERESTING_INTS) & ((1 << 64) - 1))
  return bytes(out)


def _absurd_json_value(rng: random.Random, original: Any) -> Any:
  choice = rng.randrange(14)
  if choice == 0:
    return None
  if choice == 1:
    return rng.choice((True, False))
  if choice == 2:
    return rng.choice(_INTERESTING_INTS) * rng.choice((1, -1))
  if choice == 3:
    return rng.choice((float("inf"), float("-inf"), float("nan"), 1e308, -0.5, 2.5))
  if choice == 4:
    return rng.choice(
      (
        "",
        "x" * rng.choice((1, 100, 10000)),
        "\x00",
        "../..",
        "os:system",
        "O",
        "<f8",
        "V1000000000",
        "(1000000,1000000)f8",
        ",i4",
        "i4,(2,)f8",
        "jaxfeed:nothing",
      )
    )
  if choice == 5:
    return []
  if choice == 6:
    return {}
  if choice == 7:  # deep nesting
    depth = rng.choice((10, 100, 1000, 5000))
    value: Any = 0
    for _ in range(depth):
      value = [value] if rng.random() < 0.5 else {"l": [value]}
    return value
  if choice == 8:  # many of it (inputs stay a few MB at most)
    count = rng.choice((2, 1000 if len(json_dumps(original)) < 1000 else 2))
    # Copies, not one object many times: a later edit inside one of them
    # would otherwise repeat in all, and compound.
    try:
      return [copy.deepcopy(original) for _ in range(count)]
    except RecursionError:  # a deep value an earlier edit made
      return [original]
  if choice == 9 and isinstance(original, int) and not isinstance(original, bool):
    return original + rng.choice((-1, 1, 1 << 32))
  if choice == 10 and isinstance(original, str):
    return original[: rng.randrange(len(original) + 1)]
  if choice == 11 and isinstance(original, list) and original:
    shorter = list(original)
    del shorter[rng.randrange(len(shorter))]
    return shorter
  if choice == 12 and isinstance(original, dict) and original:
    shorter = dict(original)
    del shorter[rng.choice(list(shorter))]
    return shorter
  if choice == 13 and isinstance(original, dict):
    return {**original, rng.choice(("__array__", "__object__", "params", "d", "x")): 1}
  return rng.choice((0, "", None, [], {}))


def _nodes(value: Any, path: tuple = ()) -> list[tuple]:
  found = [path]
  if len(path) > 50:  # a deep value a mutation made: edit it near its top
    return found
  if isinstance(value, dict):
    for k, v in value.items():
      found += _nodes(v, path + (k,))
  elif isinstance(value, list):
    for i, v in enumerate(value):
      found += _nodes(v, path + (i,))
  return found


def mutate_json(value: Any, rng: random.Random) -> Any:
  """`value` (JSON data) with one or two of its nodes replaced by absurd values."""
  for _ in range(rng.randint(1, 2)):
    path = rng.choice(_nodes(value))
    if not path:
      value = _absurd_json_value(rng, value)
      continue
    parent = value
    for key in path[:-1]:
      parent = parent[key]
    parent[path[-1]] = _absurd_json_value(rng, parent[path[-1]])
  return value


MAX_INPUT_BYTES = 2 << 20  # mutations compound; bigger inputs only cost time


def json_dumps(value: Any) -> bytes:
  try:
    data = json.dumps(value).encode()
  except (RecursionError, ValueError):
    return b"[" * 100000  # what a too-deep value would have been
  return data[:MAX_INPUT_BYTES]  # cut: invalid JSON, as a truncated message


# -- targets -----------------------------------------------------------------
@dataclasses.dataclass
class Target:
  """A decoder under fuzz: valid inputs, a mutator, and the decoder's call."""

  name: str
  corpus: Callable[[], list]
  mutate: Callable[[Any, random.Random], Any]
  run: Callable[[Any], Any]
  allowed: tuple[type[BaseException], ...]
  close: Callable[[], None] = lambda: None


def _sample_trees() -> list:
  rng = np.random.default_rng(0)
  return [
    {"x": np.arange(12, dtype=np.float32).reshape(3, 4), "y": np.arange(3)},
    (np.zeros((0, 3), np.int16), [np.bool_(True), np.array(b"abc")]),
    {
      "tokens": rng.integers(0, 1000, (4, 16), dtype=np.int32),
      "nested": {"a": np.array(["ab", "c"]), "b": np.float64(2.5)},
    },
    np.arange(5000, dtype=np.int64),
  ]


def _frame_with_header(header: Any, body: bytes) -> bytes:
  header_bytes = json_dumps(header)
  return wire.MAGIC + struct.pack("<I", len(header_bytes)) + header_bytes + body


def _split_frame(frame: bytes) -> tuple[Any, bytes] | None:
  (header_len,) = struct.unpack_from("<I", frame, 4)
  return json.loads(frame[8 : 8 + header_len]), frame[8 + header_len :]


def _wire_corpus() -> list[bytes]:
  return [
    wire.encode(tree, compression)
    for tree in _sample_trees()
    for compression in ("", "lz4", "zstd")
  ]


def _mutate_frame(frame: bytes, rng: random.Random) -> bytes:
  if rng.random() < 0.5:
    return mutate_bytes(frame, rng)
  header, body = _split_frame(frame)
  if rng.random() < 0.2:  # a compressed payload claiming more than it holds
    header["payload_bytes"] = rng.choice((len(body) * 1000, MAX_FRAME_BYTES, 1 << 40))
    return _frame_with_header(header, body)
  return _frame_with_header(mutate_json(header, rng), body)


def _wire_run(frame: bytes) -> Any:
  return wire.decode(frame, MAX_FRAME_BYTES)


def _chunk_corpus() -> list[list[bytes]]:
  streams = []
  for tree in _sample_trees()[:3]:
    frame = wire.encode(tree)
    third = max(1, len(frame) // 3)
    parts = [frame[:third], frame[third : 2 * third], frame[2 * third :]]
    streams.append(
      [
        element_chunks.encode([parts[0]], len(frame), 3),
        element_chunks.encode([parts[1]]),
        element_chunks.encode([parts[2]]),
        pb.ElementChunk(split_end=True, round=3).SerializeToString(),
        element_chunks.encode([frame], len(frame), 4),
        pb.ElementChunk(end_of_sequence=True, stats_json='{"rounds": 2}').SerializeToString(),
      ]
    )
  return streams


def _mutate_chunks(chunks: list[bytes], rng: random.Random) -> list[bytes]:
  chunks = list(chunks)
  op = rng.randrange(4)
  i = rng.randrange(len(chunks))
  if op == 0:
    del chunks[i]
  elif op == 1:
    chunks.insert(i, chunks[rng.randrange(len(chunks))])
  elif op == 2:  # a chunk declaring an absurd frame size
    chunks[i] = element_chunks.encode(
      [b"x" * rng.choice((0, 1, 100))], rng.choice(_INTERESTING_INTS) % (1 << 63), 0
    )
  else:
    chunks[i] = mutate_bytes(chunks[i], rng)
  return chunks


def _chunks_run(chunks: list[bytes]) -> None:
  frames = element_chunks.FrameAssembler(MAX_FRAME_BYTES)
  for raw in chunks:
    chunk = element_chunks.parse(raw)
    if chunk.end_of_sequence:
      frames.check_ended()
      chunk.end_stats()
      return
    if chunk.split_end:
      continue
    done = frames.add(chunk)
    if done is not None:
      wire.decode(done[0], MAX_FRAME_BYTES)


# The data socket's message prefix, spelled out here so the tests also pin
# the wire format: kind, body length, round, sequence number.
SOCKET_PREFIX = struct.Struct("<BQqq")


def socket_message(
  kind: int, body: bytes, round_index: int = 0, seq: int = 0, length: int | None = None
) -> bytes:
  """One data socket message; `length` overrides the announced body length."""
  return SOCKET_PREFIX.pack(kind, len(body) if length is None else length, round_index, seq) + body


def _socket_corpus() -> list[bytes]:
  streams = []
  for tree in _sample_trees()[:3]:
    frame = wire.encode(tree)
    streams.append(
      socket_message(data_socket.KIND_FRAME, frame, 1, 0)
      + socket_message(data_socket.KIND_KEEPALIVE, b"")
      + socket_message(data_socket.KIND_SPLIT_END, b"", 1, 1)
      + socket_message(data_socket.KIND_FRAME, wire.encode(tree, "lz4"), 2, 2)
      + socket_message(data_socket.KIND_END, b'{"rounds": 2}')
    )
  return streams


class _StreamServer:
  """A TCP server that answers each connection with the next stream of bytes
  (after reading the client's hello), then closes it."""

  def __init__(self):
    self._listener = socket.create_server(("127.0.0.1", 0))
    self._listener.settimeout(10)
    self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
    self._streams: collections.deque = collections.deque()
    self._ready = threading.Semaphore(0)
    self._thread = threading.Thread(target=self._serve, daemon=True, name="fuzz-stream")
    self._thread.start()

  def _serve(self) -> None:
    while True:
      self._ready.acquire()
      stream = self._streams.popleft()
      if stream is None:
        return
      try:
        conn, _ = self._listener.accept()
      except OSError:
        return
      with conn:
        conn.settimeout(10)
        try:
          (length,) = struct.unpack("<I", conn.recv(4, socket.MSG_WAITALL))
          conn.recv(length, socket.MSG_WAITALL)
          conn.sendall(stream)
          conn.shutdown(socket.SHUT_WR)
          # Take the client's acks until it closes: closing with them unread
          # would reset the connection before the client read the stream.
          while conn.recv(65536):
            pass
        except OSError:
          pass

  def run(self, stream: bytes) -> None:
    self._streams.append(stream)
    self._ready.release()
    conn = data_socket.DataConnection(
      self.address, {"task_id": 1}, timeout_s=10, max_frame_bytes=MAX_FRAME_BYTES
    )
    try:
      received = 0
      while True:
        item = conn.next_item()
        if item is None:
          return
        kind, _, frame, _ = item
        if frame is not None:
          wire.decode(frame, MAX_FRAME_BYTES)
        if kind != data_socket.KIND_KEEPALIVE:
          received += 1
          conn.ack(received)
    finally:
      conn.close()

  def close(self) -> None:
    self._streams.append(None)
    self._ready.release()
    self._thread.join(timeout=10)
    self._listener.close()


def _mutate_stream(stream: bytes, rng: random.Random) -> bytes:
  if rng.random() < 0.3:  # a message whose length is absurd, with few bytes behind it
    kind = rng.choice((0, 1, 2, 3, 4, 255))
    length = rng.choice(_INTERESTING_INTS) & ((1 << 64) - 1)
    return socket_message(kind, rng.randbytes(rng.choice((0, 16, 1000))), length=length)
  return mutate_bytes(stream, rng)


def spec_corpus() -> list[bytes]:
  import jaxfeed  # pylint: disable=g-import-not-at-top

  source = jaxfeed.ArraySource(
    {"x": np.arange(40, dtype=np.float32).reshape(20, 2), "label": np.arange(20) % 3}
  )
  pipelines = [
    jaxfeed.Dataset.range(10).map(np.negative).batch(4, drop_remainder=True),
    jaxfeed.Dataset.from_source(source, jaxfeed.IndexSampler(20, shuffle=True, seed=3))
    .shuffle(4, seed=1)
    .batch(3),
    jaxfeed.Dataset.zip((jaxfeed.Dataset.range(5), jaxfeed.Dataset.range(5, 10))).take(3),
    jaxfeed.Dataset.from_tensor_slices({"a": np.arange(6), "b": np.ones((6, 2))}).padded_batch(
      2, padded_shapes={"a": [], "b": [4]}
    ),
  ]
  return [spec.to_dataset_def(ds.node).SerializeToString() for ds in pipelines]


def mutate_spec(raw: bytes, rng: random.Random) -> bytes:
  if rng.random() < 0.3:
    return mutate_bytes(raw, rng)
  dataset_def = pb.DatasetDef.FromString(raw)
  if rng.random() < 0.2 and dataset_def.arrays:
    dataset_def.arrays = _mutate_frame(dataset_def.arrays, rng)
  else:
    dataset_def.graph_json = json_dumps(mutate_json(json.loads(dataset_def.graph_json), rng))
  return dataset_def.SerializeToString()


def _spec_run(raw: bytes) -> None:
  try:
    dataset_def = pb.DatasetDef.FromString(raw)
  except Exception:  # pylint: disable=broad-except  # protobuf's own check
    return
  spec.from_dataset_def(dataset_def, udf_secret=None)


def journal_corpus_from_run() -> list[str]:
  """The journal lines of a short session of a real dispatcher and worker."""
  import jaxfeed  # pylint: disable=g-import-not-at-top
  from jaxfeed import service  # pylint: disable=g-import-not-at-top

  with tempfile.TemporaryDirectory(prefix="jaxfeed-fuzz-journal-") as work_dir:
    with service.DispatchServer(service.DispatcherConfig(work_dir=work_dir)) as dispatcher:
      with service.WorkerServer(
        service.WorkerConfig(dispatcher_address=dispatcher.target, heartbeat_interval_s=0.1)
      ):
        dataset = jaxfeed.Dataset.from_source(jaxfeed.ArraySource({"x": np.arange(12)})).batch(4)
        for options in ({"visitation": "exactly_once"}, {"job_name": "shared"}):
          with dataset.distribute(
            dispatcher.target, "distributed_epoch", **options
          ).make_iterator() as iterator:
            list(iterator)
    with open(os.path.join(work_dir, "journal.jsonl"), "rb") as f:
      checked = journal_lines.check(f.read())
    return [payload.decode() for payload in checked.payloads[1:]]  # not the header


class _JournalTarget:
  """Replays a journal (a list of lines, each the JSON of a batch) with a
  real DispatcherState. The lines are written with their checksums, however
  mutated: what is fuzzed is what replay does with records that pass them."""

  def __init__(self):
    self._dir = tempfile.TemporaryDirectory(prefix="jaxfeed-fuzz-replay-")

  def run(self, lines: list[str]) -> None:
    from jaxfeed.service.dispatcher import server as dispatcher  # pylint: disable=g-import-not-at-top

    for name in os.listdir(self._dir.name):  # what the last replay left
      os.remove(os.path.join(self._dir.name, name))
    with open(os.path.join(self._dir.name, "journal.jsonl"), "wb") as f:
      f.write(
        journal_lines.encode_all(
          [json.dumps(journal_replay.header(0)).encode(), *(l.encode() for l in lines)]
        )[0]
      )
    state = dispatcher.DispatcherState(dispatcher.DispatcherConfig(work_dir=self._dir.name))
    try:
      for job in state.jobs.values():  # what was accepted has the types it should
        assert all(
          isinstance(v, int)
          for v in (job.job_id, job.num_consumers, job.num_positions, job.next_position)
        ), job
        assert all(
          isinstance(s, int) and isinstance(e, int) for s, (e, _) in job.unacked.items()
        ), job
    finally:
      state.close()

  def close(self) -> None:
    self._dir.cleanup()


def _mutate_journal(lines: list[str], rng: random.Random) -> list[str]:
  lines = list(lines)
  op = rng.randrange(5)
  i = rng.randrange(len(lines))
  if op == 0:
    del lines[i]
  elif op == 1:
    lines.insert(i, lines[rng.randrange(len(lines))])
  elif op == 2:
    lines[i] = mutate_bytes(lines[i].encode(), rng).decode("utf-8", "replace").replace("\n", "")
  else:
    lines[i] = json_dumps(mutate_json(json.loads(lines[i]), rng)).decode()
  return lines


def make_targets() -> dict[str, Target]:
  """Every in-process target, by name."""
  stream_server = _StreamServer()
  journal = _JournalTarget()
  return {
    "wire_frame": Target(
      "wire_frame", _wire_corpus, _mutate_frame, _wire_run, (wire.WireFormatError,)
    ),
    "element_chunks": Target(
      "element_chunks", _chunk_corpus, _mutate_chunks, _chunks_run, (wire.WireFormatError,)
    ),
    "data_socket_client": Target(
      "data_socket_client",
      _socket_corpus,
      _mutate_stream,
      stream_server.run,
      (wire.WireFormatError, data_socket.DataConnectionError),
      stream_server.close,
    ),
    "dataset_spec": Target("dataset_spec", spec_corpus, mutate_spec, _spec_run, (spec.SpecError,)),
    "journal_replay": Target(
      "journal_replay",
      lambda: [journal_corpus_from_run()],
      _mutate_journal,
      journal.run,
      (journal_records.JournalRecordError, ValueError),
      journal.close,
    ),
  }


# -- running -------------------------------------------------------------------
@dataclasses.dataclass
class TargetStats:
  target: str
  cases: int = 0
  crashes: int = 0
  hangs: int = 0
  max_rss_growth_mb: float = 0.0
  seconds: float = 0.0
  outcomes: dict = dataclasses.field(default_factory=collections.Counter)
  # The first few failing inputs: (kind, error, input as base64 of its repr).
  failures: list = dataclasses.field(default_factory=list)


def _max_rss_mb() -> float:
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_target(target: Target, cases: int, seed: int, hang_s: float = 10.0) -> TargetStats:
  """Runs `cases` mutated inputs (and the unmutated corpus) through a target."""
  rng = random.Random(seed)
  corpus = target.corpus()
  stats = TargetStats(target.name)
  rss_before = _max_rss_mb()
  started = time.monotonic()
  for i in range(len(corpus) + cases):
    data = corpus[i] if i < len(corpus) else target.mutate(rng.choice(corpus), rng)
    case_started = time.monotonic()
    outcome, failure = "ok", None
    try:
      target.run(data)
    except target.allowed as e:
      outcome = type(e).__name__
    except Exception as e:  # pylint: disable=broad-except  # what the fuzzer looks for
      where = traceback.extract_tb(e.__traceback__)[-1]
      outcome = f"CRASH {type(e).__name__}"
      failure = f"{type(e).__name__}: {e!s:.300} at {where.filename}:{where.lineno}"
      stats.crashes += 1
    if time.monotonic() - case_started > hang_s:
      outcome, failure = "HANG", f"took {time.monotonic() - case_started:.1f} s"
      stats.hangs += 1
    if i < len(corpus) and failure is None and outcome != "ok":
      outcome, failure = f"CRASH corpus {outcome}", "a valid input was refused"
      stats.crashes += 1
    stats.outcomes[outcome] += 1
    if failure is not None and len(stats.failures) < 5:
      stats.failures.append([outcome, failure, repr(data)[:2000]])
    stats.cases += 1
  stats.seconds = time.monotonic() - started
  stats.max_rss_growth_mb = _max_rss_mb() - rss_before
  return stats


def run_targets(names: list[str] | None, cases: int, seed: int) -> list[TargetStats]:
  targets = make_targets()
  try:
    return [
      run_target(targets[name], cases, seed + i) for i, name in enumerate(names or list(targets))
    ]
  finally:
    for target in targets.values():
      target.close()


def limit_address_space(extra_mb: int) -> None:
  """Caps this process's address space at its current size plus `extra_mb`."""
  with open("/proc/self/status") as f:
    vm_kb = next(int(line.split()[1]) for line in f if line.startswith("VmSize:"))
  limit = (vm_kb << 10) + (extra_mb << 20)
  resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def main(argv: list[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--cases", type=int, default=200, help="mutated cases per target")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--targets", default="", help="comma-separated; empty: all")
  parser.add_argument(
    "--rlimit_mb", type=int, default=1024, help="address space allowed beyond the start-up size"
  )
  args = parser.parse_args(argv)
  _lifetime.die_with_parent_from_env()  # started by benchmarks/fuzz_soak.py
  names = [n for n in args.targets.split(",") if n]
  targets = make_targets()  # corpora are built before the limit
  corpora = {
    name: target.corpus() for name, target in targets.items() if not names or name in names
  }
  limit_address_space(args.rlimit_mb)
  results = []
  try:
    for i, (name, corpus) in enumerate(corpora.items()):
      target = dataclasses.replace(targets[name], corpus=lambda corpus=corpus: corpus)
      stats = run_target(target, args.cases, args.seed + i)
      results.append({**dataclasses.asdict(stats), "outcomes": dict(stats.outcomes)})
  finally:
    for target in targets.values():
      target.close()
  json.dump(results, sys.stdout)


if __name__ == "__main__":
  main()
