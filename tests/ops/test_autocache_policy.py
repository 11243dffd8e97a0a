"""The autocache policy: each point computes, writes or reads its cache by
what each costs, measured (Cachew's decision)."""

from __future__ import annotations

import os
import re
import time

import numpy as np
import pytest

import jaxfeed
from jaxfeed.ops import autocache_policy, cache_disk, record_store
from jaxfeed.ops.autocache_folder import AutocacheFolder

pytestmark = pytest.mark.timeout(120)

CALLS = {"heavy": 0, "light": 0, "varying": 0}


def spin(seconds: float) -> None:
  started = time.perf_counter()
  while time.perf_counter() - started < seconds:
    pass


def heavy(x):
  CALLS["heavy"] += 1
  spin(400e-6)
  return np.full(8, x, np.int64)


def light(x):
  """Cheap to make, costly to read back: 1 MiB, one page touched."""
  CALLS["light"] += 1
  element = np.zeros(1 << 18, np.float32)
  element[0] = x
  return element


def varying(x):
  """As costly as the COST_US environment variable says."""
  CALLS["varying"] += 1
  spin(float(os.environ.get("COST_US", "0")) * 1e-6)
  element = np.zeros(1 << 16, np.float32)
  element[0] = x
  return element


def middle(x):
  spin(40e-6)
  return x + 1


def epoch(dataset) -> list[int]:
  return [int(np.asarray(e).ravel()[0]) for e in dataset]


def calls_of(name: str, dataset) -> tuple[list[int], int]:
  before = CALLS[name]
  elements = epoch(dataset)
  return elements, CALLS[name] - before


def complete_entries(folder) -> list[str]:
  return [e.name for e in AutocacheFolder(str(folder)).entries() if e.state != "abandoned"]


def decisions(folder) -> dict[str, str]:
  return {r["entry"]: r["decision"] for r in autocache_policy.read_records(str(folder))}


def test_a_cheap_input_is_computed_and_nothing_is_kept(tmp_path):
  dataset = jaxfeed.Dataset.range(600).map(light).autocache(str(tmp_path))
  for _ in range(3):
    elements, calls = calls_of("light", dataset)
    assert elements == list(range(600))
    assert calls == 600, autocache_policy.read_records(str(tmp_path))  # computed every pass
  assert complete_entries(tmp_path) == []  # kept nothing: always-cache kept one
  [decision] = decisions(tmp_path).values()
  assert decision == "compute"
  [record] = autocache_policy.read_records(str(tmp_path))
  assert re.search(r"reading is not \d+% faster", record["reason"]), record["reason"]


def test_an_expensive_input_is_written_by_its_first_pass_and_read_after(tmp_path):
  dataset = jaxfeed.Dataset.range(600).map(heavy).autocache(str(tmp_path))
  elements, calls = calls_of("heavy", dataset)
  assert (elements, calls) == (list(range(600)), 600)
  assert len(complete_entries(tmp_path)) == 1  # the first pass wrote it whole
  [decision] = decisions(tmp_path).values()
  assert decision == "write"
  for _ in range(2):
    elements, calls = calls_of("heavy", dataset)
    assert (elements, calls) == (list(range(600)), 0)
  assert list(decisions(tmp_path).values()) == ["read"]
  label = complete_entries(tmp_path)[0][:16]
  counts = autocache_policy.decision_counts()
  assert counts[("local", label, "write")] >= 1 and counts[("local", label, "read")] >= 2


def test_a_point_starts_caching_when_its_input_grows_costly(tmp_path, monkeypatch):
  dataset = jaxfeed.Dataset.range(200).map(varying).autocache(str(tmp_path))
  monkeypatch.setenv("COST_US", "0")
  for _ in range(2):
    assert calls_of("varying", dataset) == (list(range(200)), 200)
  assert complete_entries(tmp_path) == []
  monkeypatch.setenv("COST_US", "3000")
  passes = [calls_of("varying", dataset)[1] for _ in range(4)]
  # It measures the new cost while computing, writes, then reads.
  assert passes[-1] == 0, passes
  assert len(complete_entries(tmp_path)) == 1
  assert list(decisions(tmp_path).values()) == ["read"]


def test_a_point_goes_back_to_computing_when_its_reads_turn_slow(tmp_path, monkeypatch):
  dataset = jaxfeed.Dataset.range(100).map(heavy).autocache(str(tmp_path))
  assert calls_of("heavy", dataset)[1] == 100  # writes
  assert calls_of("heavy", dataset)[1] == 0  # reads
  get = cache_disk._DiskReader.get  # pylint: disable=protected-access

  def slow_get(self, index):  # a slower disk: 10 ms an element
    time.sleep(10e-3)
    return get(self, index)

  monkeypatch.setattr(cache_disk._DiskReader, "get", slow_get)  # pylint: disable=protected-access
  assert calls_of("heavy", dataset)[1] == 0  # read, slowly: measured
  assert calls_of("heavy", dataset)[1] == 100, autocache_policy.read_records(str(tmp_path))
  assert list(decisions(tmp_path).values()) == ["compute"]


def test_a_point_that_left_slow_reads_reads_again_once_they_are_fast(tmp_path, monkeypatch):
  dataset = jaxfeed.Dataset.range(100).map(heavy).autocache(str(tmp_path))
  assert calls_of("heavy", dataset)[1] == 100  # writes
  get = cache_disk._DiskReader.get  # pylint: disable=protected-access

  def slow_get(self, index):  # the write's flush, or a busy disk: 10 ms an element
    time.sleep(10e-3)
    return get(self, index)

  monkeypatch.setattr(cache_disk._DiskReader, "get", slow_get)  # pylint: disable=protected-access
  assert calls_of("heavy", dataset)[1] == 0  # read, slowly
  assert calls_of("heavy", dataset)[1] == 100  # computes
  monkeypatch.setattr(cache_disk._DiskReader, "get", get)  # pylint: disable=protected-access
  # Each computing pass reads a sample of the cache: reads grow cheaper
  # again, and the point goes back to them.
  passes = [calls_of("heavy", dataset)[1] for _ in range(10)]
  assert passes[-1] == 0, (passes, autocache_policy.read_records(str(tmp_path)))
  assert list(decisions(tmp_path).values()) == ["read"]


def test_of_two_points_only_the_one_that_saves_most_caches(tmp_path):
  dataset = (
    jaxfeed.Dataset.range(500)
    .map(middle)
    .autocache(str(tmp_path))
    .map(heavy)
    .autocache(str(tmp_path))
  )
  for _ in range(3):
    assert epoch(dataset) == list(range(1, 501))
  kept = complete_entries(tmp_path)
  assert len(kept) == 1  # always-cache kept both
  made = decisions(tmp_path)
  assert made[kept[0]] == "read"
  [(lower, lower_decision)] = [(e, d) for e, d in made.items() if e != kept[0]]
  assert lower_decision == "compute"
  reason = next(
    r["reason"] for r in autocache_policy.read_records(str(tmp_path)) if r["entry"] == lower
  )
  assert "saves more" in reason
  assert calls_of("heavy", dataset)[1] == 0


def test_the_policy_never_changes_the_elements_or_their_resume(tmp_path):
  def build(policy):
    return (
      jaxfeed.Dataset.range(300)
      .map(heavy)
      .autocache(str(tmp_path / policy), policy=policy)
      .shuffle(64, seed=1)
      .batch(7)
    )

  expected = [np.asarray(b).tolist() for b in build("never")]
  for policy in ("auto", "always", "never"):
    for _ in range(2):  # the pass that profiles or writes, then the next
      assert [np.asarray(b).tolist() for b in build(policy)] == expected
    iterator = build(policy).make_iterator()
    first = [np.asarray(next(iterator)).tolist() for _ in range(5)]
    state = iterator.get_state()
    resumed = build(policy).make_iterator()
    resumed.set_state(state)
    assert first + [np.asarray(b).tolist() for b in resumed] == expected
    iterator.close()


def test_a_policy_that_is_not_known_is_refused_by_name():
  with pytest.raises(
    ValueError, match=r"policy must be one of 'auto', 'always', 'never'.*'sometimes'"
  ):
    jaxfeed.Dataset.range(3).autocache("/tmp", policy="sometimes")


# -- stores kept by record (shared preprocessing) ---------------------------------
SOURCE = jaxfeed.ArraySource(np.arange(3000, dtype=np.int64))


def by_record(fn, folder, seed=0):
  sampler = jaxfeed.IndexSampler(3000, shuffle=True, seed=seed)
  return jaxfeed.Dataset.from_source(SOURCE, sampler).map(fn).autocache(str(folder))


def block_files(folder) -> list[str]:
  return [
    f
    for entry in os.listdir(folder)
    if entry.startswith("records-")
    for f in os.listdir(os.path.join(folder, entry))
    if f.startswith("block-")
  ]


def plain_epoch(fn, seed: int) -> list[int]:
  sampler = jaxfeed.IndexSampler(3000, shuffle=True, seed=seed)
  return epoch(jaxfeed.Dataset.from_source(SOURCE, sampler).map(fn))


def test_records_of_a_cheap_preprocessing_are_computed_not_kept(tmp_path):
  plain = plain_epoch(light, 0)
  for _ in range(2):
    assert epoch(by_record(light, tmp_path)) == plain
  # The profile's first blocks only; always-cache keeps all 47.
  assert len(block_files(tmp_path)) <= autocache_policy.PROFILE_BLOCKS
  assert list(decisions(tmp_path).values()) == ["compute"]


def test_records_of_a_costly_preprocessing_are_kept_and_shared_by_other_seeds(tmp_path):
  assert calls_of("heavy", by_record(heavy, tmp_path, seed=0))[1] >= 3000
  assert len(block_files(tmp_path)) == -(-3000 // record_store.BLOCK)
  elements, calls = calls_of("heavy", by_record(heavy, tmp_path, seed=5))
  assert (elements, calls) == (plain_epoch(light, 5), 0)
  assert list(decisions(tmp_path).values())[0] in ("read", "write")
