"""Seed mixing: scalar, vectorized and continued forms are one function."""

import numpy as np
import pytest

from jaxfeed import seeding


@pytest.mark.parametrize("values", [(0,), (1, 2), (7, -1, 3), (2**64 - 1, 5, 0, 9)])
def test_continue_mix_extends_a_prefix(values):
  for cut in range(len(values) + 1):
    prefix = seeding.mix_seed(*values[:cut])
    assert seeding.continue_mix(prefix, *values[cut:]) == seeding.mix_seed(*values)


@pytest.mark.parametrize("leading", [(), (0,), (3, 4), (2**63, 1)])
def test_vectorized_equals_scalar_with_int_prefix_and_arrays(leading):
  records = np.arange(-3, 50, dtype=np.int64)
  vector = seeding.mix_seeds(*leading, records, np.uint64(11))
  assert vector.dtype == np.uint64 and vector.shape == records.shape
  assert [int(v) for v in vector] == [seeding.mix_seed(*leading, int(r), 11) for r in records]


def test_seeds_are_spread_and_order_sensitive():
  seeds = seeding.mix_seeds(0, np.arange(10_000))
  assert len(set(seeds.tolist())) == 10_000
  assert seeding.mix_seed(1, 2) != seeding.mix_seed(2, 1)
  high_bits = (seeds >> np.uint64(63)).astype(int)
  assert 0.45 < high_bits.mean() < 0.55
