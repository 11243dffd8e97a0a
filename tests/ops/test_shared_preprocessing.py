"""Shared preprocessing: `autocache(directory)` after from_source and
per-record map / filter ops keeps the results by record index, for every
sampler, and for every process given the same folder."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import jaxfeed
from jaxfeed.ops import record_store, shared_preprocessing

N = 600
SOURCE = jaxfeed.ArraySource({"x": np.arange(N)})
CALLS = {"prep": 0}


def entries(folder):
  """The folder's entries, less its bookkeeping (jaxfeed.ops.autocache_folder)."""
  return [p for p in folder.iterdir() if p.name != ".jaxfeed"]


def prep(element):
  CALLS["prep"] += 1
  return {"x": element["x"] * 3, "row": np.full(4, element["x"], np.int32)}


def odd_free(element):
  return element["x"] % 2 == 0


def pipeline(sampler, directory=None, fn=prep, policy="always"):
  return (
    jaxfeed.Dataset.from_source(SOURCE, sampler)
    .map(fn)
    .filter(odd_free)
    .autocache(directory, policy=policy)
  )


def xs(dataset) -> list[int]:
  return [int(e["x"]) for e in dataset]


@pytest.fixture(autouse=True)
def zero_calls():
  CALLS["prep"] = 0


SAMPLERS = {
  "shuffled": lambda: jaxfeed.IndexSampler(N, shuffle=True, seed=3),
  "another seed": lambda: jaxfeed.IndexSampler(N, shuffle=True, seed=11),
  "a shard": lambda: jaxfeed.IndexSampler(
    N, shuffle=True, seed=3, shard_options=jaxfeed.ShardOptions(1, 3)
  ),
  "two epochs": lambda: jaxfeed.IndexSampler(N, shuffle=True, seed=5, num_epochs=2),
  "in order": lambda: jaxfeed.IndexSampler(N),
}


@pytest.mark.parametrize("name", sorted(SAMPLERS))
def test_each_pipeline_reads_exactly_its_own_elements(tmp_path, name):
  expected = xs(pipeline(SAMPLERS[name]()))
  assert xs(pipeline(SAMPLERS[name](), str(tmp_path))) == expected


def test_pipelines_with_other_samplers_preprocess_each_record_once(tmp_path):
  for name in sorted(SAMPLERS):
    xs(pipeline(SAMPLERS[name](), str(tmp_path)))
  assert CALLS["prep"] == N  # the first pipeline computed every block
  assert [p.name.startswith("records-") for p in entries(tmp_path)] == [True]


def test_iterating_again_reshuffles_and_reads_the_store(tmp_path):
  dataset = pipeline(jaxfeed.IndexSampler(N, shuffle=True, seed=7), str(tmp_path))
  plain = pipeline(jaxfeed.IndexSampler(N, shuffle=True, seed=7))
  first, second = xs(dataset), xs(dataset)
  assert first != second and sorted(first) == sorted(second)
  assert [first, second] == [xs(plain), xs(plain)]
  assert CALLS["prep"] == 3 * N  # once into the store, twice for `plain`


def test_a_read_resumes_exactly_from_its_state(tmp_path):
  sampler = lambda: jaxfeed.IndexSampler(N, shuffle=True, seed=2)
  expected = xs(pipeline(sampler()))
  with pipeline(sampler(), str(tmp_path)).make_iterator() as iterator:
    head = [int(next(iterator)["x"]) for _ in range(100)]
    state = iterator.get_state()
  with pipeline(sampler(), str(tmp_path)).make_iterator() as iterator:
    iterator.set_state(state)
    assert head + [int(e["x"]) for e in iterator] == expected


def test_another_function_is_another_store(tmp_path):
  sampler = lambda: jaxfeed.IndexSampler(N, shuffle=True, seed=3)
  xs(pipeline(sampler(), str(tmp_path)))
  other = lambda element: {"x": element["x"] * 5, "row": element["x"]}
  assert xs(pipeline(sampler(), str(tmp_path), fn=other)) == xs(pipeline(sampler(), fn=other))
  assert len(entries(tmp_path)) == 2


def test_tuple_elements_and_dropped_records_keep_their_shape(tmp_path):
  dataset = lambda d: (
    jaxfeed.Dataset.from_source(SOURCE, jaxfeed.IndexSampler(N))
    .map(lambda e: (e["x"], -e["x"]))
    .filter(lambda a, b: a % 5 == 0)
    .autocache(d)
  )
  assert [tuple(map(int, e)) for e in dataset(str(tmp_path))] == [(x, -x) for x in range(0, N, 5)]


def test_random_ops_are_not_kept_by_record(tmp_path):
  assert (
    shared_preprocessing.per_record_chain(
      jaxfeed.Dataset.from_source(SOURCE).random_map(lambda e, rng: e).node
    )
    is None
  )
  assert (
    shared_preprocessing.per_record_chain(
      jaxfeed.Dataset.from_source(SOURCE).map(lambda b: b, batched=True).node
    )
    is None
  )
  dataset = (
    jaxfeed.Dataset.from_source(SOURCE)
    .random_map(lambda e, rng: e)
    .autocache(str(tmp_path), policy="always")
  )
  assert len(xs(dataset)) == N
  assert [p.name.startswith("records-") for p in entries(tmp_path)] == [False]


def test_a_bad_directory_is_named():
  with pytest.raises(ValueError, match="directory must be a non-empty folder path"):
    jaxfeed.Dataset.from_source(SOURCE).autocache("")


# -- processes -----------------------------------------------------------------
SCRIPT = textwrap.dedent("""
    import json, os, sys, time
    import numpy as np
    import jaxfeed

    COUNT = os.environ["COUNT_FILE"]

    def prep(element):
      with open(COUNT, "ab") as f:
        f.write(b".")
      if os.environ.get("SLOW"):
        time.sleep(0.05)
      return {"x": element["x"] * 3}

    seed, store = int(sys.argv[1]), sys.argv[2]
    sampler = jaxfeed.IndexSampler(2000, shuffle=True, seed=seed)
    dataset = (jaxfeed.Dataset.from_source(jaxfeed.ArraySource({"x": np.arange(2000)}), sampler)
               .map(prep).filter(lambda e: e["x"] % 2 == 0).autocache(store, policy="always"))
    print(json.dumps([int(e["x"]) for e in dataset]))
""")


def expected_for(seed: int) -> list[int]:
  sampler = jaxfeed.IndexSampler(2000, shuffle=True, seed=seed)
  return [3 * m.record_index for m in sampler if (3 * m.record_index) % 2 == 0]


def start(tmp_path, seed: int, **env) -> subprocess.Popen:
  script = tmp_path / "job.py"
  script.write_text(SCRIPT)
  return subprocess.Popen(
    [sys.executable, str(script), str(seed), str(tmp_path / "store")],
    stdout=subprocess.PIPE,
    text=True,
    env={**os.environ, "COUNT_FILE": str(tmp_path / "count"), **env},
  )


def test_concurrent_jobs_in_processes_preprocess_each_record_about_once(tmp_path):
  # A 4-job sweep with different seeds, all at once, sharing one folder.
  jobs = {seed: start(tmp_path, seed) for seed in range(4)}
  outputs = {seed: json.loads(job.communicate(timeout=120)[0]) for seed, job in jobs.items()}
  assert all(job.returncode == 0 for job in jobs.values())
  for seed, output in outputs.items():
    assert output == expected_for(seed), seed
  computed = (tmp_path / "count").stat().st_size
  assert computed <= 1.5 * 2000, computed  # not preprocessed once per job
  later = start(tmp_path, 9)
  assert json.loads(later.communicate(timeout=120)[0]) == expected_for(9)
  assert (tmp_path / "count").stat().st_size == computed  # found it all there


def test_a_killed_job_s_claim_does_not_hold_the_others_up(tmp_path):
  slow = start(tmp_path, 0, SLOW="1")
  store = tmp_path / "store"
  deadline = time.monotonic() + 60
  while not any(p.name.endswith(".claim") for p in store.rglob("*")):
    assert time.monotonic() < deadline and slow.poll() is None
    time.sleep(0.01)
  slow.send_signal(signal.SIGKILL)
  slow.wait(timeout=30)
  start_s = time.monotonic()
  job = start(tmp_path, 1)
  assert json.loads(job.communicate(timeout=120)[0]) == expected_for(1)
  assert time.monotonic() - start_s < record_store.CLAIM_STALE_S
