"""The autocache folder's capacity and lifecycle, with real worker processes:
`--autocache_max_bytes`, `--autocache_ttl_s`, and `jaxfeed cache ls|rm`."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import jaxfeed
import service_udfs
from service_cluster import REPO_ROOT

pytestmark = pytest.mark.timeout(120)

ROWS, WIDTH = 120, 512  # an entry: 120 float32 rows of 2 KiB, about 246 KB
ENTRY_BYTES = ROWS * WIDTH * 4


def pipeline(k: int) -> jaxfeed.Dataset:
  """A pipeline of its own fingerprint: an entry of ENTRY_BYTES and a bit."""
  rows = np.full((ROWS, WIDTH), k, np.float32)
  return jaxfeed.Dataset.from_tensor_slices(rows).autocache()


def read(dispatcher, k: int) -> None:
  dataset = pipeline(k).distribute(dispatcher.address, "parallel_epochs")
  with dataset.make_iterator() as iterator:
    got = [float(row[0]) for row in iterator]
  assert got == [float(k)] * ROWS


def folder_bytes(path: str) -> int:
  """Bytes of the files under `path` (apparent sizes, as `du -sb` counts)."""
  while True:
    try:
      return sum(f.stat().st_size for f in pathlib.Path(path).rglob("*") if f.is_file())
    except FileNotFoundError:  # a file removed while counting: count again
      continue


def complete_entries(path: str) -> set[str]:
  return {
    name for name in os.listdir(path) if os.path.exists(os.path.join(path, name, "manifest.json"))
  }


def key(k: int) -> str:
  return pipeline(k).node.parents[0].fingerprint()


class FolderWatch:
  """Samples a folder's bytes and complete entries on a thread."""

  def __init__(self, path: str):
    self.path = path
    self.most_bytes = 0
    self.seen_without: set[str] = set()  # entries once missing
    self._stop = threading.Event()
    self._entries: set[str] = set()
    self._thread = threading.Thread(target=self._run, name="folder-watch")
    self._thread.start()

  def _run(self) -> None:
    while not self._stop.wait(0.002):
      self.most_bytes = max(self.most_bytes, folder_bytes(self.path))
      now = complete_entries(self.path)
      self.seen_without |= self._entries - now
      self._entries = now

  def close(self) -> None:
    self._stop.set()
    self._thread.join()


def start(cluster, cache_dir, *flags: str):
  dispatcher = cluster("dispatcher", "--port=0")
  cluster(
    "worker",
    f"--dispatcher_address={dispatcher.address}",
    "--heartbeat_interval_s=0.2",
    f"--autocache_dir={cache_dir}",
    "--autocache_policy=always",
    *flags,
  )
  return dispatcher


def slow_reader(dispatcher, k: int):
  """A read of job k that has begun and then waits (its worker's pass stays
  open: the buffer holds far fewer than ROWS elements)."""
  iterator = pipeline(k).distribute(dispatcher.address, "parallel_epochs").make_iterator()
  assert float(next(iterator)[0]) == k
  return iterator


def finish(iterator, k: int) -> None:
  with iterator:
    assert [float(row[0]) for row in iterator] == [float(k)] * (ROWS - 1)


def test_the_folder_stays_under_its_byte_limit_while_jobs_write_and_read(cluster, tmp_path):
  limit = 3 * ENTRY_BYTES + 200_000  # three entries fit, not four
  dispatcher = start(cluster, tmp_path, f"--autocache_max_bytes={limit}")
  watch = FolderWatch(str(tmp_path))
  try:
    for k in range(6):
      read(dispatcher, k)  # writes entry k
      read(dispatcher, k)  # reads it
  finally:
    watch.close()
  assert 0 < watch.most_bytes <= limit
  # The least recently used went first.
  assert complete_entries(str(tmp_path)) == {key(3), key(4), key(5)}


def test_a_write_that_cannot_fit_goes_on_without_caching(cluster, tmp_path):
  dispatcher = start(cluster, tmp_path, f"--autocache_max_bytes={ENTRY_BYTES // 2}")
  read(dispatcher, 1)
  read(dispatcher, 1)
  assert complete_entries(str(tmp_path)) == set()
  assert folder_bytes(str(tmp_path)) <= ENTRY_BYTES // 2


def test_an_entry_read_by_another_worker_process_is_not_evicted(cluster, tmp_path):
  limit = 3 * ENTRY_BYTES + 200_000
  evicting = start(cluster, tmp_path, f"--autocache_max_bytes={limit}")
  other = start(cluster, tmp_path)  # another worker process on the folder, no limit
  read(other, 0)  # entry 0, the least recently used from here on
  reader = slow_reader(other, 0)  # ... and being read
  try:
    watch = FolderWatch(str(tmp_path))
    try:
      for k in range(1, 5):
        read(evicting, k)
    finally:
      watch.close()
    assert key(0) not in watch.seen_without
    assert key(0) in complete_entries(str(tmp_path))
    assert watch.most_bytes <= limit
  finally:
    finish(reader, 0)
  # Entries 1 and 2 made room for 3 and 4 (entry 0 was in use).
  assert complete_entries(str(tmp_path)) == {key(0), key(3), key(4)}
  # Its read ended last: entry 3 is now the least recently used, and goes next.
  read(evicting, 5)
  assert complete_entries(str(tmp_path)) == {key(0), key(4), key(5)}


def test_ttl_removes_an_entry_nobody_reads_and_keeps_one_in_use(cluster, tmp_path):
  dispatcher = start(cluster, tmp_path, "--autocache_ttl_s=1")
  read(dispatcher, 0)
  read(dispatcher, 1)
  reader = slow_reader(dispatcher, 1)
  try:
    assert complete_entries(str(tmp_path)) == {key(0), key(1)}
    deadline = time.monotonic() + 20
    while key(0) in complete_entries(str(tmp_path)) and time.monotonic() < deadline:
      time.sleep(0.05)
    assert key(0) not in complete_entries(str(tmp_path))
    time.sleep(1.5)  # past the ttl, but being read
    assert key(1) in complete_entries(str(tmp_path))
  finally:
    finish(reader, 1)
  assert os.listdir(tmp_path / ".jaxfeed" / "trash") == []


def test_a_store_kept_by_record_is_held_while_read_and_then_expires(cluster, tmp_path):
  dispatcher = start(cluster, tmp_path, "--autocache_ttl_s=1")
  source = jaxfeed.ArraySource({"x": np.arange(400)})
  dataset = jaxfeed.Dataset.from_source(source).map(service_udfs.add_one_to_x).autocache()
  with dataset.distribute(dispatcher.address, "parallel_epochs").make_iterator() as reader:
    assert int(next(reader)["x"]) == 1
    [store] = os.listdir(tmp_path / ".jaxfeed" / "locks")
    assert store.startswith("records-")
    listed = jaxfeed_cli("cache", "ls", str(tmp_path)).stdout.splitlines()
    assert listed[1].split()[0] == store and listed[1].split()[-1] == "reading"
    time.sleep(2.5)  # past the ttl, but being read
    assert os.path.isdir(tmp_path / store)
    assert [int(e["x"]) for e in reader] == list(range(2, 401))
  deadline = time.monotonic() + 20
  while os.path.exists(tmp_path / store) and time.monotonic() < deadline:
    time.sleep(0.05)
  assert not os.path.exists(tmp_path / store)


def test_a_write_cut_by_sigkill_is_abandoned_and_removed_by_the_next_eviction(cluster, tmp_path):
  dispatcher = cluster("dispatcher", "--port=0")
  worker = cluster(
    "worker",
    f"--dispatcher_address={dispatcher.address}",
    "--heartbeat_interval_s=0.2",
    f"--autocache_dir={tmp_path}",
    "--autocache_max_bytes=100000000",
    "--autocache_policy=always",
  )
  paced = jaxfeed.Dataset.range(200).map(service_udfs.paced).autocache()
  with paced.distribute(dispatcher.address, "parallel_epochs").make_iterator() as reader:
    next(reader)
    worker.kill()  # mid-write: its temporary folder and reservation stay
  [partial] = os.listdir(tmp_path / ".jaxfeed" / "writes")
  assert os.path.isdir(tmp_path / partial)
  listed = jaxfeed_cli("cache", "ls", str(tmp_path))
  assert listed.stdout.splitlines()[1].split()[-1] == "abandoned"
  os.makedirs(tmp_path / "by-hand")  # an entry deleted by hand leaves its lock file
  open(tmp_path / ".jaxfeed" / "locks" / "by-hand", "w").close()
  os.rmdir(tmp_path / "by-hand")
  start(cluster, tmp_path, "--autocache_max_bytes=100000000")  # evicts as it starts
  deadline = time.monotonic() + 20
  while (
    os.path.exists(tmp_path / partial) or os.listdir(tmp_path / ".jaxfeed" / "locks")
  ) and time.monotonic() < deadline:
    time.sleep(0.05)
  assert sorted(os.listdir(tmp_path)) == [".jaxfeed"]
  assert os.listdir(tmp_path / ".jaxfeed" / "writes") == []
  assert os.listdir(tmp_path / ".jaxfeed" / "locks") == []


def jaxfeed_cli(*args: str) -> subprocess.CompletedProcess:
  return subprocess.run(
    [sys.executable, "-m", "jaxfeed.cli", *args],
    capture_output=True,
    text=True,
    timeout=60,
    cwd=REPO_ROOT,
  )


def test_cache_ls_and_rm_show_and_remove_entries_and_refuse_those_in_use(cluster, tmp_path):
  dispatcher = start(cluster, tmp_path)
  read(dispatcher, 0)
  read(dispatcher, 1)
  reader = slow_reader(dispatcher, 1)
  try:
    listed = jaxfeed_cli("cache", "ls", str(tmp_path))
    assert listed.returncode == 0, listed.stderr
    lines = listed.stdout.splitlines()
    assert lines[0].split() == ["ENTRY", "BYTES", "LAST", "USED", "STATE"]
    rows = {line.split()[0]: line.split() for line in lines[1:-1]}
    assert set(rows) == {key(0), key(1)}
    assert rows[key(0)][-1] == "idle" and rows[key(1)][-1] == "reading"
    assert ENTRY_BYTES < int(rows[key(0)][1]) < ENTRY_BYTES + 10_000
    assert lines[-1].startswith("2 entries, ")
    as_json = json.loads(jaxfeed_cli("cache", "ls", "--json", str(tmp_path)).stdout)
    assert [e["entry"] for e in as_json] == [key(0), key(1)]  # least recently used first

    refused = jaxfeed_cli("cache", "rm", str(tmp_path), key(1))
    assert refused.returncode == 1
    assert (
      f"jaxfeed cache rm: '{key(1)}' in '{tmp_path}' is being read or written by "
      "a process using the folder; not removed"
    ) in refused.stderr
    missing = jaxfeed_cli("cache", "rm", str(tmp_path), "nope")
    assert missing.returncode == 2
    assert f"no entry 'nope' in '{tmp_path}'; its entries: " in missing.stderr
    everything = jaxfeed_cli("cache", "rm", str(tmp_path))
    assert everything.returncode == 1  # entry 1 stays, entry 0 goes
    assert complete_entries(str(tmp_path)) == {key(1)}
  finally:
    finish(reader, 1)
  removed = jaxfeed_cli("cache", "rm", str(tmp_path), key(1))
  assert removed.returncode == 0 and removed.stdout == f"removed 1 entries: {key(1)}\n"
  assert complete_entries(str(tmp_path)) == set()
  assert "0 entries, 0 bytes" in jaxfeed_cli("cache", "ls", str(tmp_path)).stdout


def test_cache_commands_explain_bad_arguments(tmp_path):
  for args, message in [
    (("cache", "ls", str(tmp_path / "none")), f"no folder '{tmp_path / 'none'}'"),
    (("cache", "frob", str(tmp_path)), "invalid choice: 'frob'"),
    (("cache",), "the following arguments are required: ACTION"),
  ]:
    result = jaxfeed_cli(*args)
    assert result.returncode == 2 and message in result.stderr, (args, result.stderr)
  for args in (("cache", "--help"), ("cache", "ls", "--help"), ("cache", "rm", "--help")):
    result = jaxfeed_cli(*args)
    assert result.returncode == 0 and "autocache folder" in result.stdout


@pytest.mark.parametrize(
  "flags, message",
  [
    (
      ("--autocache_max_bytes=-5",),
      "autocache_max_bytes must be an integer >= 1 (bytes), "
      "or None (0 on the command line) for no limit, got -5",
    ),
    (
      ("--autocache_ttl_s=-1",),
      "autocache_ttl_s must be a number of seconds > 0, or None "
      "(0 on the command line) to keep entries, got -1.0",
    ),
    (("--autocache_ttl_s=inf",), "got inf"),
  ],
)
def test_worker_refuses_bad_limits_by_name(tmp_path, flags, message):
  result = subprocess.run(
    [
      sys.executable,
      "-m",
      "jaxfeed.cli",
      "worker",
      "--dispatcher_address=127.0.0.1:1",
      f"--autocache_dir={tmp_path}",
      *flags,
    ],
    capture_output=True,
    text=True,
    timeout=60,
  )
  assert result.returncode == 2 and message in result.stderr, result.stderr


def test_limits_need_a_folder_and_worker_help_lists_them(tmp_path):
  result = subprocess.run(
    [
      sys.executable,
      "-m",
      "jaxfeed.cli",
      "worker",
      "--dispatcher_address=127.0.0.1:1",
      "--autocache_ttl_s=5",
    ],
    capture_output=True,
    text=True,
    timeout=60,
  )
  assert result.returncode == 2
  assert (
    "autocache_max_bytes and autocache_ttl_s limit the autocache folder: they need "
    "autocache_dir" in result.stderr
  )
  shown = subprocess.run(
    [sys.executable, "-m", "jaxfeed.cli", "worker", "--help"],
    capture_output=True,
    text=True,
    timeout=60,
  ).stdout
  assert "--autocache_max_bytes" in shown and "--autocache_ttl_s" in shown


def test_folder_limits_refuse_bad_values():
  from jaxfeed.ops.autocache_folder import AutocacheFolder, FolderLimits  # pylint: disable=g-import-not-at-top

  for bad in (0, -1, 1.5, True, "10"):
    with pytest.raises(ValueError, match=f"autocache_max_bytes .* got {bad!r}"):
      FolderLimits(max_bytes=bad)
  for bad in (0, -2.0, float("nan"), "5", False):
    with pytest.raises(ValueError, match="autocache_ttl_s .* got "):
      FolderLimits(ttl_s=bad)
  assert AutocacheFolder(".", FolderLimits(10, 0.5)).limits.ttl_s == 0.5
