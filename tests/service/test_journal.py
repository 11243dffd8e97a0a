"""The dispatcher's journal and snapshots, file by file: torn and damaged files,
batches, and a crash between any two steps of a snapshot."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import threading

import numpy as np
import pytest

import jaxfeed
from jaxfeed.service.dispatcher import server as dispatcher_lib
from jaxfeed.service.protocol import spec
from jaxfeed.service.protocol.protos import service_pb2 as pb
from jaxfeed.service.storage import journal as journal_lib
from jaxfeed.service.storage import journal_lines
from jaxfeed.service.storage import state_snapshot


def dataset_def(num_records: int = 100) -> pb.DatasetDef:
  dataset = jaxfeed.Dataset.from_source(jaxfeed.ArraySource({"x": np.arange(num_records)}))
  result = spec.to_dataset_def(dataset.node)
  result.num_positions = num_records
  return result


def busy_state(config: dispatcher_lib.DispatcherConfig) -> dispatcher_lib.DispatcherState:
  """A state with datasets, an exactly-once job with issued, acknowledged and
  lost splits, a round-robin job with fixed workers, and finished tasks."""
  state = dispatcher_lib.DispatcherState(dataclasses.replace(config, split_size=10))
  first = state.register_dataset(dataset_def(100))
  second = state.register_dataset(dataset_def(50))
  for address in ("w1:1", "w2:1"):
    state.worker_heartbeat(pb.WorkerHeartbeatRequest(worker_address=address))
  job_id, client_id = state.get_or_create_job(
    pb.GetOrCreateJobRequest(
      dataset_id=first, sharding_policy="distributed_epoch", exactly_once=True
    )
  )
  tasks = {t.worker_address: t.task_id for t in state.jobs[job_id].tasks.values()}
  for address in ("w1:1", "w2:1"):
    state.get_splits(pb.GetSplitsRequest(job_id=job_id, task_id=tasks[address], max_ranges=2))
  state.client_heartbeat(job_id, client_id, acked_splits=[0])
  state.worker_heartbeat(pb.WorkerHeartbeatRequest(worker_address="w2:1", leaving=True))
  state.get_or_create_job(
    pb.GetOrCreateJobRequest(
      dataset_id=second, sharding_policy="off", job_name="rr", num_consumers=2, consumer_index=1
    )
  )
  state.worker_heartbeat(
    pb.WorkerHeartbeatRequest(worker_address="w1:1", finished_tasks=[tasks["w1:1"]])
  )
  return state


def live_records(state: dispatcher_lib.DispatcherState) -> list[dict]:
  """The state's records without the id counter (a replay may skip ids)."""
  records = state._live_records()  # pylint: disable=protected-access
  return [r for r in records if r["kind"] != "ids"]


def files(work_dir) -> list[str]:
  return sorted(p.name for p in work_dir.iterdir() if p.name != journal_lib.LOCK_NAME)


def lines(path) -> list[bytes]:
  return path.read_bytes().splitlines()


def batches(path) -> list:
  """The batches of a journal file (its lines after the header), checked."""
  checked = journal_lines.check(path.read_bytes())
  assert checked.bad_offset is None
  header = journal_lines.decode(checked.payloads[0])
  assert header["format"] == "jaxfeed-dispatcher-journal"
  return [journal_lines.decode(p) for p in checked.payloads[1:]]


def test_torn_last_line_is_cut_off_and_the_next_batch_starts_on_a_clean_line(tmp_path):
  journal = journal_lib.Journal(tmp_path)
  journal.replay(lambda r: None)
  journal.write([{"kind": "a"}])
  journal.close()
  torn = b'0123abcd [{"kind":"b","half'
  with open(tmp_path / "journal.jsonl", "ab") as f:
    f.write(torn)  # a crash in the middle of a write
  for round_ in range(2):
    journal = journal_lib.Journal(tmp_path)
    seen = []
    stats = journal.replay(seen.append)
    assert [r["kind"] for r in seen] == ["a"] + ["c"] * round_
    assert stats.torn_bytes == (len(torn) if round_ == 0 else 0)
    journal.write([{"kind": "c"}])
    journal.close()
  assert batches(tmp_path / "journal.jsonl") == [[{"kind": "a"}], [{"kind": "c"}], [{"kind": "c"}]]


def test_a_damaged_line_of_the_previous_release_names_the_file_and_offset(tmp_path):
  (tmp_path / "journal.jsonl").write_bytes(b'{"kind":"a"}\n{not json\n[{"kind":"b"}]\n')
  with pytest.raises(
    journal_lib.JournalDamageError, match=r"journal\.jsonl is damaged at byte 13 \(line 2\)"
  ):
    journal_lib.Journal(tmp_path).replay(lambda r: None)


@pytest.mark.parametrize("bad_line", [b'[{"kind":"a"}, 7]', b'"text"'])
def test_a_line_of_the_previous_release_that_is_no_record_names_the_file_and_line(
  tmp_path, bad_line
):
  (tmp_path / "journal.jsonl").write_bytes(b'{"kind":"a"}\n' + bad_line + b'\n')
  with pytest.raises(ValueError, match=r"journal\.jsonl is corrupt at line 2 \(byte 13\)"):
    journal_lib.Journal(tmp_path).replay(lambda r: None)


def test_a_record_the_state_cannot_apply_names_the_file_and_line(tmp_path):
  (tmp_path / "journal.jsonl").write_bytes(
    b'[{"kind":"job_deleted","job_id":7}]\n[{"kind":"no_such_kind"}]\n'
  )
  with pytest.raises(ValueError, match=r"journal\.jsonl is corrupt at line 2.*no_such_kind"):
    dispatcher_lib.DispatcherState(dispatcher_lib.DispatcherConfig(work_dir=str(tmp_path)))


def test_a_journal_of_the_previous_release_is_read_once_and_written_again_checked(tmp_path):
  config = dispatcher_lib.DispatcherConfig(work_dir=str(tmp_path))
  state = dispatcher_lib.DispatcherState(config)
  dataset_id = state.register_dataset(dataset_def())
  state.register_dataset(dataset_def(7))
  state.close()
  incarnation, first, second = batches(tmp_path / "journal.jsonl")
  # As the previous release wrote it: JSON lines without checksums, a batch
  # per line or (older still) one record.
  (tmp_path / "journal.jsonl").write_bytes(
    b"".join(json.dumps(line).encode() + b"\n" for line in (incarnation, first[0], second))
  )
  state = dispatcher_lib.DispatcherState(config)
  assert sorted(state.datasets) == sorted([dataset_id, str(int(dataset_id) + 1)])
  state.close()
  assert files(tmp_path) == ["journal.2.jsonl", "snapshot.json"]  # both checked
  assert state_snapshot.decode((tmp_path / "snapshot.json").read_bytes(), "").legacy is False
  batches(tmp_path / "journal.2.jsonl")
  restarted = dispatcher_lib.DispatcherState(config)
  assert restarted.register_dataset(dataset_def()) == dataset_id
  restarted.close()


def test_one_state_change_is_one_batch_with_one_fsync(tmp_path, monkeypatch):
  state = dispatcher_lib.DispatcherState(
    dispatcher_lib.DispatcherConfig(work_dir=str(tmp_path), num_workers=2)
  )
  dataset_id = state.register_dataset(dataset_def())
  for address in ("w1:1", "w2:1"):
    state.worker_heartbeat(pb.WorkerHeartbeatRequest(worker_address=address))
  state.journal.sync(state.journal.written)  # what the heartbeats wrote
  before = len(lines(tmp_path / "journal.jsonl"))
  fsyncs = []
  real_fsync = os.fsync
  monkeypatch.setattr(os, "fsync", lambda fd: (fsyncs.append(fd), real_fsync(fd)))
  state.get_or_create_job(
    pb.GetOrCreateJobRequest(dataset_id=dataset_id, sharding_policy="data")
  )  # fix workers, 2 tasks, a client
  batches = lines(tmp_path / "journal.jsonl")[before:]
  assert len(batches) == 1 and len(fsyncs) == 1
  assert batches[0].count(b'"kind"') == 5
  state.close()


def test_journal_fsync_off_writes_without_fsync(tmp_path, monkeypatch):
  fsyncs = []
  monkeypatch.setattr(os, "fsync", fsyncs.append)
  state = dispatcher_lib.DispatcherState(
    dispatcher_lib.DispatcherConfig(work_dir=str(tmp_path), journal_fsync=False)
  )
  dataset_id = state.register_dataset(dataset_def())
  state.close()
  assert not fsyncs
  state = dispatcher_lib.DispatcherState(dispatcher_lib.DispatcherConfig(work_dir=str(tmp_path)))
  assert list(state.datasets) == [dataset_id]
  state.close()


def test_a_snapshot_rebuilds_the_live_state(tmp_path):
  config = dispatcher_lib.DispatcherConfig(
    work_dir=str(tmp_path), heartbeat_timeout_s=60, snapshot_every_records=1
  )
  state = busy_state(config)  # snapshots after every change
  job = next(j for j in state.jobs.values() if j.exactly_once)
  assert job.unacked and job.reissue  # the snapshot must carry both
  expected = live_records(state)
  last_id = state._live_records()[0]["id"]  # pylint: disable=protected-access
  state.close()
  assert (tmp_path / "snapshot.json").exists()
  assert not (tmp_path / "journal.jsonl").exists()
  restarted = dispatcher_lib.DispatcherState(config)
  assert restarted.replay_stats.snapshot_records > 0
  assert live_records(restarted) == expected
  assert restarted._next_id() > last_id  # pylint: disable=protected-access
  restarted.close()


def snapshot_steps(tmp_path, config) -> tuple[dict, list[dict]]:
  """Runs a state until it snapshots; returns copies of the work_dir's files
  just before the snapshot and after it, and the live records."""
  state = busy_state(dataclasses.replace(config, snapshot_every_records=0))
  state.close()
  before = {name: (tmp_path / name).read_bytes() for name in files(tmp_path)}
  state = dispatcher_lib.DispatcherState(dataclasses.replace(config, snapshot_every_records=1))
  state.check_liveness()  # takes the lock: the journal is due for a snapshot
  expected = live_records(state)
  state.close()
  return before, expected


@pytest.mark.parametrize("crash_point", ["before_rename", "torn_tmp", "before_delete"])
def test_a_crash_at_any_step_of_a_snapshot_replays_the_same_state(tmp_path, crash_point):
  work_dir = tmp_path / "work"
  config = dispatcher_lib.DispatcherConfig(work_dir=str(work_dir), heartbeat_timeout_s=60)
  before, expected = snapshot_steps(work_dir, config)
  snapshot = (work_dir / "snapshot.json").read_bytes()
  assert files(work_dir) == ["journal.1.jsonl", "snapshot.json"]
  assert list(before) == ["journal.jsonl"]
  # Put the files back as they were at the crash.
  (work_dir / "journal.jsonl").write_bytes(before["journal.jsonl"])
  if crash_point in ("before_rename", "torn_tmp"):
    (work_dir / "snapshot.json").unlink()
    tmp = snapshot if crash_point == "before_rename" else snapshot[: len(snapshot) // 2]
    (work_dir / "snapshot.json.tmp").write_bytes(tmp)
  restarted = dispatcher_lib.DispatcherState(config)
  assert live_records(restarted) == expected
  restarted.close()
  names = files(work_dir)
  assert "snapshot.json.tmp" not in names
  if crash_point == "before_delete":
    assert names == ["journal.1.jsonl", "snapshot.json"]  # the leftover is gone
  shutil.rmtree(work_dir)


@pytest.mark.parametrize("damage", ["flip", "truncate", "version"])
def test_a_damaged_snapshot_is_refused_naming_the_file(tmp_path, damage):
  data = state_snapshot.encode([{"kind": "ids", "id": 3}], 2)
  if damage == "flip":
    data = data[:-3] + b"9" + data[-2:]
  elif damage == "truncate":
    data = data[:-5]
  else:
    data = data.replace(b'"version":2', b'"version":7')
  (tmp_path / "snapshot.json").write_bytes(data)
  with pytest.raises(ValueError, match=r"snapshot .*snapshot\.json"):
    journal_lib.Journal(tmp_path).replay(lambda r: None)


def test_a_missing_journal_generation_is_an_error(tmp_path):
  (tmp_path / "snapshot.json").write_bytes(state_snapshot.encode([], 2))
  (tmp_path / "journal.3.jsonl").write_bytes(b'[{"kind":"ids","id":1}]\n')
  with pytest.raises(ValueError, match=r"generations \[3\], expected \[2\]"):
    journal_lib.Journal(tmp_path).replay(lambda r: None)


def test_a_second_dispatcher_on_the_same_work_dir_is_refused(tmp_path):
  config = dispatcher_lib.DispatcherConfig(work_dir=str(tmp_path))
  first = dispatcher_lib.DispatcherState(config)
  with pytest.raises(RuntimeError, match=f"work_dir {tmp_path} is in use"):
    dispatcher_lib.DispatcherState(config)
  first.close()
  dispatcher_lib.DispatcherState(config).close()


@pytest.mark.parametrize(
  "field,value",
  [("snapshot_every_records", -1), ("snapshot_every_bytes", 1.5), ("dataset_gc_timeout_s", 0)],
)
def test_bad_journal_options_are_refused(field, value):
  with pytest.raises(ValueError, match=field):
    dispatcher_lib.DispatcherConfig(**{field: value})


def test_concurrent_commits_and_snapshots_lose_nothing(tmp_path):
  # Commits from many threads share fsyncs while snapshots close and reopen
  # the journal under them: every acknowledged change is replayed.
  config = dispatcher_lib.DispatcherConfig(work_dir=str(tmp_path), snapshot_every_records=7)
  state = dispatcher_lib.DispatcherState(config)
  definitions = [dataset_def(n) for n in range(1, 161)]
  registered, errors = [], []

  def register(chunk):
    try:
      registered.extend(state.register_dataset(d) for d in chunk)
    except Exception as e:  # pylint: disable=broad-except
      errors.append(e)

  threads = [threading.Thread(target=register, args=(definitions[i::8],)) for i in range(8)]
  for t in threads:
    t.start()
  for t in threads:
    t.join()
  state.close()
  assert not errors
  assert len(set(registered)) == len(definitions)
  restarted = dispatcher_lib.DispatcherState(config)
  assert set(restarted.datasets) == set(registered)
  restarted.close()
