r"""A Flax NNX CNN trained on JPEG tf.train.Examples read through jaxfeed.

The records (see `examples/images_data.py`) are random crops of the
photographs that ship with scikit-learn, re-encoded as JPEG at several sizes
and written once to a TFRecord file as tf.train.Examples. They are read back
the way a tf.data image pipeline reads them, without TensorFlow:
TFRecordSource -> IndexSampler (global shuffle, sharded per JAX process) ->
map (parse the Example) -> random_map (decode at reduced scale + random
resized crop, random flip, normalize) -> batch -> Loader (global jax.Arrays
split over every device).

Run (8 CPU devices):

  XLA_FLAGS=--xla_force_host_platform_device_count=8 \
    python -m examples.train_images --flagfile=configs/images.flags

and continue exactly from the last checkpoint with `--resume`.
"""

from __future__ import annotations

from absl import app
from absl import flags
from absl import logging

from examples import images_data
from examples import training

FLAGS = flags.FLAGS
flags.DEFINE_string(
  "data_dir", "/tmp/jaxfeed_images/data", "Where the TFRecord file is written once and read."
)
flags.DEFINE_string(
  "workdir", "/tmp/jaxfeed_images/ckpt", "Checkpoint directory (model, optimizer and loader state)."
)
flags.DEFINE_integer("num_records", 2000, "JPEG Examples to make.")
flags.DEFINE_integer("image_size", 64, "Side of the training crops.")
flags.DEFINE_integer("batch_size", 64, "Global batch size (over all hosts).")
flags.DEFINE_integer("num_steps", 300, "Total training steps.")
flags.DEFINE_integer("log_every", 50, "Steps between log lines.")
flags.DEFINE_integer("checkpoint_every", 100, "Steps between checkpoints.")
flags.DEFINE_float("learning_rate", 3e-3, "Adam learning rate.")
flags.DEFINE_integer("width", 32, "Channels of the first convolution.")
flags.DEFINE_integer("seed", 0, "Seed of the data, model, shuffle and augmentation.")
flags.DEFINE_integer("num_parallel_calls", 2, "Threads for parsing and decoding.")
flags.DEFINE_integer("prefetch", 2, "Batches the Loader keeps ahead on device.")
flags.DEFINE_bool("resume", False, "Continue from the latest checkpoint in --workdir.")
flags.DEFINE_bool(
  "distributed", False, "Call jax.distributed.initialize() first (one process per host)."
)


def make_dataset(path: str, image_size: int, batch_size: int, seed: int, num_parallel_calls: int):
  """Shuffled, per-host shard, parse, decode + augment, batch."""
  import jax  # pylint: disable=g-import-not-at-top
  import jaxfeed  # pylint: disable=g-import-not-at-top

  num_hosts = jax.process_count()
  if batch_size % num_hosts:
    raise ValueError(
      f"--batch_size={batch_size} must be divisible by the {num_hosts} JAX processes."
    )
  source = jaxfeed.TFRecordSource(path)
  sampler = jaxfeed.IndexSampler(
    len(source),
    shuffle=True,
    seed=seed,
    num_epochs=None,
    shard_options=jaxfeed.ShardByJaxProcess(drop_remainder=True),
  )
  return (
    jaxfeed.Dataset.from_source(source, sampler)
    .map(images_data.parse_record, num_parallel_calls=num_parallel_calls)
    .random_map(
      images_data.Augment(image_size),
      num_parallel_calls=num_parallel_calls,
      seed=seed,
      writes_out=True,
    )
    .batch(batch_size // num_hosts, drop_remainder=True)
  )


def build_model(width: int, seed: int):
  """Three conv blocks (3x3 conv, ReLU, 2x2 average pool), global pool, head."""
  import jax  # pylint: disable=g-import-not-at-top
  from flax import nnx  # pylint: disable=g-import-not-at-top

  class CNN(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
      self.conv1 = nnx.Conv(3, width, (3, 3), rngs=rngs)
      self.conv2 = nnx.Conv(width, 2 * width, (3, 3), rngs=rngs)
      self.conv3 = nnx.Conv(2 * width, 2 * width, (3, 3), rngs=rngs)
      self.head = nnx.Linear(2 * width, images_data.NUM_CLASSES, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
      for conv in (self.conv1, self.conv2, self.conv3):
        x = nnx.avg_pool(nnx.relu(conv(x)), (2, 2), strides=(2, 2))
      return self.head(x.mean(axis=(1, 2)))

  return CNN(nnx.Rngs(seed))


def main(argv: list[str]) -> None:
  del argv
  import jax  # pylint: disable=g-import-not-at-top
  from flax import nnx  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top

  import jaxfeed  # pylint: disable=g-import-not-at-top

  logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO
  if FLAGS.distributed:
    jax.distributed.initialize()
  path = images_data.prepare_images(FLAGS.data_dir, FLAGS.num_records, FLAGS.seed)
  _, replicated, split = training.data_parallel(FLAGS.batch_size)

  model = build_model(FLAGS.width, FLAGS.seed)
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

  dataset = make_dataset(
    path, FLAGS.image_size, FLAGS.batch_size, FLAGS.seed, FLAGS.num_parallel_calls
  )
  loader = jaxfeed.Loader(dataset, sharding=split, prefetch=FLAGS.prefetch)
  manager = training.checkpoint_manager(FLAGS.workdir)
  step = training.resume(manager, loader, state) if FLAGS.resume else 0

  training.log(
    "Training a CNN on %d devices (%s), global batch %d of %dx%d "
    "crops, %d JPEG Examples, %d classes.",
    len(jax.devices()),
    jax.devices()[0].platform,
    FLAGS.batch_size,
    FLAGS.image_size,
    FLAGS.image_size,
    FLAGS.num_records,
    images_data.NUM_CLASSES,
  )
  accuracy = [0.0]

  def line(step, loss, steps_per_s, images_per_s, wait):
    return (
      f"step {step:5d}  loss {loss:.4f}  accuracy {accuracy[0]:.3f}  "
      f"{steps_per_s:.2f} steps/s  {images_per_s:.0f} images/s  "
      f"input wait {wait:.1f}% of step time"
    )

  def run_step(batch):
    loss, batch_accuracy = train_step(model, optimizer, batch)
    accuracy[0] = float(batch_accuracy)
    return loss, FLAGS.batch_size

  training.train_with_flags(FLAGS, loader, manager, state, run_step, line, step)


if __name__ == "__main__":
  app.run(main)
