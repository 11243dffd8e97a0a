r"""A Flax NNX classifier trained on a device mesh, fed only by `jaxfeed.Loader`.

The default dataset is scikit-learn's handwritten digits (1,797 8x8 images that
ship inside the scikit-learn package, so nothing is downloaded). They are
converted once to ArrayRecord files and read back through the full jaxfeed
path: ArrayRecordSource -> IndexSampler (global shuffle, sharded per JAX
process) -> map (decode) -> random_map (augment) -> batch -> Loader (global
jax.Arrays split over every device).

Run (8 CPU devices):

  XLA_FLAGS=--xla_force_host_platform_device_count=8 \
    python -m examples.train_digits --flagfile=configs/digits.flags

and continue from the last checkpoint with `--resume`.
"""

from __future__ import annotations

import os
from typing import Any

from absl import app
from absl import flags
from absl import logging
import numpy as np

from examples import training
from examples.digits_data import IMAGE_SIZE, NUM_CLASSES, augment, decode_record, encode_record

FLAGS = flags.FLAGS
flags.DEFINE_string(
  "data_dir", "/tmp/jaxfeed_digits/data", "Where the ArrayRecord files are written once and read."
)
flags.DEFINE_string(
  "workdir", "/tmp/jaxfeed_digits/ckpt", "Checkpoint directory (model, optimizer and loader state)."
)
flags.DEFINE_integer("num_shards", 4, "ArrayRecord files to split the data into.")
flags.DEFINE_integer("batch_size", 128, "Global batch size (over all hosts).")
flags.DEFINE_integer("num_steps", 400, "Total training steps.")
flags.DEFINE_integer("log_every", 50, "Steps between log lines.")
flags.DEFINE_integer("checkpoint_every", 200, "Steps between checkpoints.")
flags.DEFINE_float("learning_rate", 3e-3, "Adam learning rate.")
flags.DEFINE_integer("hidden", 128, "Hidden units of the MLP.")
flags.DEFINE_integer("seed", 0, "Seed of the model, the shuffle and the augmentation.")
flags.DEFINE_integer("num_parallel_calls", 2, "Threads for decode and augment.")
flags.DEFINE_integer("prefetch", 2, "Batches the Loader keeps ahead on device.")
flags.DEFINE_bool("resume", False, "Continue from the latest checkpoint in --workdir.")
flags.DEFINE_string(
  "service",
  "",
  "host:port of a jaxfeed dispatcher: decode, augment "
  "and batch on its workers (every host reads one shared job).",
)
flags.DEFINE_string("service_job", "digits-train", "Job name the hosts share on the service.")
flags.DEFINE_string(
  "service_token_file",
  "",
  "File holding the service's client token, when the dispatcher requires one.",
)
flags.DEFINE_bool(
  "distributed",
  False,
  "Call jax.distributed.initialize() first (one process per "
  "host, e.g. on every host of a Cloud TPU VM slice).",
)


def prepare_digits(data_dir: str, num_shards: int) -> list[str]:
  """Writes the embedded digits dataset as ArrayRecord files once."""
  import jaxfeed
  from sklearn import datasets as sk_datasets

  paths = [
    os.path.join(data_dir, f"digits-{i:05d}-of-{num_shards:05d}.array_record")
    for i in range(num_shards)
  ]
  if all(os.path.exists(p) for p in paths):
    return paths
  os.makedirs(data_dir, exist_ok=True)
  digits = sk_datasets.load_digits()
  images = digits.images.astype(np.uint8)
  labels = digits.target.astype(np.int32)
  for shard, path in enumerate(paths):
    rows = range(shard, len(images), num_shards)
    tmp = path + ".tmp"
    jaxfeed.write_array_record(tmp, (encode_record(images[i], labels[i]) for i in rows))
    os.replace(tmp, path)
  return paths


def make_dataset(
  paths: list[str],
  batch_size: int,
  seed: int,
  num_parallel_calls: int,
  service: str = "",
  service_job: str = "digits-train",
  service_token: str | None = None,
) -> Any:
  """The input pipeline: global shuffle, per-host shard, decode, augment, batch.

  With `service`, the workers of that dispatcher run it over the whole
  dataset, split dynamically, and every host reads its batches from one
  shared job (each batch goes to one host), exactly once, so that `--resume`
  continues the read where the checkpoint left it.
  """
  import jax
  import jaxfeed

  source = jaxfeed.ArrayRecordSource(paths)
  num_hosts = jax.process_count()
  if batch_size % num_hosts:
    raise ValueError(
      f"--batch_size={batch_size} must be divisible by the {num_hosts} JAX processes."
    )
  shard = jaxfeed.NoSharding() if service else jaxfeed.ShardByJaxProcess(drop_remainder=True)
  sampler = jaxfeed.IndexSampler(
    len(source), shuffle=True, seed=seed, num_epochs=None, shard_options=shard
  )
  dataset = (
    jaxfeed.Dataset.from_source(source, sampler)
    .map(decode_record, num_parallel_calls=num_parallel_calls)
    .random_map(augment, num_parallel_calls=num_parallel_calls, seed=seed)
    .batch(batch_size // num_hosts, drop_remainder=True)
  )
  if service:
    dataset = dataset.distribute(
      service,
      "distributed_epoch",
      job_name=service_job,
      auth_token=service_token,
      visitation="exactly_once",
    )
  return dataset


def main(argv: list[str]) -> None:
  del argv
  import jax
  from flax import nnx
  import optax

  import jaxfeed

  # Orbax logs every checkpoint step at INFO; keep the trainer's output readable.
  logging.set_verbosity(logging.WARNING)
  if FLAGS.distributed:
    jax.distributed.initialize()
  paths = prepare_digits(FLAGS.data_dir, FLAGS.num_shards)
  # Parameters replicated on every device; the batch is split along "data".
  _, replicated, split = training.data_parallel(FLAGS.batch_size)

  class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
      self.hidden = nnx.Linear(IMAGE_SIZE * IMAGE_SIZE, FLAGS.hidden, rngs=rngs)
      self.out = nnx.Linear(FLAGS.hidden, NUM_CLASSES, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
      x = x.reshape(x.shape[0], -1)
      return self.out(nnx.relu(self.hidden(x)))

  model = MLP(nnx.Rngs(FLAGS.seed))
  optimizer = nnx.Optimizer(model, optax.adam(FLAGS.learning_rate), wrt=nnx.Param)
  state = training.TrainState(model, optimizer)
  state.load(jax.device_put(state.get(), replicated))

  @nnx.jit
  def train_step(model, optimizer, batch):
    def loss_fn(model):
      logits = model(batch["image"])
      loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
      return loss, (logits.argmax(-1) == batch["label"]).mean()

    (loss, accuracy), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
    training.optimizer_update(optimizer, model, grads)
    return loss, accuracy

  token = None
  if FLAGS.service_token_file:
    with open(FLAGS.service_token_file) as f:
      token = f.read().strip()
  dataset = make_dataset(
    paths,
    FLAGS.batch_size,
    FLAGS.seed,
    FLAGS.num_parallel_calls,
    FLAGS.service,
    FLAGS.service_job,
    token,
  )
  loader = jaxfeed.Loader(dataset, sharding=split, prefetch=FLAGS.prefetch)
  manager = training.checkpoint_manager(FLAGS.workdir)
  # The loader's state is saved with the model: a service read goes on too.
  step = training.resume(manager, loader, state) if FLAGS.resume else 0

  training.log(
    "Training on %d devices (%s), global batch %d, %d records.",
    len(jax.devices()),
    jax.devices()[0].platform,
    FLAGS.batch_size,
    len(jaxfeed.ArrayRecordSource(paths)),
  )
  accuracy = [0.0]

  def line(step, loss, steps_per_s, images_per_s, wait):
    del images_per_s
    return (
      f"step {step:5d}  loss {loss:.4f}  accuracy {accuracy[0]:.3f}  "
      f"{steps_per_s:.1f} steps/s  input wait {wait:.1f}% of step time"
    )

  def run_step(batch):
    loss, batch_accuracy = train_step(model, optimizer, batch)
    accuracy[0] = float(batch_accuracy)
    return loss, FLAGS.batch_size

  training.train_with_flags(FLAGS, loader, manager, state, run_step, line, step)


if __name__ == "__main__":
  app.run(main)
