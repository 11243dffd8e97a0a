"""process_batch: per-element ops and batching by chunks, inline, on threads
or in worker processes.

Checks the outputs, seeds, errors and states against the same chain run
element by element on threads, exact resume (also in a new process and
across backends), AUTOTUNE moving between backends, warm worker processes
kept by the dataset across epochs, and that closing the dataset (or losing
it, or a worker) leaves no process or shared memory behind.
"""

import functools
import gc
import json
import logging
import os
import signal
import threading

import numpy as np
import psutil
import pytest

import jaxfeed
from jaxfeed.dataset import Dataset
from jaxfeed.ops import (
  backend_choice,
  chunk_plan,
  process_batch,
  process_batch_iterator,
  worker_processes,
)
from jaxfeed.ops.process_batch import ProcessBatchNode
from jaxfeed.ops.worker_processes import WorkerProcessError
import op_testing
from op_testing import assert_identical_batch, elements_and_seeds, memfds, process_alive

# In a module of their own: each worker imports the module of a function.
from process_udfs import (
  busy_python,
  fails_on_seven,
  image_in_one_buffer,
  image_rows,
  image_rows_fail_at_13,
  image_rows_widen_at_18,
  jitter,
  not_multiple_of_three,
  plus_ten,
  wide_after_400,
)


N = 40


def _input(kind, n=N):
  values = np.arange(n, dtype=np.int64)
  if kind == "range":
    return Dataset.range(n)
  if kind == "from_tensor_slices":
    return Dataset.from_tensor_slices({"x": values})
  source = jaxfeed.ArraySource({"x": values})
  return Dataset.from_source(source, jaxfeed.IndexSampler(n, shuffle=True, seed=5))


CHAINS = {
  "map": lambda ds, **kw: ds.map(plus_ten, **kw),
  "random_map": lambda ds, **kw: ds.random_map(jitter, seed=9, **kw),
  "filter_map_random_map": lambda ds, **kw: (
    ds.filter(not_multiple_of_three).map(plus_ten, **kw).random_map(jitter, seed=1, **kw)
  ),
}


def _chain(kind, chain, backend, batch_size=6, drop_remainder=False):
  kw = {"num_parallel_calls": 2, "backend": "process"} if backend == "process" else {}
  return CHAINS[chain](_input(kind), **kw).batch(batch_size, drop_remainder)


def _processes(dataset, **kw):
  """The fused iterator over a chain built with backend="process"."""
  kw.setdefault("num_workers", 2)
  return ProcessBatchNode(dataset.node, **kw).make_iterator()


def _root(iterator):
  """The pipeline's last op iterator under the autotuner's wrapper."""
  return getattr(iterator, "root", iterator)


def _threads(dataset):
  return dataset.node.make_iterator()


def _slots():
  """The inodes of the batch slots (memfds) this process holds open."""
  inodes = set()
  for fd in os.listdir("/proc/self/fd"):
    try:
      if os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:jaxfeed-process_batch"):
        inodes.add(os.stat(f"/proc/self/fd/{fd}").st_ino)
    except OSError:
      pass  # closed meanwhile (listdir's own descriptor)
  return inodes


def _assert_same_batches(ours, expected):
  assert len(ours) == len(expected)
  for a, b in zip(ours, expected):
    assert_identical_batch(a, b)


@pytest.mark.parametrize("drop_remainder", [False, True])
@pytest.mark.parametrize("chain", sorted(CHAINS))
@pytest.mark.parametrize("kind", ["range", "from_tensor_slices", "from_source"])
def test_batches_and_seeds_are_those_of_the_thread_backend(kind, chain, drop_remainder):
  build = lambda backend: _chain(kind, chain, backend, drop_remainder=drop_remainder)
  with _threads(build("thread")) as it:
    expected, expected_seeds = elements_and_seeds(it)
  # chunk=12: several chunks per worker, batches spanning chunks (filter).
  with _processes(build("process"), chunk=12) as it:
    ours, seeds = elements_and_seeds(it)
  _assert_same_batches(ours, expected)
  assert seeds == expected_seeds


def test_optimizer_fuses_process_and_autotune_chains_and_keeps_others_on_threads():
  fused = Dataset.range(N).map(plus_ten, backend="process").batch(4)
  with fused.make_iterator() as it:
    assert list(it)[1].tolist() == [14, 15, 16, 17]
    assert _root(it).backend == "process" and len(_root(it).pids()) >= 1
  # A map asking for processes is not fused with its filter into a
  # (thread-only) map_and_filter, which would drop the backend.
  filtered = (
    Dataset.range(N).map(plus_ten, backend="process").filter(not_multiple_of_three).batch(4)
  )
  with filtered.make_iterator() as it:
    assert _root(it).backend == "process"
    assert list(it)[0].tolist() == [10, 11, 13, 14]
  plain = Dataset.range(N).map(plus_ten, num_parallel_calls=2).batch(4)
  threads = (
    Dataset.range(N).map(plus_ten, num_parallel_calls=jaxfeed.AUTOTUNE, backend="thread").batch(4)
  )
  for dataset in (plain, threads):
    with dataset.make_iterator() as it:
      assert not isinstance(_root(it), process_batch.ProcessBatchIterator)
  # AUTOTUNE chains are fused, lambdas included (they travel by value); the
  # first batches run on threads (measured) while the worker processes start.
  scale = np.int64(3)
  auto = Dataset.range(N).map(lambda x: x * scale, num_parallel_calls=jaxfeed.AUTOTUNE).batch(4)
  with auto.make_iterator() as it:
    assert isinstance(_root(it), process_batch.ProcessBatchIterator)
    assert _root(it).backend == "thread"
    assert len(_root(it).pids()) == 2  # starting
    assert [b.tolist() for b in it] == [[3 * i for i in range(j, j + 4)] for j in range(0, N, 4)]
  auto.close()


@pytest.mark.parametrize("chain", ["random_map", "filter_map_random_map"])
def test_resumes_exactly_at_every_cut_and_across_backends(chain):
  build = lambda: _chain("from_source", chain, "process", batch_size=4)
  # Cuts inside a chunk, on a chunk boundary and at the end.
  resumed = op_testing.check_resume(
    build,
    cuts=[1, 4, 7],
    make_iterator=lambda ds: _processes(ds, chunk=8),
    with_seeds=True,
    into_same_iterator=True,
  )
  # A process checkpoint restores into threads and a thread one into processes.
  on_threads = lambda: _chain("from_source", chain, "thread", batch_size=4)
  for cut, state in zip([1, 4], resumed.states[:2]):
    with _threads(on_threads()) as it:
      it.set_state(state)
      _assert_same_batches([b for b, _ in resumed.expected[cut:]], list(it))
    with _threads(on_threads()) as threads, _processes(build(), chunk=8) as ours:
      for _ in range(cut):
        next(threads)
      ours.set_state(json.loads(json.dumps(threads.get_state())))
      _assert_same_batches(list(ours), [b for b, _ in resumed.expected[cut:]])


def test_resumes_in_a_new_process():
  expression = "Dataset.range(50).map(np.square, num_parallel_calls=2, backend='process').batch(8)"
  dataset = eval(expression)  # pylint: disable=eval-used
  with dataset.make_iterator() as it:
    assert _root(it).backend == "process"
    expected = list(it)
  states = []
  with dataset.make_iterator() as it:
    for read in (1, 2):  # cuts after 1 and 3 batches
      for _ in range(read):
        next(it)
      states.append(json.loads(json.dumps(it.get_state())))
  remaining = op_testing.restore_in_new_process(expression, states)
  for cut, rest in zip((1, 3), remaining):
    assert [b.tolist() for b in rest] == [b.tolist() for b in expected[cut:]]


def _outcomes(iterator):
  """Each next(): the batch as a list, or the error's type and message."""
  outcomes = []
  while True:
    try:
      outcomes.append(next(iterator).tolist())
    except StopIteration:
      return outcomes
    except ValueError as exc:
      outcomes.append((type(exc).__name__, str(exc)))


def test_udf_error_reaches_the_consumer_and_iteration_goes_on_as_on_threads():
  build = lambda kw: Dataset.range(20).map(fails_on_seven, **kw).batch(3)
  with _threads(build({})) as it:
    expected = _outcomes(it)
  assert ("ValueError", "bad element 7") in expected
  with _processes(build({"backend": "process"}), chunk=6) as it:
    assert _outcomes(it) == expected
  with _processes(build({"backend": "process"}), chunk=6) as it:
    next(it), next(it)
    with pytest.raises(ValueError, match="bad element 7") as info:
      next(it)
    assert "fails_on_seven" in str(info.value.__cause__)  # the worker's traceback


def test_the_dataset_keeps_its_workers_until_closed_or_collected():
  big = np.arange(300_000, dtype=np.int64)  # 2.4 MB: shared, not piped
  build = lambda: (
    Dataset.from_source(jaxfeed.ArraySource({"x": big})).map(plus_ten, backend="process").batch(64)
  )
  threads_before = threading.enumerate()
  shared_before = memfds()  # those of other tests' datasets not yet collected
  dataset = build()
  it = dataset.make_iterator()
  first = next(it)
  pids = it.pids()
  assert len(pids) == 2 and all(process_alive(p) for p in pids)
  assert memfds() - shared_before  # the input array, the slots
  op_testing.check_close(it, threads_before)
  # Closing the iterator gives the workers back to the dataset, warm.
  assert all(process_alive(p) for p in pids)
  dataset.close()
  assert not any(process_alive(p) for p in pids)
  # A batch handed out before close() stays valid; its memory goes with it.
  assert first["x"].tolist() == list(range(10, 74))
  del first
  assert memfds() <= shared_before
  dataset.close()  # idempotent

  dataset = build()
  it = iter(dataset)
  next(it)
  pids = it.pids()
  del it, dataset  # garbage: the iterator first, then the dataset
  gc.collect()
  op_testing.wait_until(lambda: not any(process_alive(p) for p in pids))
  assert memfds() <= shared_before


def test_a_with_block_closes_the_dataset():
  with Dataset.range(100).map(plus_ten, backend="process").batch(10) as dataset:
    for _batch in dataset:
      pass
    it = dataset.make_iterator()
    pids = it.pids()
    it.close()
  assert pids and not any(process_alive(p) for p in pids)


def test_batches_are_views_until_dropped_then_slots_are_reused():
  dataset = Dataset.range(2000).map(plus_ten, backend="process").batch(10)
  before = len(_slots())
  with _processes(dataset, chunk=10) as it:
    held = [next(it) for _ in range(30)]  # all held: none overwritten
    for _ in range(100):
      next(it)  # dropped at once: slots come back
    assert [b.tolist() for b in held] == [list(range(10 + 10 * i, 20 + 10 * i)) for i in range(30)]
    assert held[0].flags.writeable
    del held  # their slots' memory goes with them
    for _ in range(20):
      next(it)
    assert len(_slots()) <= before + 16


def test_killed_worker_gives_a_clear_error_not_a_hang():
  dataset = Dataset.range(10_000).map(busy_python, backend="process").batch(4)
  it = _processes(dataset, chunk=4)
  next(it)
  pids = it.pids()
  os.kill(pids[0], signal.SIGKILL)
  with pytest.raises(WorkerProcessError, match=f"pid {pids[0]}.*died"):
    for _ in range(10_000):
      next(it)
  with pytest.raises(WorkerProcessError):
    next(it)  # stays failed
  assert not any(process_alive(p) for p in pids)
  it.close()


def test_lambdas_and_closures_run_in_processes():
  offset = np.arange(4)
  dataset = (
    Dataset.range(N)
    .map(lambda x: x + offset, backend="process")
    .map(lambda v: v * 2, backend="process")
    .batch(5)
  )
  with dataset.make_iterator() as it:
    batches = list(it)
    assert _root(it).backend == "process"
  assert [b.tolist() for b in batches] == [
    [[2 * (i + k) for k in range(4)] for i in range(j, j + 5)] for j in range(0, N, 5)
  ]
  dataset.close()


def test_functions_that_cannot_be_shipped_run_on_threads_with_a_log_line(caplog):
  lock = threading.Lock()

  def locked(x):
    with lock:
      return x + 1

  expected = [list(range(1, 6)), list(range(6, 11))]
  with caplog.at_level(logging.WARNING, logger="jaxfeed"):
    dataset = Dataset.range(10).map(locked, backend="process").batch(5)
    with dataset.make_iterator() as it:
      assert [b.tolist() for b in it] == expected
      assert _root(it).backend == "thread" and _root(it).pids() == []
      assert "cannot be sent to worker processes" in _root(it).stats()["ops"][-1]["reason"]
    auto = Dataset.range(10).map(locked, num_parallel_calls=jaxfeed.AUTOTUNE).batch(5)
    with auto.make_iterator() as it:
      assert [b.tolist() for b in it] == expected
      assert _root(it).pids() == []
  lines = [r.getMessage() for r in caplog.records]
  assert len(lines) == 2 and all("lock" in line and "on threads" in line for line in lines), lines


@pytest.fixture
def switching(monkeypatch):
  """AUTOTUNE measuring every batch and measuring again all the time, so
  that an iterator moves between the backends every few batches."""
  monkeypatch.setattr(backend_choice, "WINDOW_S", 0.0)
  monkeypatch.setattr(backend_choice, "WINDOW_CHUNKS", 0)
  monkeypatch.setattr(process_batch_iterator, "SETTLE_CHUNKS", 0)
  monkeypatch.setattr(chunk_plan, "CHUNK_WORK_S", 0.0)
  monkeypatch.setattr(backend_choice, "EXPLORE_FIRST_S", 0.0)
  ran = []
  switch = process_batch_iterator.ProcessBatchIterator._switch

  def spy(self, backend):
    ran.append(backend)
    switch(self, backend)

  monkeypatch.setattr(process_batch_iterator.ProcessBatchIterator, "_switch", spy)
  return ran


@pytest.mark.parametrize("chain", ["filter_random_map", "random_map", "image_rows_writes_out"])
def test_autotune_moves_between_backends_without_changing_the_output(switching, chain):
  if chain == "image_rows_writes_out":
    build = lambda npc: (
      Dataset.range(300).map(image_rows, num_parallel_calls=npc, writes_out=True).batch(2)
    )
  else:
    build = lambda npc: (
      (
        _input("from_source", 600).filter(not_multiple_of_three)
        if chain.startswith("filter")
        else _input("from_source", 600)
      )
      .random_map(jitter, seed=2, num_parallel_calls=npc)
      .batch(2)
    )
  reference = build(None)  # each epoch in its own order, element by element
  dataset = build(jaxfeed.AUTOTUNE)
  # Epochs until each backend ran (the worker processes start in the
  # background during the first ones).
  for _ in range(50):
    with reference.make_iterator() as it:
      expected, expected_seeds = elements_and_seeds(it)
    with dataset.make_iterator() as it:
      assert isinstance(_root(it), process_batch.ProcessBatchIterator)
      ours, seeds = elements_and_seeds(it)
    _assert_same_batches(ours, expected)
    assert seeds == expected_seeds
    if set(switching) == {"inline", "thread", "process"} and len(switching) > 6:
      break
  else:
    pytest.fail(f"AUTOTUNE did not move between all backends: {switching}")
  dataset.close()


def test_copies_instead_of_views_when_asked():
  dataset = Dataset.range(100).map(plus_ten, backend="process").batch(10)
  with _processes(dataset, copy=True) as it:
    batches = list(it)
  assert all(b.flags.owndata and b.flags.writeable for b in batches)
  assert [b.tolist() for b in batches] == [list(range(10 + 10 * i, 20 + 10 * i)) for i in range(10)]


def test_outputs_that_grow_get_slots_big_enough():
  dataset = Dataset.range(800).map(wide_after_400, backend="process").batch(8)
  with _processes(dataset, chunk=64) as it:
    held = [next(it) for _ in range(40)]  # small: one slot per held chunk
    del held  # ... all free now, and too small for what follows
    last_column = [int(batch[-1, -1]) for batch in it]
  assert last_column == list(range(327, 800, 8))


# ---------------------------------------------------------------------------
# rows written into the slot as elements come (64 KiB elements and more)
# ---------------------------------------------------------------------------
def _image_chain(fn, backend, writes_out, n=42, batch_size=4, **kw):
  kw.update(num_parallel_calls=2, backend=backend)
  if writes_out:
    kw["writes_out"] = True
  return Dataset.range(n).map(fn, **kw).batch(batch_size)


@pytest.mark.parametrize("chunk", [4, 8, 24])  # 24: over the first 1 MiB slot
@pytest.mark.parametrize("writes_out", [False, True])
@pytest.mark.parametrize("dtype", ["uint8", "float32"])
def test_rows_written_in_place_are_the_thread_batches(tmp_path, dtype, writes_out, chunk):
  log = tmp_path / "rows"
  fn = functools.partial(image_rows, dtype=dtype, log=str(log))
  with _threads(_image_chain(fn, "thread", writes_out)) as it:
    expected = list(it)
  log.unlink()
  with _processes(_image_chain(fn, "process", writes_out), chunk=chunk) as it:
    ours = list(it)
  _assert_same_batches(ours, expected)
  assert len(ours[-1]["label"]) == 2  # the short last batch
  had_rows = [int(line) for line in log.read_text().split()]
  assert len(had_rows) == 42
  if writes_out:
    # Each worker's first element has no template yet; later ones have rows
    # (a slot too small for them is grown first).
    assert sum(had_rows) >= 42 - 2
  else:
    assert not any(had_rows)


@pytest.mark.parametrize("writes_out", [False, True])
@pytest.mark.parametrize("fn", [image_rows_widen_at_18, image_rows_fail_at_13])
def test_shape_changes_and_errors_mid_batch_are_those_of_threads(fn, writes_out):
  with _threads(_image_chain(fn, "thread", writes_out)) as it:
    expected = op_testing.next_outcomes(it)
  assert any(isinstance(o, str) for o in expected)  # the batch that fails
  for chunk in (4, 12):
    with _processes(_image_chain(fn, "process", writes_out), chunk=chunk) as it:
      op_testing.assert_same_outcomes(op_testing.next_outcomes(it), expected)


def test_each_element_is_in_its_row_before_the_next_is_computed():
  # The function hands out the same array every call: stacking the
  # elements of a batch after computing them all would repeat the last one.
  dataset = Dataset.range(40).map(image_in_one_buffer, backend="process").batch(4)
  with _processes(dataset, chunk=8) as it:
    batches = list(it)
  assert [b["pixels"][:, 0, 0, 0].tolist() for b in batches] == [
    [4 * i, 4 * i + 1, 4 * i + 2, 4 * i + 3] for i in range(10)
  ]


def test_writes_out_resumes_exactly_across_backends():
  build = lambda backend: _image_chain(image_rows, backend, True, n=30)
  with _threads(build("thread")) as it:
    expected = list(it)
  for cut in (1, 3, 7):
    with _processes(build("process"), chunk=8) as it:
      for _ in range(cut):
        next(it)
      state = it.get_state()
    with _threads(build("thread")) as it:
      it.set_state(state)
      _assert_same_batches(list(it), expected[cut:])
    with _threads(build("thread")) as it:
      for _ in range(cut):
        next(it)
      state = it.get_state()
    with _processes(build("process"), chunk=12) as it:
      it.set_state(state)
      _assert_same_batches(list(it), expected[cut:])


def test_the_next_iterator_reuses_the_slots_of_the_last():
  dataset = Dataset.range(40).map(image_rows, backend="process").batch(4)
  node = ProcessBatchNode(dataset.node, num_workers=2, chunk=8)
  with node.make_iterator() as it:
    first = [b["label"].tolist() for b in it]
  kept = _slots()
  assert kept  # the free slots, kept for the node's next iterator
  with node.make_iterator() as it:
    second = []
    for batch in it:
      second.append(batch["label"].tolist())
      assert _slots() <= kept  # no new memory for the batches
  assert first == second == [list(range(i, i + 4)) for i in range(0, 40, 4)]
  del node, it, batch
  gc.collect()
  assert not _slots()  # the spare slots go with their node


def test_a_dataset_keeps_its_spare_slots_only_while_it_lives():
  chain = Dataset.range(40).map(image_rows, backend="process").batch(4)
  dataset = Dataset(ProcessBatchNode(chain.node, chunk=8), jaxfeed.Options(optimize=False))
  assert [b["label"].tolist() for b in dataset] == [list(range(i, i + 4)) for i in range(0, 40, 4)]
  kept = _slots()
  assert kept
  seen = set()
  for batch in dataset:  # noqa: B007 (the last batch stays alive until the del)
    seen |= _slots()
  assert seen == kept  # the second epoch wrote into the first's slots only
  del dataset, batch
  gc.collect()
  assert not _slots()


# ---------------------------------------------------------------------------
# what the dataset keeps across epochs
# ---------------------------------------------------------------------------
def _children():
  return {
    p.pid for p in psutil.Process().children(recursive=True) if p.status() != psutil.STATUS_ZOMBIE
  }


def test_epochs_of_one_dataset_reuse_its_warm_worker_processes():
  dataset = _input("from_source", 400).map(plus_ten, backend="process").batch(8)
  reference = _input("from_source", 400).map(plus_ten).batch(8)
  pids = None
  epochs = []
  for _ in range(3):
    before = _children()
    it = iter(dataset)
    batches = [b["x"].tolist() for b in it]
    assert batches == [b["x"].tolist() for b in reference]  # its epoch's order
    epochs.append(batches)
    if pids is None:
      pids = it.pids()
      assert len(pids) == 2 and set(pids) <= _children()
    else:
      assert it.pids() == pids
      assert _children() - before == set()  # no process started
  assert epochs[0] != epochs[1] != epochs[2]
  dataset.close()
  assert not any(process_alive(p) for p in pids)


def test_epochs_of_one_dataset_reuse_autotune_findings_without_a_new_trial():
  dataset = Dataset.range(3000).map(busy_python, num_parallel_calls=jaxfeed.AUTOTUNE).batch(10)
  for _ in range(30):  # until the first measurement is done
    with dataset.make_iterator() as it:
      for _ in it:
        pass
      row = it.stats()["ops"][-1]
    if not row["measuring"]:
      break
  picked, rates = row["picked"], row["rates"]
  assert picked in ("inline", "thread", "process") and set(rates) == {
    "inline",
    "thread",
    "process",
  }, row
  for _ in range(2):
    with dataset.make_iterator() as it:
      next(it)
      # The next epoch runs the pick from its first batch, measuring nothing.
      assert _root(it).backend == picked
      row = it.stats()["ops"][-1]
      assert not row["measuring"] and row["picked"] == picked
  dataset.close()


def test_idle_worker_processes_stop_after_a_while(monkeypatch):
  monkeypatch.setattr(process_batch, "IDLE_TIMEOUT_S", 0.2)
  monkeypatch.setattr(worker_processes, "TICK_S", 0.05)
  dataset = Dataset.range(40).map(plus_ten, backend="process").batch(4)
  expected = [list(range(i + 10, i + 14)) for i in range(0, 40, 4)]
  it = iter(dataset)
  assert [b.tolist() for b in it] == expected
  pids = it.pids()
  assert pids and all(process_alive(p) for p in pids)
  op_testing.wait_until(lambda: not any(process_alive(p) for p in pids), timeout_s=10)
  assert [b.tolist() for b in dataset] == expected  # new ones start
  dataset.close()


def test_a_launcher_tick_never_waits_for_the_runtime_lock():
  # close() holds the lock while it waits for the launcher to start a
  # worker; a tick that waited for the lock on the launcher thread would
  # never let it.
  ds = Dataset.range(64).map(plus_ten, num_parallel_calls=2, backend="process").batch(8)
  with ds.make_iterator() as iterator:
    assert sum(len(b) for b in iterator) == 64
  runtime = list(process_batch._RUNTIMES.values())[-1]  # pylint: disable=protected-access
  with runtime._lock:  # pylint: disable=protected-access
    tick = threading.Thread(target=runtime._expire)  # pylint: disable=protected-access
    tick.start()
    tick.join(5)
    assert not tick.is_alive()
  ds.close()
