"""Ephemeral sharing: one pipeline per dataset on a worker, read by many jobs."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

import jaxfeed
import service_udfs
from jaxfeed import service
from jaxfeed.service.protocol import wire
from jaxfeed.service.worker import shared_stream, task_runner

pytestmark = pytest.mark.timeout(60)

FRAME = wire.encode_frame({"x": np.zeros(1000, np.uint8)}).nbytes


class Counting:
  """An endless (or `limit`-long) pipeline of {"x": i} that counts its reads."""

  def __init__(self, limit=None, fail_at=None):
    self.made, self.limit, self.fail_at = 0, limit, fail_at

  def __call__(self):
    while self.limit is None or self.made < self.limit:
      if self.made == self.fail_at:
        raise KeyError(f"bad record {self.made}")
      self.made += 1
      yield {"x": np.full(1000, self.made - 1 & 0xFF, np.uint8), "i": np.int64(self.made - 1)}


def read(reader, n):
  frames = reader.frames(lambda: True)
  return [int(wire.decode(next(frames)[0].tobytes())["i"]) for _ in range(n)]


@pytest.fixture
def streams():
  made = []

  def make(pipeline, window_frames=100, ahead=4, **kwargs):
    stream = shared_stream.SharedStream(pipeline, window_frames * FRAME, ahead, **kwargs)
    made.append(stream)
    return stream

  yield make
  for stream in made:
    for task_id in list(stream._positions):  # pylint: disable=protected-access
      stream.remove_reader(task_id)
    assert not stream._thread.is_alive()  # pylint: disable=protected-access


def test_readers_in_step_share_one_pipeline_run(streams):
  pipeline = Counting()
  stream = streams(pipeline)
  a, b = stream.add_reader(1), stream.add_reader(2)
  got_a, got_b = [], []
  for _ in range(50):
    got_a += read(a, 1)
    got_b += read(b, 1)
  assert got_a == got_b == list(range(50))
  time.sleep(0.1)
  assert pipeline.made <= 50 + 4  # never more than `ahead` past the fastest


def test_a_slow_reader_skips_what_left_the_byte_bounded_window(streams):
  stream = streams(Counting(), window_frames=10)
  fast, slow = stream.add_reader(1), stream.add_reader(2)
  assert read(fast, 60) == list(range(60))
  assert stream.peak_bytes <= 10 * FRAME + FRAME
  first = read(slow, 1)[0]
  assert 45 <= first < 60  # the oldest frame the window still held
  assert slow.stats() == {"elements_skipped": first}
  assert fast.stats() == {"elements_skipped": 0}


def test_a_new_reader_starts_at_the_oldest_frame_still_held(streams):
  stream = streams(Counting(), window_frames=100)
  first, second = stream.add_reader(1), stream.add_reader(2)
  read(first, 30)
  read(second, 10)  # holds frames 10.. in the window for itself
  late = stream.add_reader(3)
  assert read(late, 3) == [10, 11, 12]


def test_the_last_reader_leaving_stops_the_pipeline(streams):
  left = []
  stream = streams(Counting(), on_empty=left.append)
  a, b = stream.add_reader(1), stream.add_reader(2)
  read(a, 5)
  a.stop()
  assert stream.num_readers == 1 and not left
  b.stop()
  assert left == [stream] and stream.add_reader(3) is None


def test_a_finite_pipeline_ends_every_reader_and_reports_each_task(streams):
  finished = []
  stream = streams(Counting(limit=20), on_finished=finished.append)
  a, b = stream.add_reader(7), stream.add_reader(8)
  results = {}

  def drain(name, reader):
    frames = reader.frames(lambda: True)
    items = []
    while True:
      try:
        items.append(int(wire.decode(next(frames)[0].tobytes())["i"]))
      except StopIteration as end:
        results[name] = (items, end.value)
        return

  threads = [threading.Thread(target=drain, args=(n, r)) for n, r in (("a", a), ("b", b))]
  for t in threads:
    t.start()
  for t in threads:
    t.join(timeout=30)
  assert results["a"] == results["b"] == (list(range(20)), {"elements_skipped": 0})
  assert sorted(finished) == [7, 8] and a.finished


def test_a_pipeline_error_reaches_every_reader(streams):
  stream = streams(Counting(fail_at=3))
  a, b = stream.add_reader(1), stream.add_reader(2)
  assert read(a, 3) == [0, 1, 2]
  for reader in (a, b):
    with pytest.raises(task_runner.TaskFailed, match="bad record 3"):
      read(reader, 4)


def test_jobs_of_one_dataset_share_the_worker_pipeline_over_the_service():
  service_udfs.CALLS["counted"] = 0
  dataset = jaxfeed.Dataset.range(1000).map(service_udfs.counted).repeat()
  with service.DispatchServer(service.DispatcherConfig()) as dispatcher:
    with service.WorkerServer(
      service.WorkerConfig(
        dispatcher_address=dispatcher.target, heartbeat_interval_s=0.1, buffer_size=2
      )
    ):
      readers = [
        dataset.distribute(
          dispatcher.target, ephemeral_sharing=True, max_outstanding_requests=1
        ).make_iterator()
        for _ in range(2)
      ]
      try:
        got = [[int(next(r)["x"])] for r in readers]
        for _ in range(199):
          for r, values in zip(readers, got):
            values.append(int(next(r)["x"]))
      finally:
        for r in readers:
          r.close()
  for values in got:  # each job reads a contiguous run of the one stream
    assert np.all(np.diff(values) % 1000 == 1)
  # Separate pipelines would make 400 elements plus what each client and its
  # socket read ahead (a few MiB); the shared one makes 200 plus that.
  assert service_udfs.CALLS["counted"] < 300, service_udfs.CALLS["counted"]


def test_sharing_options_are_checked():
  dataset = jaxfeed.Dataset.range(10)
  with pytest.raises(ValueError, match="needs processing_mode='parallel_epochs'"):
    dataset.distribute("127.0.0.1:1", "distributed_epoch", ephemeral_sharing=True)
  with pytest.raises(ValueError, match="ephemeral_sharing must be True or False"):
    dataset.distribute("127.0.0.1:1", ephemeral_sharing="yes")
