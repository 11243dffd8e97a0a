"""One process of the elastic-resume test (run by test_elastic_resume.py).

Usage: python elastic_worker.py PROCESS_ID NUM_PROCESSES PORT MODE CKPT_DIR OUT
[SOURCE]
MODE "save": iterate SAVE_AT steps, checkpoint the Loader with orbax, then run
on to the end (the uninterrupted run). MODE "resume": restore that checkpoint
(written by any number of processes) and run to the end. Writes OUT (JSON):
the (label, noise) rows this process received before and after the
checkpoint, and the global batch size of every step. SOURCE "index" (the
default) reads one sharded IndexSampler, "mix" a `Dataset.mix` of two
(labels `MIX_OFFSET + r` for the second one's record `r`), "pack" the
IndexSampler's records as documents of `tokens(...)` packed into rows of
PACK_ROW with overflow="split" (the rows hold [token] instead).
"""

import json
import os
import sys

if __name__ == "__main__":  # The test imports this module for its constants.
  os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=1"
  os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # pylint: disable=g-import-not-at-top
import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
import numpy as np  # pylint: disable=g-import-not-at-top

NUM_RECORDS = 90
NUM_EPOCHS = 2
GLOBAL_BATCH = 12
SAVE_AT = 3
SEED = 5


def noise(element, rng):
  return {"label": element["label"], "noise": np.int64(rng.integers(0, 1 << 30))}


def keep(element):
  return element["noise"] % 3 != 0


PACK_ROW = 16


def tokens(element):
  """A document of 1 .. 3 * PACK_ROW tokens `label * 1000 + offset`."""
  length = int(element["noise"]) % (3 * PACK_ROW) + 1
  return {"tokens": int(element["label"]) * 1000 + np.arange(length)}


MIX_SIZES = (60, 40)
MIX_WEIGHTS = (0.6, 0.4)
MIX_OFFSET = 1000


def mix_components():
  """The samplers and sources of the mixed pipeline's two components."""
  import jaxfeed  # pylint: disable=g-import-not-at-top

  samplers = [
    jaxfeed.IndexSampler(n, shuffle=True, seed=SEED + i, num_epochs=NUM_EPOCHS)
    for i, n in enumerate(MIX_SIZES)
  ]
  sources = [
    jaxfeed.ArraySource({"label": MIX_OFFSET * i + np.arange(n)}) for i, n in enumerate(MIX_SIZES)
  ]
  return samplers, sources


def records(source_kind):
  import jaxfeed  # pylint: disable=g-import-not-at-top

  if source_kind == "mix":
    samplers, sources = mix_components()
    return jaxfeed.Dataset.mix(
      [jaxfeed.Dataset.from_source(src, s) for s, src in zip(samplers, sources)],
      list(MIX_WEIGHTS),
      seed=SEED,
      shard_options=jaxfeed.ShardByJaxProcess(),
    )
  sampler = jaxfeed.IndexSampler(
    NUM_RECORDS,
    shuffle=True,
    seed=SEED,
    num_epochs=NUM_EPOCHS,
    shard_options=jaxfeed.ShardByJaxProcess(),
  )
  source = jaxfeed.ArraySource({"label": np.arange(NUM_RECORDS)})
  return jaxfeed.Dataset.from_source(source, sampler)


def pipeline(source_kind="index"):
  kept = (
    records("index" if source_kind == "pack" else source_kind)
    .random_map(noise, seed=SEED)
    .filter(keep)
  )
  if source_kind == "pack":
    kept = kept.map(tokens).pack({"tokens": PACK_ROW}, num_packing_bins=3, overflow="split")
  return kept.batch(GLOBAL_BATCH // jax.process_count())


def local_rows(batch) -> list[list[int]]:
  """This process's real (unpadded) rows as [label, noise], or for packed
  rows its real tokens as [token]."""

  def local(leaf):
    return np.asarray(leaf.addressable_shards[0].data)

  valid = local(batch["valid"])
  if "tokens" in batch:
    real = (local(batch["tokens_segment_ids"]) > 0) & valid[:, None]
    return local(batch["tokens"])[real].reshape(-1, 1).tolist()
  return np.stack([local(batch["label"]), local(batch["noise"])], 1)[valid].tolist()


def held_by_pack(state) -> int:
  """How many documents `pack` holds in a pipeline state (0 without pack)."""
  while state["op"] != "pack":
    if not state["parents"]:
      return 0
    state = state["parents"][0]
  unemitted = state["own"].get("unemitted", {"elements": [], "pieces": []})
  return len(unemitted["elements"]) + len(unemitted["pieces"])


def main() -> None:
  process_id, num_processes, port = map(int, sys.argv[1:4])
  mode, checkpoint_dir, out = sys.argv[4:7]
  source_kind = sys.argv[7] if len(sys.argv) > 7 else "index"
  out = out.replace("PID", str(process_id))
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(
    f"127.0.0.1:{port}",
    num_processes=num_processes,
    process_id=process_id,
    initialization_timeout=60,
  )
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top

  import jaxfeed  # pylint: disable=g-import-not-at-top

  # A collective every step: the global sum of the real labels.
  key = "tokens" if source_kind == "pack" else "label"
  real_sum = jax.jit(lambda b: jnp.sum(b[key].T * b["valid"]))
  manager = ocp.CheckpointManager(checkpoint_dir)
  report = {"before": [], "after": [], "global_rows": []}
  with jaxfeed.Loader(pipeline(source_kind), end_of_input="pad") as loader:
    if mode == "resume":
      manager.restore(SAVE_AT, args=ocp.args.Composite(loader=jaxfeed.LoaderRestore(loader)))
      report["restored_batches"] = loader.get_state()["batches"]
    for step, batch in enumerate(loader, start=loader.get_state()["batches"]):
      real_sum(batch).block_until_ready()
      report["global_rows"].append(batch[key].shape[0])
      report["before" if step < SAVE_AT else "after"].extend(local_rows(batch))
      if mode == "save" and step + 1 == SAVE_AT:
        manager.save(SAVE_AT, args=ocp.args.Composite(loader=jaxfeed.LoaderSave(loader)))
        report["held"] = held_by_pack(loader.get_state()["pipeline"])
  manager.wait_until_finished()
  manager.close()
  with open(out, "w") as f:
    json.dump(report, f)
  jax.distributed.shutdown()


if __name__ == "__main__":
  main()
