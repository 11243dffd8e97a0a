"""What the op tests in this folder share.

* The reference: TensorFlow, imported on demand with its logs silenced, and
  datasets of Python-held elements built the same way for both libraries.
* A list-backed test input op that counts what its consumers pull.
* Comparisons: element by element (structure, types, dtypes, shapes, values),
  hashable canonical forms for ordered and multiset comparisons, and batches
  read with the batched-read protocol (`next_batch`).
* State: exact resume at every cut point; restoring in a new process.
* Threads, processes and shared memory: which are new or still there;
  waiting for a condition.

Test modules import it as `import op_testing`: pytest puts this folder on
`sys.path` when it collects them (the folder has no `__init__.py`).
"""

import itertools
import json
import os
import pickle
import subprocess
import sys
import textwrap
import threading
import time
from typing import Any, Callable, Iterable, NamedTuple, Sequence

import numpy as np
import psutil
import pytest

import jaxfeed
from jaxfeed.dataset import Dataset
from jaxfeed.ops import base
from jaxfeed.ops import memfd
from jaxfeed.ops import op_stats
from jaxfeed.ops import parallel_executor
from jaxfeed.ops import stacking
from jaxfeed.ops import worker_processes

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# The num_parallel_calls values the parallel ops are tested with.
NUM_PARALLEL_CALLS = [None, 1, 4, jaxfeed.AUTOTUNE]


# ---------------------------------------------------------------------------
# the reference and the inputs
# ---------------------------------------------------------------------------
def import_tensorflow() -> Any:
  """The `tensorflow` module, with its C++ and Python logging silenced.

  A function rather than an import at the top of this module: worker
  processes of the process backend import test modules (and so this one) to
  load their functions, and should not pay for TensorFlow. Test modules call
  it at their top, so they fail, not skip, where TensorFlow is missing.
  """
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
  import tensorflow as tf  # pylint: disable=g-import-not-at-top

  tf.get_logger().setLevel("ERROR")
  tf.autograph.set_verbosity(0)
  return tf


def elements_dataset(items: Sequence[Any]) -> Dataset:
  """A jaxfeed dataset of `items` (arrays, dicts, tuples), in order."""
  items = list(items)
  return Dataset.range(len(items)).map(lambda i: items[int(i)])


def tf_spec(value: Any) -> Any:
  """The tf.TensorSpec structure of elements like `value`, sizes unknown."""
  tf = import_tensorflow()
  if isinstance(value, dict):
    return {k: tf_spec(v) for k, v in value.items()}
  if isinstance(value, tuple):
    return tuple(tf_spec(v) for v in value)
  if isinstance(value, bytes):
    return tf.TensorSpec([], tf.string)
  arr = np.asarray(value)
  dtype = tf.string if arr.dtype == object else tf.as_dtype(arr.dtype)
  return tf.TensorSpec([None] * arr.ndim, dtype)


def tf_elements_dataset(items: Sequence[Any], example: Any = None) -> Any:
  """A tf.data dataset of `items`, in order; `example` gives the spec of an
  empty one."""
  tf = import_tensorflow()
  items = list(items)
  spec = tf_spec(items[0] if items else example)
  return tf.data.Dataset.from_generator(lambda: iter(items), output_signature=spec)


_COLUMN = np.arange(10, dtype=np.int32)
# Inputs of each element structure, built from a Dataset class: jaxfeed's
# `Dataset` or `tf.data.Dataset`.
INPUT_KINDS = {
  "range": lambda D: D.range(20),
  "tuple": lambda D: D.from_tensor_slices((_COLUMN, _COLUMN * 2.5)),
  "dict": lambda D: D.from_tensor_slices({"x": _COLUMN, "y": _COLUMN[:, None]}),
  "empty": lambda D: D.range(0),
}


def graph_iterator(dataset: Dataset) -> base.OpIterator:
  """An iterator of exactly the op graph built: no optimizer, no autotuner."""
  return dataset.node.make_iterator()


def run(dataset: Any, make_iterator: Callable[[Dataset], base.OpIterator] | None = None) -> list:
  """All elements of a jaxfeed dataset (read with `make_iterator`, by default
  the dataset's own), or of a tf.data one as numpy values."""
  if isinstance(dataset, Dataset):
    with (make_iterator or Dataset.make_iterator)(dataset) as iterator:
      return list(iterator)
  return list(dataset.as_numpy_iterator())


def assert_matches_tf_data(
  make: Callable[[Any], Any],
  *,
  make_iterator: Callable[[Dataset], base.OpIterator] | None = None,
  same: Callable[[list, list], None] | None = None,
) -> list:
  """Checks that a pipeline yields what tf.data's yields.

  Args:
    make: builds the pipeline from a Dataset class, given jaxfeed's
      `Dataset` and `tf.data.Dataset` in turn.
    make_iterator: reads the jaxfeed dataset (see `run`).
    same: asserts two lists of elements are the same; by default
      `assert_same_stream`.

  Returns:
    jaxfeed's elements.
  """
  ours = run(make(Dataset), make_iterator)
  (same or assert_same_stream)(ours, run(make(import_tensorflow().data.Dataset)))
  return ours


def elements_and_seeds(iterator: Iterable[Any], limit: int | None = None) -> tuple[list, list]:
  """Reads `iterator` (to its end, or `limit` elements): the elements and the
  `last_seed` after each."""
  elements, seeds = [], []
  for element in itertools.islice(iterator, limit):
    elements.append(element)
    seeds.append(iterator.last_seed)
  return elements, seeds


def seeds_of(dataset: Dataset) -> list:
  """The `last_seed` after each element of `dataset`'s op graph."""
  with graph_iterator(dataset) as iterator:
    return elements_and_seeds(iterator)[1]


@pytest.fixture(params=["threads", "adaptive"])
def work_mode(request, monkeypatch):
  """Parallel work on the threads only, or cheap ordered work in the consumer.

  A fixture: test modules using it import it by name.
  """
  if request.param == "threads":
    monkeypatch.setattr(parallel_executor, "INLINE_BELOW_S", 0.0)
  return request.param


class ListNode(base.Node):
  """A test input of `items`; an `Exception` item is raised in its turn.

  Element i has seed `1000 + i`. The node counts the elements pulled by all
  its iterators (`pulls`) and keeps every iterator it made (`made`).
  `gate`: an Event that each pull after the first waits for; `waiting` is set
  once one does. `with_next_batch`: the iterators also read whole batches
  (the batched-read protocol), counting those calls in `batched_calls`.
  """

  op_name = "list"

  def __init__(
    self, items: Iterable[Any], gate: threading.Event | None = None, with_next_batch: bool = False
  ):
    super().__init__()
    self.items = items if isinstance(items, np.ndarray) else list(items)
    self.gate, self.with_next_batch = gate, with_next_batch
    self.pulls = 0
    self.made = []
    self.waiting = threading.Event()

  def make_iterator(self) -> "ListIterator":
    iterator_type = BatchedListIterator if self.with_next_batch else ListIterator
    iterator = iterator_type(self)
    self.made.append(iterator)
    return iterator


class ListIterator(base.OpIterator):
  """The iterator of a `ListNode`."""

  op_name = "list"

  def __init__(self, node: ListNode):
    super().__init__()
    self.node = node
    self.index = 0
    self.batched_calls = 0

  def __next__(self) -> Any:
    node = self.node
    if node.gate is not None and self.index >= 1:
      node.waiting.set()
      node.gate.wait()
    if self.index >= len(node.items):
      raise StopIteration
    item = node.items[self.index]
    self.index += 1
    node.pulls += 1
    if isinstance(item, Exception):
      raise item
    return item

  @property
  def last_seed(self) -> int:
    return 1000 + self.index - 1

  def _get_own_state(self) -> dict:
    return {"index": self.index}

  def _set_own_state(self, state: dict) -> None:
    self.index = state["index"]


class BatchedListIterator(ListIterator):
  """A `ListIterator` that also reads whole batches with `next_batch`."""

  def next_batch(self, max_count: int) -> tuple[Any, np.ndarray]:
    items = self.node.items
    if self.index >= len(items):
      raise StopIteration
    start = self.index
    self.index = min(start + max_count, len(items))
    self.node.pulls += self.index - start
    self.batched_calls += 1
    seeds = np.arange(1000 + start, 1000 + self.index, dtype=np.uint64)
    return stacking.to_batch_leaf(np.asarray(items[start : self.index])), seeds


# ---------------------------------------------------------------------------
# comparisons
# ---------------------------------------------------------------------------
def canonical(element: Any, exact_types: bool = False) -> tuple:
  """A hashable, sortable form of an element: its structure, and per leaf its
  dtype, shape and bytes.

  With `exact_types`, dict key order and the Python types of containers and
  leaves count too (a tuple is not a list, an np.int64 not a 0-d array).
  """
  if isinstance(element, dict):
    items = [(k, canonical(v, exact_types)) for k, v in element.items()]
    return ("dict", *items) if exact_types else tuple(sorted(items))
  if isinstance(element, (tuple, list)):
    parts = tuple(canonical(v, exact_types) for v in element)
    return (type(element).__name__, *parts) if exact_types else parts
  if exact_types and isinstance(element, (bytes, str, bool, int, float)):
    return (type(element).__name__, element)
  array = np.asarray(element)
  form = (str(array.dtype), array.shape, array.tobytes())
  return (type(element).__name__, *form) if exact_types else form


def assert_same_values(ours: Iterable[Any], theirs: Iterable[Any]) -> None:
  """The same elements in the same order, compared by `canonical` form."""
  assert [canonical(e) for e in ours] == [canonical(e) for e in theirs]


def assert_same_multiset(ours: Iterable[Any], theirs: Iterable[Any]) -> None:
  """The same elements in any order, compared by `canonical` form."""
  assert sorted(canonical(e) for e in ours) == sorted(canonical(e) for e in theirs)


def assert_same_element(ours: Any, theirs: Any, where: str = "element") -> None:
  """The same structure and container types; per leaf the same Python type,
  dtype, shape and values."""
  assert type(ours) is type(theirs), (where, type(ours), type(theirs))
  if isinstance(theirs, dict):
    assert set(ours) == set(theirs), (where, sorted(ours), sorted(theirs))
    for key in theirs:
      assert_same_element(ours[key], theirs[key], f"{where}/{key}")
  elif isinstance(theirs, (tuple, list)):
    assert len(ours) == len(theirs), (where, len(ours), len(theirs))
    for i, (a, b) in enumerate(zip(ours, theirs)):
      assert_same_element(a, b, f"{where}/{i}")
  elif isinstance(theirs, (bytes, str)):
    assert ours == theirs, where
  else:
    a, b = np.asarray(ours), np.asarray(theirs)
    assert a.dtype == b.dtype, (where, a.dtype, b.dtype)
    assert a.shape == b.shape, (where, a.shape, b.shape)
    if b.dtype == object:
      assert a.tolist() == b.tolist(), where
    else:
      np.testing.assert_array_equal(a, b, err_msg=where)


def assert_same_stream(ours: Iterable[Any], theirs: Iterable[Any]) -> None:
  """As many elements, pairwise the same by `assert_same_element`."""
  ours, theirs = list(ours), list(theirs)
  assert len(ours) == len(theirs), (len(ours), len(theirs))
  for i, (a, b) in enumerate(zip(ours, theirs)):
    assert_same_element(a, b, f"element {i}")


def assert_identical_batch(ours: Any, expected: Any, path: str = "batch") -> None:
  """The same container types and dict key order; per leaf array the same
  dtype, shape, Python types of the values and values; ours is writable."""
  assert type(ours) is type(expected), (path, type(ours), type(expected))
  if isinstance(expected, dict):
    assert list(ours) == list(expected), path
    for key in expected:
      assert_identical_batch(ours[key], expected[key], f"{path}[{key!r}]")
  elif isinstance(expected, (tuple, list)):
    assert len(ours) == len(expected), path
    for i, (a, b) in enumerate(zip(ours, expected)):
      assert_identical_batch(a, b, f"{path}[{i}]")
  else:
    assert ours.dtype == expected.dtype and ours.shape == expected.shape, path
    assert ours.flags.writeable, path
    assert [type(v) for v in ours.flat] == [type(v) for v in expected.flat]
    assert ours.tolist() == expected.tolist(), path


def next_outcomes(iterator: Iterable[Any]) -> list:
  """Each next() to the end: the batch, or a ValueError's text."""
  out = []
  while True:
    try:
      out.append(next(iterator))
    except StopIteration:
      return out
    except ValueError as e:
      out.append(str(e))


def assert_same_outcomes(ours: list, theirs: list) -> None:
  """`next_outcomes` lists: the same error texts, identical batches."""
  assert len(ours) == len(theirs)
  for a, b in zip(ours, theirs):
    if isinstance(b, str):
      assert a == b
    else:
      assert_identical_batch(a, b)


def leaves(tree: Any) -> list:
  """The leaves of a tree of dicts, tuples and lists, in order."""
  if isinstance(tree, dict):
    return [leaf for value in tree.values() for leaf in leaves(value)]
  if isinstance(tree, (tuple, list)):
    return [leaf for value in tree for leaf in leaves(value)]
  return [tree]


def next_of_both(ours: Iterable[Any], reference: Iterable[Any]) -> tuple | None:
  """next() of both iterators: (ours, reference's), or None where both ended
  (asserting that ours ends where the reference does)."""
  try:
    expected = next(reference)
  except StopIteration:
    with pytest.raises(StopIteration):
      next(ours)
    return None
  return next(ours), expected


def check_next_batch(
  make_iterator: Callable[[], base.OpIterator],
  sizes: Sequence[int],
  source_arrays: Sequence[np.ndarray] = (),
  same_element: Callable[[Any, Any], None] | None = None,
) -> int:
  """Reads two iterators to their end, one with `next_batch`, one with next().

  Checks that each `next_batch(size)`, for `sizes` in turn (cycled), equals
  `size` next() calls stacked, with their seeds, shares no memory with
  `source_arrays`, and leaves both iterators in the same state with the same
  `last_seed`. A size of 0 is a single next() on both: the elements, stacked,
  are identical, and also the same by `same_element` if given.

  Returns:
    The number of reads, the last (the end) included.
  """
  fast, plain = make_iterator(), make_iterator()
  reads = 0
  for size in itertools.cycle(sizes):
    reads += 1
    if size == 0:
      both = next_of_both(fast, plain)
      ended = both is None
      if not ended:
        assert_identical_batch(*(stacking.stack([e]) for e in both))
        if same_element is not None:
          same_element(*both)
    else:
      elements, seeds = elements_and_seeds(plain, size)
      ended = not elements
      if not ended:
        batch, batch_seeds = fast.next_batch(size)
        assert_identical_batch(batch, stacking.stack(elements))
        assert batch_seeds.dtype == np.uint64 and batch_seeds.tolist() == seeds
        for leaf in leaves(batch):
          assert not any(np.shares_memory(leaf, a) for a in source_arrays)
      else:
        with pytest.raises(StopIteration):
          fast.next_batch(size)
    assert fast.get_state() == plain.get_state()
    assert fast.last_seed == plain.last_seed
    if ended:
      return reads


# ---------------------------------------------------------------------------
# state
# ---------------------------------------------------------------------------
class Resumed(NamedTuple):
  """What `check_resume` saw: the uninterrupted elements, the state per cut."""

  expected: list
  states: list


def check_resume(
  build: Callable[[], Dataset],
  cuts: Iterable[int] | None = None,
  *,
  make_iterator: Callable[[Dataset], base.OpIterator] = (lambda dataset: dataset.make_iterator()),
  same: Callable[[list, list], None] = assert_same_stream,
  limit: int | None = None,
  with_seeds: bool = False,
  into_same_iterator: bool = False,
  pause_s: float = 0.0,
) -> Resumed:
  """Checks exact resume from a state saved after each cut.

  For each cut, reads that many elements, saves the state (through a JSON
  round trip) and checks that the elements read plus those after them are
  exactly the uninterrupted stream, both from the iterator the state was
  taken from (saving disturbs nothing) and from a new iterator of a new
  dataset the state is restored into.

  Args:
    build: makes the dataset; called anew for each iterator.
    cuts: the numbers of elements read before saving; all, by default.
    make_iterator: makes an iterator of a dataset.
    same: asserts that two lists of elements are the same.
    limit: reads at most this many elements in all (for endless datasets).
    with_seeds: compares (element, last_seed) pairs.
    into_same_iterator: also restores the state into the iterator it was
      taken from, once that read on to the end, and checks it again.
    pause_s: a pause before saving, so background producers run ahead.

  Returns:
    The uninterrupted elements and the state saved at each cut.
  """

  def read(iterator, count):
    elements, seeds = elements_and_seeds(iterator, count)
    return list(zip(elements, seeds)) if with_seeds else elements

  def remaining(cut):
    return None if limit is None else limit - cut

  with make_iterator(build()) as iterator:
    expected = read(iterator, limit)
  states = []
  for cut in range(len(expected) + 1) if cuts is None else cuts:
    with make_iterator(build()) as iterator:
      head = read(iterator, cut)
      assert len(head) == cut, (cut, len(head))
      if pause_s:
        time.sleep(pause_s)
      state = json.loads(json.dumps(iterator.get_state()))
      states.append(state)
      same(head + read(iterator, remaining(cut)), expected)
      if into_same_iterator:
        iterator.set_state(state)
        same(head + read(iterator, remaining(cut)), expected)
    with make_iterator(build()) as restored:
      restored.set_state(state)
      same(head + read(restored, remaining(cut)), expected)
  return Resumed(expected, states)


def restore_in_new_process(expression: str, states: Sequence[dict]) -> list:
  """Builds `expression` (jaxfeed code) in a new Python process, restores each
  of `states` there into a fresh iterator and returns, per state, the
  remaining elements (pickled back)."""
  script = textwrap.dedent("""
      import json, pickle, sys
      import numpy as np
      from jaxfeed.dataset import Dataset
      results = []
      for state in json.loads(sys.stdin.read()):
        iterator = eval(sys.argv[1]).make_iterator()
        iterator.set_state(state)
        results.append(list(iterator))
        iterator.close()
      sys.stdout.buffer.write(pickle.dumps(results))
  """)
  done = subprocess.run(
    [sys.executable, "-c", script, expression],
    input=json.dumps(states).encode(),
    capture_output=True,
    cwd=REPO_ROOT,
    timeout=120,
    check=False,
  )
  assert done.returncode == 0, done.stderr.decode()[-3000:]
  return pickle.loads(done.stdout)


# ---------------------------------------------------------------------------
# threads, processes and shared memory
# ---------------------------------------------------------------------------
def new_threads(before: Iterable[threading.Thread], prefix: str = "") -> list[threading.Thread]:
  """The live threads named `prefix...` that are not in `before`, except the
  process's op-stats sampling thread and its worker-process launcher (no
  op's: they outlive pipelines by `op_stats.LINGER_S` and
  `worker_processes.LINGER_S`)."""
  before = set(before)
  return [
    t
    for t in threading.enumerate()
    if t not in before
    and t.is_alive()
    and t.name.startswith(prefix)
    and t.name not in (op_stats.THREAD_NAME, worker_processes.LAUNCHER_THREAD)
  ]


def check_close(iterator: Any, threads_before: Iterable[threading.Thread]) -> None:
  """Closes `iterator` twice (closing is idempotent), then checks that no
  thread started since `threads_before` runs and that next() fails."""
  iterator.close()
  iterator.close()
  assert new_threads(threads_before) == []
  with pytest.raises(RuntimeError, match="closed"):
    next(iterator)


def wait_until(condition: Callable[[], bool], timeout_s: float = 30.0) -> None:
  """Polls `condition` until it holds; fails once `timeout_s` has passed."""
  deadline = time.monotonic() + timeout_s
  while not condition():
    assert time.monotonic() < deadline, "condition not reached"
    time.sleep(0.005)


def process_alive(pid: int) -> bool:
  """Whether process `pid` runs (exists and is no zombie)."""
  try:
    return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
  except psutil.NoSuchProcess:
    return False


def memfds(pid: int | None = None) -> set[int]:
  """The inodes of the jaxfeed memfds (shared memory: batch slots, input
  arrays) process `pid` (default: this one) holds open."""
  folder = f"/proc/{pid or 'self'}/fd"
  inodes = set()
  try:
    names = os.listdir(folder)
  except (FileNotFoundError, ProcessLookupError):
    return inodes  # the process is gone
  for fd in names:
    try:
      if os.readlink(f"{folder}/{fd}").startswith("/memfd:" + memfd.PREFIX):
        inodes.add(os.stat(f"{folder}/{fd}").st_ino)
    except OSError:
      pass  # closed meanwhile (listdir's own descriptor)
  return inodes


def shared_memory_exists(name: str) -> bool:
  """Whether POSIX shared-memory block `name` (leading "/" or not) exists."""
  return os.path.exists(f"/dev/shm/{name.lstrip('/')}")
