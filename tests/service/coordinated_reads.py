"""A real token corpus and the coordinated-read pipeline the service tests read.

The corpus: paragraphs (blocks between blank lines) of the Python standard
library's own source files, split on whitespace, each token mapped to an id
by CRC32; a deterministic sample of them. Run as a script, this module is one
consumer of a coordinated read that prints one JSON line per batch:

  python -m coordinated_reads DISPATCHER JOB_NAME CONSUMER_INDEX ROUND_TIMEOUT_S PAYLOAD
"""

from __future__ import annotations

import functools
import glob
import json
import os
import sys
import zlib

import numpy as np

import jaxfeed
import service_udfs

NUM_SEQUENCES = 3000
MAX_TOKENS = 127
BOUNDARIES = list(range(8, MAX_TOKENS + 2, 8))  # 8, 16, ..., 128
BATCH_SIZES = [4] * (len(BOUNDARIES) + 1)
NUM_CONSUMERS = 3
NUM_WORKERS = 2
SEED = 0


@functools.lru_cache(maxsize=1)
def corpus() -> list[np.ndarray]:
  """NUM_SEQUENCES int32 token-id sequences of 1 to MAX_TOKENS tokens."""
  lib = os.path.dirname(os.__file__)
  paragraphs = []
  for path in sorted(glob.glob(os.path.join(lib, "*.py"))):
    with open(path, encoding="utf-8", errors="replace") as f:
      for paragraph in f.read().split("\n\n"):
        words = paragraph.split()
        if 1 <= len(words) <= MAX_TOKENS:
          paragraphs.append(words)
  if len(paragraphs) < NUM_SEQUENCES:
    raise RuntimeError(f"Only {len(paragraphs)} paragraphs under {lib}.")
  picked = np.random.default_rng(SEED).permutation(len(paragraphs))[:NUM_SEQUENCES]
  return [
    np.array([zlib.crc32(w.encode()) % 30_000 + 1 for w in paragraphs[i]], np.int32) for i in picked
  ]


def source() -> jaxfeed.ArraySource:
  """The corpus as fixed-width rows plus lengths and ids (cut by trim_tokens)."""
  sequences = corpus()
  tokens = np.zeros((len(sequences), MAX_TOKENS), np.int32)
  for i, sequence in enumerate(sequences):
    tokens[i, : len(sequence)] = sequence
  return jaxfeed.ArraySource(
    {
      "tokens": tokens,
      "length": np.array([len(s) for s in sequences], np.int32),
      "id": np.arange(len(sequences), dtype=np.int64),
    }
  )


def pipeline(payload: bool = False) -> jaxfeed.Dataset:
  """Shuffled sequences bucketed by length, batches padded to their longest.

  With `payload`, every element also carries 64 KiB of zeros, so that a
  consumer that stops reading soon fills its socket buffers and stops taking
  batches at the worker (small batches would all fit in them).
  """
  dataset = jaxfeed.Dataset.from_source(
    source(), jaxfeed.IndexSampler(NUM_SEQUENCES, shuffle=True, seed=SEED)
  ).map(service_udfs.trim_tokens)
  if payload:
    dataset = dataset.map(service_udfs.add_payload)
  return dataset.bucket_by_sequence_length(service_udfs.token_count, BOUNDARIES, BATCH_SIZES)


def shard_orders() -> list[np.ndarray]:
  """The record order each worker reads under static DATA sharding."""
  orders = []
  for index in range(NUM_WORKERS):
    sampler = jaxfeed.IndexSampler(
      NUM_SEQUENCES, shuffle=True, seed=SEED, shard_options=jaxfeed.ShardOptions(index, NUM_WORKERS)
    )
    orders.append(sampler.get_many(np.arange(len(sampler)))[1])
  return orders


def coordinated(
  address: str,
  job_name: str,
  consumer_index: int,
  round_timeout_s: float,
  payload: bool = False,
  **options,
) -> jaxfeed.Dataset:
  return pipeline(payload).distribute(
    address,
    "data",
    job_name=job_name,
    num_consumers=NUM_CONSUMERS,
    consumer_index=consumer_index,
    round_timeout_s=round_timeout_s,
    **options,
  )


def main(argv: list[str]) -> None:
  address, job_name, index, timeout = argv[1], argv[2], int(argv[3]), float(argv[4])
  payload = argv[5] == "payload"
  with coordinated(address, job_name, index, timeout, payload).make_iterator() as iterator:
    for batch in iterator:
      print(
        json.dumps(
          {
            "round": iterator.last_round,
            "length": batch["tokens"].shape[1],
            "ids": batch["id"].tolist(),
          }
        ),
        flush=True,
      )


if __name__ == "__main__":
  main(sys.argv)
