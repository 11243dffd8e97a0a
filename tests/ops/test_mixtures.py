"""`sample_from_datasets` and `choose_from_datasets`: tf.data semantics,
determinism, weights, nothing lost, exact resume (also in a new process)."""

import collections

import numpy as np
import pytest

from jaxfeed.dataset import Dataset
from op_testing import (
  assert_matches_tf_data,
  assert_same_stream,
  check_resume,
  import_tensorflow,
  restore_in_new_process,
  run,
)

import_tensorflow()  # the reference must be there: fail, never skip


def ints(elements):
  return [int(e) for e in elements]


# -- choose_from_datasets: equal to tf.data -------------------------------------
CHOICES = {
  "alternating": [0, 1] * 6,
  "runs": [1, 1, 1, 0, 0, 2, 2, 0, 1],
  "exhausts_first": [0, 0, 0, 0, 0, 1, 2, 1, 0, 2],
  "random": np.random.default_rng(3).integers(0, 3, 40).tolist(),
  "no_choices": [],
}


@pytest.mark.parametrize("stop_on_empty", [True, False])
@pytest.mark.parametrize("choices", CHOICES.values(), ids=CHOICES.keys())
def test_choose_from_datasets_matches_tf_data(choices, stop_on_empty):
  def make(D):
    tf = import_tensorflow()
    as_array = np.asarray(choices, np.int64)
    choice = (
      tf.data.Dataset.from_tensor_slices(tf.constant(as_array, tf.int64))
      if D is tf.data.Dataset
      else D.from_tensor_slices(as_array)
    )
    inputs = [D.range(3), D.range(100, 108), D.range(200, 200)]
    return D.choose_from_datasets(inputs, choice, stop_on_empty_dataset=stop_on_empty)

  assert_matches_tf_data(make)


def test_choose_from_datasets_of_dict_elements_matches_tf_data():
  def make(D):
    tf = import_tensorflow()
    choice = np.array([1, 0, 0, 1, 1, 0], np.int64)
    choice_ds = (
      tf.data.Dataset.from_tensor_slices(tf.constant(choice))
      if D is tf.data.Dataset
      else D.from_tensor_slices(choice)
    )
    column = np.arange(6, dtype=np.int32)
    inputs = [
      D.from_tensor_slices({"x": column, "y": column * 2.0}),
      D.from_tensor_slices({"x": column + 10, "y": column * 3.0}),
    ]
    return D.choose_from_datasets(inputs, choice_ds)

  assert_matches_tf_data(make)


def test_choose_from_datasets_refuses_a_choice_out_of_range():
  ds = Dataset.choose_from_datasets(
    [Dataset.range(3), Dataset.range(3)], Dataset.from_tensor_slices(np.array([0, 2], np.int64))
  )
  with pytest.raises(ValueError, match="choice 2 is out of range.*2 datasets"):
    run(ds)


def test_choose_from_datasets_refuses_non_integer_choices_and_bad_inputs():
  with pytest.raises(TypeError, match="scalar integers"):
    run(
      Dataset.choose_from_datasets([Dataset.range(3)], Dataset.from_tensor_slices(np.array([0.5])))
    )
  with pytest.raises(TypeError, match="list or tuple"):
    Dataset.choose_from_datasets({"a": Dataset.range(2)}, Dataset.range(1))
  with pytest.raises(ValueError, match="must not be empty"):
    Dataset.choose_from_datasets([], Dataset.range(1))


def test_choose_from_datasets_resumes_exactly():
  choices = np.random.default_rng(0).integers(0, 2, 30)

  def build():
    return Dataset.choose_from_datasets(
      [Dataset.range(10), Dataset.range(50, 60).map(lambda x: x * 2)],
      Dataset.from_tensor_slices(choices),
      stop_on_empty_dataset=False,
    )

  check_resume(build, with_seeds=True)


# -- sample_from_datasets ---------------------------------------------------------
def mixture(seed=7, weights=(0.7, 0.3), sizes=(700, 300), stop=False):
  return Dataset.sample_from_datasets(
    [Dataset.range(sizes[0]), Dataset.range(10_000, 10_000 + sizes[1])],
    list(weights),
    seed=seed,
    stop_on_empty_dataset=stop,
  )


def test_sample_from_datasets_is_deterministic_from_the_seed():
  assert ints(run(mixture(seed=7))) == ints(run(mixture(seed=7)))
  assert ints(run(mixture(seed=7))) != ints(run(mixture(seed=8)))


def test_sample_from_datasets_keeps_each_input_in_order():
  out = ints(run(mixture()))
  assert [x for x in out if x < 10_000] == list(range(700))
  assert [x for x in out if x >= 10_000] == list(range(10_000, 10_300))


@pytest.mark.parametrize("weights", [(0.7, 0.3), (0.5, 0.5), (0.9, 0.1), (0.2, 0.3, 0.5)])
def test_sample_from_datasets_holds_its_weights_within_one_percent(weights):
  inputs = [Dataset.range(i, i + 1).repeat() for i in range(len(weights))]
  ds = Dataset.sample_from_datasets(inputs, list(weights), seed=11).take(20_000)
  counts = collections.Counter(ints(run(ds)))
  for i, weight in enumerate(weights):
    assert abs(counts[i] / 20_000 - weight) < 0.01, (i, counts)


def test_sample_from_datasets_loses_nothing_when_inputs_run_dry():
  # Sizes against the weights: the smaller input runs dry long before the end.
  out = ints(run(mixture(weights=(0.3, 0.7), sizes=(900, 100))))
  assert sorted(out) == list(range(900)) + list(range(10_000, 10_100))


def test_sample_from_datasets_with_stop_on_empty_ends_at_the_first_empty_draw():
  out = ints(run(mixture(weights=(0.5, 0.5), sizes=(50, 5), stop=True)))
  assert len([x for x in out if x >= 10_000]) == 5
  assert len(out) < 55
  # Same draws as the unstopped mixture up to where it stops.
  assert out == ints(run(mixture(weights=(0.5, 0.5), sizes=(50, 5))))[: len(out)]


def test_sample_from_datasets_never_draws_a_zero_weight_input():
  out = ints(run(mixture(weights=(1.0, 0.0), sizes=(40, 40))))
  assert out == list(range(40))


def test_sample_from_datasets_resumes_exactly():
  check_resume(lambda: mixture(sizes=(30, 20)), with_seeds=True)


def test_sample_from_datasets_resumes_exactly_in_a_new_process():
  expression = (
    "Dataset.sample_from_datasets([Dataset.range(30), Dataset.range(100, 120)], [0.6, 0.4], seed=5)"
  )
  ds = Dataset.sample_from_datasets(
    [Dataset.range(30), Dataset.range(100, 120)], [0.6, 0.4], seed=5
  )
  expected = ints(run(ds))
  cuts = [0, 1, 17, 49, 50]
  states = []
  for cut in cuts:
    with ds.make_iterator() as iterator:
      for _ in range(cut):
        next(iterator)
      states.append(iterator.get_state())
  for cut, rest in zip(cuts, restore_in_new_process(expression, states)):
    assert ints(rest) == expected[cut:]


def test_an_unseeded_mixture_resumes_with_its_drawn_seed():
  ds = Dataset.sample_from_datasets([Dataset.range(20), Dataset.range(50, 70)])
  with ds.make_iterator() as iterator:
    head = [int(next(iterator)) for _ in range(9)]
    state = iterator.get_state()
    rest = ints(iterator)
  fresh = Dataset.sample_from_datasets([Dataset.range(20), Dataset.range(50, 70)])
  with fresh.make_iterator() as restored:
    restored.set_state(state)
    assert ints(restored) == rest
  assert sorted(head + rest) == list(range(20)) + list(range(50, 70))


def test_a_mixture_restored_with_new_weights_goes_on_with_them():
  def build(weights):
    return Dataset.sample_from_datasets(
      [Dataset.range(0, 1).repeat(), Dataset.range(1, 2).repeat()], weights, seed=3
    )

  with build([0.5, 0.5]).make_iterator() as iterator:
    for _ in range(100):
      next(iterator)
    state = iterator.get_state()
  with build([1.0, 0.0]).make_iterator() as restored:
    restored.set_state(state)
    assert set(ints(next(restored) for _ in range(200))) == {0}


def test_a_seeded_mixture_refuses_the_state_of_another_seed():
  with mixture(seed=1).make_iterator() as iterator:
    next(iterator)
    state = iterator.get_state()
  with mixture(seed=2).make_iterator() as other:
    with pytest.raises(ValueError, match="seed 1.*seed 2"):
      other.set_state(state)


@pytest.mark.parametrize(
  "weights,match",
  [
    ([0.5], "1 weights for 2 datasets"),
    ([-1, 2], ">= 0"),
    ([0, 0], "not all 0"),
    ([float("nan"), 1], "finite"),
    ("ab", "numbers"),
  ],
)
def test_sample_from_datasets_refuses_bad_weights(weights, match):
  with pytest.raises((TypeError, ValueError), match=match):
    Dataset.sample_from_datasets([Dataset.range(2), Dataset.range(2)], weights)


def test_sample_from_datasets_cardinality():
  assert mixture(sizes=(7, 5)).cardinality() == 12
  assert (
    Dataset.sample_from_datasets([Dataset.range(3).repeat(), Dataset.range(2)]).cardinality() == -1
  )
  assert mixture(sizes=(7, 5), stop=True).cardinality() is None


def test_sample_from_datasets_matches_tf_data_in_distribution_of_counts():
  # tf.data draws with its own generator: compare what both promise, the
  # multiset of a finite mixture without stopping.
  def make(D):
    return D.sample_from_datasets([D.range(40), D.range(100, 130)], [0.5, 0.5], seed=1)

  assert_matches_tf_data(
    make, same=lambda a, b: assert_same_stream(sorted(ints(a)), sorted(ints(b)))
  )


def test_spec_params_rebuild_equal_mixture_nodes():
  choice = Dataset.from_tensor_slices(np.array([1, 0, 1, 1], np.int64))
  for ds in (
    mixture(seed=None, sizes=(9, 4)),
    Dataset.choose_from_datasets(
      [Dataset.range(3), Dataset.range(5, 9)], choice, stop_on_empty_dataset=False
    ),
  ):
    node = ds.node
    rebuilt = Dataset(type(node)(*node.parents, **node.spec_params()))
    assert ints(run(rebuilt)) == ints(run(ds))
    assert rebuilt.fingerprint() == ds.fingerprint()
