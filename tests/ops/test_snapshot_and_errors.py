"""snapshot (persist once, read back, exact resume, a writer killed mid-write)
and ignore_errors over corrupt records, up to a Loader."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import jaxfeed
from jaxfeed.dataset import Dataset
from op_testing import REPO_ROOT, check_resume, run

# A pipeline a child process can build too (module-level, importable UDF).
SNAPSHOT_SCRIPT = textwrap.dedent("""
    import sys, time
    import numpy as np
    from jaxfeed.dataset import Dataset
    import snapshot_udfs
    path, marker, delay = sys.argv[1], sys.argv[2], float(sys.argv[3])
    snapshot_udfs.configure(marker, delay)
    ds = Dataset.range(200).map(snapshot_udfs.record_and_square).snapshot(path)
    out = [int(x) for x in ds]
    print(sum(out), len(out), flush=True)
""")


@pytest.fixture
def udfs_module(tmp_path):
  """A UDF module that counts its calls in a marker file (by appending)."""
  module = tmp_path / "mods" / "snapshot_udfs.py"
  module.parent.mkdir()
  module.write_text(
    textwrap.dedent("""
      import time
      _MARKER = None
      _DELAY = 0.0

      def configure(marker, delay):
        global _MARKER, _DELAY
        _MARKER, _DELAY = marker, delay

      def record_and_square(x):
        with open(_MARKER, "a") as f:
          f.write("x")
        time.sleep(_DELAY)
        return x * x
  """)
  )
  return module.parent


def run_child(udfs_dir, path, marker, delay, wait=True):
  env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO_ROOT), str(udfs_dir)]))
  proc = subprocess.Popen(
    [sys.executable, "-c", SNAPSHOT_SCRIPT, str(path), str(marker), str(delay)],
    env=env,
    cwd=REPO_ROOT,
    stdout=subprocess.PIPE,
    stderr=subprocess.PIPE,
    text=True,
  )
  if not wait:
    return proc
  out, err = proc.communicate(timeout=120)
  assert proc.returncode == 0, err[-3000:]
  return out.split()


def calls(marker):
  return len(marker.read_text()) if marker.exists() else 0


def test_a_snapshot_is_written_once_and_read_by_other_processes(tmp_path, udfs_module):
  path, marker = tmp_path / "snap", tmp_path / "calls"
  expected = [str(sum(x * x for x in range(200))), "200"]
  assert run_child(udfs_module, path, marker, 0) == expected
  assert calls(marker) == 200
  assert run_child(udfs_module, path, marker, 0) == expected
  assert calls(marker) == 200  # read from the snapshot: the map never ran


def test_a_writer_killed_mid_write_leaves_no_partial_snapshot(tmp_path, udfs_module):
  path, marker = tmp_path / "snap", tmp_path / "calls"
  proc = run_child(udfs_module, path, marker, 0.01, wait=False)
  deadline = time.monotonic() + 60
  while calls(marker) < 50 and time.monotonic() < deadline:
    time.sleep(0.01)
  assert proc.poll() is None, "the writer finished before it could be killed"
  proc.send_signal(signal.SIGKILL)
  proc.communicate(timeout=30)
  killed_at = calls(marker)
  assert 50 <= killed_at < 200
  expected = [str(sum(x * x for x in range(200))), "200"]
  # The next run does not read the torn snapshot: it computes everything.
  assert run_child(udfs_module, path, marker, 0) == expected
  assert calls(marker) == killed_at + 200
  assert run_child(udfs_module, path, marker, 0) == expected
  assert calls(marker) == killed_at + 200


def test_snapshot_resumes_exactly_while_writing_and_reading(tmp_path):
  def build():
    return Dataset.range(30).map(lambda x: {"x": x, "v": np.arange(x % 5)}).snapshot(tmp_path / "s")

  check_resume(build, with_seeds=True)  # the first pass writes, later ones read
  assert os.listdir(tmp_path / "s")


def test_a_changed_pipeline_gets_a_snapshot_of_its_own(tmp_path):
  first = Dataset.range(5).snapshot(tmp_path)
  second = Dataset.range(7).snapshot(tmp_path)
  assert [int(x) for x in run(first)] == list(range(5))
  assert [int(x) for x in run(second)] == list(range(7))
  assert len(os.listdir(tmp_path)) == 2


def corrupt_tfrecord(path, count=12, bad=(3, 7)):
  records = [f"record-{i}".encode() for i in range(count)]
  jaxfeed.write_tfrecord(path, records)
  data = bytearray(path.read_bytes())
  for i in bad:  # flip a payload byte: that record's CRC no longer matches
    data[data.index(f"record-{i}".encode())] ^= 0xFF
  path.write_bytes(bytes(data))
  return records


def test_ignore_errors_skips_corrupt_records_of_a_file_source(tmp_path):
  path = tmp_path / "data.tfrecord"
  records = corrupt_tfrecord(path)
  source = jaxfeed.TFRecordSource([str(path)])
  with pytest.raises(jaxfeed.CorruptRecordError, match="data.tfrecord"):
    run(Dataset.from_source(source))
  ds = Dataset.from_source(source).ignore_errors()
  with ds.make_iterator() as iterator:
    assert list(iterator) == [r for i, r in enumerate(records) if i not in (3, 7)]
    assert iterator.stats()["ops"][-1]["errors_ignored"] == 2
  # Without ignore_errors the records before the bad one still arrive first.
  with Dataset.from_source(source).make_iterator() as iterator:
    assert [next(iterator) for _ in range(3)] == records[:3]
    with pytest.raises(jaxfeed.CorruptRecordError):
      next(iterator)
    assert next(iterator) == records[4]


def test_a_loader_survives_a_corrupt_record_and_counts_it(tmp_path):
  path = tmp_path / "data.tfrecord"
  corrupt_tfrecord(path, count=40, bad=(5,))
  source = jaxfeed.TFRecordSource([str(path)])
  ds = (
    Dataset.from_source(source)
    .map(lambda r: np.frombuffer(r.ljust(16, b" "), np.uint8))
    .ignore_errors()
    .batch(8, drop_remainder=True)
  )
  with jaxfeed.Loader(ds, prefetch=2) as loader:
    batches = list(loader)
    state = loader.get_state()
  assert len(batches) == 39 // 8 and all(b.shape == (8, 16) for b in batches)
  assert '"errors_ignored": 1' in __import__("json").dumps(state)
