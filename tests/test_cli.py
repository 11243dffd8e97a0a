"""The `jaxfeed` command: convert round-trips every record and resumes after
a kill, inspect describes files, bench times a pipeline, servers start."""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import jaxfeed
from jaxfeed import cli

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def records(count, seed=0):
  rng = np.random.default_rng(seed)
  return [rng.bytes(int(n)) for n in rng.integers(0, 300, count)]


def run_cli(*args, timeout=120, cwd=REPO):
  env = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu")
  return subprocess.run([sys.executable, "-m", "jaxfeed.cli", *args], cwd=cwd, env=env,
                        capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("shards,workers", [(1, 1), (3, 2)])
def test_convert_round_trips_every_record(tmp_path, shards, workers):
  original = records(500)
  jaxfeed.write_tfrecord(str(tmp_path / "in.tfrecord"), original)
  result = cli.convert([str(tmp_path / "in.tfrecord")], str(tmp_path / "mid.array_record"),
                       num_shards=shards, workers=workers, progress=False)
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
  env = dict(os.environ, PYTHONPATH=REPO, JAX_PLATFORMS="cpu")
  proc = subprocess.Popen([sys.executable, "-m", "jaxfeed.cli", "convert", str(src),
                           str(out), "--num_shards=40", "--workers=1"], cwd=REPO,
                          env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  paths = cli.shard_paths(str(out), 40)
  deadline = time.monotonic() + 60
  while not os.path.exists(paths[2]) and time.monotonic() < deadline:
    time.sleep(0.005)
  proc.send_signal(signal.SIGKILL)
  proc.wait(timeout=30)
  done_before = [p for p in paths if os.path.exists(p)]
  assert 3 <= len(done_before) < 40, "the conversion was not caught mid-way"
  result = cli.convert([str(src)], str(out), num_shards=40, progress=False)
  assert result["skipped"] == len(done_before)
  back = jaxfeed.ArrayRecordSource(paths)
  assert [back[i] for i in range(len(back))] == original


def test_convert_errors_name_the_file_or_format(tmp_path):
  with pytest.raises(cli.UsageError, match="No such input file.*missing.tfrecord"):
    cli.convert([str(tmp_path / "missing.tfrecord")], str(tmp_path / "o.array_record"))
  with pytest.raises(cli.UsageError, match="format of .*data.bin.*--from/--to"):
    cli.convert([str(tmp_path / "data.bin")], str(tmp_path / "o.array_record"))
  done = run_cli("convert", str(tmp_path / "missing.tfrecord"), "x.array_record")
  assert done.returncode == 2 and "No such input file" in done.stderr


def test_inspect_describes_a_file(tmp_path):
  jaxfeed.write_array_record(str(tmp_path / "t.array_record"),
                             [b"hello world", b"x" * 10, b""])
  done = run_cli("inspect", str(tmp_path / "t.array_record"))
  assert done.returncode == 0, done.stderr
  info = json.loads(done.stdout)
  assert info["records"] == 3 and info["bytes"] == 21
  assert info["record_bytes"] == {"min": 0, "mean": 7.0, "max": 11}
  assert "hello world" in info["samples"][0]


def test_bench_times_a_users_pipeline(tmp_path):
  (tmp_path / "my_pipeline.py").write_text(
      "from jaxfeed.dataset import Dataset\n"
      "def make():\n  return Dataset.range(10**9).map(lambda x: x + 1).ignore_errors()\n")
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
      ".map(slow, num_parallel_calls=2).batch(4)\n")
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


def test_the_console_script_is_installed_with_the_package():
  script = os.path.join(os.path.dirname(sys.executable), "jaxfeed")
  assert os.path.exists(script), "pip install -e . installs the jaxfeed command"
  done = subprocess.run([script, "--help"], capture_output=True, text=True, timeout=60)
  assert done.returncode == 0 and "convert" in done.stdout
