"""Frames, specs, generated protos, the journal and round-robin reads."""

from __future__ import annotations

import collections
import dataclasses
import filecmp
import pathlib
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import jaxfeed
import service_udfs
from jaxfeed import service
from jaxfeed.ops import op_stats, shared_preprocessing
from jaxfeed.service.protocol import rpc, spec, wire
from jaxfeed.service.protocol.protos import generate

pytestmark = pytest.mark.timeout(60)

TREES = [
  {"image": np.arange(24, dtype=np.uint8).reshape(2, 3, 4), "label": np.int32(7)},
  (np.float32([1.5, -2.0]), [np.array([b"ab", b"c"]), np.array(["xyz"])]),
  np.arange(12, dtype=np.float64).reshape(3, 4)[:, ::2],  # not contiguous
  {"empty": np.zeros((0, 5), np.int16), "flag": np.array([True, False])},
]


@pytest.mark.parametrize("compression", [None, "lz4", "zstd"])
@pytest.mark.parametrize("tree_index", range(len(TREES)))
def test_frame_round_trips_structure_dtypes_and_values(tree_index, compression):
  value = TREES[tree_index]
  decoded = wire.decode(wire.encode(value, compression))
  expected_leaves = jaxfeed.ops.tree.flatten(value)
  got_leaves = jaxfeed.ops.tree.flatten(decoded)
  assert jaxfeed.ops.tree.same_structure(value, decoded)
  assert type(decoded) is type(value)
  for got, want in zip(got_leaves, expected_leaves):
    want = np.asarray(want)
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_array_equal(got, want)


def test_frame_payload_is_aligned_raw_bytes():
  frame = wire.encode({"a": np.arange(100, dtype=np.float32)})
  decoded = wire.decode(frame)
  payload_start = len(frame) - 400
  assert payload_start % 64 == 0
  assert bytes(frame[payload_start:]) == np.arange(100, dtype=np.float32).tobytes()
  assert decoded["a"].base is not None  # a view, not a copy


@pytest.mark.parametrize("tree_index", range(len(TREES)))
def test_frame_parts_view_the_arrays_and_join_to_the_encoded_bytes(tree_index):
  value = TREES[tree_index]
  frame = wire.encode_frame(value)
  data = frame.tobytes()
  assert data == bytes(wire.encode(value))
  assert frame.nbytes == len(data) == sum(memoryview(p).nbytes for p in frame.parts)
  leaves = [x for x in jaxfeed.ops.tree.flatten(value) if isinstance(x, np.ndarray)]
  contiguous = [x for x in leaves if x.flags.c_contiguous and x.nbytes]
  assert contiguous or tree_index == 2
  parts = [np.frombuffer(p, np.uint8) for p in frame.parts]
  for leaf in contiguous:  # sent from the array's own memory, not a copy
    assert any(np.shares_memory(leaf, p) for p in parts)


@pytest.mark.parametrize("size", [1, 7, 64, 100, 4096, 10**6])
def test_frame_chunks_rejoin_to_the_frame_across_part_boundaries(size):
  value = {
    "a": np.arange(1000, dtype=np.int32),
    "b": np.arange(3, dtype=np.uint8),
    "c": np.arange(50, dtype=np.float64),
  }
  frame = wire.encode_frame(value)
  chunks = [b"".join(views) for views in frame.chunks(size)]
  assert b"".join(chunks) == frame.tobytes()
  assert all(len(c) == size for c in chunks[:-1]) and 0 < len(chunks[-1]) <= size


def test_frame_encoded_with_compression_decodes_to_the_value():
  value = {"a": np.zeros(10000, np.float32), "b": np.arange(5)}
  frame = wire.encode_frame(value)
  assert frame.encoded(None) is frame
  packed = frame.encoded("zstd")
  assert packed.nbytes < frame.nbytes
  decoded = wire.decode(packed.tobytes())
  np.testing.assert_array_equal(decoded["a"], value["a"])
  np.testing.assert_array_equal(decoded["b"], value["b"])


@pytest.mark.parametrize(
  "fields", [{"frame_bytes": 5000, "round": 3}, {}, {"round": -2}, {"frame_bytes": 2**40}]
)
def test_hand_written_element_chunks_are_protobuf_both_ways(fields):
  from jaxfeed.service.protocol import element_chunks  # pylint: disable=g-import-not-at-top
  from jaxfeed.service.protocol.protos import service_pb2 as pb  # pylint: disable=g-import-not-at-top

  parts = [b"abc", memoryview(np.arange(300, dtype=np.int16).view(np.uint8)), b""]
  data = b"".join(bytes(p) for p in parts)
  raw = element_chunks.encode(parts, fields.get("frame_bytes", 0), fields.get("round", 0))
  assert pb.ElementChunk.FromString(raw) == pb.ElementChunk(data=data, **fields)
  message = pb.ElementChunk(data=data, end_of_sequence=True, stats_json='{"a": 1}', **fields)
  chunk = element_chunks.parse(message.SerializeToString())
  assert bytes(chunk.data) == data and chunk.end_of_sequence
  assert chunk.stats_json == '{"a": 1}'
  assert (chunk.frame_bytes, chunk.round) == (fields.get("frame_bytes", 0), fields.get("round", 0))
  parsed = element_chunks.parse(raw)
  assert isinstance(parsed.data, memoryview) and parsed.data.obj is raw  # a view, no copy


@pytest.mark.parametrize(
  "raw", [b"\x0a\x05ab", b"\x10", b"\x10\xff\xff", b"\x0b", b"\x10" + b"\xff" * 11]
)
def test_malformed_element_chunks_raise_wire_format_error(raw):
  from jaxfeed.service.protocol import element_chunks  # pylint: disable=g-import-not-at-top

  with pytest.raises(wire.WireFormatError):
    element_chunks.parse(raw)


class _TrickleSocket:
  """Accepts at most `limit` bytes per sendmsg, like a full socket buffer."""

  def __init__(self, limit):
    self.limit, self.received, self.calls = limit, bytearray(), []

  def sendmsg(self, buffers):
    self.calls.append(len(buffers))
    room = self.limit
    for b in buffers:
      take = bytes(memoryview(b)[:room])
      self.received += take
      room -= len(take)
      if not room:
        break
    return self.limit - room


@pytest.mark.parametrize("limit", [1, 5, 64, 10**7])
def test_scatter_gather_send_delivers_every_byte_in_order_after_partial_sends(limit):
  from jaxfeed.service.worker import data_server  # pylint: disable=g-import-not-at-top

  rng = np.random.default_rng(0)
  buffers = [rng.bytes(n) for n in (3, 0, 200, 1, 0, 77)]
  buffers += [memoryview(np.arange(10, dtype=np.int64).view(np.uint8))] * 600  # > one iovec list
  sock = _TrickleSocket(limit)
  data_server._send_all(sock, buffers)  # pylint: disable=protected-access
  assert bytes(sock.received) == b"".join(bytes(b) for b in buffers)
  assert max(sock.calls) <= data_server._MAX_IOV  # pylint: disable=protected-access


@pytest.mark.parametrize("cut", [3, 10, -1])
def test_truncated_frame_raises_wire_format_error(cut):
  frame = bytes(wire.encode({"a": np.arange(10)}))
  with pytest.raises(wire.WireFormatError):
    wire.decode(frame[:cut])


def test_frame_with_object_dtype_is_refused_both_ways():
  with pytest.raises(TypeError, match="dtype object"):
    wire.encode({"a": np.array([object()])})
  frame = bytes(wire.encode({"a": np.arange(2, dtype=np.int64)}))
  forged = frame.replace(b'"<i8"', b'"|O8"')
  with pytest.raises(wire.WireFormatError):
    wire.decode(forged)


def test_frame_leaf_outside_payload_is_refused():
  frame = bytes(wire.encode({"a": np.arange(2, dtype=np.int64)}))
  forged = frame.replace(b"[2],0,16]", b"[9],0,72]")
  with pytest.raises(wire.WireFormatError, match="does not fit"):
    wire.decode(forged)


def test_spec_round_trip_rebuilds_an_equal_graph():
  source = jaxfeed.ArraySource({"x": np.arange(30, dtype=np.int64)})
  dataset = (
    jaxfeed.Dataset.from_source(source, jaxfeed.IndexSampler(30, shuffle=True, seed=5))
    .map(service_udfs.add_one_to_x)
    .batch(4, drop_remainder=True)
  )
  rebuilt = spec.from_dataset_def(spec.to_dataset_def(dataset.node))
  assert rebuilt.fingerprint() == dataset.node.fingerprint()
  got = list(rebuilt.make_iterator())
  want = list(dataset.make_iterator())
  assert len(got) == len(want) == 7
  for g, w in zip(got, want):
    np.testing.assert_array_equal(g["x"], w["x"])


def test_spec_carries_arrays_as_raw_bytes_not_pickle():
  source = jaxfeed.ArraySource({"x": np.arange(1000, dtype=np.int64)})
  dataset_def = spec.to_dataset_def(jaxfeed.Dataset.from_source(source).node)
  assert not dataset_def.pickled_udfs
  assert np.arange(1000, dtype=np.int64).tobytes() in dataset_def.arrays
  assert b"pickle" not in dataset_def.graph_json


def test_local_function_is_refused_with_its_name():
  def scale(x):
    return x * 2

  with pytest.raises(spec.SpecError, match="scale.*module level"):
    spec.to_dataset_def(jaxfeed.Dataset.range(3).map(scale).node)


def test_generated_protos_are_up_to_date(tmp_path):
  # In a child process: protoc in a process that loaded TensorFlow can crash.
  subprocess.run(
    [sys.executable, "-m", "jaxfeed.service.protocol.protos.generate", str(tmp_path)],
    check=True,
    timeout=60,
    capture_output=True,
    cwd=generate.PROTO_DIR.parents[2],
  )
  written = sorted(pathlib.Path(tmp_path).glob("*_pb2*.py"))
  assert len(written) == 2 * len(generate.PROTO_FILES)
  for path in written:
    committed = generate.PROTO_DIR / path.name
    assert filecmp.cmp(path, committed, shallow=False), (
      f"{committed} is stale: run python -m jaxfeed.service.protocol.protos.generate"
    )


def test_dispatcher_replays_its_journal_after_a_restart(tmp_path):
  dataset = jaxfeed.Dataset.range(10).map(service_udfs.add_one).batch(5)
  config = service.DispatcherConfig(work_dir=str(tmp_path))
  with service.DispatchServer(config) as dispatcher:
    dataset_id = service.register_dataset(dispatcher.target, dataset)
    port = dispatcher.port
  restarted = service.DispatcherConfig(work_dir=str(tmp_path), port=port)
  with service.DispatchServer(restarted) as dispatcher:
    assert service.register_dataset(dispatcher.target, dataset) == dataset_id
    other = service.register_dataset(dispatcher.target, dataset.batch(1))
    assert other != dataset_id
    with service.WorkerServer(service.WorkerConfig(dispatcher_address=dispatcher.target)):
      batches = list(service.from_dataset_id("parallel_epochs", dispatcher.target, dataset_id))
  assert np.concatenate(batches).tolist() == list(range(1, 11))


def test_round_robin_consumers_read_each_round_from_one_worker():
  threads_before = set(threading.enumerate())
  config = service.DispatcherConfig(num_workers=2)
  with service.DispatchServer(config) as dispatcher:
    workers = [
      service.WorkerServer(
        service.WorkerConfig(dispatcher_address=dispatcher.target, heartbeat_interval_s=0.1)
      )
      for _ in range(2)
    ]
    dataset = jaxfeed.Dataset.range(16).batch(1)
    results: list = [None, None]

    def consume(i):
      with dataset.distribute(
        dispatcher.target, job_name="rr", num_consumers=2, consumer_index=i
      ).make_iterator() as iterator:
        results[i] = [int(b[0]) for b in iterator]

    threads = [threading.Thread(target=consume, args=(i,)) for i in range(2)]
    for t in threads:
      t.start()
    for t in threads:
      t.join(timeout=30)
    for worker in workers:
      worker.stop()
  # Both workers run range(16) (OFF); round r comes from worker r % 2 and is
  # its local round r // 2: batches 2*(r//2) and 2*(r//2)+1 of that worker.
  assert results[0] == [2 * (r // 2) for r in range(16)]
  assert results[1] == [2 * (r // 2) + 1 for r in range(16)]
  # The op-stats sampling thread is the process's, not the service's: it
  # ends by itself once no pipeline has been open for a while. The reads'
  # reaper ends within its poll once no read is open.
  deadline = time.monotonic() + 5
  while True:
    leaked = [
      t
      for t in set(threading.enumerate()) - threads_before
      if t.is_alive() and t.name != op_stats.THREAD_NAME
    ]
    if not leaked or time.monotonic() > deadline:
      break
    time.sleep(0.05)
  assert not leaked, leaked


def test_a_task_learned_twice_at_once_gets_one_runner(monkeypatch):
  # The heartbeat thread and a client's first request can both hand a
  # worker the same new task; two runners would split its consumers.
  from jaxfeed.service.protocol.protos import service_pb2 as pb  # pylint: disable=g-import-not-at-top
  from jaxfeed.service.worker import state as worker_state  # pylint: disable=g-import-not-at-top
  from jaxfeed.service.worker import task_runner  # pylint: disable=g-import-not-at-top

  created = []

  class CountedRunner(task_runner.TaskRunner):
    def __init__(self, *args, **kwargs):
      created.append(args[0])
      super().__init__(*args, **kwargs)

  monkeypatch.setattr(task_runner, "TaskRunner", CountedRunner)
  monkeypatch.setattr(worker_state.WorkerState, "_make_iterator", lambda self, task: iter([]))
  worker = worker_state.WorkerState(
    service.WorkerConfig(dispatcher_address="127.0.0.1:1"), "127.0.0.1:2"
  )
  task = pb.TaskInfo(task_id=7, job_id=1, dataset_id="1", num_consumers=2)
  barrier = threading.Barrier(8)

  def learn():
    barrier.wait()
    worker.start_task(task)

  threads = [threading.Thread(target=learn) for _ in range(8)]
  for t in threads:
    t.start()
  for t in threads:
    t.join(timeout=10)
  worker.shutdown()
  assert created == [7]


def test_named_job_outlives_its_last_client_until_the_gc_timeout():
  config = service.DispatcherConfig(job_gc_timeout_s=1.0, heartbeat_timeout_s=0.4)
  dataset = jaxfeed.Dataset.range(10).batch(5)

  def read():
    return [int(x) for b in dataset.distribute(dispatcher.target, job_name="shared") for x in b]

  with service.DispatchServer(config) as dispatcher:
    with service.WorkerServer(
      service.WorkerConfig(dispatcher_address=dispatcher.target, heartbeat_interval_s=0.1)
    ):
      assert read() == list(range(10))
      # A consumer joining the finished job shares it: nothing is read twice.
      assert read() == []
      time.sleep(2.0)  # past job_gc_timeout_s: the name is free again
      assert read() == list(range(10))


@pytest.mark.parametrize("compression", [None, "zstd"])
@pytest.mark.parametrize("data_transfer", ["grpc", "socket"])
def test_frames_spanning_many_chunks_arrive_whole_and_in_order(data_transfer, compression):
  rng = np.random.default_rng(5)
  source = jaxfeed.ArraySource(
    {"x": rng.normal(size=(24, 300)), "y": np.arange(24, dtype=np.int32)}
  )
  dataset = jaxfeed.Dataset.from_source(source).batch(4)  # 9.6 kB frames in 1 kB chunks
  with service.DispatchServer(service.DispatcherConfig()) as dispatcher:
    with service.WorkerServer(
      service.WorkerConfig(
        dispatcher_address=dispatcher.target, heartbeat_interval_s=0.1, chunk_bytes=1024
      )
    ):
      with dataset.distribute(
        dispatcher.target, "parallel_epochs", compression=compression, data_transfer=data_transfer
      ).make_iterator() as iterator:
        got = list(iterator)
  want = list(dataset)
  assert len(got) == len(want) == 6
  for g, w in zip(got, want):
    np.testing.assert_array_equal(g["x"], w["x"])
    np.testing.assert_array_equal(g["y"], w["y"])


def test_exactly_once_runs_the_pipeline_split_by_split_and_delivers_one_epoch():
  num_records, split_size = 103, 10
  source = jaxfeed.ArraySource({"x": np.arange(num_records)})
  # 20 ms an element: one worker alone would take 2 s for the epoch, so the
  # other one, a heartbeat behind, takes splits too on a busy machine.
  dataset = (
    jaxfeed.Dataset.from_source(source, jaxfeed.IndexSampler(num_records, shuffle=True, seed=1))
    .map(service_udfs.paced_record)
    .batch(4)
  )
  with service.DispatchServer(service.DispatcherConfig(split_size=split_size)) as dispatcher:
    workers = [
      service.WorkerServer(
        service.WorkerConfig(dispatcher_address=dispatcher.target, heartbeat_interval_s=0.1)
      )
      for _ in range(2)
    ]
    try:
      # Both registered before the job starts, so both get a task at once
      # (a worker that registers later may find every split taken).
      deadline = time.monotonic() + 30
      while len(dispatcher.state.workers) < 2:
        assert time.monotonic() < deadline, dispatcher.state.workers
        time.sleep(0.02)
      for data_transfer in ("socket", "grpc"):
        with dataset.distribute(
          dispatcher.target,
          "distributed_epoch",
          visitation="exactly_once",
          data_transfer=data_transfer,
        ).make_iterator() as iterator:
          batches = list(iterator)
          by_worker = iterator.elements_by_worker
        got = np.concatenate([b["x"] for b in batches])
        assert sorted(got.tolist()) == list(range(num_records))
        # A batch never spans two splits: each split of 10 gives 4 + 4 + 2.
        sizes = collections.Counter(len(b["x"]) for b in batches)
        assert sizes == {4: 20, 2: 10, 3: 1}
        assert sum(by_worker.values()) == len(batches) and len(by_worker) == 2
    finally:
      for worker in workers:
        worker.stop()


def test_exactly_once_bookkeeping_survives_a_dispatcher_restart(tmp_path):
  from jaxfeed.service.dispatcher import server as dispatcher_lib  # pylint: disable=g-import-not-at-top
  from jaxfeed.service.protocol.protos import service_pb2 as pb  # pylint: disable=g-import-not-at-top

  dataset_def = spec.to_dataset_def(
    jaxfeed.Dataset.from_source(jaxfeed.ArraySource({"x": np.arange(100)})).node
  )
  dataset_def.num_positions = 100
  config = service.DispatcherConfig(work_dir=str(tmp_path), split_size=10)
  state = dispatcher_lib.DispatcherState(config)
  dataset_id = state.register_dataset(dataset_def)
  for address in ("w1:1", "w2:1"):
    state.worker_heartbeat(pb.WorkerHeartbeatRequest(worker_address=address))
  job_id, client_id = state.get_or_create_job(
    pb.GetOrCreateJobRequest(
      dataset_id=dataset_id, sharding_policy="distributed_epoch", exactly_once=True
    )
  )
  task_by_worker = {t.worker_address: t.task_id for t in state.jobs[job_id].tasks.values()}

  def splits(worker):
    response = state.get_splits(
      pb.GetSplitsRequest(job_id=job_id, task_id=task_by_worker[worker], max_ranges=2)
    )
    return [(r.start, r.stop) for r in response.ranges], response.end_of_splits

  assert splits("w1:1") == ([(0, 10), (10, 20)], False)
  assert splits("w2:1") == ([(20, 30), (30, 40)], False)
  state.client_heartbeat(job_id, client_id, acked_splits=[0, 20, 999])
  state.close()

  # Replays the journal; neither worker registers again in time.
  state = dispatcher_lib.DispatcherState(dataclasses.replace(config, heartbeat_timeout_s=0.05))
  job = state.jobs[job_id]
  assert job.unacked == {10: (20, task_by_worker["w1:1"]), 30: (40, task_by_worker["w2:1"])}
  state.check_liveness()
  assert not job.reissue  # not yet: they may still come back
  time.sleep(0.1)
  state.check_liveness()
  assert job.reissue == {10: 20, 30: 40} and not job.unacked and not job.tasks
  for address in ("w3:1",):
    state.worker_heartbeat(pb.WorkerHeartbeatRequest(worker_address=address))
  task_by_worker["w3:1"] = next(t.task_id for t in job.tasks.values() if t.worker_address == "w3:1")
  assert splits("w3:1") == ([(10, 20), (30, 40)], False)  # the lost ones first
  ranges, end = splits("w3:1")
  while ranges:
    state.client_heartbeat(job_id, client_id, acked_splits=[a for a, _ in ranges])
    ranges, end = splits("w3:1")
  assert not end  # 10 and 30 are not acknowledged yet
  state.client_heartbeat(job_id, client_id, acked_splits=[10, 30])
  assert splits("w3:1") == ([], True)
  state.close()


def test_exactly_once_splits_a_released_client_held_are_issued_again(tmp_path):
  from jaxfeed.service.dispatcher import server as dispatcher_lib  # pylint: disable=g-import-not-at-top
  from jaxfeed.service.protocol.protos import service_pb2 as pb  # pylint: disable=g-import-not-at-top

  dataset_def = spec.to_dataset_def(
    jaxfeed.Dataset.from_source(jaxfeed.ArraySource({"x": np.arange(100)})).node
  )
  dataset_def.num_positions = 100
  config = service.DispatcherConfig(work_dir=str(tmp_path), split_size=10, snapshot_every_records=1)
  state = dispatcher_lib.DispatcherState(config)
  dataset_id = state.register_dataset(dataset_def)
  state.worker_heartbeat(pb.WorkerHeartbeatRequest(worker_address="w1:1"))
  request = pb.GetOrCreateJobRequest(
    dataset_id=dataset_id, job_name="shared", sharding_policy="distributed_epoch", exactly_once=True
  )
  (job_id, first), (_, second) = [state.get_or_create_job(request) for _ in range(2)]
  [task_id] = state.jobs[job_id].tasks
  ranges = state.get_splits(
    pb.GetSplitsRequest(job_id=job_id, task_id=task_id, max_ranges=4)
  ).ranges
  assert [r.start for r in ranges] == [0, 10, 20, 30]

  def held(client_id, starts):
    return state.worker_heartbeat(
      pb.WorkerHeartbeatRequest(
        worker_address="w1:1",
        current_tasks=[task_id],
        held_splits=[pb.HeldSplits(task_id=task_id, client_id=client_id, starts=starts)],
      )
    )

  response = held(first, [0, 10])
  assert [list(t.client_ids) for t in response.task_clients] == [sorted([first, second])]
  held(second, [20])
  state.client_heartbeat(job_id, first, acked_splits=[0])
  state.close()  # the holders survive a restart (here from a snapshot)
  state = dispatcher_lib.DispatcherState(config)
  job = state.jobs[job_id]
  assert job.holders == {10: first, 20: second}
  state.release_client(job_id, first)  # it had 0 whole, not 10
  assert job.reissue == {10: 20} and job.holders == {20: second}
  response = held(first, [30])  # told late: its client is gone
  assert job.reissue == {10: 20, 30: 40} and job.holders == {20: second}
  assert [list(t.client_ids) for t in response.task_clients] == [[second]]
  state.release_client(job_id, second)
  assert job.reissue == {10: 20, 20: 30, 30: 40} and not job.holders
  state.close()


def test_autocache_keeps_a_pass_for_later_jobs_of_the_same_input(tmp_path):
  service_udfs.CALLS["tally"] = 0
  decoded = jaxfeed.Dataset.range(30).map(service_udfs.tally).autocache()
  dataset = decoded.map(service_udfs.add_one_to_x).batch(10)
  local = [b["x"].tolist() for b in dataset]
  assert service_udfs.CALLS["tally"] == 30  # locally it passes through
  other = decoded.batch(15)  # another pipeline over the same input
  source = jaxfeed.Dataset.from_source(jaxfeed.ArraySource(np.arange(30)))
  dynamic = source.map(service_udfs.tally).autocache().batch(10)
  with service.DispatchServer(service.DispatcherConfig()) as dispatcher:
    with service.WorkerServer(
      service.WorkerConfig(
        dispatcher_address=dispatcher.target,
        heartbeat_interval_s=0.1,
        autocache_dir=str(tmp_path),
        autocache_policy="always",
      )
    ):
      runs = [[b["x"].tolist() for b in dataset.distribute(dispatcher.target)] for _ in range(2)]
      assert service_udfs.CALLS["tally"] == 60  # the first job ran the input
      shared = [b["x"].tolist() for b in other.distribute(dispatcher.target)]
      assert service_udfs.CALLS["tally"] == 60  # later jobs read the cache
      # DYNAMIC tasks read other splits each time; over from_source with
      # per-record ops, the records are kept by index all the same.
      for _ in range(2):
        got = [b["x"].tolist() for b in dynamic.distribute(dispatcher.target, "distributed_epoch")]
        assert sorted(sum(got, [])) == list(range(30))
      assert service_udfs.CALLS["tally"] == 90
  assert runs == [local, local]
  assert shared == [list(range(15)), list(range(15, 30))]
  key = decoded.node.parents[0].fingerprint()
  source_node, ops = shared_preprocessing.per_record_chain(dynamic.node.parents[0].parents[0])
  records = f"records-{shared_preprocessing.store_key(source_node.source, ops)}"
  # Beside the entries: the folder's bookkeeping (jaxfeed.ops.autocache_folder).
  assert sorted(p.name for p in tmp_path.iterdir()) == sorted([".jaxfeed", key, records])


def test_exactly_once_shared_job_gives_each_split_whole_to_one_of_its_clients():
  num_records = 200
  source = jaxfeed.ArraySource({"x": np.arange(num_records)})
  dataset = jaxfeed.Dataset.from_source(
    source, jaxfeed.IndexSampler(num_records, shuffle=True, seed=4)
  ).batch(5)
  results = [None, None]
  with service.DispatchServer(service.DispatcherConfig(split_size=10)) as dispatcher:
    with service.WorkerServer(
      service.WorkerConfig(dispatcher_address=dispatcher.target, heartbeat_interval_s=0.1)
    ):
      iterators = [
        dataset.distribute(
          dispatcher.target,
          "distributed_epoch",
          job_name="shared-once",
          visitation="exactly_once",
          max_outstanding_requests=2,
        ).make_iterator()
        for _ in range(2)
      ]

      def read(i):
        with iterators[i] as iterator:
          results[i] = [b["x"].tolist() for b in iterator]

      threads = [threading.Thread(target=read, args=(i,)) for i in range(2)]
      for t in threads:
        t.start()
      for t in threads:
        t.join(timeout=60)
  sampler = jaxfeed.IndexSampler(num_records, shuffle=True, seed=4)
  split_of = {int(sampler[p].record_index): p // 10 for p in range(num_records)}
  for batches in results:
    # Each split's two batches went to the same client.
    splits = [split_of[b[0]] for b in batches]
    assert all(split_of[x] == s for b, s in zip(batches, splits) for x in b)
    assert sorted(collections.Counter(splits).values()) == [2] * len(set(splits))
  assert sorted(sum(sum(results, []), [])) == list(range(num_records))


def test_workers_advertise_the_host_clients_can_reach():
  from jaxfeed.service.worker import server as worker_lib  # pylint: disable=g-import-not-at-top

  config = service.WorkerConfig(dispatcher_address="127.0.0.1:1", host="0.0.0.0", insecure=True)
  assert worker_lib._advertised_host(config) == socket.gethostname()  # pylint: disable=protected-access
  dataset = jaxfeed.Dataset.range(12).batch(4)
  with service.DispatchServer(service.DispatcherConfig()) as dispatcher:
    with service.WorkerServer(
      service.WorkerConfig(
        dispatcher_address=dispatcher.target, heartbeat_interval_s=0.1, advertise_host="localhost"
      )
    ) as worker:
      assert worker.target.startswith("localhost:")
      assert worker.data_address.startswith("localhost:")
      for data_transfer in ("socket", "grpc"):
        got = [
          b.tolist() for b in dataset.distribute(dispatcher.target, data_transfer=data_transfer)
        ]
        assert got == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]


def test_channels_reconnect_within_seconds_after_an_outage():
  # gRPC's default reconnect backoff grows to 120 s: a dispatcher back after
  # a short outage would be noticed only minutes later.
  options = dict(rpc.channel_options(1 << 20))
  assert options["grpc.max_reconnect_backoff_ms"] <= 2000
  assert options["grpc.initial_reconnect_backoff_ms"] <= options["grpc.max_reconnect_backoff_ms"]
