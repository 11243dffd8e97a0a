"""How a fused chain cuts its input positions into chunks."""

from jaxfeed.ops import chunk_plan
from jaxfeed.ops.chunk_plan import chunk_stop, tuned_size


def test_each_workers_first_chunk_is_one_batch():
  assert chunk_stop(0, 512, end=None, workers=2, sent=0, unit=128) == 128
  assert chunk_stop(128, 512, end=None, workers=2, sent=1, unit=128) == 256
  assert chunk_stop(256, 512, end=None, workers=2, sent=2, unit=128) == 768


def test_the_last_chunks_share_what_is_left_among_the_workers():
  # 1,024 left for 2 workers at 512 each would be whole chunks: kept.
  assert chunk_stop(0, 512, end=1024, workers=2, sent=4, unit=128) == 512
  # 600 left: 3 batches each (rounded up to whole batches), not 512 and 88.
  assert chunk_stop(400, 512, end=1000, workers=2, sent=4, unit=128) == 784
  # Never past the end, never under a batch.
  assert chunk_stop(950, 512, end=1000, workers=2, sent=4, unit=128) == 1000


def test_chunks_take_a_worker_about_the_target_time():
  per_position = chunk_plan.CHUNK_WORK_S / 1000.5  # 1,000 positions per target
  assert tuned_size(per_position, 128, filters=False) == 7 * 128  # whole batches
  assert tuned_size(per_position, 128, filters=True) == 1000
  assert tuned_size(1.0, 128, filters=False) == 128  # at least a batch
  assert tuned_size(1e-12, 128, filters=False) == chunk_plan.MAX_CHUNK_BATCHES * 128
  assert tuned_size(1.0, 128, filters=True) == chunk_plan.MIN_CHUNK_ELEMENTS
  assert tuned_size(1e-12, 128, filters=True) == chunk_plan.MAX_CHUNK_ELEMENTS
