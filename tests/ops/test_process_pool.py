"""Worker processes with shared-memory transfer: results, errors, no leaks."""

import gc
import os
import signal
import threading

import numpy as np
import pytest

from jaxfeed.ops import process_pool
from op_testing import memfds, process_alive


def square_dict(x):
  return {"sq": np.full((3, 4), x * x, np.float32), "id": x, "name": f"n{x}"}


def big_output(n):
  return np.arange(n, dtype=np.int64)  # n * 8 bytes, past the 1 MiB block


def add_pair(a, b):
  return np.array([a + b])


def fails_on_three(x):
  if x == 3:
    raise KeyError(f"bad element {x}")
  return np.array(x)


def dies(x):
  os.kill(os.getpid(), signal.SIGKILL)


@pytest.fixture
def pool_factory():
  pools = []

  def make(*args, **kwargs):
    pool = process_pool.ProcessPool(*args, **kwargs)
    pools.append(pool)
    return pool

  yield make
  for pool in pools:
    pool.close()


def test_outputs_come_back_through_shared_memory(pool_factory):
  pool = pool_factory(square_dict, "map")
  out = pool(5, seed=0)
  assert out["id"] == 5 and out["name"] == "n5"
  np.testing.assert_array_equal(out["sq"], np.full((3, 4), 25, np.float32))
  assert out["sq"].dtype == np.float32 and out["sq"].flags.owndata


def test_tuple_elements_are_unpacked_like_tf_data(pool_factory):
  pool = pool_factory(add_pair, "map")
  np.testing.assert_array_equal(pool((2, 5), seed=0), [7])


def test_outputs_larger_than_the_block_grow_it(pool_factory):
  pool = pool_factory(big_output, "map")
  np.testing.assert_array_equal(pool(10, seed=0), np.arange(10))
  [worker] = pool._workers
  first_size = worker.block.size
  out = pool(1_000_000, seed=0)
  np.testing.assert_array_equal(out, np.arange(1_000_000))
  assert worker.block.size >= 8_000_000 > first_size
  np.testing.assert_array_equal(pool(10, seed=0), np.arange(10))


def test_worker_exception_reaches_caller_with_remote_traceback(pool_factory):
  pool = pool_factory(fails_on_three, "map")
  with pytest.raises(KeyError, match="bad element 3") as info:
    pool(3, seed=0)
  assert "fails_on_three" in str(info.value.__cause__)
  np.testing.assert_array_equal(pool(4, seed=0), 4)  # the worker lives on


def test_dead_worker_raises_and_is_replaced(pool_factory):
  pool = pool_factory(dies, "map")
  with pytest.raises(process_pool.WorkerProcessError, match="died"):
    pool(1, seed=0)
  assert pool.num_processes == 0


def test_lambdas_and_closures_run_and_unshippable_functions_say_why(pool_factory):
  offset = np.arange(3)
  pool = pool_factory(lambda x: x + offset, "map")
  np.testing.assert_array_equal(pool(2, seed=0), [2, 3, 4])
  lock = threading.Lock()
  with pytest.raises(ValueError, match="cannot be sent to worker processes.*lock"):
    process_pool.ProcessPool(lambda x: (lock, x), "map")
  assert process_pool.pool_or_threads(lambda x: (lock, x), "map") is None


def test_close_stops_processes_and_frees_shared_memory():
  shared_before = memfds()
  pool = process_pool.ProcessPool(square_dict, "map")
  pool(1, seed=0)
  pids = pool.pids()
  assert pids and memfds() - shared_before
  pool.close()
  pool.close()  # idempotent
  assert not any(process_alive(p) for p in pids)
  assert memfds() <= shared_before


def test_garbage_collection_stops_processes():
  shared_before = memfds()
  pool = process_pool.ProcessPool(square_dict, "map")
  pool(1, seed=0)
  pids = pool.pids()
  del pool
  gc.collect()
  assert not any(process_alive(p) for p in pids)
  assert memfds() <= shared_before
