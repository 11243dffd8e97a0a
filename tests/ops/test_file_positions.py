"""Files as positions: `from_tfrecord`'s index addressing, `reads_files`,
`over_positions` (the service's FILE sharding) and the SHARD_HINT placeholder."""

from __future__ import annotations

import numpy as np
import pytest

import jaxfeed
from jaxfeed.ops import index_ranges
from jaxfeed.ops.shard import SHARD_HINT, has_shard_hint

Dataset = jaxfeed.Dataset


def write_files(tmp_path, sizes=(2, 3, 1, 4)) -> list[str]:
  paths = []
  for f, size in enumerate(sizes):
    path = str(tmp_path / f"{f}.tfrecord")
    jaxfeed.write_tfrecord(path, [f"{f}-{r}".encode() for r in range(size)])
    paths.append(path)
  return paths


def by_file(records) -> list[str]:
  return [r.decode() for r in records]


def test_a_tfrecord_files_position_is_a_file(tmp_path):
  node = Dataset.from_tfrecord(write_files(tmp_path)).node
  assert index_ranges.split_input(node) is node and index_ranges.num_positions(node) == 4
  with index_ranges.range_iterator(node, 1, 3) as iterator:
    assert by_file(iterator) == ["1-0", "1-1", "1-2", "2-0"]


def test_a_file_range_iterator_restores_inside_its_range_only(tmp_path):
  node = Dataset.from_tfrecord(write_files(tmp_path)).node
  with index_ranges.range_iterator(node, 1, 3) as iterator:
    next(iterator), next(iterator)
    state = iterator.get_state()
  with index_ranges.range_iterator(node, 1, 3) as iterator:
    iterator.set_state(state)
    assert by_file(iterator) == ["1-2", "2-0"]
  with index_ranges.range_iterator(node, 2, 3) as iterator:
    with pytest.raises(jaxfeed.PipelineStateError, match="'file' in \\[2, 3\\]"):
      iterator.set_state(state)


def test_reads_files_through_from_tfrecord_or_an_interleave_of_names(tmp_path):
  paths = write_files(tmp_path)
  assert index_ranges.reads_files(Dataset.from_tfrecord(paths).batch(2).node)
  names = Dataset.from_tensor_slices(np.array([p.encode() for p in paths]))
  interleaved = names.interleave(lambda p: Dataset.from_tfrecord(p.decode()))
  assert index_ranges.reads_files(interleaved.node)
  assert not index_ranges.reads_files(names.node)  # names, not files read
  assert not index_ranges.reads_files(Dataset.range(4).node)
  assert not index_ranges.reads_files(Dataset.from_generator(lambda: iter([1])).node)


@pytest.mark.parametrize("index, files", [(0, [0, 2]), (1, [1, 3])])
def test_over_positions_reads_every_nth_file(tmp_path, index, files):
  node = Dataset.from_tfrecord(write_files(tmp_path)).node
  got = by_file(Dataset(index_ranges.over_positions(node, index, 2)))
  assert sorted({int(r.split("-")[0]) for r in got}) == files
  assert by_file(Dataset(index_ranges.over_positions(node, 5, 8))) == []  # no file of its own


def test_shard_hint_is_a_placeholder_found_in_the_graph():
  hinted = Dataset.range(4).shard(SHARD_HINT, SHARD_HINT).map(lambda x: x)
  assert has_shard_hint(hinted.node) and not has_shard_hint(Dataset.range(4).shard(2, 0).node)
  assert hinted.cardinality() is None or hinted.cardinality() < 0
  with pytest.raises(ValueError, match="only a jaxfeed service job"):
    list(hinted)
