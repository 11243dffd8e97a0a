r"""A Flax NNX decoder-only transformer trained on real text through jaxfeed.

The main job. The text ships with Python itself (the standard library's
source as "code", the interactive help's topics as "prose"; see
`examples/lm_data.py`), is written once to ArrayRecord, and is read back
through the whole jaxfeed path: ArrayRecordSource -> IndexSampler (global
shuffle per corpus) -> Dataset.mix (70/30, sharded per JAX process) ->
tokenize -> pack (fixed-length rows with segment ids and positions; long documents are
split) -> batch -> Loader (global jax.Arrays split over every device).
Attention never crosses a segment: packed documents do not see each other.

Run (8 CPU devices):

  XLA_FLAGS=--xla_force_host_platform_device_count=8 \
    python -m examples.train_lm --flagfile=configs/lm.flags

and continue exactly from the last checkpoint with `--resume`.
"""

from __future__ import annotations

import os

from absl import app
from absl import flags
from absl import logging

from examples import lm_data
from examples import training

FLAGS = flags.FLAGS
flags.DEFINE_string(
  "data_dir", "/tmp/jaxfeed_lm/data", "Where the corpora are written once and read."
)
flags.DEFINE_string(
  "workdir", "/tmp/jaxfeed_lm/ckpt", "Checkpoint directory (model, optimizer and loader state)."
)
flags.DEFINE_enum(
  "tokenizer",
  "bytes",
  ["bytes", "bpe"],
  "bytes: UTF-8 bytes (no dependency); bpe: a byte-level BPE "
  "tokenizer trained once on the corpora (needs jaxfeed[text]).",
)
flags.DEFINE_integer("vocab_size", 2048, "Vocabulary of the trained BPE tokenizer.")
flags.DEFINE_float("code_weight", 0.7, "Share of code in the mixture (the rest is prose).")
flags.DEFINE_integer("seq_len", 128, "Tokens per packed row.")
flags.DEFINE_integer("batch_size", 32, "Global batch size (rows, over all hosts).")
flags.DEFINE_integer("num_steps", 300, "Total training steps.")
flags.DEFINE_integer("log_every", 50, "Steps between log lines.")
flags.DEFINE_integer("checkpoint_every", 100, "Steps between checkpoints.")
flags.DEFINE_float("learning_rate", 3e-3, "Adam learning rate.")
flags.DEFINE_integer("d_model", 128, "Width of the transformer.")
flags.DEFINE_integer("num_layers", 2, "Transformer blocks.")
flags.DEFINE_integer("num_heads", 4, "Attention heads.")
flags.DEFINE_integer("seed", 0, "Seed of the model, the shuffles and the mixture.")
flags.DEFINE_integer("num_parallel_calls", 2, "Threads for tokenization.")
flags.DEFINE_integer("prefetch", 2, "Batches the Loader keeps ahead on device.")
flags.DEFINE_bool("resume", False, "Continue from the latest checkpoint in --workdir.")
flags.DEFINE_bool(
  "distributed", False, "Call jax.distributed.initialize() first (one process per host)."
)


def make_tokenizer(data_dir: str, kind: str, vocab_size: int):
  import jaxfeed  # pylint: disable=g-import-not-at-top

  if kind == "bytes":
    return jaxfeed.ByteTokenizer()
  path = os.path.join(data_dir, f"bpe-{vocab_size}.json")
  if os.path.exists(path):
    return jaxfeed.HFTokenizer(path)
  texts = (
    d.decode("utf-8", errors="replace")
    for d in lm_data.code_documents() + lm_data.prose_documents()
  )
  return jaxfeed.HFTokenizer.train_bpe(texts, path, vocab_size=vocab_size)


def build_model(vocab_size: int, seed: int):
  """The decoder: token + position embeddings, pre-norm blocks, tied-free head."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from flax import nnx  # pylint: disable=g-import-not-at-top

  d = FLAGS.d_model

  class Block(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
      self.norm1 = nnx.LayerNorm(d, rngs=rngs)
      self.attention = nnx.MultiHeadAttention(
        num_heads=FLAGS.num_heads, in_features=d, decode=False, rngs=rngs
      )
      self.norm2 = nnx.LayerNorm(d, rngs=rngs)
      self.up = nnx.Linear(d, 4 * d, rngs=rngs)
      self.down = nnx.Linear(4 * d, d, rngs=rngs)

    def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
      x = x + self.attention(self.norm1(x), mask=mask)
      return x + self.down(nnx.gelu(self.up(self.norm2(x))))

  class Decoder(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
      self.tokens = nnx.Embed(vocab_size, d, rngs=rngs)
      self.positions = nnx.Embed(FLAGS.seq_len, d, rngs=rngs)
      self.blocks = (
        nnx.List([Block(rngs) for _ in range(FLAGS.num_layers)])
        if hasattr(nnx, "List")
        else [Block(rngs) for _ in range(FLAGS.num_layers)]
      )
      self.norm = nnx.LayerNorm(d, rngs=rngs)
      self.head = nnx.Linear(d, vocab_size, rngs=rngs)

    def __call__(self, tokens, segments, positions) -> jax.Array:
      length = tokens.shape[1]
      causal = jnp.tril(jnp.ones((length, length), bool))
      same_document = segments[:, :, None] == segments[:, None, :]
      mask = (causal[None] & same_document & (segments[:, :, None] > 0))[:, None]
      x = self.tokens(tokens) + self.positions(positions)
      for block in self.blocks:
        x = block(x, mask)
      return self.head(self.norm(x))

  return Decoder(nnx.Rngs(seed))


def main(argv: list[str]) -> None:
  del argv
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from flax import nnx  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top

  import jaxfeed  # pylint: disable=g-import-not-at-top

  logging.set_verbosity(logging.WARNING)  # orbax logs every save at INFO
  if FLAGS.distributed:
    jax.distributed.initialize()
  paths = lm_data.prepare_corpora(FLAGS.data_dir)
  tokenizer = make_tokenizer(FLAGS.data_dir, FLAGS.tokenizer, FLAGS.vocab_size)
  mesh, replicated, split = training.data_parallel(FLAGS.batch_size)
  del mesh

  model = build_model(tokenizer.vocab_size, FLAGS.seed)
  optimizer = nnx.Optimizer(model, optax.adam(FLAGS.learning_rate), wrt=nnx.Param)
  state = training.TrainState(model, optimizer)
  state.load(jax.device_put(state.get(), replicated))

  @nnx.jit
  def train_step(model, optimizer, batch):
    tokens = batch["tokens"]
    segments = batch["tokens_segment_ids"]
    positions = batch["tokens_positions"]
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    # A target counts only inside the document of its input token.
    weights = ((segments[:, 1:] == segments[:, :-1]) & (segments[:, 1:] > 0)).astype(jnp.float32)

    def loss_fn(model):
      logits = model(inputs, segments[:, :-1], positions[:, :-1])
      losses = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
      return (losses * weights).sum() / jnp.maximum(weights.sum(), 1.0)

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    training.optimizer_update(optimizer, model, grads)
    return loss, (segments > 0).sum()

  dataset = lm_data.make_dataset(
    paths,
    seq_len=FLAGS.seq_len,
    batch_size=FLAGS.batch_size,
    seed=FLAGS.seed,
    weights=(FLAGS.code_weight, 1.0 - FLAGS.code_weight),
    tokenizer=tokenizer,
    num_parallel_calls=FLAGS.num_parallel_calls,
  )
  loader = jaxfeed.Loader(dataset, sharding=split, prefetch=FLAGS.prefetch)
  manager = training.checkpoint_manager(FLAGS.workdir)
  step = training.resume(manager, loader, state) if FLAGS.resume else 0

  training.log(
    "Training a %d-layer transformer on %d devices (%s), global batch "
    "%d x %d tokens, %s tokenizer (vocabulary %d), code/prose %.0f/%.0f.",
    FLAGS.num_layers,
    len(jax.devices()),
    jax.devices()[0].platform,
    FLAGS.batch_size,
    FLAGS.seq_len,
    FLAGS.tokenizer,
    tokenizer.vocab_size,
    100 * FLAGS.code_weight,
    100 * (1 - FLAGS.code_weight),
  )

  def line(step, loss, steps_per_s, tokens_per_s, wait):
    return (
      f"step {step:5d}  loss {loss:.4f}  {steps_per_s:.2f} steps/s  "
      f"{tokens_per_s:.0f} tokens/s  input wait {wait:.1f}% of step time"
    )

  def run_step(batch):
    return train_step(model, optimizer, batch)  # (loss, real tokens)

  training.train_with_flags(FLAGS, loader, manager, state, run_step, line, step)


if __name__ == "__main__":
  app.run(main)
