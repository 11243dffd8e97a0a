"""One host of the two-process coordinated-read test (see test_multihost.py).

Run as `python multihost_worker.py <process_id> <num_processes> <port> <out>`.
Joins a `jax.distributed` CPU cluster, iterates `Dataset.from_bucket_plan`
through `jaxfeed.Loader` into global `jax.Array`s, and writes one JSON line per
step to `<out>/host_<process_id>.jsonl` for the test to compare across hosts.
"""

from __future__ import annotations

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

NUM_RECORDS = 400
BOUNDARIES = [8, 16, 32]
GLOBAL_BATCH = 8  # every bucket: the id leaf keeps one global shape
RESUME_AT = 5
NUM_EPOCHS = 2
SEED = 3


def lengths_index() -> np.ndarray:
  rng = np.random.default_rng(0)
  return np.clip(rng.lognormal(2.7, 0.7, NUM_RECORDS), 1, 60).astype(np.int64)


class TokenSource:
  """Record i: `lengths[i]` tokens, all equal to i."""

  def __init__(self, lengths: np.ndarray):
    self._lengths = lengths

  def __len__(self) -> int:
    return len(self._lengths)

  def __getitem__(self, i: int) -> dict:
    return {"tokens": np.full(int(self._lengths[i]), i, np.int32), "id": np.int32(i)}

  def get_many(self, indices) -> list:
    return [self[int(i)] for i in indices]


def local_rows(array: jax.Array) -> np.ndarray:
  shards = sorted(array.addressable_shards, key=lambda s: s.index[0].start or 0)
  return np.concatenate([np.asarray(s.data) for s in shards])


def main(process_id: int, num_processes: int, port: int, out: str) -> None:
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(
    f"127.0.0.1:{port}",
    num_processes=num_processes,
    process_id=process_id,
    initialization_timeout=60,
  )
  import jaxfeed  # pylint: disable=g-import-not-at-top
  from jaxfeed.coord import BucketPlan  # pylint: disable=g-import-not-at-top

  lengths = lengths_index()
  plan = BucketPlan(
    lengths,
    BOUNDARIES,
    [GLOBAL_BATCH] * (len(BOUNDARIES) + 1),
    seed=SEED,
    num_epochs=NUM_EPOCHS,
    shard_options=jaxfeed.ShardByJaxProcess(),
  )
  dataset = jaxfeed.Dataset.from_bucket_plan(TokenSource(lengths), plan, padding_values=-1)
  sum_ids = jax.jit(jnp.sum)
  count_tokens = jax.jit(lambda tokens: jnp.sum(tokens >= 0))

  lines = []

  def record(phase: str, step: int, batch: dict) -> None:
    tokens, ids = batch["tokens"], batch["id"]
    local_tokens = local_rows(tokens)
    line = {
      "phase": phase,
      "step": step,
      "global_shape": list(tokens.shape),
      "padded_length": int(local_tokens.shape[1]),
      "ids": local_rows(ids).tolist(),
      "row_lengths": (local_tokens >= 0).sum(axis=1).tolist(),
      # Reductions over the GLOBAL arrays: all hosts must hold one array.
      "global_id_sum": int(sum_ids(ids)),
    }
    if step < 2:  # one compilation per padded length; two steps suffice
      line["global_token_count"] = int(count_tokens(tokens))
    lines.append(line)

  saved_state = None
  with jaxfeed.Loader(dataset, prefetch=2) as loader:
    for step, batch in enumerate(loader):
      record("first", step, batch)
      if step + 1 == RESUME_AT:
        saved_state = json.loads(json.dumps(loader.get_state()))
  with jaxfeed.Loader(dataset, prefetch=2) as loader:
    loader.set_state(saved_state)
    for step, batch in enumerate(loader, start=RESUME_AT):
      record("resumed", step, batch)

  with open(f"{out}/host_{process_id}.jsonl", "w") as f:
    for line in lines:
      f.write(json.dumps(line) + "\n")
  jax.distributed.shutdown()


if __name__ == "__main__":
  main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
