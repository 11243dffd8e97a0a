"""`jaxfeed.service.protocol.read_state`: what an exactly-once read's consumer took."""

import json

import pytest

from jaxfeed.service.protocol import read_state
from jaxfeed.service.protocol.read_state import SplitProgress


def take_all(progress: SplitProgress, start: int, stop: int, count: int, upto: int | None = None):
  """Delivers a split of `count` elements and takes `upto` of those handed on."""
  handed = progress.arrived(start, stop, [(f"{start}:{i}", start) for i in range(count)])
  for _, tag in handed[:upto]:
    progress.took(tag)
  return handed


@pytest.mark.parametrize(
  "ranges,merged",
  [
    ([], []),
    ([[5, 7], [0, 3], [3, 5]], [[0, 7]]),
    ([[0, 2], [4, 6], [2, 2]], [[0, 2], [4, 6]]),
  ],
)
def test_merge_ranges_joins_adjacent_and_drops_empty(ranges, merged):
  assert read_state.merge_ranges(ranges) == merged


def test_skip_to_and_clip_carve_around_skipped_ranges():
  skip = [[0, 10], [20, 30]]
  assert read_state.skip_to(skip, 0) == 10
  assert read_state.skip_to(skip, 12) == 12
  assert read_state.skip_to(skip, 25) == 30
  assert read_state.clip(skip, 10, 40) == 20
  assert read_state.clip(skip, 30, 40) == 40


def test_state_records_whole_splits_as_merged_ranges_and_partial_ones_with_a_count():
  progress = SplitProgress()
  take_all(progress, 0, 10, 3)
  take_all(progress, 10, 20, 3)
  take_all(progress, 30, 40, 3, upto=1)
  take_all(progress, 20, 30, 3, upto=0)  # arrived, not taken
  state = progress.state()
  assert state == {"version": 1, "done": [[0, 20]], "partial": [[30, 40, 1]]}
  assert json.loads(json.dumps(state)) == state


def test_an_empty_split_is_done_when_it_arrives():
  progress = SplitProgress()
  assert take_all(progress, 0, 10, 0) == []
  assert progress.state()["done"] == [[0, 10]]


def test_a_restored_partial_split_drops_what_was_taken_and_stays_partial_until_taken():
  progress = SplitProgress({"version": 1, "done": [[0, 10]], "partial": [[10, 20, 2]]})
  assert progress.resume_ranges == ([[0, 10]], [[10, 20]])
  assert progress.state()["partial"] == [[10, 20, 2]]
  handed = take_all(progress, 10, 20, 5, upto=1)
  assert [element for element, _ in handed] == ["10:2", "10:3", "10:4"]
  assert progress.state()["partial"] == [[10, 20, 3]]
  for _, tag in handed[1:]:
    progress.took(tag)
  assert progress.state() == {"version": 1, "done": [[0, 20]], "partial": []}


@pytest.mark.parametrize(
  "state,match",
  [
    ({"done": [], "partial": []}, "version 1"),
    ({"version": 1, "done": [[3, 3]], "partial": []}, "'done' must be"),
    ({"version": 1, "done": [], "partial": [[0, 4, 0]]}, "'partial' must be"),
    ({"version": 1, "done": [[0, 8]], "partial": [[4, 12, 1]]}, "overlapping"),
  ],
)
def test_malformed_states_are_refused_naming_the_field(state, match):
  with pytest.raises(read_state.ResumeStateError, match=match):
    SplitProgress(state)


def test_the_dispatcher_refuses_ranges_past_the_dataset():
  read_state.check_resume_ranges([[0, 8]], [[8, 10]], 10)
  with pytest.raises(read_state.ResumeStateError, match="outside the dataset's 10 positions"):
    read_state.check_resume_ranges([[0, 12]], [], 10)


def test_consumers_resuming_one_state_share_one_new_job_name():
  state = {"version": 1, "done": [[0, 8]], "partial": []}
  name = read_state.resume_job_name("train", state)
  assert name == read_state.resume_job_name("train", dict(state))
  assert name.startswith("train/resumed-")
  assert name != read_state.resume_job_name("train", {**state, "done": [[0, 9]]})
  # Two restores of one state: two jobs.
  assert read_state.resume_job_name("train", state, "a") != read_state.resume_job_name(
    "train", state, "b"
  )


def test_merged_states_of_a_shared_job_take_the_furthest_consumer_of_each_split():
  # Both consumers resumed from one state listing [10, 20, 2] as partial; one
  # of them then took split [10, 20) whole, and another one part of [30, 40).
  a = {"version": 1, "done": [[0, 10], [20, 30]], "partial": [[10, 20, 2], [30, 40, 1]]}
  b = {"version": 1, "done": [[0, 20]], "partial": [[30, 40, 3]]}
  assert read_state.merge_states([a, b]) == {
    "version": 1,
    "done": [[0, 30]],
    "partial": [[30, 40, 3]],
  }


def test_merge_process_states_merges_reads_of_one_named_job_only():
  def pipeline(job_name, splits):
    read = {
      "op": "distribute",
      "own": {"elements_read": 1, "splits": splits, "job_name": job_name},
      "parents": [],
    }
    return {"op": "map", "own": {}, "parents": [read]}

  first = {"version": 1, "done": [[0, 10]], "partial": []}
  second = {"version": 1, "done": [[10, 20]], "partial": [[20, 30, 1]]}
  merged = read_state.merge_process_states([pipeline("train", first), pipeline("train", second)])
  want = {"version": 1, "done": [[0, 20]], "partial": [[20, 30, 1]]}
  assert [m["parents"][0]["own"]["splits"] for m in merged] == [want, want]
  assert read_state.has_shared_read(merged[0])
  own_jobs = read_state.merge_process_states([pipeline("", first), pipeline("", second)])
  assert [m["parents"][0]["own"]["splits"] for m in own_jobs] == [first, second]
  assert not read_state.has_shared_read(own_jobs[0])


@pytest.mark.parametrize("snapshot_every_records", [0, 1], ids=["journal", "snapshots"])
def test_a_resumed_job_skips_taken_splits_across_dispatcher_restarts(
  tmp_path, snapshot_every_records
):
  import numpy as np  # pylint: disable=g-import-not-at-top
  import jaxfeed  # pylint: disable=g-import-not-at-top
  from jaxfeed.service.dispatcher import server as dispatcher_lib  # pylint: disable=g-import-not-at-top
  from jaxfeed.service.protocol import spec  # pylint: disable=g-import-not-at-top
  from jaxfeed.service.protocol.protos import service_pb2 as pb  # pylint: disable=g-import-not-at-top

  config = dispatcher_lib.DispatcherConfig(
    work_dir=str(tmp_path),
    split_size=10,
    journal_fsync=False,
    snapshot_every_records=snapshot_every_records,
  )
  definition = spec.to_dataset_def(
    jaxfeed.Dataset.from_source(jaxfeed.ArraySource({"x": np.arange(100)})).node
  )
  definition.num_positions = 100
  state = dispatcher_lib.DispatcherState(config)
  dataset_id = state.register_dataset(definition)
  state.worker_heartbeat(pb.WorkerHeartbeatRequest(worker_address="w:1"))
  job_id, _ = state.get_or_create_job(
    pb.GetOrCreateJobRequest(
      dataset_id=dataset_id,
      sharding_policy="distributed_epoch",
      exactly_once=True,
      resume_done=[
        pb.SplitRange(start=0, stop=25),
        pb.SplitRange(start=40, stop=50),
        pb.SplitRange(start=72, stop=80),
      ],
      resume_partial=[pb.SplitRange(start=30, stop=40)],
    )
  )
  task_id = next(iter(state.jobs[job_id].tasks))

  def splits() -> list[list[int]]:
    response = state.get_splits(pb.GetSplitsRequest(job_id=job_id, task_id=task_id, max_ranges=2))
    return [[r.start, r.stop] for r in response.ranges]

  assert splits() == [[30, 40], [25, 30]]  # the partly taken split first, whole
  state.close()
  state = dispatcher_lib.DispatcherState(config)
  assert splits() == [[50, 60], [60, 70]]
  state.close()
  state = dispatcher_lib.DispatcherState(config)
  assert splits() == [[70, 72], [80, 90]]
  assert splits() == [[90, 100]]
  with pytest.raises(ValueError, match="outside the dataset's 100 positions"):
    state.get_or_create_job(
      pb.GetOrCreateJobRequest(
        dataset_id=dataset_id,
        sharding_policy="distributed_epoch",
        exactly_once=True,
        resume_done=[pb.SplitRange(start=90, stop=110)],
      )
    )
  with pytest.raises(ValueError, match="Only exactly-once reads resume"):
    state.get_or_create_job(
      pb.GetOrCreateJobRequest(
        dataset_id=dataset_id,
        sharding_policy="distributed_epoch",
        resume_done=[pb.SplitRange(start=0, stop=10)],
      )
    )
  state.close()
