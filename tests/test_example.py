"""jaxfeed.example against TensorFlow's own tf.train.Example parsing."""

import os
import subprocess
import sys

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import tensorflow as tf  # pylint: disable=g-import-not-at-top

from jaxfeed import example as jex  # pylint: disable=g-import-not-at-top
from jaxfeed.protos import generate  # pylint: disable=g-import-not-at-top


def tf_example(**features) -> bytes:
  def feature(v):
    if isinstance(v, bytes):
      v = [v]
    if isinstance(v, list) and v and isinstance(v[0], bytes):
      return tf.train.Feature(bytes_list=tf.train.BytesList(value=v))
    v = np.atleast_1d(np.asarray(v))
    if v.dtype.kind == "f":
      return tf.train.Feature(float_list=tf.train.FloatList(value=v))
    return tf.train.Feature(int64_list=tf.train.Int64List(value=v))

  return tf.train.Example(
    features=tf.train.Features(feature={k: feature(v) for k, v in features.items()})
  ).SerializeToString()


def tf_specs(specs):
  out = {}
  for key, spec in specs.items():
    dtype = {
      np.dtype(np.int64): tf.int64,
      np.dtype(np.float32): tf.float32,
      np.dtype(object): tf.string,
    }[spec.dtype]
    if isinstance(spec, jex.VarLenFeature):
      out[key] = tf.io.VarLenFeature(dtype)
    else:
      out[key] = tf.io.FixedLenFeature(spec.shape, dtype, spec.default_value)
  return out


def assert_same(ours, theirs):
  assert set(ours) == set(theirs)
  for key, want in theirs.items():
    got = ours[key]
    if isinstance(want, tf.SparseTensor):
      assert isinstance(got, jex.SparseArray), key
      np.testing.assert_array_equal(got.indices, want.indices.numpy())
      np.testing.assert_array_equal(got.dense_shape, want.dense_shape.numpy())
      want_values = want.values.numpy()
      assert got.values.dtype == want_values.dtype, key
      np.testing.assert_array_equal(got.values, want_values)
    else:
      want = want.numpy()
      if isinstance(want, bytes):  # TensorFlow gives a bare scalar string
        want = np.array(want, object)
      assert got.dtype == want.dtype and got.shape == want.shape, key
      np.testing.assert_array_equal(got, want)


SPECS = {
  "label": jex.FixedLenFeature([], np.int64),
  "pixels": jex.FixedLenFeature([2, 3], np.float32),
  "name": jex.FixedLenFeature([], "string", default_value=b"none"),
  "weight": jex.FixedLenFeature([2], np.float32, default_value=[0.5, -1.0]),
  "tags": jex.VarLenFeature(bytes),
  "ids": jex.VarLenFeature(np.int64),
  "scores": jex.VarLenFeature(np.float32),
}

RECORDS = [
  tf_example(
    label=3,
    pixels=np.arange(6, dtype=np.float32) / 7,
    name=b"cat",
    weight=[1.5, 2.5],
    tags=[b"a", b"bb"],
    ids=[1, -(2**62), 3],
    scores=[0.1],
  ),
  tf_example(
    label=-7, pixels=np.full(6, 1e30, np.float32), tags=[b"\x00\xff"], ids=np.array([], np.int64)
  ),
  tf_example(label=2**40, pixels=np.zeros(6, np.float32), name=b"", scores=[1.0, 2.0, 3.0, 4.0]),
]


def test_parse_single_example_matches_tensorflow():
  for record in RECORDS:
    assert_same(
      jex.parse_single_example(record, SPECS), tf.io.parse_single_example(record, tf_specs(SPECS))
    )


def test_parse_example_batch_matches_tensorflow():
  assert_same(jex.parse_example(RECORDS, SPECS), tf.io.parse_example(RECORDS, tf_specs(SPECS)))
  objects = np.array(RECORDS, dtype=object)
  assert_same(jex.parse_example(objects, SPECS), tf.io.parse_example(RECORDS, tf_specs(SPECS)))


def test_empty_batch_has_batch_dimension_zero():
  out = jex.parse_example([], SPECS)
  assert out["pixels"].shape == (0, 2, 3) and out["pixels"].dtype == np.float32
  assert out["tags"].indices.shape == (0, 2)
  np.testing.assert_array_equal(out["tags"].dense_shape, [0, 0])


def test_sparse_row_lengths():
  out = jex.parse_example(RECORDS, {"scores": jex.VarLenFeature(np.float32)})
  np.testing.assert_array_equal(out["scores"].row_lengths(), [1, 0, 4])
  single = jex.parse_single_example(RECORDS[2], SPECS)["scores"]
  np.testing.assert_array_equal(single.row_lengths(), [4])


def test_make_example_bytes_parse_in_tensorflow():
  record = jex.make_example(
    {
      "label": 5,
      "flag": True,
      "pixels": np.arange(6).reshape(2, 3) * 0.25,
      "name": "héllo",
      "tags": [b"x", "y"],
      "ids": np.array([7, 8], np.uint8),
      "empty": np.array([], np.float32),
    }
  )
  specs = {
    "label": jex.FixedLenFeature([], np.int64),
    "flag": jex.FixedLenFeature([], np.int64),
    "pixels": jex.FixedLenFeature([2, 3], np.float32),
    "name": jex.FixedLenFeature([], bytes),
    "tags": jex.VarLenFeature(bytes),
    "ids": jex.FixedLenFeature([2], np.int64),
    "empty": jex.VarLenFeature(np.float32),
  }
  theirs = tf.io.parse_single_example(record, tf_specs(specs))
  assert theirs["name"].numpy() == "héllo".encode()
  assert_same(jex.parse_single_example(record, specs), theirs)
  # And TensorFlow's message reads the same bytes back.
  parsed = tf.train.Example.FromString(record)
  assert list(parsed.features.feature["ids"].int64_list.value) == [7, 8]


def test_make_example_refuses_untyped_empty_and_unknown_values():
  with pytest.raises(ValueError, match="'e'.*typed empty array"):
    jex.make_example({"e": []})
  with pytest.raises(TypeError, match="'d'.*allowed are ints"):
    jex.make_example({"d": {"nested": 1}})


def test_sequence_example_matches_tensorflow():
  record = jex.make_sequence_example(
    context={"length": 3, "title": b"t"},
    feature_lists={
      "tokens": [[1, 2], [3, 4], [5, 6]],
      "words": [[b"a"], np.array([], object), [b"b", b"c"]],
    },
  )
  context_specs = {
    "length": jex.FixedLenFeature([], np.int64),
    "title": jex.VarLenFeature(bytes),
    "missing": jex.FixedLenFeature([], np.float32, 1.5),
  }
  sequence_specs = {
    "tokens": jex.FixedLenSequenceFeature([2], np.int64),
    "words": jex.VarLenFeature(bytes),
    "absent": jex.FixedLenSequenceFeature([], np.float32, allow_missing=True),
  }
  context, sequences = jex.parse_single_sequence_example(record, context_specs, sequence_specs)
  tf_context, tf_sequences = tf.io.parse_single_sequence_example(
    record,
    tf_specs(context_specs),
    {
      "tokens": tf.io.FixedLenSequenceFeature([2], tf.int64),
      "words": tf.io.VarLenFeature(tf.string),
      "absent": tf.io.FixedLenSequenceFeature([], tf.float32, allow_missing=True),
    },
  )
  assert_same(context, tf_context)
  assert_same(sequences, tf_sequences)
  with pytest.raises(ValueError, match="'absent'.*required.*allow_missing"):
    jex.parse_single_sequence_example(
      record, {}, {"absent": jex.FixedLenSequenceFeature([], np.float32)}
    )


def test_missing_required_feature_is_named():
  record = tf_example(other=1)
  spec = {"label": jex.FixedLenFeature([], np.int64)}
  with pytest.raises(ValueError, match=r"'label' \(int64\) is required"):
    jex.parse_single_example(record, spec)
  with pytest.raises(ValueError, match="'label'.*record 1 of the batch"):
    jex.parse_example([tf_example(label=1), record], spec)


def test_wrong_type_is_named():
  with pytest.raises(ValueError, match="'label'.*float32 values.*asks for int64"):
    jex.parse_single_example(tf_example(label=1.5), {"label": jex.FixedLenFeature([], np.int64)})
  with pytest.raises(ValueError, match="'x'.*int64 values.*asks for bytes"):
    jex.parse_single_example(tf_example(x=[1]), {"x": jex.VarLenFeature(bytes)})


def test_wrong_length_is_named():
  with pytest.raises(
    ValueError,
    match=r"'p' in record 0.*has 2 values.*"
    r"shape \(3,\) needs 3",
  ):
    jex.parse_example([tf_example(p=[1.0, 2.0])], {"p": jex.FixedLenFeature([3], np.float32)})


def test_bytes_that_are_not_an_example_are_refused():
  with pytest.raises(ValueError, match="record 1 of the batch.*Example"):
    jex.parse_example([RECORDS[0], b"\xff\xff\xff"], {"label": jex.FixedLenFeature([], np.int64)})


def test_specs_are_validated_at_construction():
  with pytest.raises(TypeError, match="dtype must be int64, float32 or bytes"):
    jex.FixedLenFeature([], np.int32)
  with pytest.raises(ValueError, match=r"default_value of shape \(3,\).*\(2,\)"):
    jex.FixedLenFeature([2], np.float32, default_value=[1.0, 2.0, 3.0])
  with pytest.raises(ValueError, match=">= 0"):
    jex.FixedLenFeature([-1], np.int64)
  with pytest.raises(TypeError, match="'a'.*allowed are FixedLenFeature"):
    jex.parse_example([], {"a": jex.FixedLenSequenceFeature([], np.int64)})
  assert jex.FixedLenFeature([2], tf.string).dtype == object


def test_public_names_are_exported():
  import jaxfeed  # pylint: disable=g-import-not-at-top

  assert jaxfeed.parse_example is jex.parse_example
  assert jaxfeed.VarLenFeature is jex.VarLenFeature


def test_generated_proto_is_up_to_date(tmp_path):
  subprocess.run(
    [sys.executable, "-m", "jaxfeed.protos.generate", str(tmp_path)],
    check=True,
    timeout=60,
    capture_output=True,
    cwd=generate.ROOT,
  )
  for name in generate.PROTO_FILES:
    module = name[: -len(".proto")] + "_pb2.py"
    assert (tmp_path / module).read_text() == (generate.PROTO_DIR / module).read_text(), (
      f"{module} is stale: run python -m jaxfeed.protos.generate"
    )
