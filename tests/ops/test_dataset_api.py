"""tf.data.Dataset's public names on jaxfeed.Dataset, and the ones added last:
apply, counter, element_spec, from_tensors, get_single_element, list_files,
random, rejection_resample, sparse_batch, take_while. tf.data's outputs where
they are deterministic, its distributions where they are random, and exact
resume."""

import itertools
import json

import numpy as np
import pytest

import jaxfeed
from jaxfeed.dataset import Dataset
from jaxfeed.ops.element_spec import TensorSpec
from op_testing import (
  assert_matches_tf_data,
  assert_same_stream,
  check_resume,
  elements_dataset,
  import_tensorflow,
  run,
  tf_elements_dataset,
)

tf = import_tensorflow()

# tf.data.Dataset names jaxfeed.Dataset deliberately does not have. Keep each
# with its reason; a name here that jaxfeed gains fails the test below, so
# the list cannot go stale.
DELIBERATE_OMISSIONS = {
  # Nothing: every public name of tf.data.Dataset (TensorFlow 2.21) exists.
}


def test_every_public_name_of_tf_data_dataset_exists():
  names = [n for n in dir(tf.data.Dataset) if not n.startswith("_")]
  assert len(names) >= 49, names
  missing = [n for n in names if not hasattr(Dataset, n) and n not in DELIBERATE_OMISSIONS]
  assert not missing, f"jaxfeed.Dataset lacks tf.data names {missing}"
  stale = [n for n in DELIBERATE_OMISSIONS if hasattr(Dataset, n)]
  assert not stale, f"{stale} exist now: remove them from DELIBERATE_OMISSIONS"


def both(make_jf, make_tf):
  """A `make(D)` for assert_matches_tf_data from one builder per library."""
  return lambda D: make_tf() if D is tf.data.Dataset else make_jf()


# -- from_tensors ------------------------------------------------------------------
FROM_TENSORS = {
  "python_int": 5,
  "python_list": [1, 2, 3],
  "float_and_str": {"a": 3.0, "b": "x", "c": b"y"},
  "numpy": (np.arange(6, dtype=np.int16).reshape(2, 3), np.float64(2.5)),
  "nested": {"x": (np.zeros((2, 2), np.float32), [[1.5, 2.5]]), "y": np.int64(7)},
  "big_int": [2**40, 1],
}


@pytest.mark.parametrize("name", sorted(FROM_TENSORS))
def test_from_tensors_matches_tf_data(name):
  value = FROM_TENSORS[name]
  assert_matches_tf_data(lambda D: D.from_tensors(value))
  assert_matches_tf_data(lambda D: D.from_tensors(value).repeat(3))
  assert Dataset.from_tensors(value).cardinality() == 1


def test_from_tensors_resumes():
  check_resume(lambda: Dataset.from_tensors({"a": np.arange(3)}).repeat(2))


# -- counter -----------------------------------------------------------------------
@pytest.mark.parametrize(
  "args",
  [
    {},
    {"start": 2},
    {"start": 2, "step": 5},
    {"start": 10, "step": -1},
    {"start": 2**31 - 3, "dtype": np.int32},
    {"start": 250, "step": 3, "dtype": np.uint8},
    {"start": 0.1, "step": 0.1, "dtype": np.float32},
    {"start": -1.5, "step": 0.25, "dtype": np.float16},
  ],
)
def test_counter_matches_tf_data(args):
  def make(D):
    kwargs = dict(args)
    if D is tf.data.Dataset and "dtype" in kwargs:
      kwargs["dtype"] = tf.as_dtype(kwargs["dtype"])
    return D.counter(**kwargs).take(40)

  assert_matches_tf_data(make)
  assert Dataset.counter(**args).cardinality() == -1


def test_counter_refuses_a_start_outside_its_dtype():
  with pytest.raises(ValueError, match=r"counter: start=300 is not a value of uint8"):
    Dataset.counter(300, dtype=np.uint8)


def test_counter_resumes_exactly_through_wrap_around_and_float_rounding():
  check_resume(lambda: Dataset.counter(2**31 - 3, dtype=np.int32), limit=8)
  check_resume(lambda: Dataset.counter(0.1, 0.1, dtype=np.float32), limit=15, cuts=[0, 1, 7, 14])


# -- random ------------------------------------------------------------------------
def first(dataset, count):
  with dataset.make_iterator() as iterator:
    return [int(x) for x in itertools.islice(iterator, count)]


def test_random_has_tf_data_values_range_and_distribution():
  ours = np.array(first(Dataset.random(seed=4), 20000))
  theirs = np.array(list(tf.data.Dataset.random(seed=4).take(20000).as_numpy_iterator()))
  element = next(iter(Dataset.random(seed=4)))
  assert isinstance(element, np.int64)
  assert Dataset.random(seed=4).cardinality() == -1
  for values in (ours, theirs):
    assert 0 <= values.min() and values.max() < 2**32
    assert values.max() > 2**32 * 0.999 and values.min() < 2**32 * 0.001
  # Both uniform: 16 buckets each hold 1/16 of the values, within 5 sigma.
  sigma = np.sqrt(20000 / 16 * (15 / 16))
  for values in (ours, theirs):
    counts = np.bincount(values >> 28, minlength=16)
    assert np.all(np.abs(counts - 20000 / 16) < 5 * sigma), counts
  # Consecutive values are not correlated.
  assert abs(np.corrcoef(ours[:-1], ours[1:])[0, 1]) < 0.05


def test_random_is_a_function_of_the_seed_and_iteration():
  a = Dataset.random(seed=4)
  assert first(a, 50) == first(Dataset.random(seed=4), 50)
  assert first(a, 50) != first(Dataset.random(seed=5), 50)
  assert first(a, 50) == first(a, 50)  # the same every iteration (tf.data default)
  b = Dataset.random(seed=4, rerandomize_each_iteration=True)
  epochs = [first(b, 50) for _ in range(3)]
  assert len({tuple(e) for e in epochs}) == 3
  again = Dataset.random(seed=4, rerandomize_each_iteration=True)
  assert [first(again, 50) for _ in range(3)] == epochs
  # Under repeat, each repetition is an iteration.
  repeated = first(Dataset.random(seed=4, rerandomize_each_iteration=True).take(50).repeat(3), 150)
  assert repeated == sum(epochs, [])


def check_unseeded_resume(build, cut):
  """A state of a pipeline with a drawn seed, restored into a pipeline that
  drew another, resumes the first one's elements."""
  with build().make_iterator() as iterator:
    head = list(itertools.islice(iterator, cut))
    state = json.loads(json.dumps(iterator.get_state()))
    rest = list(iterator)
  with build().make_iterator() as restored:
    restored.set_state(state)
    assert_same_stream(list(restored), rest)
  return head, rest


def test_random_resumes_exactly_also_unseeded_and_in_later_iterations():
  check_resume(lambda: Dataset.random(seed=9), limit=600, cuts=[0, 1, 255, 256, 599])
  head, rest = check_unseeded_resume(lambda: Dataset.random().take(20), cut=10)
  assert head != rest
  check_resume(lambda: Dataset.random(seed=3, rerandomize_each_iteration=True).take(4).repeat(3))


def test_random_refuses_a_state_of_another_seed():
  with Dataset.random(seed=1).make_iterator() as iterator:
    next(iterator)
    state = iterator.get_state()
  with Dataset.random(seed=2).make_iterator() as other:
    with pytest.raises(jaxfeed.PipelineStateError, match="saved with seed 1"):
      other.set_state(state)


# -- list_files --------------------------------------------------------------------
@pytest.fixture()
def files(tmp_path, monkeypatch):
  for name in ["b.py", "a.txt", "c.py", "sub/x.py", "sub/y.txt", "d2/z.py", ".hidden.py"]:
    path = tmp_path / name
    path.parent.mkdir(exist_ok=True)
    path.write_text(name)
  monkeypatch.chdir(tmp_path)
  return tmp_path


def list_files_patterns(root):
  return [
    f"{root}/*.py",
    "*.py",
    "./*.txt",
    [f"{root}/c.py", f"{root}/*.py"],
    f"{root}/*/*.py",
    "sub",
    f"{root}/s?b/*",
    f"{root}/[ab].*",
    np.array([f"{root}/*.txt", f"{root}/d2/*"]),
  ]


def test_list_files_unshuffled_matches_tf_data(files):
  for pattern in list_files_patterns(files):
    assert_matches_tf_data(lambda D, p=pattern: D.list_files(p, shuffle=False))


def test_list_files_shuffled_has_tf_data_names_in_a_seeded_order_per_epoch(files):
  pattern = [f"{files}/*", f"{files}/**/*"]
  theirs = run(tf.data.Dataset.list_files(pattern, seed=3))
  dataset = Dataset.list_files(pattern, seed=3)
  epochs = [run(dataset) for _ in range(4)]
  assert sorted(epochs[0]) == sorted(theirs) and len(theirs) >= 4
  assert len({tuple(e) for e in epochs}) > 1  # reshuffled each iteration
  again = Dataset.list_files(pattern, seed=3)
  assert [run(again) for _ in range(4)] == epochs
  check_resume(lambda: Dataset.list_files(pattern, seed=3).repeat(2))
  check_unseeded_resume(lambda: Dataset.list_files(pattern), cut=3)


def test_list_files_without_a_match_names_the_patterns(files):
  with pytest.raises(
    ValueError,
    match=r"list_files: no files matched pattern: "
    r".*/none\*\.q, nothing/\*",
  ):
    Dataset.list_files([f"{files}/none*.q", "nothing/*"])


# -- get_single_element / apply -------------------------------------------------------
def test_get_single_element_matches_tf_data():
  for make in (
    lambda D: D.range(5).batch(5),
    lambda D: D.from_tensors({"a": [1.5]}),
    lambda D: D.range(3).skip(2),
  ):
    ours = make(Dataset).get_single_element()
    theirs = make(tf.data.Dataset).get_single_element()
    assert_same_stream([ours], [tf.nest.map_structure(lambda t: t.numpy(), theirs)])


@pytest.mark.parametrize(
  "make,error", [(lambda D: D.range(0), "is empty"), (lambda D: D.range(2), "more than one")]
)
def test_get_single_element_refuses_like_tf_data(make, error):
  with pytest.raises(tf.errors.InvalidArgumentError):
    make(tf.data.Dataset).get_single_element()
  with pytest.raises(ValueError, match=f"get_single_element: the dataset .* {error}"):
    make(Dataset).get_single_element()


def test_get_single_element_reads_no_further_than_the_second_element():
  pulled = []
  dataset = Dataset.counter().map(lambda x: pulled.append(x) or x)
  with pytest.raises(ValueError):
    dataset.get_single_element()
  assert len(pulled) == 2


def test_apply_matches_tf_data_and_refuses_what_is_not_a_dataset():
  assert_matches_tf_data(lambda D: D.range(100).apply(lambda ds: ds.filter(lambda x: x < 5)))
  with pytest.raises(
    TypeError, match="apply: transformation_func must return a jaxfeed Dataset, got int"
  ):
    Dataset.range(3).apply(lambda ds: 3)


# -- take_while --------------------------------------------------------------------
@pytest.mark.parametrize(
  "make",
  [
    lambda D: D.range(10).take_while(lambda x: x < 5),
    lambda D: D.range(10).take_while(lambda x: x < 0),
    lambda D: D.range(4).take_while(lambda x: x < 100),
    lambda D: D.range(0).take_while(lambda x: x < 3),
    lambda D: D.range(10).map(lambda x: x % 4).take_while(lambda x: x != 3).repeat(2),
    lambda D: D.zip((D.range(8), D.range(8, 0, -1))).take_while(lambda a, b: a < b),
    lambda D: D.from_tensor_slices({"x": np.arange(6)}).take_while(lambda e: e["x"] * 2 < 7),
  ],
)
def test_take_while_matches_tf_data(make):
  assert_matches_tf_data(make)


def test_take_while_stops_reading_its_input_and_resumes():
  pulled = []
  dataset = Dataset.counter().map(lambda x: pulled.append(x) or x).take_while(lambda x: x < 3)
  assert len(run(dataset)) == 3 and len(pulled) == 4
  check_resume(lambda: Dataset.range(10).take_while(lambda x: x < 6).repeat(2))
  with pytest.raises(TypeError, match="take_while: predicate .* must return a bool"):
    run(Dataset.range(3).take_while(lambda x: x))


# -- sparse_batch ------------------------------------------------------------------
VECTORS = [
  np.array([1, 0, 3]),
  np.array([0, 5]),
  np.array([7, 0, 0, 9]),
  np.array([], np.int64),
  np.array([4]),
]
MATRICES = [
  np.arange(6, dtype=np.float32).reshape(2, 3),
  np.ones((1, 4), np.float32),
  np.full((3, 1), 2.0, np.float32),
]
WORDS = [np.array([b"a", b"bb"]), np.array([b"c"]), np.array([b"d", b"e", b"f"])]


def tf_sparse_batches(dataset):
  return [
    {"indices": b.indices.numpy(), "values": b.values.numpy(), "dense_shape": b.dense_shape.numpy()}
    for b in dataset
  ]


@pytest.mark.parametrize(
  "items,batch_size,row_shape",
  [
    (VECTORS, 2, [6]),
    (VECTORS, 3, [None]),
    (VECTORS, 10, [4]),
    (MATRICES, 2, [3, 4]),
    (MATRICES, 2, [None, 5]),
    (WORDS, 2, [3]),
    (VECTORS[:1], 1, [3]),
  ],
)
def test_sparse_batch_matches_tf_data(items, batch_size, row_shape):
  ours = run(elements_dataset(items).sparse_batch(batch_size, row_shape))
  theirs = tf_sparse_batches(tf_elements_dataset(items).sparse_batch(batch_size, row_shape))
  assert_same_stream(ours, theirs)


def test_sparse_batch_of_scalars_matches_tf_data():
  ours = run(Dataset.range(5).sparse_batch(2, []))
  assert_same_stream(ours, tf_sparse_batches(tf.data.Dataset.range(5).sparse_batch(2, [])))


def test_sparse_batch_is_what_jax_builds_a_sparse_array_from():
  from jax.experimental import sparse  # pylint: disable=g-import-not-at-top

  batch = run(elements_dataset(VECTORS).sparse_batch(2, [6]))[0]
  dense = sparse.BCOO(
    (batch["values"], batch["indices"]), shape=tuple(batch["dense_shape"])
  ).todense()
  np.testing.assert_array_equal(dense, [[1, 0, 3, 0, 0, 0], [0, 5, 0, 0, 0, 0]])


@pytest.mark.parametrize(
  "items,row_shape,error",
  [
    (VECTORS, [2], r"shape \(3,\) is larger than row_shape \[2\]"),
    (VECTORS, [3, 3], r"shape \(3,\) rank differs from row_shape \[3, 3\]"),
    ([{"a": np.zeros(2)}], [2], "every element must be one array, got a dict"),
  ],
)
def test_sparse_batch_refuses_elements_that_do_not_fit(items, row_shape, error):
  with pytest.raises((ValueError, TypeError), match=error):
    run(elements_dataset(items).sparse_batch(2, row_shape))


def test_sparse_batch_resumes():
  check_resume(lambda: elements_dataset(VECTORS * 3).sparse_batch(2, [None]))


# -- rejection_resample --------------------------------------------------------------
LABELS = np.random.default_rng(0).choice(3, size=6000, p=[0.6, 0.3, 0.1])
TARGET = [0.2, 0.3, 0.5]


def resampled_classes(dataset):
  pairs = run(dataset)
  assert all(int(c) == int(x) for c, x in pairs)  # class_func is the identity
  return np.array([int(c) for c, _ in pairs])


@pytest.mark.parametrize("initial", [[0.6, 0.3, 0.1], None])
def test_rejection_resample_reaches_the_target_as_tf_data_does(initial):
  def classes(D, seed):
    return resampled_classes(
      D.from_tensor_slices(LABELS).rejection_resample(
        lambda x: x, TARGET, initial_dist=initial, seed=seed
      )
    )

  # Three seeds pooled: about 3,900 outputs, so a share's noise is < 0.01.
  ours = np.concatenate([classes(Dataset, seed) for seed in range(3)])
  theirs = np.concatenate([classes(tf.data.Dataset, seed) for seed in range(3)])
  for pooled in (ours, theirs):
    shares = np.bincount(pooled, minlength=3) / len(pooled)
    np.testing.assert_allclose(shares, TARGET, atol=0.03)
  # As many elements out: the same mixture of the input as it comes and a
  # rejection-sampled second read, ending with the read it draws from.
  assert abs(len(ours) - len(theirs)) < 0.1 * len(theirs), (len(ours), len(theirs))


def test_rejection_resample_unpacks_tuples_and_keeps_the_element():
  pairs = run(
    Dataset.zip((Dataset.range(40), Dataset.range(40).map(lambda x: x % 2))).rejection_resample(
      lambda i, label: label, [0.5, 0.5], seed=1
    )
  )
  assert pairs and all(isinstance(p[1], tuple) and p[0] == p[1][1] for p in pairs)


def test_rejection_resample_is_deterministic_from_its_seed_and_resumes():
  def make(seed=3, initial=None):
    return Dataset.from_tensor_slices(LABELS[:300]).rejection_resample(
      lambda x: x, TARGET, initial_dist=initial, seed=seed
    )

  assert_same_stream(run(make()), run(make()))
  assert run(make()) != run(make(seed=4))
  check_resume(make, cuts=[0, 1, 17, 60, 100])
  check_resume(lambda: make(initial=[0.6, 0.3, 0.1]), cuts=[0, 5, 80])
  check_unseeded_resume(lambda: make(seed=None), cut=40)


@pytest.mark.parametrize(
  "args,error",
  [
    (([0.5, 0.6],), "target_dist must be a 1-d list of probabilities"),
    (([0.5, 0.5], [1.0]), "initial_dist has 1 classes but target_dist has 2"),
  ],
)
def test_rejection_resample_refuses_bad_distributions(args, error):
  with pytest.raises(ValueError, match=error):
    Dataset.range(3).rejection_resample(lambda x: x % 2, *args)


def test_rejection_resample_refuses_a_class_out_of_range():
  with pytest.raises(
    ValueError,
    match=r"class_func must return an integer scalar "
    r"in \[0, 2\)",
  ):
    run(Dataset.range(5).rejection_resample(lambda x: x, [0.5, 0.5], seed=0))


# -- element_spec ----------------------------------------------------------------------
SLICES = {
  "x": np.arange(12, dtype=np.int32),
  "y": np.zeros((12, 3), np.float32),
  "s": np.array([b"a"] * 12),
}
SPEC_PIPELINES = {
  "range": lambda D: D.range(5),
  "counter": lambda D: D.counter(dtype=np.int32 if D is Dataset else tf.int32),
  "random": lambda D: D.random(seed=1),
  "slices": lambda D: D.from_tensor_slices(SLICES),
  "tensors": lambda D: D.from_tensors({"a": [1, 2], "b": 3.0, "c": "x"}),
  "batch": lambda D: D.from_tensor_slices(SLICES).batch(5),
  "batch_drop": lambda D: D.from_tensor_slices(SLICES).batch(5, drop_remainder=True),
  "batch_batch": lambda D: D.range(20).batch(2, True).batch(3),
  "padded_batch": lambda D: D.from_tensor_slices(SLICES).padded_batch(4),
  "padded_batch_shapes": lambda D: D.from_tensor_slices(SLICES).padded_batch(
    4, padded_shapes={"x": [], "y": [None], "s": []}, drop_remainder=True
  ),
  "unbatch": lambda D: D.from_tensor_slices(SLICES).batch(5).unbatch(),
  "rebatch": lambda D: D.range(20).batch(4).rebatch(3, drop_remainder=True),
  "zip_enumerate": lambda D: D.zip((D.range(3), {"a": D.from_tensor_slices(SLICES)})).enumerate(),
  "concatenate": lambda D: D.range(4).batch(2, True).concatenate(D.range(3).batch(3, True)),
  "pass_through": lambda D: (
    D.from_tensor_slices(SLICES)
    .shuffle(4, seed=1)
    .take(3)
    .skip(1)
    .repeat(2)
    .prefetch(2)
    .filter(lambda e: e["x"] > 0)
    .cache()
    .shard(2, 0)
  ),
  "map": lambda D: D.range(8).map(lambda x: {"v": x * 2, "w": (x, x + 1)}).batch(3),
  "map_shapes": lambda D: D.from_tensor_slices(SLICES).map(lambda e: e["y"] * 2),
  "sparse_batch": lambda D: (
    D.range(6).map(lambda x: (x, x)).map(lambda a, b: a).sparse_batch(2, [])
  ),
  "list_files": lambda D: D.list_files(__file__),
  "take_while": lambda D: D.range(6).take_while(lambda x: x < 3),
}


def tf_spec_as_ours(spec):
  def leaf(s):
    if isinstance(s, tf.SparseTensorSpec):
      rank = s.shape.rank
      return {
        "indices": TensorSpec((None, rank), np.int64),
        "values": TensorSpec((None,), s.dtype.as_numpy_dtype),
        "dense_shape": TensorSpec((rank,), np.int64),
      }
    dtype = object if s.dtype == tf.string else s.dtype.as_numpy_dtype
    return TensorSpec(tuple(s.shape.as_list()), dtype)

  return tf.nest.map_structure(leaf, spec)


@pytest.mark.parametrize("name", sorted(SPEC_PIPELINES))
def test_element_spec_matches_tf_data(name):
  make = SPEC_PIPELINES[name]
  assert make(Dataset).element_spec == tf_spec_as_ours(make(tf.data.Dataset).element_spec)


def test_element_spec_of_range_has_its_dtype():
  # tf.data 2.21 reports int64 for any range dtype; the elements have it.
  dataset = Dataset.range(5, dtype=np.float32)
  assert dataset.element_spec == TensorSpec((), np.float32)
  assert dataset.element_spec.is_compatible_with(next(iter(dataset)))


def test_element_spec_below_a_function_is_its_first_output_and_uses_no_iteration():
  reads = []
  dataset = (
    Dataset.range(10)
    .shuffle(10, seed=0)
    .map(lambda x: reads.append(x) or np.zeros(int(x) + 2))
    .padded_batch(4)
  )
  expected = run(dataset)
  reads.clear()
  again = (
    Dataset.range(10)
    .shuffle(10, seed=0)
    .map(lambda x: reads.append(x) or np.zeros(int(x) + 2))
    .padded_batch(4)
  )
  assert again.element_spec == TensorSpec((None, None), np.float64)
  assert reads == [0]  # one element, read without the shuffle
  assert_same_stream(run(again), expected)  # the first pass's order is untouched
  assert jaxfeed.TensorSpec is TensorSpec


def test_element_spec_of_an_empty_dataset_below_a_function_is_an_error():
  with pytest.raises(
    ValueError,
    match="element_spec: the spec of op 'map' is read from its first element .* but it has none",
  ):
    _ = Dataset.range(0).map(lambda x: x).element_spec
  assert Dataset.range(0).batch(2).element_spec == TensorSpec((None,), np.int64)
