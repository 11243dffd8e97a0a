"""`pack`: Grain's first-fit / best-fit packing, packing invariants, resume."""

import collections

import grain
import numpy as np
import pytest

import jaxfeed
from jaxfeed.dataset import Dataset
from op_testing import assert_same_stream, check_resume, elements_dataset, run


def make_examples(seed, n=60, max_a=12, max_b=6, min_length=1):
  rng = np.random.default_rng(seed)
  return [
    {
      "a": rng.integers(1, 1000, rng.integers(min_length, max_a + 1)).astype(np.int32),
      "b": rng.integers(1, 1000, (rng.integers(min_length, max_b + 1), 2)).astype(np.float32),
    }
    for _ in range(n)
  ]


GRAIN_PACKERS = {
  "first_fit": grain.experimental.FirstFitPackIterDataset,
  "best_fit": grain.experimental.BestFitPackIterDataset,
}


@pytest.mark.parametrize("algorithm", ["first_fit", "best_fit"])
@pytest.mark.parametrize(
  "lengths,bins,max_seqs",
  [
    ({"a": 12}, 1, None),
    ({"a": 16}, 4, None),
    ({"a": 20, "b": 8}, 3, None),
    ({"a": 30, "b": 12}, 5, 3),
    ({"a": 12, "b": 6}, 8, 1),
  ],
)
def test_rows_match_grain(algorithm, lengths, bins, max_seqs):
  examples = [{k: e[k] for k in lengths} for e in make_examples(1, min_length=0)]
  ours = run(
    elements_dataset(examples).pack(
      lengths, num_packing_bins=bins, algorithm=algorithm, max_sequences_per_bin=max_seqs
    )
  )
  theirs = list(
    GRAIN_PACKERS[algorithm](
      grain.MapDataset.source(examples).to_iter_dataset(),
      length_struct=lengths,
      num_packing_bins=bins,
      shuffle_bins=False,
      max_sequences_per_bin=max_seqs,
    )
  )
  assert_same_stream(ours, theirs)


def unpack(rows, feature):
  """The sequences packed in rows, checking segment ids and positions."""
  sequences = []
  for row in rows:
    values = row[feature]
    segments = row[f"{feature}_segment_ids"]
    positions = row[f"{feature}_positions"]
    assert segments.dtype == np.int32 and positions.dtype == np.int32
    padding = segments == 0
    assert not values[padding].any() and not positions[padding].any()
    used = np.flatnonzero(~padding)
    # Segments are contiguous, numbered 1, 2, ... from the row's start.
    assert np.array_equal(used, np.arange(len(used)))
    ids = segments[used]
    assert ids[0] == 1 and np.all(np.diff(ids) >= 0) and np.all(np.diff(ids) <= 1)
    for seg in range(1, int(ids.max()) + 1):
      span = segments == seg
      assert np.array_equal(positions[span], np.arange(span.sum()))
      sequences.append(values[span])
  return sequences


def key(sequence):
  return (sequence.shape, sequence.tobytes())


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("algorithm", ["first_fit", "best_fit"])
def test_no_token_is_lost_or_duplicated_and_segments_are_consistent(seed, algorithm):
  rng = np.random.default_rng(100 + seed)
  examples = make_examples(seed, n=int(rng.integers(1, 120)), max_a=int(rng.integers(1, 30)))
  row_length = int(rng.integers(30, 64))
  bins = int(rng.integers(1, 9))
  rows = run(
    elements_dataset(examples).pack(
      {"a": row_length, "b": 40}, num_packing_bins=bins, algorithm=algorithm
    )
  )
  for row in rows:
    assert row["a"].shape == (row_length,) and row["b"].shape == (40, 2)
    # Both features of an element share its segment id.
    assert row["a_segment_ids"].max() == row["b_segment_ids"].max()
  for feature in ("a", "b"):
    packed = collections.Counter(key(s) for s in unpack(rows, feature))
    given = collections.Counter(key(e[feature]) for e in examples)
    assert packed == given


def test_first_fit_keeps_arrival_order_within_rows_and_across_row_sets():
  lengths = [5, 5, 3, 8, 2, 6, 6]
  examples = [{"t": np.full(n, i + 1, np.int32)} for i, n in enumerate(lengths)]
  rows = run(elements_dataset(examples).pack({"t": 10}, num_packing_bins=2))
  # 5,5 -> row 0; 3 -> row 1; 8 fits nowhere -> emit; 8 -> row 0, 2 -> row 0;
  # 6 -> row 1; 6 fits nowhere -> emit; 6 -> row 0.
  assert [r["t"].tolist() for r in rows] == [
    [1] * 5 + [2] * 5,
    [3] * 3 + [0] * 7,
    [4] * 8 + [5] * 2,
    [6] * 6 + [0] * 4,
    [7] * 6 + [0] * 4,
  ]


def test_best_fit_chooses_the_fullest_row_that_fits():
  lengths = [6, 3, 2]
  examples = [{"t": np.full(n, i + 1, np.int32)} for i, n in enumerate(lengths)]
  rows = run(elements_dataset(examples).pack({"t": 8}, num_packing_bins=2, algorithm="best_fit"))
  # 6 -> row 0 (2 left); 3 -> row 1 (5 left); 2 fits both: best fit is row 0.
  assert [r["t"].tolist() for r in rows] == [[1] * 6 + [3] * 2, [2] * 3 + [0] * 5]


def test_max_sequences_per_bin_limits_segments():
  examples = [{"t": np.ones(1, np.int32)} for _ in range(20)]
  rows = run(
    elements_dataset(examples).pack({"t": 100}, num_packing_bins=2, max_sequences_per_bin=3)
  )
  assert [int(r["t_segment_ids"].max()) for r in rows] == [3] * 6 + [2]


def test_nested_features_get_segment_ids_beside_them_and_extras_are_dropped():
  examples = [
    {"x": {"ids": np.arange(n, dtype=np.int64)}, "label": np.int32(n), "extra": "dropped"}
    for n in (2, 3)
  ]
  rows = run(elements_dataset(examples).pack({"x": {"ids": 6}, "label": 2}, num_packing_bins=1))
  assert len(rows) == 1
  row = rows[0]
  assert set(row) == {"x", "label", "label_segment_ids", "label_positions"}
  assert set(row["x"]) == {"ids", "ids_segment_ids", "ids_positions"}
  assert row["x"]["ids"].tolist() == [0, 1, 0, 1, 2, 0]
  assert row["x"]["ids_positions"].tolist() == [0, 1, 0, 1, 2, 0]
  # Scalar features pack as length-1 sequences.
  assert row["label"].tolist() == [2, 3]
  assert row["label_segment_ids"].tolist() == [1, 2]


def test_an_element_longer_than_its_row_is_an_error_naming_feature_and_lengths():
  examples = [{"a": np.ones(3, np.int32)}, {"a": np.ones(9, np.int32)}]
  with elements_dataset(examples).pack({"a": 8}, num_packing_bins=2).make_iterator() as it:
    with pytest.raises(
      ValueError,
      match=r"pack: feature 'a'.*length 9.*row "
      r"length 8",
    ):
      next(it)


def test_an_element_without_a_packed_feature_is_an_error():
  with (
    elements_dataset([{"b": np.ones(2)}]).pack({"a": 8}, num_packing_bins=1).make_iterator() as it
  ):
    with pytest.raises(ValueError, match="pack.*features.*'a'"):
      next(it)


@pytest.mark.parametrize(
  "kwargs,error,match",
  [
    ({"length_struct": 8}, TypeError, "length_struct"),
    ({"length_struct": {}}, TypeError, "length_struct"),
    ({"length_struct": {"a": 0}}, ValueError, "row length of feature 'a'"),
    ({"num_packing_bins": 0}, ValueError, "num_packing_bins"),
    ({"algorithm": "worst_fit"}, ValueError, "algorithm.*worst_fit"),
    ({"max_sequences_per_bin": 0}, ValueError, "max_sequences_per_bin"),
    ({"overflow": "wrap"}, ValueError, "overflow.*'split'.*wrap"),
  ],
)
def test_invalid_options_are_rejected(kwargs, error, match):
  args = {"length_struct": {"a": 8}, "num_packing_bins": 2, **kwargs}
  length_struct = args.pop("length_struct")
  with pytest.raises(error, match=f"pack.*{match}"):
    Dataset.range(2).pack(length_struct, **args)


@pytest.mark.parametrize("algorithm", ["first_fit", "best_fit"])
@pytest.mark.parametrize("bins", [1, 3])
def test_resume_at_every_cut_is_exact(algorithm, bins):
  examples = make_examples(5, n=40)
  check_resume(
    lambda: elements_dataset(examples).pack(
      {"a": 20, "b": 10}, num_packing_bins=bins, algorithm=algorithm
    )
  )


def test_resume_under_a_shuffled_input_is_exact():
  examples = make_examples(6, n=50)
  check_resume(
    lambda: (
      Dataset.range(50)
      .shuffle(10, seed=3)
      .map(lambda i: examples[int(i)])
      .pack({"a": 24}, num_packing_bins=4)
    ),
    cuts=[0, 1, 5, 9, 14],
  )


def test_state_is_small_with_many_pending_elements():
  examples = [{"a": np.ones(2, np.int32)} for _ in range(3000)]
  with elements_dataset(examples).pack({"a": 512}, num_packing_bins=4).make_iterator() as it:
    next(it)
    state = it.get_state()
  assert len(str(state)) < 1000


def test_over_a_sampler_the_state_names_held_elements_by_seed_only():
  # For elastic resume: one seed per held element, no values.
  source = jaxfeed.ArraySource({"a": np.ones((3000, 2), np.int32)})
  ds = Dataset.from_source(source, jaxfeed.IndexSampler(3000, seed=1))
  with ds.pack({"a": 512}, num_packing_bins=4).make_iterator() as it:
    next(it)
    state = it.get_state()
  held = state["own"]["unemitted"]["elements"]
  assert len(held) == state["own"]["input"]["num_read"] - 256
  assert len(str(state)) < 1000 + 22 * len(held)


def test_spec_params_rebuild_an_equal_node_and_the_optimizer_keeps_rows():
  examples = make_examples(8, n=30)
  node = (
    elements_dataset(examples)
    .pack({"a": 20}, num_packing_bins=2, algorithm="best_fit", max_sequences_per_bin=3)
    .node
  )
  rebuilt = type(node)(*node.parents, **node.spec_params())
  assert rebuilt.fingerprint() == node.fingerprint()
  assert_same_stream(run(Dataset(rebuilt)), run(Dataset(node)))


def test_last_seed_is_the_seed_of_the_row_first_element():
  examples = make_examples(9, n=20)
  with elements_dataset(examples).pack({"a": 16}, num_packing_bins=3).make_iterator() as it:
    seeds = [it.last_seed for _ in it]
  assert len(set(seeds)) == len(seeds)


def test_saved_input_positions_stay_bounded_over_a_long_run():
  examples = make_examples(10, n=50)
  ds = Dataset.range(5000).map(lambda i: examples[int(i) % 50]).pack({"a": 24}, num_packing_bins=4)
  with ds.make_iterator() as it:
    for _ in it:
      pass
    # The positions kept for restoring (InputReplay anchors) cover only the
    # rows being filled, not the whole run.
    assert len(it._input._anchors) <= 3  # pylint: disable=protected-access


# -- overflow: documents longer than a row -----------------------------------------
@pytest.mark.parametrize("seed", range(40))
@pytest.mark.parametrize("algorithm", ["first_fit", "best_fit"])
def test_split_loses_and_duplicates_no_token_and_keeps_piece_order(seed, algorithm):
  rng = np.random.default_rng(seed)
  row_length = int(rng.integers(1, 40))
  # Token values name (document, offset), so order and identity are checked.
  documents = [
    np.arange(n, dtype=np.int64) + 1000 * d
    for d, n in enumerate(rng.integers(1, 130, rng.integers(1, 30)))
  ]
  examples = [{"t": doc, "extra": np.int32(d)} for d, doc in enumerate(documents)]
  rows = run(
    elements_dataset(examples).pack(
      {"t": row_length},
      num_packing_bins=int(rng.integers(1, 6)),
      algorithm=algorithm,
      overflow="split",
    )
  )
  pieces = unpack(rows, "t")  # also checks positions restart at 0 per piece
  assert all(0 < len(p) <= row_length for p in pieces)
  # Exactly the row-length chunks of every document: no token lost or repeated.
  chunks = [doc[k : k + row_length] for doc in documents for k in range(0, len(doc), row_length)]
  assert collections.Counter(key(p) for p in pieces) == collections.Counter(key(c) for c in chunks)


def test_split_with_one_bin_emits_the_pieces_in_document_order():
  documents = [np.arange(n, dtype=np.int64) + 1000 * d for d, n in enumerate([3, 25, 1, 9, 17])]
  rows = run(
    elements_dataset([{"t": d} for d in documents]).pack(
      {"t": 8}, num_packing_bins=1, overflow="split"
    )
  )
  assert np.array_equal(np.concatenate(unpack(rows, "t")), np.concatenate(documents))


def test_split_cuts_every_feature_at_its_row_length():
  example = {"a": np.arange(25, dtype=np.int32), "b": np.arange(4, dtype=np.int32)}
  rows = run(
    elements_dataset([example]).pack({"a": 10, "b": 3}, num_packing_bins=1, overflow="split")
  )
  assert [r["a"][r["a_segment_ids"] > 0].tolist() for r in rows] == [
    list(range(10)),
    list(range(10, 20)),
    list(range(20, 25)),
  ]
  assert [r["b"][r["b_segment_ids"] > 0].tolist() for r in rows] == [[0, 1, 2], [3], []]


def test_truncate_keeps_the_first_row_length_tokens():
  examples = [{"t": np.arange(n, dtype=np.int32)} for n in (3, 12, 7)]
  rows = run(elements_dataset(examples).pack({"t": 8}, num_packing_bins=3, overflow="truncate"))
  assert sorted(tuple(s.tolist()) for s in unpack(rows, "t")) == sorted(
    [tuple(range(3)), tuple(range(8)), tuple(range(7))]
  )


def test_the_default_overflow_is_an_error_that_names_the_options():
  with pytest.raises(ValueError, match="overflow='truncate' or overflow='split'"):
    run(elements_dataset([{"t": np.arange(9)}]).pack({"t": 8}, num_packing_bins=1))


@pytest.mark.parametrize("bins", [1, 3])
def test_split_resumes_exactly_at_every_cut(bins):
  rng = np.random.default_rng(9)
  examples = [
    {"t": np.arange(n, dtype=np.int32) + 100 * i} for i, n in enumerate(rng.integers(1, 60, 25))
  ]
  check_resume(
    lambda: elements_dataset(examples).pack({"t": 16}, num_packing_bins=bins, overflow="split"),
    with_seeds=True,
  )
