"""A training process reading an exactly-once service job through a Loader,
for test_service_resume.py; the test kills it and restores in a new one.

Usage: python -m resume_trainer DISPATCHER CHECKPOINT_DIR SAVE_AT (first|restore)
  [distributed_epoch|parallel_epochs]

distributed_epoch (the default) reads exactly once; parallel_epochs reads a
whole epoch from each worker.

first: prints {"step": s, "x": [...]} for each batch; after batch SAVE_AT it
saves an orbax checkpoint (model and loader) and prints {"saved": SAVE_AT},
reads AHEAD more batches (lost with the process) and waits to be killed.
restore: restores the latest checkpoint, prints {"restored": step}, then
every batch to the end of the epoch and {"end": batches}.
"""

import json
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
import numpy as np  # pylint: disable=g-import-not-at-top
import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top

import jaxfeed  # pylint: disable=g-import-not-at-top

RECORDS = 200
BATCH = 4
AHEAD = 3


def dataset(dispatcher: str, mode: str = "distributed_epoch") -> jaxfeed.Dataset:
  source = jaxfeed.ArraySource({"x": np.arange(RECORDS, dtype=np.int64)})
  sampler = jaxfeed.IndexSampler(RECORDS, shuffle=True, seed=7)
  visitation = "exactly_once" if mode == "distributed_epoch" else "at_most_once"
  return (
    jaxfeed.Dataset.from_source(source, sampler)
    .batch(BATCH)
    .distribute(dispatcher, mode, visitation=visitation, max_outstanding_requests=2)
  )


def emit(**fields) -> None:
  print(json.dumps(fields), flush=True)


def main() -> None:
  dispatcher, directory, save_at, mode = sys.argv[1:5]
  processing_mode = sys.argv[5] if len(sys.argv) > 5 else "distributed_epoch"
  save_at = int(save_at)
  manager = ocp.CheckpointManager(directory)
  model = {"w": jnp.zeros(2)}
  with jaxfeed.Loader(dataset(dispatcher, processing_mode), prefetch=2) as loader:
    batches = iter(loader)
    if mode == "restore":
      model = jaxfeed.restore_checkpoint(manager, None, loader, model_state=model)
      emit(restored=int(model["w"][0]))
    step = loader.get_state()["batches"]
    for batch in batches:
      step += 1
      emit(step=step, x=np.asarray(batch["x"]).tolist())
      if mode == "first" and step == save_at:
        jaxfeed.save_checkpoint(manager, step, loader, model_state={"w": jnp.full(2, step)})
        manager.wait_until_finished()
        emit(saved=step)
      if mode == "first" and step == save_at + AHEAD:
        time.sleep(600)  # killed here
  emit(end=step)
  manager.close()


if __name__ == "__main__":
  main()
