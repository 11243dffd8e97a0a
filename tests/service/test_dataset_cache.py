"""A worker's dataset definitions (jaxfeed.service.worker.dataset_cache):
given only for the fingerprint a task names, bounded, least recently used
out first, and forgotten when the dispatcher is a new incarnation."""

from __future__ import annotations

import pytest

from jaxfeed.service.protocol.protos import service_pb2 as pb
from jaxfeed.service.worker import dataset_cache


def definition(fingerprint: str, size: int = 10) -> pb.DatasetDef:
  return pb.DatasetDef(graph_json=b"x" * size, fingerprint=fingerprint)


def test_a_definition_is_given_only_for_its_fingerprint():
  cache = dataset_cache.DatasetCache(max_entries=4, max_bytes=1 << 20)
  cache.put("7", definition("aaa"))
  assert cache.get("7", "aaa").fingerprint == "aaa"
  assert cache.get("7", "bbb") is None  # the same id, another pipeline
  assert cache.get("7", "") is None  # a task that names none: ask the dispatcher
  assert cache.get("8", "aaa") is None


def test_the_least_recently_used_go_first_past_either_bound():
  cache = dataset_cache.DatasetCache(max_entries=2, max_bytes=1 << 20)
  cache.put("1", definition("a"))
  cache.put("2", definition("b"))
  assert cache.get("1", "a") is not None  # 2 is now the least recently used
  cache.put("3", definition("c"))
  assert cache.get("2", "b") is None and len(cache) == 2
  by_bytes = dataset_cache.DatasetCache(max_entries=100, max_bytes=250)
  for i in range(5):
    by_bytes.put(str(i), definition(str(i), size=100))
  assert len(by_bytes) == 2 and by_bytes.nbytes <= 250
  assert by_bytes.get("4", "4") is not None and by_bytes.get("0", "0") is None
  by_bytes.put("big", definition("big", size=1000))  # larger than the bound: not kept
  assert by_bytes.get("big", "big") is None and by_bytes.nbytes <= 250


def test_a_new_dispatcher_incarnation_empties_it_and_the_same_one_does_not():
  cache = dataset_cache.DatasetCache(max_entries=4, max_bytes=1 << 20)
  cache.meet("100")
  cache.put("1", definition("a"))
  cache.meet("100")  # restarted with its work_dir: the same incarnation
  cache.meet("")  # a dispatcher that names none
  assert len(cache) == 1
  cache.meet("200")
  assert len(cache) == 0 and cache.nbytes == 0


def test_a_definition_with_another_fingerprint_than_its_task_is_refused():
  task = pb.TaskInfo(task_id=3, job_id=2, dataset_id="1", dataset_fingerprint="aaa")
  dataset_cache.check_fingerprint(task, definition("aaa"))
  dataset_cache.check_fingerprint(pb.TaskInfo(dataset_id="1"), definition("bbb"))
  with pytest.raises(
    dataset_cache.DefinitionMismatchError,
    match="made for dataset 1 with fingerprint aaa.*fingerprint bbb",
  ):
    dataset_cache.check_fingerprint(task, definition("bbb"))
