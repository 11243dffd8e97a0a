"""NumPy and Parquet tables as records of tf.train.Example, for `jaxfeed convert`.

A table's row is one record: a tf.train.Example with a feature per column,
the bytes `jaxfeed.make_example` makes of the row, so every record file
jaxfeed reads holds the same records whatever it was converted from.

  * `.npz`: one column per key; every array's leading axis is the row, so all
    keys need the same length. `.npy`: one array, its column named "array".
    Files are read without pickle: object arrays are refused.
  * `.parquet`: one column per Parquet column (`pip install
    'jaxfeed[parquet]'`). A null leaves the feature out of that record.

Values become what tf.train.Example holds: ints and bools int64, floats
float32, strings and binary bytes; a row's value of any shape is flattened.
Written back, a feature with one value in every record that has it becomes a
column of scalars, else of rows (`.npz`: a 2-D array, which needs the same
number of values in every record; Parquet: a list column, where records may
differ and a missing feature is a null). Bytes go to `.npz` as NumPy 'S' arrays, which
drop trailing NUL bytes, so such values are refused there.
"""

from __future__ import annotations

import os
from typing import Any, Iterator, Sequence

import numpy as np

from jaxfeed.protos import example_pb2

NUMPY_FORMAT, PARQUET_FORMAT = "numpy", "parquet"
NPY_COLUMN = "array"
# Rows turned into records at a time (a Parquet batch, a NumPy slice).
_CHUNK_ROWS = 1024


def _pyarrow() -> tuple[Any, Any]:
  try:
    import pyarrow  # pylint: disable=g-import-not-at-top
    import pyarrow.parquet  # pylint: disable=g-import-not-at-top
  except ImportError:
    raise ImportError("Parquet files need pyarrow: pip install 'jaxfeed[parquet]'.") from None
  return pyarrow, pyarrow.parquet


class _NumpyFile:
  """The columns of one .npy / .npz file (loaded on first use)."""

  def __init__(self, path: str):
    self.path = path
    try:
      loaded = np.load(path, mmap_mode="r", allow_pickle=False)
      if isinstance(loaded, np.ndarray):
        self.columns = {NPY_COLUMN: loaded}
      else:
        with loaded:
          self.columns = {key: loaded[key] for key in loaded.files}
    except ValueError as e:  # object arrays need pickle, which is refused
      raise ValueError(
        f"{path}: cannot read it without pickle ({e}); store numbers, bools or fixed-width strings."
      ) from None
    except OSError as e:
      raise ValueError(f"{path}: not a NumPy .npy/.npz file: {e}") from None
    lengths = {key: (value.shape[0] if value.ndim else None) for key, value in self.columns.items()}
    if not lengths or None in lengths.values() or len(set(lengths.values())) > 1:
      raise ValueError(
        f"{path}: every array needs the same leading (row) axis; got shapes "
        f"{ {k: v.shape for k, v in self.columns.items()} }."
      )
    self.num_rows = next(iter(lengths.values()))

  def records(self, start: int, stop: int) -> Iterator[bytes]:
    for first in range(start, stop, _CHUNK_ROWS):
      last = min(stop, first + _CHUNK_ROWS)
      yield from _examples(
        [
          _numpy_column(self.path, key, np.asarray(value[first:last]))
          for key, value in self.columns.items()
        ],
        last - first,
      )


def _examples(columns: list[tuple[str, str, list]], rows: int) -> Iterator[bytes]:
  """Serialized tf.train.Examples of `rows` rows, from (feature name, the
  Feature's list field, [a row's list of values, or None]) per column.

  Columns are turned into Python lists in one step each (`tolist`), so a
  row costs a few protobuf calls: several times faster than `make_example`
  on each row's values.
  """
  for i in range(rows):
    record = example_pb2.Example()
    fmap = record.features.feature
    for name, kind, values in columns:
      row = values[i]
      if row is not None:
        field = getattr(fmap[name], kind)
        field.SetInParent()  # an empty list is still a list of its type
        try:
          field.value.extend(row)
        except TypeError:  # a null inside a row's list
          raise ValueError(
            f"column {name!r}: row {i} of a chunk holds {row!r}; "
            "a tf.train.Example's lists hold no nulls."
          ) from None
    yield record.SerializeToString()


def _unsupported(path: str, name: str, what: Any) -> ValueError:
  return ValueError(
    f"{path}: column {name!r} holds {what}; a tf.train.Example "
    "holds ints, bools, floats, strings or bytes."
  )


def _numpy_column(path: str, name: str, chunk: np.ndarray) -> tuple[str, str, list]:
  """(name, list field, rows' values) of rows of one array."""
  flat = chunk.reshape(len(chunk), -1)
  kind = chunk.dtype.kind
  if kind in "biu":
    if kind == "u" and flat.size and flat.max() > np.iinfo(np.int64).max:
      raise ValueError(f"{path}: column {name!r} has values above the int64 range.")
    return name, "int64_list", flat.astype(np.int64).tolist()
  if kind == "f":
    return name, "float_list", flat.astype(np.float32).tolist()
  if kind == "S":
    return name, "bytes_list", flat.tolist()
  if kind == "U":
    return name, "bytes_list", [[v.encode() for v in row] for row in flat.tolist()]
  raise _unsupported(path, name, f"{chunk.dtype} values")


class _ParquetFile:
  """The rows of one Parquet file, read a row group at a time."""

  def __init__(self, path: str):
    self.path = path
    _, parquet = _pyarrow()
    try:
      self._file = parquet.ParquetFile(path)
    except Exception as e:  # noqa: BLE001 -- pyarrow raises several kinds
      raise ValueError(f"{path}: not a Parquet file: {e}") from None
    meta = self._file.metadata
    self.num_rows = meta.num_rows
    self._group_starts = np.cumsum(
      [0] + [meta.row_group(g).num_rows for g in range(meta.num_row_groups)]
    )

  def records(self, start: int, stop: int) -> Iterator[bytes]:
    first_group = int(np.searchsorted(self._group_starts, start, side="right")) - 1
    for group in range(max(first_group, 0), len(self._group_starts) - 1):
      offset = int(self._group_starts[group])
      if offset >= stop:
        return
      table = self._file.read_row_group(group)
      table = table.slice(max(start - offset, 0), stop - max(start, offset))
      for batch in table.to_batches(_CHUNK_ROWS):
        yield from _examples(
          [
            _arrow_column(self.path, field.name, batch.column(i))
            for i, field in enumerate(batch.schema)
          ],
          batch.num_rows,
        )


def _arrow_column(path: str, name: str, column: Any) -> tuple[str, str, list]:
  """(name, list field, rows' values or None for a null) of a Parquet column."""
  pyarrow, _ = _pyarrow()
  types = pyarrow.types
  is_list = (
    types.is_list(column.type)
    or types.is_large_list(column.type)
    or types.is_fixed_size_list(column.type)
  )
  item = column.type.value_type if is_list else column.type
  if types.is_integer(item) or types.is_boolean(item):
    kind, target = "int64_list", pyarrow.int64()
  elif types.is_floating(item):
    kind, target = "float_list", pyarrow.float32()
  elif (
    types.is_string(item)
    or types.is_large_string(item)
    or types.is_binary(item)
    or types.is_large_binary(item)
    or types.is_fixed_size_binary(item)
  ):
    kind, target = "bytes_list", None
  else:
    raise _unsupported(path, name, f"Parquet type {column.type}")
  if target is not None:
    try:
      column = column.cast(
        pyarrow.list_(target) if is_list else target, safe=kind == "int64_list"
      )  # floats round to float32
    except pyarrow.ArrowInvalid as e:
      raise ValueError(f"{path}: column {name!r}: {e}") from None
  values = column.to_pylist()
  if types.is_string(item) or types.is_large_string(item):
    values = [
      None if v is None else [s and s.encode() for s in v] if is_list else v.encode()
      for v in values
    ]
  if not is_list:
    values = [None if v is None else [v] for v in values]
  return name, kind, values


class TableSource:
  """The rows of NumPy or Parquet files, in order, as serialized Examples.

  `len(source)`, `source[i]` and `source.get_many(indices)` as for record
  sources, plus `records(start, stop)` that streams a range.
  """

  def __init__(self, paths: Sequence[str], fmt: str):
    if fmt not in (NUMPY_FORMAT, PARQUET_FORMAT):
      raise ValueError(
        f"TableSource: format must be {NUMPY_FORMAT!r} or {PARQUET_FORMAT!r}, got {fmt!r}."
      )
    opener = _NumpyFile if fmt == NUMPY_FORMAT else _ParquetFile
    self._files = [opener(os.fspath(p)) for p in paths]
    self._starts = np.cumsum([0] + [f.num_rows for f in self._files])

  def __len__(self) -> int:
    return int(self._starts[-1])

  def records(self, start: int, stop: int) -> Iterator[bytes]:
    """Records start..stop-1, streamed."""
    for file, offset in zip(self._files, self._starts[:-1]):
      offset = int(offset)
      lo, hi = max(start - offset, 0), min(stop - offset, file.num_rows)
      if lo < hi:
        yield from file.records(lo, hi)

  def get_many(self, indices: Sequence[int]) -> list[bytes]:
    indices = np.asarray(indices, np.int64)
    if not indices.size:
      return []
    if indices.min() < 0 or indices.max() >= len(self):
      raise IndexError(
        f"TableSource: indices must be in [0, {len(self)}), got {indices.min()}..{indices.max()}."
      )
    lo = int(indices.min())
    span = list(self.records(lo, int(indices.max()) + 1))
    return [span[i - lo] for i in indices.tolist()]

  def __getitem__(self, index: int) -> bytes:
    return self.get_many([index])[0]


# -- writing -----------------------------------------------------------------


def _columns(records: Iterator[bytes], path: str) -> tuple[int, dict[str, list]]:
  """(rows, name -> (kind, [values per row or None])) of serialized Examples."""
  columns: dict[str, tuple[str, list]] = {}
  rows = 0
  for rows, record in enumerate(records, start=1):
    try:
      features = example_pb2.Example.FromString(record).features.feature
    except Exception as e:  # noqa: BLE001 -- DecodeError and friends
      raise ValueError(
        f"{path}: record {rows - 1} is not a tf.train.Example ({e}); "
        "only Examples convert to tables."
      ) from None
    for name, feature in features.items():
      kind = feature.WhichOneof("kind")
      if kind is None:
        continue
      if name not in columns:
        columns[name] = (kind, [None] * (rows - 1))
      elif columns[name][0] != kind:
        raise ValueError(
          f"{path}: feature {name!r} is {columns[name][0]} in earlier "
          f"records and {kind} in record {rows - 1}."
        )
      columns[name][1].append(list(getattr(feature, kind).value))
    for _, values in columns.values():
      if len(values) < rows:
        values.append(None)
  return rows, columns


_NUMPY_DTYPES = {"int64_list": np.int64, "float_list": np.float32, "bytes_list": np.bytes_}


def write_numpy(path: str, records: Iterator[bytes], *, single_array: bool | None = None) -> int:
  """Writes Examples as an .npz (a key per feature) or an .npy (one feature).

  single_array: write an .npy; None: when `path` ends with .npy.
  """
  if single_array is None:
    single_array = path.endswith(".npy")
  rows, columns = _columns(records, path)
  arrays = {}
  for name, (kind, values) in sorted(columns.items()):
    if any(v is None for v in values):
      missing = next(i for i, v in enumerate(values) if v is None)
      raise ValueError(
        f"{path}: feature {name!r} is missing from record {missing}; "
        "NumPy arrays need it in every record (Parquet allows nulls)."
      )
    sizes = {len(v) for v in values}
    if len(sizes) > 1:
      raise ValueError(
        f"{path}: feature {name!r} has {sorted(sizes)} values in "
        "different records; NumPy arrays need the same number in each."
      )
    if kind == "bytes_list" and any(b.endswith(b"\0") for v in values for b in v):
      raise ValueError(
        f"{path}: feature {name!r} has bytes ending in NUL, which "
        "NumPy 'S' arrays drop; convert to TFRecord, ArrayRecord or Parquet."
      )
    array = np.array(values, _NUMPY_DTYPES[kind]).reshape(rows, *sizes - {1})
    arrays[name] = array
  with open(path, "wb") as f:
    if single_array:
      if len(arrays) != 1:
        raise ValueError(
          f"{path}: an .npy file holds one feature, the records have "
          f"{sorted(arrays)}; write an .npz."
        )
      np.save(f, next(iter(arrays.values())), allow_pickle=False)
    else:
      np.savez(f, **arrays)
  return rows


def write_parquet(path: str, records: Iterator[bytes]) -> int:
  """Writes Examples as a Parquet file, a column per feature."""
  pyarrow, parquet = _pyarrow()
  types = {
    "int64_list": pyarrow.int64(),
    "float_list": pyarrow.float32(),
    "bytes_list": pyarrow.binary(),
  }
  rows, columns = _columns(records, path)
  arrays = {}
  for name, (kind, values) in sorted(columns.items()):
    if all(v is None or len(v) == 1 for v in values):
      arrays[name] = pyarrow.array([v and v[0] for v in values], types[kind])
    else:
      arrays[name] = pyarrow.array(values, pyarrow.list_(types[kind]))
  parquet.write_table(
    pyarrow.table(arrays) if arrays else pyarrow.table({}).append_column("_", pyarrow.nulls(rows)),
    path,
  )
  return rows
