"""The language-model example's corpora and input pipeline.

Two real-text corpora that ship with Python itself, so nothing is downloaded:

- "code": the standard library's top-level modules (`<stdlib>/*.py`), one
  document per file;
- "prose": the topics of the interactive help (`pydoc_data.topics`), one
  document per topic.

They are written once to ArrayRecord files (one record per document, UTF-8
bytes) and read back through jaxfeed: a global shuffle per corpus -> a 70/30
index-level mixture (`Dataset.mix`), sharded per JAX process -> tokenize ->
packing into fixed-length rows (long documents split into row-length pieces)
-> batch.
"""

from __future__ import annotations

import glob
import os
import sysconfig
from typing import Any, Sequence

CORPORA = ("code", "prose")


def code_documents() -> list[bytes]:
  """The standard library's top-level modules, sorted by file name."""
  stdlib = sysconfig.get_paths()["stdlib"]
  paths = sorted(glob.glob(os.path.join(stdlib, "*.py")))
  if not paths:
    raise FileNotFoundError(f"No Python modules under {stdlib!r} to train on.")
  documents = []
  for path in paths:
    with open(path, "rb") as f:
      documents.append(f.read())
  return documents


def prose_documents() -> list[bytes]:
  """The interactive help's topics, sorted by topic name."""
  from pydoc_data import topics  # pylint: disable=g-import-not-at-top

  return [topics.topics[name].encode("utf-8") for name in sorted(topics.topics)]


def prepare_corpora(data_dir: str) -> dict[str, str]:
  """Writes each corpus as one ArrayRecord file once; returns their paths."""
  import jaxfeed  # pylint: disable=g-import-not-at-top

  paths = {name: os.path.join(data_dir, f"{name}.array_record") for name in CORPORA}
  documents = {"code": code_documents, "prose": prose_documents}
  os.makedirs(data_dir, exist_ok=True)
  for name, path in paths.items():
    if not os.path.exists(path):
      tmp = f"{path}.tmp{os.getpid()}"
      jaxfeed.write_array_record(tmp, documents[name]())
      os.replace(tmp, path)
  return paths


def make_dataset(
  paths: dict[str, str],
  *,
  seq_len: int,
  batch_size: int,
  seed: int,
  weights: Sequence[float] = (0.7, 0.3),
  tokenizer: Any = None,
  num_parallel_calls: int = 2,
  num_packing_bins: int = 8,
) -> Any:
  """This host's batches: `{"tokens", "tokens_segment_ids", "tokens_positions"}`,
  each `[batch_size // process_count, seq_len + 1]` (one extra token, so inputs
  and targets are the row shifted by one).
  """
  import jax  # pylint: disable=g-import-not-at-top
  import jaxfeed  # pylint: disable=g-import-not-at-top

  num_hosts = jax.process_count()
  if batch_size % num_hosts:
    raise ValueError(
      f"--batch_size={batch_size} must be divisible by the {num_hosts} JAX processes."
    )
  tokenize = jaxfeed.Tokenize(tokenizer or jaxfeed.ByteTokenizer())
  corpora = []
  for salt, name in enumerate(CORPORA):
    source = jaxfeed.ArrayRecordSource([paths[name]])
    sampler = jaxfeed.IndexSampler(len(source), shuffle=True, seed=seed + salt, num_epochs=None)
    corpora.append(jaxfeed.Dataset.from_source(source, sampler))
  # One global mixture of the two shuffles, sharded per process.
  mixture = jaxfeed.Dataset.mix(
    corpora, list(weights), seed=seed, shard_options=jaxfeed.ShardByJaxProcess()
  ).map(tokenize, num_parallel_calls=num_parallel_calls)
  return mixture.pack(
    {"tokens": seq_len + 1}, num_packing_bins=num_packing_bins, overflow="split"
  ).batch(batch_size // num_hosts, drop_remainder=True)
