r"""Hugging Face BPE tokenization on the thread backend: per document vs batched.

Tokenizes the W8 corpora (`examples/lm_data.py`: the standard library's
source and the help topics) with a byte-level BPE tokenizer trained on them
(4096 ids, written to a temporary directory), through jaxfeed pipelines:

- per document: `from_source(docs).map(Tokenize(tok), num_parallel_calls=n)`;
- batched: `from_source(docs).batch(16).map(Tokenize(tok, batched=True),
  num_parallel_calls=n).unbatch()`, once with the tokenizers library's own
  thread pool on (its default) and once with TOKENIZERS_PARALLELISM=false;
- per document on the process backend, for reference.

First it prints, for `HFTokenizer.encode` and `encode_many`, how far another
Python thread gets while they run (near 0: the call holds the GIL). Then the
configurations take turns for `--rounds` rounds (so load from other
processes hits them alike) and the median MB/s of text per configuration is
printed as one JSON line each, with its ratio to per-document on 1 thread
and `cores_busy`, this process's CPU seconds per second (worker processes not
counted): above 1 only where threads encode at once, which a machine shared
with other work shows better than the rates, and `mb_per_cpu_second`, the
text tokenized per CPU second of this process (the cost, whatever the
load; null for worker processes, whose CPU is not counted). Timing starts at the first
element of each run.

  python -m benchmarks.tokenizer_threads [--rounds 3] [--megabytes 4]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import threading
import time

from examples import lm_data

BATCH = 16


def pipeline(tokenizer, documents, threads: int, batched: bool,
             backend: str = "thread"):
  import jaxfeed  # pylint: disable=g-import-not-at-top
  calls = None if threads == 1 else threads
  ds = jaxfeed.Dataset.from_source(documents)
  if batched:
    return ds.batch(BATCH).map(jaxfeed.Tokenize(tokenizer, batched=True),
                               num_parallel_calls=calls).unbatch()
  return ds.map(jaxfeed.Tokenize(tokenizer), num_parallel_calls=calls,
                backend=backend)


def other_thread_progress(work) -> float:
  """How fast a pure-Python thread counts while `work()` runs, relative to
  while this thread sleeps: near 1 when `work` releases the GIL, near 0
  when it holds it."""

  def rate_during(run) -> float:
    stop, counted = threading.Event(), []

    def spin():
      n = 0
      while not stop.is_set():
        n += 1
      counted.append(n)

    thread = threading.Thread(target=spin)
    thread.start()
    start = time.perf_counter()
    run()
    elapsed = time.perf_counter() - start
    stop.set()
    thread.join()
    return counted[0] / elapsed

  idle = rate_during(lambda: time.sleep(0.5))
  return rate_during(work) / idle


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--megabytes", type=float, default=4.0,
                      help="text tokenized per configuration and round")
  args = parser.parse_args()
  import jaxfeed  # pylint: disable=g-import-not-at-top
  documents = lm_data.code_documents() + lm_data.prose_documents()
  # Interleave the corpora, then take documents up to the requested size.
  documents = sorted(documents, key=hash)
  chosen, size = [], 0
  for doc in documents:
    if size >= args.megabytes * 1e6:
      break
    chosen.append(doc)
    size += len(doc)
  with tempfile.TemporaryDirectory() as tmp:
    tokenizer = jaxfeed.HFTokenizer.train_bpe(
        (d.decode("utf-8", "replace") for d in documents[:400]),
        os.path.join(tmp, "tokenizer.json"), vocab_size=4096)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    texts = [d.decode("utf-8", "replace") for d in chosen[:300]]
    for name, work in (
        ("encode", lambda: [tokenizer.encode(t) for t in texts]),
        ("encode_many", lambda: [tokenizer.encode_many(texts[i:i + BATCH])
                                 for i in range(0, len(texts), BATCH)])):
      print(json.dumps({"workload": "hf_tokenize_gil", "call": name,
                        "other_thread_progress": round(
                            other_thread_progress(work), 2)}), flush=True)
    configs = {
        "per_document_1_thread": (1, False, "thread", None),
        "per_document_2_threads": (2, False, "thread", None),
        "batched_1_thread": (1, True, "thread", "false"),
        "batched_2_threads": (2, True, "thread", "false"),
        "batched_1_thread_rust_pool": (1, True, "thread", "true"),
        "batched_2_threads_rust_pool": (2, True, "thread", "true"),
        "per_document_2_processes": (2, False, "process", None),
    }
    rates = {name: [] for name in configs}
    busy = {name: [] for name in configs}
    tokens = {}
    for _ in range(args.rounds + 1):  # The first round warms up.
      for name, (threads, batched, backend, rust_pool) in configs.items():
        if rust_pool is None:
          os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
          os.environ["TOKENIZERS_PARALLELISM"] = rust_pool
        iterator = pipeline(tokenizer, chosen, threads, batched,
                            backend).make_iterator()
        # Timed from the first element on: start-up (worker processes,
        # threads) is not tokenization.
        first = next(iterator)
        start, cpu = time.perf_counter(), time.process_time()
        count = len(first["tokens"]) + sum(len(e["tokens"]) for e in iterator)
        elapsed = time.perf_counter() - start
        busy[name].append((time.process_time() - cpu) / elapsed)
        iterator.close()
        rates[name].append((size - len(chosen[0])) / 1e6 / elapsed)
        tokens[name] = count
    base = statistics.median(rates["per_document_1_thread"][1:])
    for name, values in rates.items():
      rate = statistics.median(values[1:])
      print(json.dumps({
          "workload": "hf_tokenize", "config": name, "unit": "MB/s",
          "rate": round(rate, 2), "rates": [round(r, 2) for r in values[1:]],
          "ratio_vs_per_document_1_thread": round(rate / base, 2),
          "cores_busy": round(statistics.median(busy[name][1:]), 2),
          "mb_per_cpu_second": None if configs[name][2] == "process" else round(
              statistics.median(r / b for r, b in zip(values[1:], busy[name][1:])),
              2),
          "tokens": tokens[name], "megabytes": round(size / 1e6, 2)}),
            flush=True)
    if len(set(tokens.values())) != 1:
      raise AssertionError(f"configurations disagree on the tokens: {tokens}")


if __name__ == "__main__":
  main()
