"""`bucket_by_sequence_length`: tf.data's batches, errors and exact resume."""

import numpy as np
import pytest

from jaxfeed.dataset import Dataset
import op_testing
from op_testing import assert_same_stream, check_resume, run

tf = op_testing.import_tensorflow()

RNG = np.random.default_rng(11)
LENGTHS = np.clip(RNG.lognormal(2.0, 0.7, 120), 1, 40).astype(int)
SEQUENCES = [np.arange(1, n + 1, dtype=np.int32) for n in LENGTHS]


def ours(sequences=SEQUENCES, **kwargs):
  return op_testing.elements_dataset(sequences).bucket_by_sequence_length(
    lambda x: x.shape[0], **kwargs
  )


def theirs(sequences=SEQUENCES, **kwargs):
  ds = op_testing.tf_elements_dataset(sequences, example=SEQUENCES[0])
  return ds.bucket_by_sequence_length(lambda x: tf.shape(x)[0], **kwargs)


@pytest.mark.parametrize(
  "kwargs",
  [
    {"bucket_boundaries": [8, 16, 32], "bucket_batch_sizes": [8, 6, 4, 2]},
    {
      "bucket_boundaries": [8, 16, 41],
      "bucket_batch_sizes": [8, 6, 4, 2],
      "pad_to_bucket_boundary": True,
    },
    {"bucket_boundaries": [5, 10], "bucket_batch_sizes": [7, 5, 3], "drop_remainder": True},
    {
      "bucket_boundaries": [5, 10],
      "bucket_batch_sizes": [7, 5, 3],
      "padding_values": np.int32(-1),
      "padded_shapes": [None],
    },
    {
      "bucket_boundaries": [5, 10, 50],
      "bucket_batch_sizes": [7, 5, 3, 1],
      "pad_to_bucket_boundary": True,
      "drop_remainder": True,
    },
    {"bucket_boundaries": [3], "bucket_batch_sizes": [200, 200]},
  ],
)
def test_matches_tf_data(kwargs):
  assert_same_stream(run(ours(**kwargs)), theirs(**kwargs).as_numpy_iterator())


def test_full_buckets_come_out_at_once_and_partial_ones_at_the_end_in_order():
  lengths = [1, 5, 1, 5, 5, 9, 1]
  seqs = [np.ones(n, np.int32) for n in lengths]
  out = run(ours(seqs, bucket_boundaries=[3, 7], bucket_batch_sizes=[2, 3, 2]))
  assert [b.shape for b in out] == [(2, 1), (3, 5), (1, 1), (1, 9)]


def test_pad_to_bucket_boundary_pads_to_boundary_minus_one():
  out = run(
    ours(
      bucket_boundaries=[8, 16, 41], bucket_batch_sizes=[4, 4, 4, 4], pad_to_bucket_boundary=True
    )
  )
  assert {b.shape[1] for b in out} <= {7, 15, 40}


def test_no_padding_stacks_equal_shapes():
  ds = (
    Dataset.range(10)
    .map(lambda x: np.full(3, x))
    .bucket_by_sequence_length(lambda x: int(x[0]) % 4, [2], [3, 2], no_padding=True)
  )
  assert [b[:, 0].tolist() for b in run(ds)] == [[2, 3], [0, 1, 4], [6, 7], [5, 8, 9]]


def test_tuple_elements_are_unpacked_into_the_length_function():
  pairs = [(s, np.int32(i)) for i, s in enumerate(SEQUENCES[:20])]
  ds = (
    Dataset.range(20)
    .map(lambda i: pairs[int(i)])
    .bucket_by_sequence_length(lambda s, i: s.shape[0], [6], [3, 3])
  )
  out = run(ds)
  assert sum(len(b[1]) for b in out) == 20
  assert all(isinstance(b, tuple) and b[0].ndim == 2 for b in out)


@pytest.mark.parametrize(
  "bad_length,error,match",
  [
    (2.5, TypeError, r"bucket_by_sequence_length.*integer.*2\.5"),
    ("3", TypeError, r"bucket_by_sequence_length.*integer.*'3'"),
    (np.array([1, 2]), TypeError, "bucket_by_sequence_length.*integer"),
    (-4, ValueError, r"bucket_by_sequence_length.*negative length -4"),
  ],
)
def test_length_function_must_return_a_non_negative_integer(bad_length, error, match):
  ds = Dataset.range(3).bucket_by_sequence_length(lambda x: bad_length, [2], [1, 1])
  with ds.make_iterator() as it:
    with pytest.raises(error, match=match):
      next(it)


def test_numpy_integer_lengths_are_accepted():
  ds = Dataset.range(4).bucket_by_sequence_length(
    lambda x: np.array(x, np.int32), [2], [2, 2], no_padding=True
  )
  assert [b.tolist() for b in run(ds)] == [[0, 1], [2, 3]]


@pytest.mark.parametrize(
  "boundaries,sizes,error,match",
  [
    ([4, 4], [1, 1, 1], ValueError, "strictly increasing"),
    ([8, 4], [1, 1, 1], ValueError, "strictly increasing"),
    ([4, 8], [1, 1], ValueError, r"len\(bucket_batch_sizes\).*3.*2"),
    ([4], [1, 0], ValueError, "batch size"),
    ([0, 4], [1, 1, 1], ValueError, "boundary"),
    (4, [1, 1], TypeError, "bucket_boundaries"),
  ],
)
def test_invalid_buckets_are_rejected(boundaries, sizes, error, match):
  with pytest.raises(error, match=f"bucket_by_sequence_length.*{match}"):
    Dataset.range(3).bucket_by_sequence_length(len, boundaries, sizes)


def test_pad_to_bucket_boundary_refuses_elements_past_the_last_boundary():
  ds = ours(bucket_boundaries=[4, 8], bucket_batch_sizes=[2, 2, 2], pad_to_bucket_boundary=True)
  with ds.make_iterator() as it:
    with pytest.raises(
      ValueError,
      match=r"bucket_by_sequence_length.*< max"
      r"\(bucket_boundaries\) = 8.*length",
    ):
      list(it)


@pytest.mark.parametrize(
  "kwargs",
  [
    {"bucket_boundaries": [4, 9], "bucket_batch_sizes": [3, 2, 4]},
    {
      "bucket_boundaries": [4, 9, 41],
      "bucket_batch_sizes": [3, 2, 4, 2],
      "pad_to_bucket_boundary": True,
      "drop_remainder": True,
    },
  ],
)
def test_resume_at_every_cut_is_exact_including_the_final_flush(kwargs):
  check_resume(lambda: ours(SEQUENCES[:40], **kwargs))


def test_resume_under_a_shuffled_input_is_exact():
  check_resume(
    lambda: (
      Dataset.range(60)
      .shuffle(16, seed=2)
      .map(lambda i: SEQUENCES[int(i)])
      .bucket_by_sequence_length(lambda x: x.shape[0], [5, 10], [4, 3, 2])
    ),
    cuts=[0, 3, 8, 15, 22],
  )


def test_state_holds_counts_not_elements():
  with ours(bucket_boundaries=[8, 16], bucket_batch_sizes=[32, 32, 32]).make_iterator() as it:
    next(it)
    state = it.get_state()
  own = state["own"]
  assert sum(own["pending"]) > 10
  assert len(str(state)) < 1500


def test_spec_params_rebuild_an_equal_node():
  node = ours(
    bucket_boundaries=[4, 9, 41], bucket_batch_sizes=[3, 2, 4, 2], pad_to_bucket_boundary=True
  ).node
  rebuilt = type(node)(*node.parents, **node.spec_params())
  assert rebuilt.fingerprint() == node.fingerprint()
  assert_same_stream(run(Dataset(rebuilt)), run(Dataset(node)))
