"""`group_by_window`: tf.data's windows and flush order, errors, resume."""

import numpy as np
import pytest

from jaxfeed.dataset import Dataset
from op_testing import assert_matches_tf_data, check_resume, run


@pytest.mark.parametrize(
  "n,mod,window,batch",
  [(17, 3, 3, 4), (20, 2, 5, 2), (13, 5, 4, 4), (30, 7, 2, 1), (1, 3, 3, 3), (0, 3, 3, 3)],
)
def test_matches_tf_data(n, mod, window, batch):
  def make(D):
    return D.range(n).group_by_window(
      lambda x: x % mod, lambda k, w: w.batch(batch), window_size=window
    )

  assert_matches_tf_data(make)


def test_window_size_func_matches_tf_data():
  def make(D):
    return D.range(40).group_by_window(
      lambda x: x % 4, lambda k, w: w.batch(3), window_size_func=lambda k: k + 1
    )

  assert_matches_tf_data(make)


def test_partial_windows_are_flushed_in_increasing_key_order():
  ds = (
    Dataset.range(6)
    .map(lambda x: 5 - x)
    .group_by_window(lambda x: x, lambda k, w: w.batch(9), window_size=3)
  )
  assert [b.tolist() for b in run(ds)] == [[0], [1], [2], [3], [4], [5]]


def test_reduce_func_gets_an_int64_key_and_a_dataset_of_the_window():
  seen = []

  def reduce(key, window):
    seen.append((type(key), int(key), window.cardinality()))
    return window.map(lambda x: x + key * 100)

  out = run(Dataset.range(7).group_by_window(lambda x: x % 2, reduce, window_size=2))
  assert [int(v) for v in out] == [0, 2, 101, 103, 4, 6, 105]
  assert seen[0] == (np.int64, 0, 2)


@pytest.mark.parametrize(
  "kwargs,match",
  [
    ({}, "exactly one"),
    ({"window_size": 2, "window_size_func": lambda k: 2}, "exactly one"),
    ({"window_size": 0}, "window_size"),
  ],
)
def test_window_size_options_are_validated(kwargs, match):
  with pytest.raises(ValueError, match=f"group_by_window.*{match}"):
    Dataset.range(3).group_by_window(lambda x: x, lambda k, w: w, **kwargs)


def test_reduce_func_returning_a_non_dataset_is_a_type_error():
  ds = Dataset.range(4).group_by_window(lambda x: x % 2, lambda k, w: 7, window_size=2)
  with ds.make_iterator() as it:
    with pytest.raises(TypeError, match="group_by_window.*reduce_func.*int: 7"):
      next(it)


@pytest.mark.parametrize("key", [1.5, "a", np.array([1, 2]), True])
def test_key_func_must_return_an_integer_scalar(key):
  ds = Dataset.range(4).group_by_window(lambda x: key, lambda k, w: w, window_size=2)
  with ds.make_iterator() as it:
    with pytest.raises(TypeError, match="group_by_window.*int64 scalar"):
      next(it)


def test_window_size_func_must_return_a_positive_size():
  ds = Dataset.range(4).group_by_window(
    lambda x: x % 2, lambda k, w: w, window_size_func=lambda k: k - 1
  )
  with ds.make_iterator() as it:
    with pytest.raises(
      ValueError,
      match=r"group_by_window.*greater than zero"
      r".*-1.*key 0",
    ):
      next(it)


@pytest.mark.parametrize("window,batch", [(3, 4), (5, 2), (1, 1)])
def test_resume_at_every_cut_is_exact_mid_window_and_during_the_flush(window, batch):
  check_resume(
    lambda: Dataset.range(23).group_by_window(
      lambda x: x % 3, lambda k, w: w.batch(batch), window_size=window
    )
  )


def test_resume_with_padded_windows_of_sequences_is_exact():
  seqs = [np.arange(n % 7, dtype=np.int32) for n in range(30)]
  check_resume(
    lambda: (
      Dataset.range(30)
      .map(lambda i: seqs[int(i)])
      .group_by_window(
        lambda s: s.shape[0] % 3,
        lambda k, w: w.padded_batch(2),
        window_size_func=lambda k: int(k) + 2,
      )
    )
  )


def test_state_holds_counts_not_elements():
  with (
    Dataset.range(500)
    .group_by_window(lambda x: x % 2, lambda k, w: w.batch(400), window_size=400)
    .make_iterator() as it
  ):
    next(it)
    state = it.get_state()
  assert len(str(state)) < 1500


def test_spec_params_rebuild_an_equal_node():
  node = (
    Dataset.range(9).group_by_window(lambda x: x % 2, lambda k, w: w.batch(2), window_size=3).node
  )
  rebuilt = type(node)(*node.parents, **node.spec_params())
  assert rebuilt.fingerprint() == node.fingerprint()
