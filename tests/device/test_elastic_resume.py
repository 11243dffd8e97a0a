"""A Loader checkpoint written by N JAX processes restored by M (real
processes, jax.distributed on CPU): global shuffle (or an index-level
mixture of two) + random_map + filter (+ pack with overflow="split") + batch,
with `end_of_input="pad"` so every record read shows up in a batch."""

import collections
import json
import pathlib

import numpy as np
import pytest

import elastic_worker as worker
from jax_processes import run_processes
from jaxfeed.mixture import MixtureSampler
from jaxfeed.ops.random_map import element_rng
from jaxfeed.sampler import IndexSampler

WORKER = str(pathlib.Path(worker.__file__).resolve())
TIMEOUT_S = 150


def run(num_processes, mode, checkpoint_dir, out_dir, source_kind="index"):
  timed_out, results = run_processes(
    WORKER,
    num_processes,
    [mode, str(checkpoint_dir), str(out_dir / f"{mode}_PID.json"), source_kind],
    TIMEOUT_S,
  )
  assert not timed_out, f"{mode} with {num_processes} processes hung"
  for i, (returncode, _, stderr) in enumerate(results):
    assert returncode == 0, f"{mode}: process {i} failed:\n{stderr[-4000:]}"
  return [json.loads((out_dir / f"{mode}_{i}.json").read_text()) for i in range(num_processes)]


def kept_records(source_kind):
  """Every (label, noise) the pipeline keeps over all epochs, any sharding
  (for "pack": every (token,) of the kept documents)."""
  if source_kind == "mix":
    sampler = MixtureSampler(worker.mix_components()[0], list(worker.MIX_WEIGHTS), seed=worker.SEED)
  else:
    sampler = IndexSampler(
      worker.NUM_RECORDS, shuffle=True, seed=worker.SEED, num_epochs=worker.NUM_EPOCHS
    )
  _, records, seeds = sampler.get_many(np.arange(len(sampler)))
  if source_kind == "mix":  # The second source's labels start at MIX_OFFSET.
    first = worker.MIX_SIZES[0]
    records = np.where(records < first, records, records - first + worker.MIX_OFFSET)
  rows = collections.Counter()
  for record, seed in zip(records.tolist(), seeds.tolist()):
    element = worker.noise({"label": record}, element_rng(worker.SEED, seed))
    if not worker.keep(element):
      continue
    if source_kind == "pack":
      rows.update((t,) for t in worker.tokens(element)["tokens"].tolist())
    else:
      rows[(record, int(element["noise"]))] += 1
  return rows


def rows(reports, key):
  return collections.Counter(tuple(row) for r in reports for row in r[key])


@pytest.mark.parametrize(
  "saved_with, resumed_with, source_kind",
  [(2, 3, "index"), (4, 2, "index"), (2, 3, "mix"), (2, 3, "pack"), (3, 2, "pack")],
)
def test_resume_on_another_process_count_reads_the_rest_exactly_once(
  tmp_path, saved_with, resumed_with, source_kind
):
  checkpoint_dir = tmp_path / "ckpt"
  saved = run(saved_with, "save", checkpoint_dir, tmp_path, source_kind)
  resumed = run(resumed_with, "resume", checkpoint_dir, tmp_path, source_kind)
  # The uninterrupted run reads every kept record once.
  assert rows(saved, "before") + rows(saved, "after") == kept_records(source_kind)
  assert sum(rows(saved, "before").values()) > 0
  if source_kind == "pack":  # The checkpoint cut through packed rows.
    assert sum(report["held"] for report in saved) > 0
  # The resumed run reads exactly what the uninterrupted one read after the
  # checkpoint: every record once over all processes.
  assert rows(resumed, "before") == collections.Counter()
  assert rows(resumed, "after") == rows(saved, "after")
  for report in saved + resumed:  # Only the very last batch may be short.
    assert set(report["global_rows"][:-1]) == {worker.GLOBAL_BATCH}
  for report in resumed:
    assert report["restored_batches"] == worker.SAVE_AT
