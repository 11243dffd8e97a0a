"""`distributed_save` with real dispatcher and worker processes: workers write
the pipeline's output in chunks; a worker SIGKILLed mid-save and a
dispatcher restarted on its work_dir lose nothing; `Dataset.load` reads the
result locally and through the service."""

from __future__ import annotations

import time

import numpy as np
import pytest

import jaxfeed
from jaxfeed import service
from jaxfeed.ops import save_format
import service_udfs
from service_cluster import free_port

HEARTBEAT = ("--heartbeat_interval_s=0.2",)
WAIT_S = 60
NUM = 800


def slow_pipeline(n: int = NUM) -> jaxfeed.Dataset:
  # 2 ms an element: a chunk of 40 positions takes about 0.1 s to write.
  return jaxfeed.Dataset.from_tensor_slices({"x": np.arange(n)}).map(service_udfs.slow_add_one_to_x)


def saved_xs(path) -> list:
  return sorted(int(e["x"]) for e in jaxfeed.Dataset.load(path))


def wait_for_chunks(path, count: int) -> save_format.Progress:
  deadline = time.monotonic() + WAIT_S
  while time.monotonic() < deadline:
    try:
      progress = save_format.progress(path)
      if progress.chunks_done >= count:
        return progress
    except save_format.SaveFormatError:
      pass  # save.json not there yet
    time.sleep(0.02)
  raise TimeoutError(f"{path}: fewer than {count} chunks after {WAIT_S} s")


def test_two_workers_save_a_pipeline_that_loads_in_its_local_order(cluster, tmp_path):
  dispatcher = cluster("dispatcher", "--port=0")
  for _ in range(2):
    cluster("worker", f"--dispatcher_address={dispatcher.address}", *HEARTBEAT)
  pipeline = jaxfeed.Dataset.range(500).map(service_udfs.add_one)
  service.distributed_save(
    pipeline,
    tmp_path / "s",
    dispatcher.address,
    wait=True,
    chunk_positions=37,
    wait_timeout_s=WAIT_S,
  )
  progress = save_format.progress(tmp_path / "s")
  assert (progress.complete, progress.chunks_done, progress.num_elements) == (True, 14, 500)
  loaded = jaxfeed.Dataset.load(tmp_path / "s")
  assert [int(x) for x in loaded] == list(range(1, 501))
  assert loaded.element_spec == jaxfeed.TensorSpec((), np.int64)
  # Through the service: the saved dataset is a source its workers split.
  read = loaded.distribute(dispatcher.address, processing_mode="distributed_epoch")
  assert sorted(int(x) for x in read) == list(range(1, 501))


def test_a_worker_killed_mid_save_loses_nothing_and_the_others_finish_it(cluster, tmp_path):
  dispatcher = cluster("dispatcher", "--port=0", "--heartbeat_timeout_s=1.5")
  workers = [
    cluster("worker", f"--dispatcher_address={dispatcher.address}", *HEARTBEAT) for _ in range(2)
  ]
  path = tmp_path / "s"
  service.distributed_save(slow_pipeline(), path, dispatcher.address, chunk_positions=40)
  wait_for_chunks(path, 4)
  workers[0].kill()  # mid-chunk: it writes one at a time, without pause
  before = save_format.progress(path)
  assert not before.complete and before.chunks_done < before.chunks_expected == 20
  jaxfeed.ops.load.wait_until_complete(path, WAIT_S)
  assert saved_xs(path) == list(range(1, NUM + 1))
  assert sorted(save_format.committed_chunks(path)) == list(range(20))
  assert not (path / "tmp").exists()  # the killed worker's partial chunk is gone


def test_a_dispatcher_restarted_mid_save_on_its_work_dir_completes_it(cluster, tmp_path):
  port = free_port()
  work_dir = tmp_path / "work"
  flags = (f"--port={port}", f"--work_dir={work_dir}", "--heartbeat_timeout_s=2")
  dispatcher = cluster("dispatcher", *flags)
  for _ in range(2):
    cluster("worker", f"--dispatcher_address={dispatcher.address}", *HEARTBEAT)
  path = tmp_path / "s"
  service.distributed_save(slow_pipeline(), path, dispatcher.address, chunk_positions=40)
  wait_for_chunks(path, 3)
  dispatcher.kill()
  # Workers keep writing the chunks they hold; nothing hands out more.
  time.sleep(0.5)
  assert not save_format.progress(path).complete
  dispatcher = cluster("dispatcher", *flags)
  jaxfeed.ops.load.wait_until_complete(path, WAIT_S)
  assert saved_xs(path) == list(range(1, NUM + 1))
  # Saved again to the same folder: refused, it is complete.
  with pytest.raises(service.ServiceError, match="ALREADY_EXISTS.*complete saved dataset"):
    service.distributed_save(slow_pipeline(), path, dispatcher.address)


def test_an_incomplete_save_is_refused_by_load_and_waited_for_on_request(cluster, tmp_path):
  dispatcher = cluster("dispatcher", "--port=0")
  path = tmp_path / "s"
  service.distributed_save(slow_pipeline(200), path, dispatcher.address, chunk_positions=40)
  with pytest.raises(jaxfeed.SaveFormatError, match=r"incomplete \(0 of 5 chunks"):
    jaxfeed.Dataset.load(path)
  cluster("worker", f"--dispatcher_address={dispatcher.address}", *HEARTBEAT)
  assert sorted(int(e["x"]) for e in jaxfeed.Dataset.load(path, wait=True)) == list(range(1, 201))


def test_a_pipeline_that_batches_is_saved_whole_as_its_local_run_gives_it(cluster, tmp_path):
  dispatcher = cluster("dispatcher", "--port=0")
  for _ in range(2):
    cluster("worker", f"--dispatcher_address={dispatcher.address}", *HEARTBEAT)
  pipeline = jaxfeed.Dataset.range(50).map(service_udfs.add_one).batch(7).repeat(2)
  service.distributed_save(
    pipeline, tmp_path / "s", dispatcher.address, wait=True, wait_timeout_s=WAIT_S
  )
  loaded = [b.tolist() for b in jaxfeed.Dataset.load(tmp_path / "s")]
  assert loaded == [b.tolist() for b in pipeline]
  assert save_format.progress(tmp_path / "s").chunks_done == 1


def test_a_chunk_that_keeps_failing_fails_the_save_with_its_error(cluster, tmp_path):
  dispatcher = cluster("dispatcher", "--port=0", "--max_split_attempts=2")
  cluster("worker", f"--dispatcher_address={dispatcher.address}", *HEARTBEAT)
  pipeline = jaxfeed.Dataset.range(20).map(service_udfs.fails_at_five)
  failure = (
    r"failed: chunk 1 \(positions \[4, 8\)\) of dataset \w+ raised 2 times "
    r"\(max_split_attempts=2\); the last error: ValueError: element five is bad"
  )
  with pytest.raises(jaxfeed.SaveFormatError, match=failure):
    service.distributed_save(
      pipeline,
      tmp_path / "s",
      dispatcher.address,
      wait=True,
      chunk_positions=4,
      wait_timeout_s=WAIT_S,
    )
  with pytest.raises(jaxfeed.SaveFormatError, match=failure):
    jaxfeed.Dataset.load(tmp_path / "s")
  assert "element five is bad" in save_format.progress(tmp_path / "s").error


def test_a_save_is_resumed_by_calling_again_and_another_pipeline_is_refused(tmp_path):
  path = tmp_path / "s"
  pipeline = jaxfeed.Dataset.range(100).map(np.square)
  with service.DispatchServer(service.DispatcherConfig(port=0)) as first:
    service.distributed_save(pipeline, path, first.target, chunk_positions=10)
  # A dispatcher without a work_dir forgets the save; the folder remembers it.
  with service.DispatchServer(service.DispatcherConfig(port=0)) as second:
    with pytest.raises(
      service.ServiceError, match="ALREADY_EXISTS.*incomplete save of another pipeline"
    ):
      service.distributed_save(pipeline.map(np.negative), path, second.target)
    service.distributed_save(pipeline, path, second.target)
    with service.WorkerServer(service.WorkerConfig(dispatcher_address=second.target)):
      jaxfeed.ops.load.wait_until_complete(path, WAIT_S)
  assert [int(x) for x in jaxfeed.Dataset.load(path)] == [x * x for x in range(100)]
  assert save_format.progress(path).chunks_done == 10


def test_a_damaged_list_of_saves_in_progress_does_not_stop_the_dispatcher(tmp_path):
  (tmp_path / "saves.json").write_text('{"paths": ["/x"], "checksum": "0"}')
  with service.DispatchServer(service.DispatcherConfig(port=0, work_dir=str(tmp_path))) as d:
    assert d.saves.active_paths() == []
