"""Index-addressable datasets: reading ranges of positions directly."""

import numpy as np
import pytest

import jaxfeed
from jaxfeed.dataset import Dataset
from jaxfeed.ops import base
from jaxfeed.ops import index_ranges


def _source(n: int = 30):
  return jaxfeed.ArraySource({"x": np.arange(n) * 3})


ADDRESSABLE = {
  "range": lambda: Dataset.range(3, 40, 2),
  "from_tensor_slices": lambda: Dataset.from_tensor_slices(
    {"a": np.arange(17), "b": (np.arange(17) * 2.0, np.arange(17) % 3)}
  ),
  "from_source": lambda: Dataset.from_source(
    _source(), jaxfeed.IndexSampler(30, shuffle=True, seed=3, num_epochs=2)
  ),
  "concatenate": lambda: Dataset.range(5).concatenate(Dataset.range(100, 113)),
  "zip": lambda: Dataset.zip((Dataset.range(20), Dataset.from_tensor_slices(np.arange(15) * 10))),
  "zip_of_concatenate": lambda: Dataset.zip(
    {
      "a": Dataset.range(5).concatenate(Dataset.from_tensor_slices(np.arange(12))),
      "b": Dataset.from_source(_source()),
    }
  ),
}


def _elements_and_seeds(iterator) -> tuple[list, list]:
  elements, seeds = [], []
  for element in iterator:
    elements.append(repr(element))
    seeds.append(iterator.last_seed)
  return elements, seeds


def _cuts(n: int, seed: int) -> list[tuple[int, int]]:
  bounds = sorted({0, n, *np.random.default_rng(seed).integers(0, n, 6).tolist()})
  return list(zip(bounds, bounds[1:]))


@pytest.mark.parametrize("name", sorted(ADDRESSABLE))
def test_ranges_of_positions_give_the_local_elements_with_their_seeds(name):
  node = ADDRESSABLE[name]().node
  want = _elements_and_seeds(node.make_iterator())
  assert index_ranges.is_index_addressable(node)
  assert index_ranges.num_positions(node) == len(want[0])
  got: tuple[list, list] = ([], [])
  for start, stop in _cuts(len(want[0]), seed=1):
    elements, seeds = _elements_and_seeds(index_ranges.range_iterator(node, start, stop))
    got[0].extend(elements)
    got[1].extend(seeds)
  assert got == want


@pytest.mark.parametrize("name", sorted(ADDRESSABLE))
def test_ranges_node_reads_fetched_ranges_in_the_order_given(name):
  dataset = ADDRESSABLE[name]()
  local = [repr(e) for e in dataset.node.make_iterator()]
  cuts = _cuts(len(local), seed=2)[::-1]
  calls = iter([(cuts[:2], False), (cuts[2:], False), ([], True)])
  ranges = index_ranges.RangesNode(dataset.node, lambda: next(calls))
  got = [repr(e) for e in ranges.make_iterator()]
  assert got == [e for start, stop in cuts for e in local[start:stop]]


def test_a_batch_of_fetched_ranges_joins_the_ends_of_two_ranges():
  dataset = ADDRESSABLE["from_source"]()
  local = np.array([e["x"] for e in dataset])
  calls = iter([([(0, 7), (40, 60)], False), ([(7, 40)], False), ([], True)])
  batches = list(
    Dataset(index_ranges.RangesNode(dataset.node, lambda: next(calls))).batch(8).make_iterator()
  )
  assert [len(b["x"]) for b in batches] == [8] * 7 + [4]
  np.testing.assert_array_equal(
    np.concatenate([b["x"] for b in batches]),
    np.concatenate([local[0:7], local[40:60], local[7:40]]),
  )


def test_an_endless_sampler_has_endless_positions_and_zip_takes_the_shortest():
  endless = Dataset.from_source(_source(), jaxfeed.IndexSampler(30, num_epochs=None))
  assert index_ranges.num_positions(endless.node) is None
  assert index_ranges.num_positions(endless.concatenate(Dataset.range(3)).node) is None
  assert index_ranges.num_positions(Dataset.zip((endless, Dataset.range(7))).node) == 7


def test_split_input_is_the_addressable_input_under_element_wise_ops():
  zipped = Dataset.zip((Dataset.range(5), Dataset.range(5)))
  assert index_ranges.split_input(zipped.map(abs).batch(2).node) is zipped.node


@pytest.mark.parametrize(
  "make, named",
  [
    (
      lambda: Dataset.range(5).map(abs).concatenate(Dataset.range(3)),
      "'range -> map -> concatenate', 'range -> concatenate'",
    ),
    (
      lambda: Dataset.zip((Dataset.range(5), Dataset.range(5).map(abs))).batch(2),
      "'range -> zip -> batch', 'range -> map -> zip -> batch'",
    ),
  ],
)
def test_inputs_combined_after_other_ops_are_refused_naming_them(make, named):
  with pytest.raises(index_ranges.NotIndexAddressableError, match="2 inputs") as raised:
    index_ranges.split_input(make().node)
  assert named in str(raised.value)
  assert index_ranges.ALLOWED in str(raised.value)


def test_one_input_read_along_two_paths_is_refused():
  numbers = Dataset.range(5).map(abs)
  with pytest.raises(index_ranges.NotIndexAddressableError, match="2 inputs"):
    index_ranges.split_input(Dataset.zip((numbers, numbers)).node)


class _Opaque(base.Node):
  """A source without positions."""

  op_name = "opaque"


def test_a_source_without_positions_is_refused_naming_it():
  dataset = Dataset.zip((Dataset(_Opaque()), Dataset.range(3))).batch(2)
  with pytest.raises(
    index_ranges.NotIndexAddressableError,
    match="reads 'opaque -> zip -> batch', which cannot be split",
  ):
    index_ranges.split_input(dataset.node)
