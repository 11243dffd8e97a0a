"""Conformance: the same pipelines through jaxfeed and tf.data, element by element.

Every configuration is one function of a namespace (`JF` or `TF`) that builds
the pipeline with that library's API, so both sides run exactly the same ops on
the same data. Outputs are compared in order (structure, dtype, shape, values),
or as multisets for shuffles.
"""

import numpy as np
import pytest

from jaxfeed.dataset import Dataset
import op_testing
from op_testing import assert_same_stream, restore_in_new_process

tf = op_testing.import_tensorflow()


# ---------------------------------------------------------------------------
# The two namespaces
# ---------------------------------------------------------------------------
class JF:
  """jaxfeed side."""

  D = Dataset
  name = "jaxfeed"

  @staticmethod
  def length(x):
    return np.shape(x)[0]

  @staticmethod
  def arange(n):
    return np.arange(n)

  @staticmethod
  def int32(x):
    return np.int32(x)

  @staticmethod
  def int64(x):
    return np.int64(x)

  @staticmethod
  def elements(items, example=None):
    """A dataset of Python-held elements (arrays, dicts, tuples)."""
    del example  # only tf.data needs it: the spec of an empty dataset
    return op_testing.elements_dataset(items)


class TF:
  """tf.data side."""

  D = tf.data.Dataset
  name = "tf.data"

  @staticmethod
  def length(x):
    return tf.shape(x)[0]

  @staticmethod
  def arange(n):
    return tf.range(n)

  @staticmethod
  def int32(x):
    return tf.cast(x, tf.int32)

  @staticmethod
  def int64(x):
    return tf.cast(x, tf.int64)

  @staticmethod
  def elements(items, example=None):
    return op_testing.tf_elements_dataset(items, example)


# ---------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------
_RNG = np.random.default_rng(7)
SEQ_LENGTHS = [3, 1, 7, 2, 9, 4, 4, 1, 12, 5, 0, 6, 15, 2, 8, 3, 11, 1, 5, 7]
SEQUENCES = [np.arange(1, n + 1, dtype=np.int32) * (i + 1) for i, n in enumerate(SEQ_LENGTHS)]
FEATURES = [
  {"tokens": s.astype(np.int64), "weight": np.float32(i), "mask": np.ones(len(s), np.bool_)}
  for i, s in enumerate(SEQUENCES)
]
PAIRS = [(s, np.int32(i)) for i, s in enumerate(SEQUENCES)]
MATRICES = [np.full((n % 4 + 1, 2), n, np.float32) for n in SEQ_LENGTHS]
SLICES = {"x": np.arange(12, dtype=np.int32), "y": _RNG.random((12, 3)).astype(np.float32)}


def seqs(ns, items=SEQUENCES):
  return ns.elements(items, example=SEQUENCES[0])


# ---------------------------------------------------------------------------
# Configurations: id -> (build(ns), compare) with compare "exact" | "multiset"
# ---------------------------------------------------------------------------
CONFIGS = {}


def config(name, compare="exact"):
  def register(build):
    assert name not in CONFIGS, name
    CONFIGS[name] = (build, compare)
    return build

  return register


def _add(name, build, compare="exact"):
  config(name, compare)(build)


# interleave: cycles larger than the input, empty nested datasets, blocks
# that do not divide the nested datasets, parallel and sequential.
for n, cycle, block in [
  (0, 2, 1),
  (1, 3, 1),
  (5, 2, 1),
  (7, 3, 2),
  (6, 8, 1),
  (10, 4, 3),
  (9, 1, 1),
  (12, 2, 5),
]:
  # tf.data refuses num_parallel_calls > cycle_length.
  for parallel in (None, min(2, cycle)):
    _add(
      f"interleave/n{n}_c{cycle}_b{block}_p{parallel}",
      lambda ns, n=n, cycle=cycle, block=block, parallel=parallel: ns.D.range(n).interleave(
        lambda x: ns.D.range(x % 4),
        cycle_length=cycle,
        block_length=block,
        num_parallel_calls=parallel,
      ),
    )
_add(
  "interleave/nested_map",
  lambda ns: ns.D.range(6).interleave(
    lambda x: ns.D.range(x).map(lambda y: y * 10 + x), cycle_length=3, block_length=2
  ),
)
_add(
  "interleave/tuple_elements_unpacked",
  lambda ns: ns.D.zip((ns.D.range(5), ns.D.range(5, 10))).interleave(
    lambda a, b: ns.D.range(a, b), cycle_length=2
  ),
)
_add(
  "interleave/sequences_to_tokens",
  lambda ns: ns.D.range(len(SEQUENCES)).interleave(
    lambda i: ns.D.range(i * 3), cycle_length=4, block_length=3, num_parallel_calls=3
  ),
)
_add(
  "interleave/autotune_parallel",
  lambda ns: ns.D.range(8).interleave(
    lambda x: ns.D.range(x), cycle_length=3, num_parallel_calls=-1
  ),
)

# flat_map
for n in (0, 1, 6):
  _add(f"flat_map/range_{n}", lambda ns, n=n: ns.D.range(n).flat_map(lambda x: ns.D.range(x % 3)))
_add(
  "flat_map/tuple_elements_unpacked",
  lambda ns: ns.D.zip((ns.D.range(4), ns.D.range(10, 14))).flat_map(
    lambda a, b: ns.D.range(a, b, 4)
  ),
)
_add(
  "flat_map/nested",
  lambda ns: ns.D.range(4).flat_map(lambda x: ns.D.range(x).flat_map(lambda y: ns.D.range(y))),
)

# unbatch
_add("unbatch/range_batch3", lambda ns: ns.D.range(10).batch(3).unbatch())
_add("unbatch/drop_remainder", lambda ns: ns.D.range(10).batch(4, drop_remainder=True).unbatch())
_add("unbatch/dict_slices", lambda ns: ns.D.from_tensor_slices(SLICES).batch(5).unbatch())
_add(
  "unbatch/tuple_batches",
  lambda ns: ns.D.zip((ns.D.range(7), ns.D.range(7).map(lambda x: x * 2))).batch(3).unbatch(),
)
_add("unbatch/empty", lambda ns: ns.D.range(0).batch(2).unbatch())
_add("unbatch/padded_batches", lambda ns: seqs(ns).padded_batch(3).unbatch())

# rebatch
for n, first, sizes, drop in [
  (10, 3, 4, False),
  (10, 3, 4, True),
  (10, 3, 1, False),
  (10, 4, 7, False),
  (20, 8, 3, True),
  (0, 3, 2, False),
  (11, 5, [1, 2, 3], False),
  (11, 5, [4, 1], True),
  (9, 3, 3, False),
  (9, 9, 2, False),
]:
  _add(
    f"rebatch/n{n}_in{first}_out{sizes}_drop{drop}",
    lambda ns, n=n, first=first, sizes=sizes, drop=drop: (
      ns.D.range(n).batch(first).rebatch(sizes, drop_remainder=drop)
    ),
  )
_add("rebatch/dict_slices", lambda ns: ns.D.from_tensor_slices(SLICES).batch(5).rebatch(4))

# zip
_add("zip/equal", lambda ns: ns.D.zip((ns.D.range(4), ns.D.range(10, 14))))
_add("zip/shortest_first", lambda ns: ns.D.zip((ns.D.range(3), ns.D.range(10, 20))))
_add("zip/shortest_last", lambda ns: ns.D.zip((ns.D.range(8), ns.D.range(10, 12))))
_add("zip/dict", lambda ns: ns.D.zip({"b": ns.D.range(5), "a": seqs(ns)}))
_add(
  "zip/nested",
  lambda ns: ns.D.zip(
    (ns.D.range(5), {"x": ns.D.range(3, 9), "y": (ns.D.range(2), ns.D.range(4))})
  ),
)
_add(
  "zip/three_with_map",
  lambda ns: ns.D.zip(
    (ns.D.range(6), ns.D.range(6).map(lambda x: x * x), ns.D.from_tensor_slices(SLICES["y"]))
  ),
)
_add("zip/empty_input", lambda ns: ns.D.zip((ns.D.range(0), ns.D.range(5))))
_add("zip/single", lambda ns: ns.D.zip((ns.D.range(3),)))

# concatenate
_add("concatenate/ranges", lambda ns: ns.D.range(3).concatenate(ns.D.range(5, 8)))
_add("concatenate/empty_first", lambda ns: ns.D.range(0).concatenate(ns.D.range(3)))
_add("concatenate/empty_second", lambda ns: ns.D.range(3).concatenate(ns.D.range(0)))
_add(
  "concatenate/sequences", lambda ns: seqs(ns, SEQUENCES[:5]).concatenate(seqs(ns, SEQUENCES[10:]))
)
_add(
  "concatenate/dict_slices",
  lambda ns: ns.D.from_tensor_slices(SLICES).concatenate(ns.D.from_tensor_slices(SLICES).skip(9)),
)
_add(
  "concatenate/chained",
  lambda ns: ns.D.range(2).concatenate(ns.D.range(3)).concatenate(ns.D.range(10, 12)),
)

# bucket_by_sequence_length
BUCKET_CASES = {
  "default": ([3, 6, 13], [2, 2, 2, 3], {}),
  "pad_to_boundary": ([3, 6, 16], [2, 2, 2, 3], {"pad_to_bucket_boundary": True}),
  "drop_remainder": ([3, 6, 13], [2, 2, 2, 3], {"drop_remainder": True}),
  "padding_value": ([4, 8], [3, 2, 4], {"padding_values": np.int32(-1)}),
  "padded_shapes_fixed": ([4, 8], [3, 2, 4], {"padded_shapes": [16]}),
  "padded_shapes_none_to_boundary": (
    [4, 8, 16],
    [3, 2, 4, 1],
    {"padded_shapes": [None], "pad_to_bucket_boundary": True},
  ),
  "one_boundary": ([5], [4, 4], {}),
  "no_boundaries": ([], [6], {}),
  "batch_size_one": ([2, 5], [1, 1, 1], {}),
  "big_batches_flush_only": ([5, 10], [50, 50, 50], {}),
  "big_batches_drop_all": ([5, 10], [50, 50, 50], {"drop_remainder": True}),
}
for case, (bounds, sizes, kwargs) in BUCKET_CASES.items():
  _add(
    f"bucket_by_sequence_length/{case}",
    lambda ns, bounds=bounds, sizes=sizes, kwargs=kwargs: seqs(ns).bucket_by_sequence_length(
      ns.length, bounds, sizes, **kwargs
    ),
  )
_add(
  "bucket_by_sequence_length/empty",
  lambda ns: seqs(ns, []).bucket_by_sequence_length(ns.length, [3], [2, 2]),
)
_add(
  "bucket_by_sequence_length/single_element",
  lambda ns: seqs(ns, SEQUENCES[:1]).bucket_by_sequence_length(ns.length, [3], [2, 2]),
)
_add(
  "bucket_by_sequence_length/dict_features",
  lambda ns: ns.elements(FEATURES).bucket_by_sequence_length(
    lambda e: ns.length(e["tokens"]), [4, 8], [2, 3, 2]
  ),
)
_add(
  "bucket_by_sequence_length/dict_features_to_boundary",
  lambda ns: ns.elements(FEATURES).bucket_by_sequence_length(
    lambda e: ns.length(e["tokens"]),
    [4, 8, 16],
    [2, 3, 2, 2],
    pad_to_bucket_boundary=True,
    padding_values={"tokens": np.int64(-7), "weight": None, "mask": None},
  ),
)
_add(
  "bucket_by_sequence_length/tuple_elements_unpacked",
  lambda ns: ns.elements(PAIRS).bucket_by_sequence_length(lambda s, i: ns.length(s), [5], [3, 2]),
)
_add(
  "bucket_by_sequence_length/matrices",
  lambda ns: ns.elements(MATRICES).bucket_by_sequence_length(ns.length, [2, 3], [2, 2, 3]),
)
_add(
  "bucket_by_sequence_length/scalars_no_padding",
  lambda ns: ns.D.range(20).bucket_by_sequence_length(
    lambda x: ns.int32(x % 7), [2, 5], [3, 2, 4], no_padding=True
  ),
)

# group_by_window
_add(
  "group_by_window/mod3_window3",
  lambda ns: ns.D.range(17).group_by_window(
    lambda x: x % 3, lambda k, w: w.batch(4), window_size=3
  ),
)
_add(
  "group_by_window/window_size_func",
  lambda ns: ns.D.range(17).group_by_window(
    lambda x: x % 3, lambda k, w: w.batch(2), window_size_func=lambda k: k + 2
  ),
)
_add(
  "group_by_window/several_outputs_per_window",
  lambda ns: ns.D.range(20).group_by_window(
    lambda x: x % 2, lambda k, w: w.batch(2), window_size=5
  ),
)
_add(
  "group_by_window/window_size_one",
  lambda ns: ns.D.range(6).group_by_window(lambda x: x % 4, lambda k, w: w, window_size=1),
)
_add(
  "group_by_window/negative_and_large_keys",
  lambda ns: ns.D.range(15).group_by_window(
    lambda x: (x % 3 - 1) * 1_000_000_000_000, lambda k, w: w.batch(10), window_size=4
  ),
)
_add(
  "group_by_window/reduce_uses_key",
  lambda ns: ns.D.range(12).group_by_window(
    lambda x: x % 3, lambda k, w: w.map(lambda x: x + k * 100), window_size=5
  ),
)
_add(
  "group_by_window/empty",
  lambda ns: ns.D.range(0).group_by_window(lambda x: x % 3, lambda k, w: w.batch(3), window_size=3),
)
_add(
  "group_by_window/single",
  lambda ns: ns.D.range(1).group_by_window(lambda x: x % 3, lambda k, w: w.batch(3), window_size=3),
)
_add(
  "group_by_window/padded_sequences",
  lambda ns: seqs(ns).group_by_window(
    lambda s: ns.int64(ns.length(s) % 2), lambda k, w: w.padded_batch(3), window_size=4
  ),
)

# batch / padded_batch (the stacking helpers this folder's ops reuse)
for n, size, drop in [(10, 3, False), (10, 3, True), (5, 1, False), (5, 20, False), (0, 4, False)]:
  _add(
    f"batch/n{n}_b{size}_drop{drop}",
    lambda ns, n=n, size=size, drop=drop: ns.D.range(n).batch(size, drop),
  )
_add("batch/dict_slices", lambda ns: ns.D.from_tensor_slices(SLICES).batch(5))
_add("padded_batch/default", lambda ns: seqs(ns).padded_batch(3))
_add("padded_batch/fixed_shape", lambda ns: seqs(ns).padded_batch(4, [16]))
_add("padded_batch/padding_value", lambda ns: seqs(ns).padded_batch(3, padding_values=np.int32(9)))
_add("padded_batch/drop_remainder", lambda ns: seqs(ns).padded_batch(6, drop_remainder=True))

# map / filter / shuffle / take / skip / repeat / range / from_tensor_slices
_add("map/double", lambda ns: ns.D.range(6).map(lambda x: x * 2))
_add("map/to_tuple", lambda ns: ns.D.range(5).map(lambda x: (x, x * x)))
_add(
  "map/dict_slices",
  lambda ns: ns.D.from_tensor_slices(SLICES).map(lambda e: {"z": e["x"] * 3, "y": e["y"]}),
)
_add("filter/even", lambda ns: ns.D.range(10).filter(lambda x: x % 2 == 0))
_add("filter/none_kept", lambda ns: ns.D.range(5).filter(lambda x: x > 10))
_add("filter/all_kept", lambda ns: ns.D.range(5).filter(lambda x: x >= 0))
_add("shuffle/small_buffer", lambda ns: ns.D.range(30).shuffle(4, seed=1), "multiset")
_add("shuffle/full_buffer", lambda ns: ns.D.range(30).shuffle(100, seed=1).batch(7), "multiset")
for ops in [
  ("take", 3),
  ("take", 0),
  ("take", -1),
  ("skip", 3),
  ("skip", 20),
  ("repeat", 2),
  ("repeat", 0),
]:
  _add(f"{ops[0]}/{ops[1]}", lambda ns, ops=ops: getattr(ns.D.range(7), ops[0])(ops[1]))
_add("repeat/then_take", lambda ns: ns.D.range(5).repeat(3).take(7))
for args in [(5,), (2, 10, 3), (10, 0, -2), (0,)]:
  _add(f"range/{args}", lambda ns, args=args: ns.D.range(*args))
_add("from_tensor_slices/array", lambda ns: ns.D.from_tensor_slices(SLICES["y"]))
_add("from_tensor_slices/dict", lambda ns: ns.D.from_tensor_slices(SLICES))
_add("from_tensor_slices/tuple", lambda ns: ns.D.from_tensor_slices((SLICES["x"], SLICES["y"])))

# from_tensors, counter, take_while
_add("from_tensors/dict", lambda ns: ns.D.from_tensors(SLICES).repeat(2))
_add("from_tensors/python_values", lambda ns: ns.D.from_tensors({"a": [1, 2], "b": 2.5, "c": "s"}))
_add("counter/take", lambda ns: ns.D.counter(3, -2).take(9))
_add(
  "take_while/after_map",
  lambda ns: ns.D.range(12).map(lambda x: x * 3).take_while(lambda x: x < 20),
)
_add(
  "take_while/zip_unpacked",
  lambda ns: (
    ns.D.zip((ns.D.range(9), ns.D.range(9, 0, -1))).take_while(lambda a, b: a < b).batch(2)
  ),
)

# Combinations of this folder's ops
_add(
  "combo/interleave_map_bucket",
  lambda ns: (
    ns.D.range(8)
    .interleave(lambda i: ns.D.range(i, i + 5), cycle_length=3)
    .map(lambda x: ns.arange(x % 9))
    .bucket_by_sequence_length(ns.length, [4, 9], [2, 2, 2])
  ),
)
_add(
  "combo/group_by_window_rebatch",
  lambda ns: (
    ns.D.range(25)
    .group_by_window(lambda x: x % 3, lambda k, w: w.batch(3), window_size=4)
    .rebatch(2)
  ),
)
_add(
  "combo/zip_batch_unbatch_concatenate",
  lambda ns: (
    ns.D.zip((ns.D.range(7), ns.D.range(7).map(lambda x: -x)))
    .batch(3)
    .unbatch()
    .concatenate(ns.D.zip((ns.D.range(2), ns.D.range(2))))
  ),
)


def test_enough_configurations():
  assert len(CONFIGS) >= 100, len(CONFIGS)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_matches_tf_data(name):
  build, compare = CONFIGS[name]
  ours = op_testing.run(build(JF))
  theirs = op_testing.run(build(TF))
  if compare == "multiset":
    flat = lambda xs: sorted(np.concatenate([np.ravel(x) for x in xs]).tolist()) if xs else []
    assert flat(ours) == flat(theirs)
    assert [np.shape(x) for x in ours] == [np.shape(x) for x in theirs]
  else:
    assert_same_stream(ours, theirs)


# ---------------------------------------------------------------------------
# Restoring in a new process
# ---------------------------------------------------------------------------
NEW_PROCESS_PIPELINES = {
  "interleave": (
    "Dataset.range(12).interleave(lambda x: Dataset.range(x % 5)"
    ".map(lambda y: y * 100 + x), cycle_length=3, block_length=2)",
    [1, 6, 13],
  ),
  "parallel_interleave": (
    "Dataset.range(12).interleave(lambda x: Dataset.range(x % 5), "
    "cycle_length=3, block_length=2, num_parallel_calls=2)",
    [4, 11],
  ),
  "bucket_by_sequence_length": (
    "Dataset.range(40).map(lambda i: np.arange(int(i) * 7 % 13, "
    "dtype=np.int32)).bucket_by_sequence_length(lambda x: x.shape[0], "
    "[4, 8], [3, 2, 4])",
    [0, 2, 5, 9],
  ),
  "pack": (
    "Dataset.range(60).map(lambda i: {'tokens': np.arange(int(i) * 5 % 11 "
    "+ 1, dtype=np.int32)}).pack({'tokens': 16}, num_packing_bins=3)",
    [1, 7, 15],
  ),
  "group_by_window": (
    "Dataset.range(30).group_by_window(lambda x: x % 4, lambda k, w: w.batch(2), window_size=5)",
    [1, 8, 14],
  ),
  "rejection_resample": (
    "Dataset.range(60).rejection_resample(lambda x: x % 3, [0.2, 0.3, 0.5], seed=5)",
    [1, 9, 20],
  ),
  "random_rerandomized": (
    "Dataset.random(seed=3, rerandomize_each_iteration=True).take(5).repeat(3)",
    [2, 7, 12],
  ),
  "sparse_batch": (
    "Dataset.range(9).map(lambda x: np.arange(int(x) % 4)).sparse_batch(2, [None])",
    [1, 3],
  ),
}


@pytest.mark.parametrize("name", sorted(NEW_PROCESS_PIPELINES))
def test_state_restores_in_a_new_process(name):
  expression, cuts = NEW_PROCESS_PIPELINES[name]
  build = lambda: eval(expression)  # pylint: disable=eval-used
  expected = list(build().make_iterator())
  states, heads = [], []
  for cut in cuts:
    with build().make_iterator() as it:
      heads.append([next(it) for _ in range(cut)])
      states.append(it.get_state())
  # One new process restores every state of this pipeline, in turn.
  rests = restore_in_new_process(expression, states)
  assert len(rests) == len(states)
  for head, rest in zip(heads, rests):
    assert_same_stream(head + rest, expected)
