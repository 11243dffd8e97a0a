"""Checked journal lines: what replay calls a torn tail (cut) and what damage
(refused, or cut with what follows under --journal_damage=truncate), and a
journal whose fsync fails."""

from __future__ import annotations

import errno
import logging
import threading
import time

import pytest

from jaxfeed.service.dispatcher import server as dispatcher_lib
from jaxfeed.service.storage import journal as journal_lib
from jaxfeed.service.storage import journal_files
from jaxfeed.service.storage import journal_lines
from jaxfeed.service.storage import state_snapshot
from test_journal import dataset_def


def lines_of(*payloads: bytes) -> bytes:
  data, crc = b"", 0
  for payload in payloads:
    line, crc = journal_lines.encode(payload, crc)
    data += line
  return data


FILE = lines_of(b'{"a":1}', b'{"b":2}', b'{"c":3}')
SECOND = FILE.index(b"\n") + 1  # where the second line starts
LAST = FILE.rindex(b"\n", 0, len(FILE) - 1) + 1  # where the last line starts


def line_start(data: bytes, number: int) -> int:
  """Where line `number` (1: the first) of `data` starts."""
  offset = 0
  for _ in range(number - 1):
    offset = data.index(b"\n", offset) + 1
  return offset


# A new dispatcher state's journal: its header, its incarnation's line, then
# a line per change.
FIRST_CHANGE_LINE = 3


def flipped(data: bytes, offset: int, bit: int = 0) -> bytes:
  return data[:offset] + bytes([data[offset] ^ (1 << bit)]) + data[offset + 1 :]


@pytest.mark.parametrize(
  "data,bad,torn,after",
  [
    (FILE, None, False, 0),
    (FILE + b"0123abcd [{", len(FILE), True, 0),  # cut mid-line
    (FILE[:-1], LAST, True, 0),  # cut before its newline: never acknowledged
    (FILE + b"\0" * 4096, len(FILE), True, 0),  # sectors never written
    (flipped(FILE, SECOND + 12), SECOND, False, 1),  # then a valid line
    (flipped(FILE, len(FILE) - 3), LAST, False, 0),  # the last line, whole
    (flipped(FILE, len(FILE) - 1), LAST, False, 0),  # its newline
    (flipped(FILE, SECOND - 1), 0, False, 0),  # a newline between lines: merged
    (FILE[:SECOND] + FILE[LAST:], SECOND, False, 0),  # a line lost
    (FILE[:LAST] + FILE[SECOND:LAST] + FILE[LAST:], LAST, False, 1),  # one repeated
    (flipped(FILE, next(i for i in range(8) if FILE[i] >= ord("a")), 5), None, False, 0),
  ],
)  # the last: a hex digit's case, the same checksum
def test_check_tells_torn_tails_from_damage(data, bad, torn, after):
  checked = journal_lines.check(data)
  assert (checked.bad_offset, checked.torn, checked.valid_after) == (bad, torn, after)


def test_damage_before_valid_lines_refuses_naming_file_and_offset(tmp_path):
  config = dispatcher_lib.DispatcherConfig(work_dir=str(tmp_path))
  state = dispatcher_lib.DispatcherState(config)
  for size in (10, 20, 30):
    state.register_dataset(dataset_def(size))
  state.close()
  path = tmp_path / "journal.jsonl"
  data = path.read_bytes()
  second = line_start(data, FIRST_CHANGE_LINE + 1)  # the second dataset's line
  path.write_bytes(flipped(data, second + 40))
  with pytest.raises(
    journal_lib.JournalDamageError,
    match=rf"{path} is damaged at byte {second} \(line 4\).*truncate",
  ) as e:
    dispatcher_lib.DispatcherState(config)
  assert (e.value.path, e.value.offset) == (str(path), second)


def test_truncate_cuts_at_the_damage_and_reports_what_was_lost(tmp_path, caplog):
  config = dispatcher_lib.DispatcherConfig(work_dir=str(tmp_path), journal_damage="truncate")
  state = dispatcher_lib.DispatcherState(config)
  first = state.register_dataset(dataset_def(10))
  for size in (20, 30):
    state.register_dataset(dataset_def(size))
  state.close()
  path = tmp_path / "journal.jsonl"
  data = path.read_bytes()
  second = line_start(data, FIRST_CHANGE_LINE + 1)  # the second dataset's line
  path.write_bytes(flipped(data, second + 40))
  with caplog.at_level(logging.ERROR):
    state = dispatcher_lib.DispatcherState(config)
  assert list(state.datasets) == [first]  # what came after the damage is gone
  assert state.replay_stats.cut_bytes == len(data) - second
  assert state.replay_stats.records_lost == 2  # both still read, the damaged one too
  assert "LOST" in caplog.text and "{'dataset': 2}" in caplog.text
  again = state.register_dataset(dataset_def(20))
  state.close()
  restarted = dispatcher_lib.DispatcherState(config)  # written after the cut, intact
  assert sorted(restarted.datasets) == sorted([first, again])
  restarted.close()


def test_a_flipped_bit_in_a_snapshot_header_is_refused_and_deletes_nothing(tmp_path):
  # Version 1 did not check its header: a damaged journal generation number
  # there deleted the journal files it named as folded into the snapshot.
  (tmp_path / "snapshot.json").write_bytes(state_snapshot.encode([{"kind": "ids", "id": 3}], 2))
  (tmp_path / "journal.2.jsonl").write_bytes(b"")
  data = (tmp_path / "snapshot.json").read_bytes()
  at = data.index(b'"journal":2') + len(b'"journal":')
  (tmp_path / "snapshot.json").write_bytes(flipped(data, at, 0))  # "journal":3
  with pytest.raises(journal_lib.JournalDamageError, match=r"snapshot\.json is damaged at byte 0"):
    journal_lib.Journal(tmp_path).replay(lambda r: None)
  assert (tmp_path / "journal.2.jsonl").exists()


def test_a_failed_fsync_fails_the_journal_for_good(tmp_path, monkeypatch):
  server = dispatcher_lib.DispatchServer(dispatcher_lib.DispatcherConfig(work_dir=str(tmp_path)))
  try:
    server.state.register_dataset(dataset_def(10))
    assert not server.health.failed.is_set()

    def failing_fsync(fd):
      raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(journal_files, "fsync", failing_fsync)
    with pytest.raises(journal_lib.JournalUnavailableError, match="must be restarted"):
      server.state.register_dataset(dataset_def(20))
    assert server.state.journal.failed and not server.state.journal.healthy
    assert server.health.failed.is_set()  # the command line exits with FATAL_EXIT_STATUS
    monkeypatch.undo()
    with pytest.raises(journal_lib.JournalUnavailableError):  # for good
      server.state.register_dataset(dataset_def(30))
  finally:
    server.stop()


@pytest.mark.parametrize("round_under_way", [False, True])
def test_a_change_nobody_waits_for_is_durable_soon(tmp_path, monkeypatch, round_under_way):
  # A heartbeat's change waits for no fsync: the journal's thread makes it
  # durable, also when it woke while a caller's fsync was under way.
  monkeypatch.setenv(journal_files.FSYNC_DELAY_ENV, "0.2")
  journal = journal_lib.Journal(tmp_path)
  journal.replay(lambda r: None)
  try:
    first = journal.write([{"kind": "a"}])
    caller = threading.Thread(target=journal.sync, args=(first,))
    if round_under_way:
      caller.start()
      time.sleep(0.05)
    second = journal.write([{"kind": "b"}])
    deadline = time.monotonic() + 5
    while not journal.durable(second) and time.monotonic() < deadline:
      time.sleep(0.01)
    assert journal.durable(second)
    if round_under_way:
      caller.join()
  finally:
    journal.close()
