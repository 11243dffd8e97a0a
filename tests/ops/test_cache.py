"""Tests of the cache op (in memory and on disk) against tf.data's cache."""

import gc
import json
import os

import numpy as np
import pytest

from jaxfeed.dataset import Dataset
from jaxfeed.ops import cache_disk
from jaxfeed.ops.cache import CacheNode
import op_testing
from op_testing import INPUT_KINDS, canonical, check_resume, graph_iterator, run, seeds_of

tf = op_testing.import_tensorflow()


class Counter:
  """An identity map fn that counts its calls (how often the input ran)."""

  def __init__(self):
    self.calls = 0

  def __call__(self, *element):
    self.calls += 1
    return element[0] if len(element) == 1 else element


def _filename(tmp_path, on_disk, name="cache"):
  return str(tmp_path / name) if on_disk else ""


@pytest.mark.parametrize("on_disk", [False, True])
@pytest.mark.parametrize("kind", sorted(INPUT_KINDS))
def test_cache_under_repeat_matches_tf_data_and_runs_the_input_once(kind, on_disk, tmp_path):
  make_input = INPUT_KINDS[kind]
  counter = Counter()
  ds = make_input(Dataset).map(counter).cache(_filename(tmp_path, on_disk)).repeat(3)
  ours = [canonical(e, exact_types=True) for e in run(ds, graph_iterator)]
  tf_ds = make_input(tf.data.Dataset).cache(_filename(tmp_path, on_disk, "tf")).repeat(3)
  theirs = [canonical(e, exact_types=True) for e in run(tf_ds)]
  assert ours == theirs
  assert counter.calls == len(ours) // 3
  assert ds.cardinality() == int(tf_ds.cardinality())


@pytest.mark.parametrize("on_disk", [False, True])
def test_later_iterations_of_the_same_dataset_read_the_cache(on_disk, tmp_path):
  counter = Counter()
  ds = Dataset.range(6).map(counter).cache(_filename(tmp_path, on_disk))
  first = [int(x) for x in graph_iterator(ds)]
  second = [int(x) for x in graph_iterator(ds)]
  assert first == second == list(range(6))
  assert counter.calls == 6


@pytest.mark.parametrize("on_disk", [False, True])
def test_partial_first_pass_does_not_fill_the_cache(on_disk, tmp_path):
  counter = Counter()
  ds = Dataset.range(10).map(counter).cache(_filename(tmp_path, on_disk))
  with graph_iterator(ds) as it:
    assert [int(next(it)) for _ in range(3)] == [0, 1, 2]
  assert os.listdir(tmp_path) == []  # no partial files left behind
  assert [int(x) for x in graph_iterator(ds)] == list(range(10))
  assert [int(x) for x in graph_iterator(ds)] == list(range(10))
  assert counter.calls == 3 + 10


def test_abandoned_partial_disk_cache_is_removed_on_garbage_collection(tmp_path):
  ds = Dataset.range(10).cache(str(tmp_path / "c"))
  it = graph_iterator(ds)
  next(it)
  assert len(os.listdir(tmp_path)) == 1  # the temporary directory
  del it
  gc.collect()
  assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("on_disk", [False, True])
def test_a_pass_whose_input_fails_is_not_cached(on_disk, tmp_path):
  calls = []

  def fail_once_on_four(x):
    calls.append(int(x))
    if x == 4 and calls.count(4) == 1:
      raise OSError("read error")
    return x

  ds = Dataset.range(6).map(fail_once_on_four).cache(_filename(tmp_path, on_disk))
  it = graph_iterator(ds)
  with pytest.raises(OSError):
    list(it)
  assert [int(x) for x in it] == [5]  # the pass goes on, uncached
  assert [int(x) for x in graph_iterator(ds)] == list(range(6))
  before = len(calls)
  assert [int(x) for x in graph_iterator(ds)] == list(range(6))
  assert len(calls) == before  # that complete pass was cached


def _leafy(i):
  return {
    "ragged": np.arange(i % 4, dtype=np.float32).reshape(-1),
    "image": np.full((2, 3), i, dtype=np.uint8),
    "zero_d": np.array(i * 1.5),
    "np_scalar": np.int16(i),
    "py": (int(i), float(i) / 2, bool(i % 2), complex(i, 1)),
    "text": [f"record {i}", bytes([i, 0, 255])[: i % 4]],
  }


def test_disk_cache_keeps_every_leaf_kind_and_structure(tmp_path, monkeypatch):
  monkeypatch.setattr(cache_disk, "_CHUNK_ELEMENTS", 4)  # several chunks
  elements = [_leafy(i) for i in range(11)]
  source = Dataset.range(11).map(lambda i: _leafy(int(i)))
  filename = str(tmp_path / "leafy")
  written = list(graph_iterator(source.cache(filename)))
  assert sorted(os.listdir(filename)) == [
    "chunk-00000.npz",
    "chunk-00001.npz",
    "chunk-00002.npz",
    "manifest.json",
  ]
  counter = Counter()
  read = list(graph_iterator(source.map(counter).cache(filename)))  # a new node
  assert counter.calls == 0
  expected = [canonical(e, exact_types=True) for e in elements]
  assert [canonical(e, exact_types=True) for e in written] == expected
  assert [canonical(e, exact_types=True) for e in read] == expected
  assert all(list(e) == list(_leafy(0)) for e in read)  # dict key order


def test_disk_cache_written_by_one_dataset_is_read_by_another(tmp_path):
  filename = str(tmp_path / "shared")
  list(graph_iterator(Dataset.range(5).map(lambda x: x * 10).cache(filename)))
  # As in tf.data, an existing complete cache is used as is.
  reused = graph_iterator(Dataset.range(99).cache(filename))
  assert [int(x) for x in reused] == [0, 10, 20, 30, 40]


@pytest.mark.parametrize("on_disk", [False, True])
def test_resume_at_every_cut_point_with_a_fresh_pipeline(on_disk, tmp_path, monkeypatch):
  monkeypatch.setattr(cache_disk, "_CHUNK_ELEMENTS", 3)

  def build():
    # A new node each time: an in-memory cache starts empty, as in a new
    # process.
    return Dataset.range(7).map(lambda x: x * 2).cache(_filename(tmp_path, on_disk)).repeat(3)

  resumed = check_resume(build, make_iterator=graph_iterator)
  assert [int(x) for x in resumed.expected] == [x * 2 for x in range(7)] * 3


def test_restoring_a_read_state_rebuilds_a_missing_memory_cache():
  counter = Counter()
  ds = Dataset.range(5).map(counter).cache().repeat(2)
  it = graph_iterator(ds)
  head = [int(next(it)) for _ in range(7)]  # two into the cached epoch
  state = it.get_state()
  assert state["parents"][0]["own"] == {"mode": "read", "index": 2}
  fresh = Dataset.range(5).map(counter).cache().repeat(2)
  restored = graph_iterator(fresh)
  restored.set_state(state)
  assert head + [int(x) for x in restored] == [0, 1, 2, 3, 4] * 2
  assert counter.calls == 5 + 5  # the rebuild ran the input once


def test_seeds_of_cached_elements_are_kept(tmp_path):
  expected = seeds_of(Dataset.range(6))
  for filename in ("", str(tmp_path / "s")):
    assert seeds_of(Dataset.range(6).cache(filename).repeat(2)) == expected * 2


@pytest.mark.parametrize(
  "element, match",
  [
    ({1: np.int32(1)}, "dict keys must be str"),
    (np.array([object()], dtype=object), "dtype object"),
    (object(), "cannot store a leaf"),
  ],
)
def test_unstorable_elements_raise_type_error_naming_the_cache(element, match, tmp_path):
  filename = str(tmp_path / "bad")
  ds = Dataset.range(2).map(lambda x: element).cache(filename)
  with pytest.raises(TypeError, match=match) as info:
    list(graph_iterator(ds))
  assert filename in str(info.value)
  assert os.listdir(tmp_path) == []


def test_elements_changing_structure_or_dtype_raise_type_error(tmp_path):
  changing = (
    Dataset.range(3).map(lambda x: {"a": x} if x == 0 else {"b": x}).cache(str(tmp_path / "s"))
  )
  with pytest.raises(TypeError, match="share one structure"):
    list(graph_iterator(changing))
  dtypes = (
    Dataset.range(3)
    .map(lambda x: np.int32(x) if x == 0 else np.float32(x))
    .cache(str(tmp_path / "d"))
  )
  with pytest.raises(TypeError, match="keep their dtype"):
    list(graph_iterator(dtypes))


def test_invalid_filename_and_state_are_rejected():
  with pytest.raises(TypeError, match="cache: filename must be a str"):
    CacheNode(Dataset.range(2).node, 3)
  it = graph_iterator(Dataset.range(2).cache())
  state = it.get_state()
  state["own"] = {"mode": "read", "index": -1}
  with pytest.raises(ValueError, match="'cache'"):
    it.set_state(state)


def test_spec_params_rebuild_an_equal_node(tmp_path):
  node = CacheNode(Dataset.range(3).node, str(tmp_path / "x"))
  assert node.spec_params() == {"filename": str(tmp_path / "x")}
  assert CacheNode(*node.parents, **node.spec_params()).fingerprint() == (node.fingerprint())
  assert node.cardinality() == 3


@pytest.mark.parametrize("on_disk", [False, True])
def test_skip_over_a_filled_cache_matches_tf_data(on_disk, tmp_path):
  ds = Dataset.range(12).map(lambda x: x * 3).cache(_filename(tmp_path, on_disk))
  list(graph_iterator(ds))  # fill
  ours = [int(x) for x in graph_iterator(ds.skip(5).repeat(2))]
  tf_ds = tf.data.Dataset.range(12).map(lambda x: x * 3).cache(_filename(tmp_path, on_disk, "tf"))
  list(tf_ds)
  assert ours == [int(x) for x in tf_ds.skip(5).repeat(2).as_numpy_iterator()]
  with graph_iterator(ds) as it:
    assert it.skip_elements(4) == 4
    assert it.last_seed == seeds_of(Dataset.range(12))[3]
    state = json.loads(json.dumps(it.get_state()))
  with graph_iterator(ds) as restored:
    restored.set_state(state)
    assert [int(x) for x in restored] == [x * 3 for x in range(4, 12)]


def test_autocache_passes_through_and_resumes_exactly_outside_the_service(tmp_path):
  def build():
    return Dataset.range(40).shuffle(16, seed=3).autocache().batch(6)

  assert canonical(list(build())) == canonical(list(Dataset.range(40).shuffle(16, seed=3).batch(6)))
  check_resume(build)
  pointed = build()
  from jaxfeed.ops import autocache  # pylint: disable=g-import-not-at-top

  [node] = autocache.point_at(pointed.node, str(tmp_path), policy="always")
  assert canonical(list(pointed)) == canonical(list(build()))
  assert os.path.isdir(node.cache_path())  # a complete pass was written there
