"""NumPy and Parquet rows as tf.train.Examples: the records are the bytes
`make_example` makes of each row, and what no Example holds is refused."""

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import jaxfeed
from jaxfeed import tables


def test_numpy_rows_are_the_examples_make_example_makes(tmp_path):
  rng = np.random.default_rng(0)
  columns = {
    "i": rng.integers(-9, 9, 70).astype(np.int8),
    "u": np.arange(70, dtype=np.uint32),
    "b": rng.random(70) > 0.5,
    "f": rng.random(70),  # float64: rounds to float32
    "m": rng.random((70, 2, 3)).astype(np.float32),
    "s": np.array([b"x\0y"] * 70),
    "t": np.array(["ü%d" % i for i in range(70)]),
  }
  np.savez(tmp_path / "t.npz", **columns)
  source = tables.TableSource([str(tmp_path / "t.npz")] * 2, "numpy")
  assert len(source) == 140
  expected = [jaxfeed.make_example({k: v[i] for k, v in columns.items()}) for i in range(70)]
  assert list(source.records(0, 140)) == expected * 2
  assert source.get_many([139, 3]) == [expected[69], expected[3]]
  assert source[70] == expected[0]


def test_parquet_rows_are_the_examples_make_example_makes(tmp_path):
  table = pa.table(
    {
      "i": pa.array([1, None, 3], pa.int32()),
      "b": pa.array([True, False, None]),
      "f": pa.array([0.1, 0.2, 0.3], pa.float64()),
      "l": pa.array([[1.5], [], None], pa.list_(pa.float32())),
      "s": pa.array(["a", "ü", None]),
      "y": pa.array([b"\0", None, b"z"], pa.binary()),
      "ls": pa.array([["a", "b"], None, []], pa.list_(pa.string())),
    }
  )
  pq.write_table(table, tmp_path / "t.parquet", row_group_size=2)
  rows = table.to_pylist()
  expected = [
    jaxfeed.make_example(
      {
        k: (np.array(v, np.float32) if k == "l" else np.array(v, object) if k == "ls" else v)
        for k, v in row.items()
        if v is not None
      }
    )
    for row in rows
  ]
  source = tables.TableSource([str(tmp_path / "t.parquet")], "parquet")
  assert list(source.records(0, 3)) == expected
  assert list(source.records(1, 3)) == expected[1:]  # from the middle of a row group


@pytest.mark.parametrize("kind", ["numpy", "parquet"])
def test_columns_no_example_holds_are_refused_by_name(tmp_path, kind):
  if kind == "numpy":
    path = tmp_path / "t.npz"
    np.savez(path, ok=np.arange(2), when=np.array(["2020-01-01"] * 2, "datetime64[D]"))
  else:
    path = tmp_path / "t.parquet"
    pq.write_table(pa.table({"ok": [1, 2], "when": pa.array([{"a": 1}, {"a": 2}])}), path)
  with pytest.raises(ValueError, match="t.(npz|parquet): column 'when' holds"):
    list(tables.TableSource([str(path)], kind).records(0, 2))


def test_a_table_is_written_back_from_examples(tmp_path):
  records = [jaxfeed.make_example({"x": [i, i + 1], "s": b"r%d" % i}) for i in range(5)]
  assert tables.write_numpy(str(tmp_path / "t.npz"), iter(records)) == 5
  with np.load(tmp_path / "t.npz") as back:
    np.testing.assert_array_equal(back["x"], [[i, i + 1] for i in range(5)])
    assert back["s"].tolist() == [b"r%d" % i for i in range(5)]
  with pytest.raises(ValueError, match="holds one feature.*'s', 'x'"):
    tables.write_numpy(str(tmp_path / "t.npy"), iter(records))
  with pytest.raises(ValueError, match="feature 's' is missing from record 1"):
    tables.write_numpy(str(tmp_path / "m.npz"), iter([records[0], jaxfeed.make_example({"x": 1})]))
