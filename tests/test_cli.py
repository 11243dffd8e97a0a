"""The `jaxfeed` command: convert round-trips every record and resumes after
a kill, inspect describes files, bench times a pipeline, servers start."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import psutil
import pytest

import jaxfeed
from jaxfeed import cli
from jaxfeed import convert as convert_lib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def records(count, seed=0):
  rng = np.random.default_rng(seed)
  return [rng.bytes(int(n)) for n in rng.integers(0, 300, count)]


def run_cli(*args, timeout=120, cwd=REPO):
  env = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu")
  return subprocess.run(
    [sys.executable, "-m", "jaxfeed.cli", *args],
    cwd=cwd,
    env=env,
    capture_output=True,
    text=True,
    timeout=timeout,
  )


def start_conversion(*args, stderr=subprocess.DEVNULL):
  """`jaxfeed convert ARGS...` as a process of its own."""
  env = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu")
  return subprocess.Popen(
    [sys.executable, "-m", "jaxfeed.cli", "convert", *map(str, args)],
    cwd=REPO,
    env=env,
    stdout=subprocess.DEVNULL,
    stderr=stderr,
    text=True,
  )


def kill_mid_conversion(src, out, num_shards=40):
  """SIGKILLs `jaxfeed convert SRC OUT` once its third shard is complete;
  returns (the shard paths, those complete then)."""
  proc = start_conversion(src, out, f"--num_shards={num_shards}", "--workers=1")
  paths = convert_lib.shard_paths(str(out), num_shards)
  deadline = time.monotonic() + 60
  while not os.path.exists(paths[2]) and time.monotonic() < deadline:
    time.sleep(0.005)
  proc.send_signal(signal.SIGKILL)
  proc.wait(timeout=30)
  done_before = [p for p in paths if os.path.exists(p)]
  assert 3 <= len(done_before) < num_shards, "the conversion was not caught mid-way"
  return paths, done_before


@pytest.mark.parametrize("shards,workers", [(1, 1), (3, 2)])
def test_convert_round_trips_every_record(tmp_path, shards, workers):
  original = records(500)
  jaxfeed.write_tfrecord(str(tmp_path / "in.tfrecord"), original)
  result = cli.convert(
    [str(tmp_path / "in.tfrecord")],
    str(tmp_path / "mid.array_record"),
    num_shards=shards,
    workers=workers,
    progress=False,
  )
  assert result["records"] == 500 and len(result["shards"]) == shards
  back = cli.convert(result["shards"], str(tmp_path / "out.tfrecord"), progress=False)
  assert back["records"] == 500
  out = jaxfeed.TFRecordSource([str(tmp_path / "out.tfrecord")])
  assert [out[i] for i in range(len(out))] == original


def test_a_killed_conversion_keeps_its_finished_shards_and_completes(tmp_path):
  original = records(4000, seed=1)
  src = tmp_path / "in.tfrecord"
  jaxfeed.write_tfrecord(str(src), original)
  out = tmp_path / "out.array_record"
  paths, done_before = kill_mid_conversion(src, out)
  result = cli.convert([str(src)], str(out), num_shards=40, progress=False)
  assert result["skipped"] == len(done_before)
  back = jaxfeed.ArrayRecordSource(paths)
  assert [back[i] for i in range(len(back))] == original


def wait_for(condition, what, timeout_s=60):
  deadline = time.monotonic() + timeout_s
  while not condition():
    assert time.monotonic() < deadline, f"timed out waiting for {what}"
    time.sleep(0.005)


def tfrecords_of(path):
  source = jaxfeed.TFRecordSource([str(path)])
  return list(source.get_many(range(len(source))))


@pytest.mark.parametrize(
  "first, second",
  [
    # A staging name (a script renames it when done), and the final name.
    ("data.tfrecord.tmp", "data.tfrecord"),
    ("same.tfrecord", "same.tfrecord"),
  ],
)
def test_concurrent_conversions_in_one_folder_keep_each_others_files(tmp_path, first, second):
  original = records(100000, seed=3)
  src = tmp_path / "in.tfrecord"
  jaxfeed.write_tfrecord(str(src), original)
  jaxfeed.TFRecordSource([str(src)])  # its offset index, before the folder is watched
  before = set(os.listdir(tmp_path))
  paused = start_conversion(
    src, tmp_path / first, "--to=tfrecord", "--workers=1", stderr=subprocess.PIPE
  )
  try:
    # Stopped from outside while it writes its temporary...
    wait_for(lambda: set(os.listdir(tmp_path)) - before, "the first one's temporary")
    os.kill(paused.pid, signal.SIGSTOP)
    assert not (tmp_path / first).exists(), "the first conversion was not caught mid-write"
    # ... while the second one runs from start to end in the same folder.
    done = run_cli("convert", str(src), str(tmp_path / second), "--to=tfrecord", "--workers=1")
    assert done.returncode == 0, done.stderr
    os.kill(paused.pid, signal.SIGCONT)
    _, stderr = paused.communicate(timeout=120)
    assert paused.returncode == 0, stderr
  finally:
    if paused.poll() is None:
      paused.kill()
      paused.communicate()
  # Once more with the first one complete: its output stays.
  os.remove(tmp_path / second)
  done = run_cli("convert", str(src), str(tmp_path / second), "--to=tfrecord", "--workers=1")
  assert done.returncode == 0, done.stderr
  for name in {first, second}:
    assert tfrecords_of(tmp_path / name) == original
  left = [name for name in os.listdir(tmp_path) if not name.endswith(".idx")]
  assert sorted(left) == sorted({"in.tfrecord", first, second})


def test_a_conversion_killed_mid_write_leaves_no_partial_shard_and_its_pool_exits(tmp_path):
  original = records(200000, seed=4)
  src = tmp_path / "in.tfrecord"
  jaxfeed.write_tfrecord(str(src), original)
  jaxfeed.TFRecordSource([str(src)])
  out = tmp_path / "out.array_record"
  paths = convert_lib.shard_paths(str(out), 4)
  # Not the record of what the conversion converts (see jaxfeed.convert).
  known = (
    set(os.listdir(tmp_path)) | set(map(os.path.basename, paths)) | {".out.array_record.convert"}
  )
  proc = start_conversion(src, out, "--num_shards=4", "--workers=2")
  pool = []

  def writing():
    for name in set(os.listdir(tmp_path)) - known:
      try:
        if os.stat(tmp_path / name).st_size > 0:
          return True
      except FileNotFoundError:
        pass  # renamed into place meanwhile
    return False

  try:
    wait_for(writing, "a temporary with records in it")
    pool = psutil.Process(proc.pid).children(recursive=True)
    assert pool
    proc.kill()
    proc.wait(timeout=30)
    _, alive = psutil.wait_procs(pool, timeout=15)
    assert not alive, "the pool's processes outlived the killed conversion"
  finally:
    proc.kill()
    proc.wait(timeout=30)
    for process in pool:
      try:
        process.kill()
      except psutil.NoSuchProcess:
        pass
  # Under the final names only complete shards.
  bounds = [len(original) * i // 4 for i in range(5)]
  complete = [p for p in paths if os.path.exists(p)]
  assert len(complete) < 4
  for i, path in enumerate(paths):
    if os.path.exists(path):
      shard = jaxfeed.ArrayRecordSource([path])
      assert list(shard.get_many(range(len(shard)))) == original[bounds[i] : bounds[i + 1]]
  done = run_cli("convert", str(src), str(out), "--num_shards=4", "--workers=2")
  assert done.returncode == 0, done.stderr
  assert json.loads(done.stdout)["skipped"] == len(complete)
  back = jaxfeed.ArrayRecordSource(paths)
  assert list(back.get_many(range(len(back)))) == original
  left = [name for name in os.listdir(tmp_path) if not name.endswith(".idx")]
  assert sorted(left) == sorted(["in.tfrecord", *map(os.path.basename, paths)])


def table_columns(rows=600, seed=2):
  """A table of every kind of column a tf.train.Example holds."""
  rng = np.random.default_rng(seed)
  return {
    "label": rng.integers(-5, 10**12, rows),
    "score": rng.random(rows).astype(np.float32),
    "vector": rng.integers(0, 100, (rows, 3)),
    "name": np.array([b"row-%d" % i for i in range(rows)]),
  }


def write_table(path, columns, row_group_size=128):
  """`columns` as an .npz or a Parquet file (binary, not string, for bytes)."""
  if str(path).endswith(".npz"):
    np.savez(path, **columns)
    return
  import pyarrow as pa  # pylint: disable=g-import-not-at-top
  import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top

  arrays = {
    k: pa.array(list(v) if v.ndim > 1 else v, pa.binary() if v.dtype.kind == "S" else None)
    for k, v in columns.items()
  }
  pq.write_table(pa.table(arrays), str(path), row_group_size=row_group_size)


def read_table(paths):
  """name -> array of every row of .npz or Parquet files, in order."""
  if paths[0].endswith(".npz"):
    loaded = [np.load(p) for p in paths]
    return {k: np.concatenate([f[k] for f in loaded]) for k in loaded[0].files}
  import pyarrow as pa  # pylint: disable=g-import-not-at-top
  import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top

  table = pa.concat_tables([pq.read_table(p) for p in paths])
  return {
    k: (
      np.array(c.to_pylist())
      if pa.types.is_list(c.type) or pa.types.is_binary(c.type)
      else c.to_numpy()
    )
    for k, c in zip(table.column_names, table.columns)
  }


@pytest.mark.parametrize("ext", [".npz", ".parquet"])
def test_convert_round_trips_every_row_of_a_table(tmp_path, ext):
  columns = table_columns()
  write_table(tmp_path / f"in{ext}", columns)
  # Two inputs, four shards over two processes, through both record formats.
  mid = cli.convert(
    [str(tmp_path / f"in{ext}")] * 2,
    str(tmp_path / "mid.array_record"),
    num_shards=4,
    workers=2,
    progress=False,
  )
  assert mid["records"] == 1200
  rows = [
    jaxfeed.parse_single_example(
      r,
      {
        "label": jaxfeed.FixedLenFeature([], np.int64),
        "vector": jaxfeed.FixedLenFeature([3], np.int64),
        "name": jaxfeed.FixedLenFeature([], bytes),
      },
    )
    for r in jaxfeed.ArrayRecordSource(mid["shards"]).get_many(range(1200))
  ]
  assert [r["label"] for r in rows] == [*columns["label"]] * 2
  assert [r["name"] for r in rows] == [*columns["name"]] * 2
  np.testing.assert_array_equal(np.stack([r["vector"] for r in rows[:600]]), columns["vector"])
  out = cli.convert(
    mid["shards"], str(tmp_path / f"out{ext}"), num_shards=3, workers=2, progress=False
  )
  back = read_table(out["shards"])
  assert sorted(back) == sorted(columns)
  for name, column in columns.items():
    np.testing.assert_array_equal(back[name], np.concatenate([column, column]))
    assert back[name].dtype == column.dtype, name


def test_an_npy_array_is_one_feature_a_row(tmp_path):
  images = np.arange(40 * 6, dtype=np.float32).reshape(40, 6)
  np.save(tmp_path / "images.npy", images)
  cli.convert([str(tmp_path / "images.npy")], str(tmp_path / "images.tfrecord"), progress=False)
  first = jaxfeed.TFRecordSource([str(tmp_path / "images.tfrecord")])[0]
  parsed = jaxfeed.parse_single_example(first, {"array": jaxfeed.FixedLenFeature([6], np.float32)})
  np.testing.assert_array_equal(parsed["array"], images[0])
  cli.convert([str(tmp_path / "images.tfrecord")], str(tmp_path / "back.npy"), progress=False)
  np.testing.assert_array_equal(np.load(tmp_path / "back.npy"), images)


def test_parquet_rows_of_different_lengths_and_nulls_round_trip(tmp_path):
  import pyarrow as pa  # pylint: disable=g-import-not-at-top
  import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top

  table = pa.table(
    {
      "tokens": pa.array([[1, 2, 3], [], None, [7]], pa.list_(pa.int64())),
      "text": pa.array(["a", None, "ü", ""], pa.string()),
    }
  )
  pq.write_table(table, tmp_path / "t.parquet")
  cli.convert([str(tmp_path / "t.parquet")], str(tmp_path / "t.tfrecord"), progress=False)
  cli.convert([str(tmp_path / "t.tfrecord")], str(tmp_path / "back.parquet"), progress=False)
  back = pq.read_table(tmp_path / "back.parquet")
  assert back.column("tokens").to_pylist() == [[1, 2, 3], [], None, [7]]
  # Text comes back as its UTF-8 bytes (an Example has no string type).
  assert back.column("text").to_pylist() == [b"a", None, "ü".encode(), b""]


@pytest.mark.parametrize("source,target", [(".npz", ".parquet"), (".parquet", ".tfrecord")])
def test_a_killed_table_conversion_completes_without_duplicates(tmp_path, source, target):
  columns = {"index": np.arange(20000)}
  write_table(tmp_path / f"in{source}", columns, row_group_size=500)
  out = tmp_path / f"out{target}"
  paths, done_before = kill_mid_conversion(tmp_path / f"in{source}", out)
  done = run_cli(
    "convert", str(tmp_path / f"in{source}"), str(out), "--num_shards=40", "--workers=2"
  )
  assert done.returncode == 0, done.stderr
  assert json.loads(done.stdout)["skipped"] == len(done_before)
  if target == ".tfrecord":
    spec = {"index": jaxfeed.FixedLenFeature([], np.int64)}
    got = [
      jaxfeed.parse_single_example(r, spec)["index"]
      for r in jaxfeed.TFRecordSource(paths).get_many(range(20000))
    ]
  else:
    got = read_table(paths)["index"]
  np.testing.assert_array_equal(got, columns["index"])
  # Nothing half-written is left beside the shards (TFRecordSource's
  # offset indexes aside).
  left = [name for name in os.listdir(tmp_path) if not name.endswith(".idx")]
  assert sorted(left) == sorted([f"in{source}", *map(os.path.basename, paths)])


@pytest.mark.parametrize("ext", [".npz", ".parquet"])
def test_inspect_decodes_a_table_row(tmp_path, ext):
  write_table(tmp_path / f"t{ext}", table_columns(rows=5))
  done = run_cli("inspect", str(tmp_path / f"t{ext}"))
  assert done.returncode == 0, done.stderr
  info = json.loads(done.stdout)
  assert info["records"] == 5
  assert "'name': bytes[1] [b'row-0']" in info["samples"][0]
  assert "'vector': int64[3]" in info["samples"][0]


def test_table_errors_name_the_file_and_feature(tmp_path):
  np.save(tmp_path / "objects.npy", np.array([{"a": 1}], object))
  with pytest.raises(cli.UsageError, match="objects.npy.*without pickle"):
    cli.convert([str(tmp_path / "objects.npy")], str(tmp_path / "o.tfrecord"))
  np.savez(tmp_path / "ragged.npz", a=np.zeros(3), b=np.zeros(4))
  with pytest.raises(cli.UsageError, match="ragged.npz.*same leading"):
    cli.convert([str(tmp_path / "ragged.npz")], str(tmp_path / "o.tfrecord"))
  jaxfeed.write_tfrecord(
    str(tmp_path / "var.tfrecord"),
    [jaxfeed.make_example({"t": [1, 2]}), jaxfeed.make_example({"t": [3]})],
  )
  with pytest.raises(cli.UsageError, match="feature 't' has \\[1, 2\\] values"):
    cli.convert([str(tmp_path / "var.tfrecord")], str(tmp_path / "o.npz"), progress=False)
  assert not list(tmp_path.glob("o.npz*")), "no half-written output is left"
  jaxfeed.write_tfrecord(str(tmp_path / "raw.tfrecord"), [b"\xff\xff"])
  with pytest.raises(cli.UsageError, match="record 0 is not a tf.train.Example"):
    cli.convert([str(tmp_path / "raw.tfrecord")], str(tmp_path / "o.parquet"), progress=False)


def test_convert_errors_name_the_file_or_format(tmp_path):
  with pytest.raises(cli.UsageError, match="No such input file.*missing.tfrecord"):
    cli.convert([str(tmp_path / "missing.tfrecord")], str(tmp_path / "o.array_record"))
  with pytest.raises(cli.UsageError, match="format of .*data.bin.*--from/--to"):
    cli.convert([str(tmp_path / "data.bin")], str(tmp_path / "o.array_record"))
  done = run_cli("convert", str(tmp_path / "missing.tfrecord"), "x.array_record")
  assert done.returncode == 2 and "No such input file" in done.stderr


def test_inspect_describes_a_file(tmp_path):
  jaxfeed.write_array_record(str(tmp_path / "t.array_record"), [b"hello world", b"x" * 10, b""])
  done = run_cli("inspect", str(tmp_path / "t.array_record"))
  assert done.returncode == 0, done.stderr
  info = json.loads(done.stdout)
  assert info["records"] == 3 and info["bytes"] == 21
  assert info["record_bytes"] == {"min": 0, "mean": 7.0, "max": 11}
  assert "hello world" in info["samples"][0]


def test_bench_times_a_users_pipeline(tmp_path):
  (tmp_path / "my_pipeline.py").write_text(
    "from jaxfeed.dataset import Dataset\n"
    "def make():\n  return Dataset.range(10**9).map(lambda x: x + 1).ignore_errors()\n"
  )
  done = run_cli("bench", "my_pipeline:make", "--seconds=1", "--json", cwd=tmp_path)
  assert done.returncode == 0, done.stderr
  result = json.loads(done.stdout)
  assert result["elements"] > 1000 and result["elements_per_s"] > 1000
  rows = result["stats"]["ops"]
  assert [row["op"] for row in rows] == ["range", "map", "ignore_errors"]
  assert rows[-1]["errors_ignored"] == 0


def test_bench_prints_the_per_op_table_and_the_op_to_fix(tmp_path):
  (tmp_path / "slow_pipeline.py").write_text(
    "import time\n"
    "from jaxfeed.dataset import Dataset\n"
    "def slow(x):\n  time.sleep(0.002)\n  return x\n"
    "def make():\n  return Dataset.range(10**9).map(lambda x: x + 1).filter(bool)"
    ".map(slow, num_parallel_calls=2).batch(4)\n"
  )
  done = run_cli("bench", "slow_pipeline:make", "--seconds=2", cwd=tmp_path)
  assert done.returncode == 0, done.stderr
  lines = done.stdout.splitlines()
  assert "elements/s" in lines[0]
  table = [line.split()[0] for line in lines[2:7]]
  assert table == ["op", "range", "map+filter", "map", "batch"]
  assert "Op to fix: 'map' (" in done.stdout


@pytest.mark.parametrize("role", ["dispatcher", "worker"])
def test_server_subcommands_take_the_servers_flags(role):
  done = run_cli(role, "--helpfull", timeout=60)
  assert "--port" in done.stdout + done.stderr


def test_progress_is_silent_off_a_terminal_and_drawn_on_one(capsys):
  from jaxfeed import progress

  with progress.Progress("quiet", 10) as bar:
    bar.advance(10)
  assert capsys.readouterr().err == "" and bar.count == 10
  with progress.Progress("loud work", 4, enabled=True) as bar:
    bar.advance(4)
  assert "loud work" in capsys.readouterr().err


def test_a_conversion_draws_its_progress_on_a_terminal_only(tmp_path, capsys):
  np.savez(tmp_path / "t.npz", x=np.arange(300))
  cli.convert([str(tmp_path / "t.npz")], str(tmp_path / "a.tfrecord"), progress=True)
  assert "convert -> a.tfrecord" in capsys.readouterr().err
  cli.convert([str(tmp_path / "t.npz")], str(tmp_path / "b.tfrecord"))  # stderr is no tty
  assert capsys.readouterr().err == ""


def test_the_console_script_is_installed_with_the_package():
  script = os.path.join(os.path.dirname(sys.executable), "jaxfeed")
  assert os.path.exists(script), "pip install -e . installs the jaxfeed command"
  done = subprocess.run([script, "--help"], capture_output=True, text=True, timeout=60)
  assert done.returncode == 0 and "convert" in done.stdout


# -- a newcomer's command lines ------------------------------------------------
def test_convert_into_a_complete_output_refuses_and_overwrite_replaces_it(tmp_path):
  jaxfeed.write_tfrecord(str(tmp_path / "big.tfrecord"), records(3000, seed=5))
  small = records(500, seed=6)
  jaxfeed.write_tfrecord(str(tmp_path / "small.tfrecord"), small)
  out = tmp_path / "out.array_record"
  assert run_cli("convert", str(tmp_path / "big.tfrecord"), str(out)).returncode == 0
  refused = run_cli("convert", str(tmp_path / "small.tfrecord"), str(out))
  assert refused.returncode == 2 and "Traceback" not in refused.stderr
  assert str(out) in refused.stderr and "--overwrite" in refused.stderr
  assert len(refused.stderr.strip().splitlines()) == 1, refused.stderr
  assert len(jaxfeed.ArrayRecordSource([str(out)])) == 3000, "the old output is untouched"
  done = run_cli("convert", str(tmp_path / "small.tfrecord"), str(out), "--overwrite")
  assert done.returncode == 0, done.stderr
  assert json.loads(done.stdout)["replaced"] == 1
  back = jaxfeed.ArrayRecordSource([str(out)])
  assert list(back.get_many(range(len(back)))) == small
  assert sorted(os.listdir(tmp_path)) == sorted(
    ["big.tfrecord", "big.tfrecord.idx", "small.tfrecord", "small.tfrecord.idx", "out.array_record"]
  )


def test_convert_refuses_another_shard_count_of_the_same_output(tmp_path):
  original = records(400, seed=7)
  jaxfeed.write_tfrecord(str(tmp_path / "in.tfrecord"), original)
  out = str(tmp_path / "out.tfrecord")
  cli.convert([str(tmp_path / "in.tfrecord")], out, num_shards=4, progress=False)
  with pytest.raises(cli.UsageError, match=r"out-00000-of-00004.tfrecord.*--overwrite"):
    cli.convert([str(tmp_path / "in.tfrecord")], out, num_shards=2, progress=False)
  assert not os.path.exists(convert_lib.shard_paths(out, 2)[0])
  result = cli.convert(
    [str(tmp_path / "in.tfrecord")], out, num_shards=2, progress=False, overwrite=True
  )
  assert result["replaced"] == 4
  assert sorted(tmp_path.glob("out*")) == [
    tmp_path / os.path.basename(p) for p in convert_lib.shard_paths(out, 2)
  ]
  assert tfrecords_of(result["shards"][0]) + tfrecords_of(result["shards"][1]) == original


def test_a_killed_conversion_is_not_completed_with_other_inputs(tmp_path):
  src = tmp_path / "in.tfrecord"
  jaxfeed.write_tfrecord(str(src), records(4000, seed=8))
  other = tmp_path / "other.tfrecord"
  replacement = records(4000, seed=9)
  jaxfeed.write_tfrecord(str(other), replacement)
  out = tmp_path / "out.array_record"
  paths, _ = kill_mid_conversion(src, out)
  with pytest.raises(cli.UsageError, match="unfinished conversion of other inputs"):
    cli.convert([str(other)], str(out), num_shards=40, progress=False)
  result = cli.convert([str(other)], str(out), num_shards=40, progress=False, overwrite=True)
  assert result["skipped"] == 0
  back = jaxfeed.ArrayRecordSource(paths)
  assert list(back.get_many(range(len(back)))) == replacement


def test_bench_times_a_pipeline_that_ends_during_its_warm_up(tmp_path):
  (tmp_path / "short_pipeline.py").write_text(
    "from jaxfeed.dataset import Dataset\n"
    "def make():\n  return Dataset.range(50).map(lambda x: x * 2)\n"
    "def empty():\n  return Dataset.range(0)\n"
  )
  done = run_cli("bench", "short_pipeline:make", "--seconds=1", "--json", cwd=tmp_path)
  assert done.returncode == 0, done.stderr
  result = json.loads(done.stdout)
  assert result["elements"] == 50 and result["elements_per_s"] > 0
  assert "within the 1 s warm-up" in result["note"]
  table = run_cli("bench", "short_pipeline:make", "--seconds=1", cwd=tmp_path)
  assert table.stdout.startswith("50 elements in ") and "Note: the pipeline ended" in table.stdout
  empty = run_cli("bench", "short_pipeline:empty", cwd=tmp_path)
  assert empty.returncode == 2 and "has no element" in empty.stderr
  assert "Traceback" not in empty.stderr


@pytest.mark.parametrize("command", ["convert", "inspect", "bench"])
def test_every_option_of_a_command_is_described_in_its_help(command):
  done = run_cli(command, "--help")
  assert done.returncode == 0, done.stderr
  options = done.stdout.split("\noptions:\n")[1]
  entries = re.split(r"\n(?=  -)", options.strip("\n"))
  assert len(entries) >= 3
  for entry in entries:
    flag, _, rest = entry.strip().partition("  ")
    described = rest.strip() or entry.partition("\n")[2].strip()
    assert described, f"{command} --help: {flag} says nothing"


@pytest.mark.parametrize(
  "role,flag", [("dispatcher", "--work_dir"), ("worker", "--dispatcher_address")]
)
def test_server_help_lists_the_servers_flags(role, flag):
  done = run_cli(role, "--help", timeout=60)
  assert done.returncode == 0, done.stderr
  assert f"  {flag}:" in done.stdout and "  --port:" in done.stdout
  assert "Port to serve on" in done.stdout


def write_bench_module(folder):
  (folder / "my_steps.py").write_text(
    "from jaxfeed.dataset import Dataset\n"
    "LIMIT = 3\n"
    "def make():\n  return Dataset.range(10)\n"
    "def make_small():\n  return Dataset.range(3)\n"
  )


# (arguments, what the one-line error must say); {d} is a temporary folder.
WRONG_COMMAND_LINES = [
  (["frobnicate"], "invalid choice: 'frobnicate'"),
  (["convert", "{d}/in.tfrecord", "{d}/o.tfrecord", "--bogus"], "unrecognized arguments: --bogus"),
  (
    ["convert", "{d}/in.tfrecord", "{d}/o.tfrecord", "--num_shards=0"],
    "--num_shards: 0 is less than 1",
  ),
  (
    ["convert", "{d}/in.tfrecord", "{d}/o.tfrecord", "--workers=two"],
    "--workers: 'two' is not an integer",
  ),
  (
    ["convert", "{d}/in.tfrecord", "{d}/o.tfrecord", "--to=csv"],
    "--to: invalid choice: 'csv' (choose from",
  ),
  (
    ["convert", "{d}/missing.tfrecord", "{d}/o.tfrecord"],
    "No such input file: '{d}/missing.tfrecord'",
  ),
  (["convert", "{d}/in.tfrecord"], "needs at least one input and an output"),
  (["inspect", "{d}/missing.tfrecord"], "No such file: '{d}/missing.tfrecord'"),
  (["inspect", "{d}"], "is a folder"),
  (["inspect", "{d}/my_steps.py"], "Cannot tell the format of '{d}/my_steps.py'"),
  (["inspect", "{d}/in.tfrecord", "--samples=-1"], "--samples: -1 is less than 0"),
  (["bench", "my_steps"], "bench needs MODULE:FUNCTION"),
  (
    ["bench", "my_steps:nope"],
    (
      "Module 'my_steps' ({d}/my_steps.py) has no attribute 'nope'; its functions: make, make_small"
    ),
  ),
  (
    ["bench", "my_steps:LIMIT"],
    "Module 'my_steps' ({d}/my_steps.py): 'LIMIT' is of type int, not a function",
  ),
  (["bench", "not_a_module:make"], "No module 'not_a_module' in the current folder"),
  (["bench", "my_steps.py:make"], "(a module name, not a file: my_steps:make)"),
  (["bench", "my_steps:make", "--seconds=soon"], "--seconds: 'soon' is not a number"),
  (["dispatcher", "--bogus=1"], "Unknown command line flag 'bogus'"),
  (["worker", "--port=abc"], "flag --port=abc"),
  (["worker"], "--dispatcher_address must have a value"),
  (["dispatcher", "--port=-5"], "port must be in [0, 65535], got -5"),
  (
    ["dispatcher", "--work_dir={d}/in.tfrecord/journal"],
    "cannot start: [Errno 20] Not a directory: '{d}/in.tfrecord/journal'",
  ),
  (
    ["worker", "--dispatcher_address=127.0.0.1:9", "--worker_token_file={d}/no.token"],
    "Cannot read --worker_token_file '{d}/no.token'",
  ),
]


@pytest.mark.parametrize(
  "argv,message",
  WRONG_COMMAND_LINES,
  ids=[" ".join(a).replace("{d}/", "") for a, _ in WRONG_COMMAND_LINES],
)
def test_a_wrong_command_line_ends_with_one_line_naming_it_and_status_2(tmp_path, argv, message):
  jaxfeed.write_tfrecord(str(tmp_path / "in.tfrecord"), records(3))
  write_bench_module(tmp_path)
  done = run_cli(*[a.format(d=tmp_path) for a in argv], timeout=60, cwd=tmp_path)
  assert done.returncode == 2, (done.returncode, done.stderr)
  assert "Traceback" not in done.stderr
  lines = done.stderr.strip().splitlines()
  assert len(lines) == 1, done.stderr
  assert message.format(d=tmp_path) in lines[0]
  assert lines[0].startswith("jaxfeed")


def test_inspect_shows_images_as_their_size_and_shape(tmp_path):
  import io  # pylint: disable=g-import-not-at-top
  from PIL import Image  # pylint: disable=g-import-not-at-top

  pixels = np.random.default_rng(0).integers(0, 255, (48, 64, 3), np.uint8)
  encoded = {}
  for kind in ("JPEG", "PNG"):
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, kind)
    encoded[kind] = buffer.getvalue()
  jaxfeed.write_tfrecord(
    str(tmp_path / "images.tfrecord"),
    [
      jaxfeed.make_example({"image": encoded["JPEG"], "label": 3, "blob": bytes(range(200))}),
      encoded["PNG"],
    ],
  )
  done = run_cli("inspect", str(tmp_path / "images.tfrecord"), "--samples=2")
  assert done.returncode == 0, done.stderr
  example, png = json.loads(done.stdout)["samples"]
  assert f"'image': bytes[1] [<JPEG, {len(encoded['JPEG'])} bytes, 48x64x3>]" in example
  assert "'blob': bytes[1] [<200 bytes: b'\\x00\\x01\\x02" in example
  assert "'label': int64[1] [3]" in example
  assert len(example) < 200
  assert png == f"<PNG, {len(encoded['PNG'])} bytes, 48x64x3>"


def test_the_worker_command_imports_udf_modules_from_the_current_folder(tmp_path, monkeypatch):
  # As `python -m jaxfeed.service.worker` does: its folder is not on the path.
  from jaxfeed import service  # pylint: disable=g-import-not-at-top

  (tmp_path / "folder_udfs.py").write_text("def add_seven(x):\n  return x + 7\n")
  monkeypatch.syspath_prepend(str(tmp_path))  # the client names the function too
  import folder_udfs  # pylint: disable=g-import-not-at-top

  dispatcher = service.DispatchServer(service.DispatcherConfig(udf_modules=("folder_udfs",)))
  script = os.path.join(os.path.dirname(sys.executable), "jaxfeed")
  worker = subprocess.Popen(
    [
      script,
      "worker",
      f"--dispatcher_address={dispatcher.target}",
      "--udf_modules=folder_udfs",
      "--heartbeat_interval_s=0.1",
      "--drain_timeout_s=0",
    ],
    cwd=tmp_path,
    env=dict(os.environ, JAX_PLATFORMS="cpu"),
    stdout=subprocess.DEVNULL,
    stderr=subprocess.PIPE,
    text=True,
  )
  try:
    dataset = (
      jaxfeed.Dataset.range(10)
      .map(folder_udfs.add_seven)
      .batch(5)
      .distribute(dispatcher.target, timeout_s=30)
    )
    with dataset.make_iterator() as iterator:
      got = np.concatenate(list(iterator)).tolist()
  finally:
    worker.terminate()
    _, stderr = worker.communicate(timeout=30)
    dispatcher.stop()
  assert got == list(range(7, 17)), stderr[-2000:]


@pytest.mark.parametrize("role", ["dispatcher", "worker"])
def test_a_server_on_a_port_in_use_says_so_with_status_2(role):
  import socket  # pylint: disable=g-import-not-at-top

  with socket.socket() as taken:
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    flags = [f"--port={port}"] + (["--dispatcher_address=127.0.0.1:9"] if role == "worker" else [])
    done = run_cli(role, *flags, timeout=60)
  assert done.returncode == 2, done.stderr
  assert "Traceback" not in done.stderr
  # gRPC's own log line may come before it.
  assert done.stderr.strip().splitlines()[-1] == (
    f"jaxfeed {role}: cannot start: Cannot listen on '127.0.0.1:{port}': the port is in "
    "use, or the host is not an address of this machine."
  )


def test_inspect_of_a_damaged_file_describes_its_intact_records_and_the_damage(tmp_path):
  path = str(tmp_path / "t.tfrecord")
  records = [b"r%03d" % i + b"x" * 20 for i in range(20)]
  jaxfeed.write_tfrecord(path, records)
  with open(path, "r+b") as f:  # one bit of record 10's length field
    f.seek(10 * (16 + 24))
    byte = f.read(1)
    f.seek(10 * (16 + 24))
    f.write(bytes([byte[0] ^ 0x01]))
  done = run_cli("inspect", path)
  assert done.returncode == 0, done.stderr
  info = json.loads(done.stdout)
  assert info["records"] == 19 and info["bytes"] == 19 * 24
  assert len(info["damage"]) == 1 and f"{path} bytes 400-440" in info["damage"][0]
