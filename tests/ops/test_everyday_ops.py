"""enumerate, shard, unique, scan, window, ragged_batch, reduce, from_generator
and ignore_errors: tf.data's outputs, errors, and exact resume."""

import numpy as np
import pytest

from jaxfeed.dataset import Dataset
from op_testing import assert_matches_tf_data, check_resume, import_tensorflow, run

tf = import_tensorflow()


def both(make_jf, make_tf):
  """A `make(D)` for assert_matches_tf_data from one builder per library."""
  return lambda D: make_tf() if D is tf.data.Dataset else make_jf()


# -- enumerate / shard / unique ---------------------------------------------------
@pytest.mark.parametrize("start", [0, 5, -3])
def test_enumerate_matches_tf_data(start):
  assert_matches_tf_data(lambda D: D.range(4, 9).enumerate(start))


def test_enumerate_of_dict_elements_matches_tf_data():
  column = np.arange(4, dtype=np.int32)
  assert_matches_tf_data(
    lambda D: D.from_tensor_slices({"a": column, "b": column * 1.5}).enumerate()
  )


@pytest.mark.parametrize("num_shards,index", [(1, 0), (3, 0), (3, 2), (7, 6), (20, 3)])
def test_shard_matches_tf_data(num_shards, index):
  ds = assert_matches_tf_data(lambda D: D.range(17).shard(num_shards, index))
  assert Dataset.range(17).shard(num_shards, index).cardinality() == len(ds)


def test_shard_refuses_an_index_out_of_range():
  with pytest.raises(ValueError, match=r"index must be in \[0, num_shards=3\), got 3"):
    Dataset.range(5).shard(3, 3)


@pytest.mark.parametrize("values", [[3, 1, 3, 2, 1, 5, 2], [], [7, 7, 7]])
def test_unique_of_integers_matches_tf_data(values):
  array = np.array(values, np.int64)
  assert_matches_tf_data(lambda D: D.from_tensor_slices(array).unique())


def test_unique_of_strings_matches_tf_data():
  words = np.array([b"a", b"bb", b"a", b"c", b"bb"])
  assert_matches_tf_data(lambda D: D.from_tensor_slices(words).unique())


def test_unique_refuses_non_scalar_elements():
  with pytest.raises(TypeError, match="unique: elements must be integer or string scalars"):
    run(Dataset.from_tensor_slices(np.ones((3, 2), np.int64)).unique())


# -- scan / reduce ----------------------------------------------------------------
def test_scan_running_sum_matches_tf_data():
  def make(D):
    if D is tf.data.Dataset:
      return D.range(8).scan(tf.constant(0, tf.int64), lambda s, x: (s + x, s * x))
    return D.range(8).scan(np.int64(0), lambda s, x: (s + x, s * x))

  assert_matches_tf_data(make)


def test_scan_with_a_structured_state_and_tuple_elements_matches_tf_data():
  a, b = np.arange(6, dtype=np.int64), np.arange(6, dtype=np.float32) / 2

  def step(state, element):
    count, total = state
    x, y = element
    return (count + 1, total + y), {"x": x, "mean": (total + y) / (count + 1)}

  def make(D):
    if D is tf.data.Dataset:
      init = (tf.constant(0, tf.float32), tf.constant(0.0, tf.float32))
      return D.from_tensor_slices((a, b)).scan(init, step)
    return D.from_tensor_slices((a, b)).scan((np.float32(0), np.float32(0)), step)

  assert_matches_tf_data(make)


def test_scan_resumes_exactly_with_its_running_state():
  check_resume(
    lambda: Dataset.range(12).scan(
      {"sum": np.int64(0), "last": np.zeros(2)},
      lambda s, x: ({"sum": s["sum"] + x, "last": np.array([x, 2.0 * x])}, s["sum"] * 10 + x),
    )
  )


def test_scan_refuses_a_state_that_cannot_be_saved_and_a_bad_return():
  with pytest.raises(TypeError, match="Cannot save a object"):
    Dataset.range(3).scan(object(), lambda s, x: (s, x))
  with pytest.raises(TypeError, match=r"scan_func must return \(new_state, output\)"):
    run(Dataset.range(3).scan(np.int64(0), lambda s, x: s))


def test_reduce_matches_tf_data():
  theirs = (
    tf.data.Dataset.range(10).reduce(tf.constant(0, tf.int64), lambda s, x: s + x * x).numpy()
  )
  assert Dataset.range(10).reduce(np.int64(0), lambda s, x: s + x * x) == theirs
  assert Dataset.range(0).reduce(np.int64(4), lambda s, x: s + x) == 4


# -- window ----------------------------------------------------------------------
WINDOWS = [
  (3, None, 1, False),
  (3, 2, 1, False),
  (3, 1, 2, True),
  (2, 5, 1, False),
  (4, 3, 2, False),
  (5, 1, 1, True),
  (20, 2, 1, False),
]


@pytest.mark.parametrize("size,shift,stride,drop", WINDOWS)
def test_stacked_windows_match_tf_data(size, shift, stride, drop):
  def make(D):
    if D is tf.data.Dataset:
      return D.range(11).window(size, shift, stride, drop).flat_map(lambda w: w.batch(size))
    return D.range(11).window(size, shift, stride, drop)

  assert_matches_tf_data(make)


def test_windows_of_dicts_as_lists_hold_the_elements():
  column = np.arange(5, dtype=np.int32)
  windows = run(Dataset.from_tensor_slices({"x": column}).window(2, stack=False))
  assert [[int(e["x"]) for e in w] for w in windows] == [[0, 1], [2, 3], [4]]


@pytest.mark.parametrize("size,shift,stride,drop", WINDOWS[:5])
def test_window_resumes_exactly(size, shift, stride, drop):
  check_resume(lambda: Dataset.range(23).window(size, shift, stride, drop), with_seeds=True)


def test_window_cardinality_matches_its_output():
  for size, shift, stride, drop in WINDOWS:
    ds = Dataset.range(11).window(size, shift, stride, drop)
    assert ds.cardinality() == len(run(ds)), (size, shift, stride, drop)


# -- ragged_batch -----------------------------------------------------------------
@pytest.mark.parametrize("drop", [False, True])
def test_ragged_batch_matches_tf_data(drop):
  def make(D):
    if D is tf.data.Dataset:
      ds = D.range(7).map(lambda x: {"seq": tf.range(x) * 2, "id": x})
      return ds.ragged_batch(3, drop_remainder=drop).map(
        lambda b: {
          "seq": {"values": b["seq"].flat_values, "row_lengths": b["seq"].row_lengths()},
          "id": b["id"],
        }
      )
    return (
      D.range(7)
      .map(lambda x: {"seq": np.arange(x) * 2, "id": x})
      .ragged_batch(3, drop_remainder=drop)
    )

  assert_matches_tf_data(make)


def test_ragged_batch_resumes_exactly():
  check_resume(
    lambda: Dataset.range(10).map(lambda x: np.arange(x % 4)).ragged_batch(3), with_seeds=True
  )


# -- from_generator ---------------------------------------------------------------
def gen(n):
  for i in range(int(n)):
    yield {"i": i, "squares": np.arange(i) ** 2}


def test_from_generator_matches_tf_data():
  def make(D):
    if D is tf.data.Dataset:
      return D.from_generator(
        gen,
        args=(6,),
        output_signature={
          "i": tf.TensorSpec([], tf.int64),
          "squares": tf.TensorSpec([None], tf.int64),
        },
      )
    return D.from_generator(gen, args=(6,), output_signature={"i": np.int64, "squares": np.int64})

  assert_matches_tf_data(make)


def test_from_generator_resumes_by_skipping_or_with_skip():
  check_resume(lambda: Dataset.from_generator(gen, args=(9,)))
  skips = []

  def skip(count, n):
    skips.append(count)
    return (x for x in list(gen(n))[count:])

  check_resume(lambda: Dataset.from_generator(gen, args=(9,), skip=skip), cuts=[4])
  assert 4 in skips


def test_from_generator_that_changed_is_refused_on_restore():
  items = list(range(5))
  ds = Dataset.from_generator(lambda: iter(list(items)))
  with ds.make_iterator() as iterator:
    for _ in range(4):
      next(iterator)
    state = iterator.get_state()
  del items[2:]
  with ds.make_iterator() as restored:
    with pytest.raises(ValueError, match="generator ended after 2 elements.*after 4"):
      restored.set_state(state)


# -- ignore_errors ----------------------------------------------------------------
def fails_on_multiples_of_three(x):
  if int(x) % 3 == 0:
    raise ValueError(f"bad element {int(x)}")
  return x * 10


@pytest.mark.parametrize("calls", [None, 4])
def test_ignore_errors_drops_failed_elements_like_tf_data(calls):
  def make(D):
    if D is tf.data.Dataset:
      return (
        D.range(10)
        .map(
          lambda x: tf.numpy_function(
            lambda v: np.int64(fails_on_multiples_of_three(v)), [x], tf.int64
          )
        )
        .ignore_errors()
      )
    return D.range(10).map(fails_on_multiples_of_three, num_parallel_calls=calls).ignore_errors()

  assert_matches_tf_data(make)


def test_without_ignore_errors_the_error_reaches_the_consumer():
  with pytest.raises(ValueError, match="bad element 0"):
    run(Dataset.range(5).map(fails_on_multiples_of_three))


def test_ignore_errors_counts_and_resumes():
  ds = Dataset.range(20).map(fails_on_multiples_of_three).ignore_errors()
  with ds.make_iterator() as iterator:
    out = [int(x) for x in iterator]
    assert iterator.stats()["ops"][-1]["errors_ignored"] == 7
  assert out == [x * 10 for x in range(20) if x % 3]
  check_resume(lambda: ds)


def test_ignore_errors_ends_an_input_that_never_moves_on():
  calls = []

  class Stuck:
    def __iter__(self):
      return self

    def __next__(self):
      calls.append(1)
      raise OSError("disk gone")

  ds = Dataset.from_generator(lambda: Stuck()).ignore_errors()
  with ds.make_iterator() as iterator:
    assert list(iterator) == []
    assert iterator.stats()["ops"][-1]["dead_ends"] == 1
  assert len(calls) == 3  # not retried 10,000 times
