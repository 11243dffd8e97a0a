r"""Hugging Face BPE tokenization on the thread backend: per document vs batched.

Tokenizes the W8 corpora (`examples/lm_data.py`: the standard library's
source and the help topics) with a byte-level BPE tokenizer trained on them
(4096 ids, written to a temporary directory), through jaxfeed pipelines:

- per document: `from_source(docs).map(Tokenize(tok), num_parallel_calls=n)`;
- batched: `from_source(docs).batch(16).map(Tokenize(tok, batched=True),
  num_parallel_calls=n).unbatch()`, once with the tokenizers library's own
  thread pool on (its default) and once with TOKENIZERS_PARALLELISM=false;
- per document on the process backend, for reference;
- the same tokenizer called directly, no pipeline (`bare_...`): `encode` per
  document, and `encode_many` on batches of 16 from 1 or 2 Python threads,
  with and without the library's own pool. What a pipeline row loses
  against its bare row is jaxfeed's cost; what 2 threads gain over 1 in the
  bare rows is what the tokenizer itself allows on this machine.

The library's own pool (rayon, one thread per core) runs inside this
process, so its CPU time is in `cores_busy` too. Every line also gives the
machine's core count and its load average before and after the run: on a
machine with other work, `cores_busy` says whether two threads ran at once
at all.

First it prints, for `HFTokenizer.encode` and `encode_many`, how far another
Python thread gets while they run (near 0: the call holds the GIL). Then the
configurations take turns for `--rounds` rounds (so load from other
processes hits them alike) and the median MB/s of text per configuration is
printed as one JSON line each, with its ratio to per-document on 1 thread
and `cores_busy`, this process's CPU seconds per second (worker processes not
counted): above 1 only where threads encode at once, which a machine shared
with other work shows better than the rates, and `mb_per_cpu_second`, the
text tokenized per CPU second of this process (the cost, whatever the
load; null for worker processes, whose CPU is not counted). A run is timed
from its start, except on the process backend, where it is timed from the
first element on (worker start-up is not tokenization).

  python -m benchmarks.tokenizer_threads [--rounds 3] [--megabytes 4] [--only a,b]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import statistics
import tempfile
import threading
import time

from examples import lm_data

from benchmarks import record

BATCH = 16


def pipeline(tokenizer, documents, threads: int, batched: bool, backend: str = "thread"):
  import jaxfeed  # pylint: disable=g-import-not-at-top

  calls = None if threads == 1 else threads
  ds = jaxfeed.Dataset.from_source(documents)
  if batched:
    return (
      ds.batch(BATCH)
      .map(jaxfeed.Tokenize(tokenizer, batched=True), num_parallel_calls=calls)
      .unbatch()
    )
  return ds.map(jaxfeed.Tokenize(tokenizer), num_parallel_calls=calls, backend=backend)


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


def bare_loop(tokenizer, documents, threads: int, batched: bool):
  """The tokenizer called directly, no pipeline: per document, or
  `encode_many` on batches of `BATCH` spread over `threads` Python threads.
  Yields each document's token count, the end-of-document id included as
  `Tokenize` appends it."""
  if not batched:
    for doc in documents:
      yield len(tokenizer.encode(doc)) + 1
    return
  batches = [documents[i : i + BATCH] for i in range(0, len(documents), BATCH)]
  with concurrent.futures.ThreadPoolExecutor(threads) as pool:
    for ids in pool.map(tokenizer.encode_many, batches):
      for one in ids:
        yield len(one) + 1


# name: (threads, batched, runner, TOKENIZERS_PARALLELISM or None for unset)
CONFIGS = {
  "per_document_1_thread": (1, False, "thread", None),
  "per_document_2_threads": (2, False, "thread", None),
  "batched_1_thread": (1, True, "thread", "false"),
  "batched_2_threads": (2, True, "thread", "false"),
  "batched_1_thread_rust_pool": (1, True, "thread", "true"),
  "batched_2_threads_rust_pool": (2, True, "thread", "true"),
  "per_document_2_processes": (2, False, "process", None),
  "bare_per_document_1_thread": (1, False, "bare", None),
  "bare_batched_1_thread": (1, True, "bare", "false"),
  "bare_batched_2_threads": (2, True, "bare", "false"),
  "bare_batched_1_thread_rust_pool": (1, True, "bare", "true"),
  "bare_batched_2_threads_rust_pool": (2, True, "bare", "true"),
}


def run_once(tokenizer, documents, threads, batched, runner):
  """(seconds, this process's CPU seconds, tokens, bytes of text timed)."""
  if runner == "bare":
    start, cpu = time.perf_counter(), time.process_time()
    count = sum(bare_loop(tokenizer, documents, threads, batched))
    return (time.perf_counter() - start, time.process_time() - cpu, count, sum(map(len, documents)))
  start, cpu = time.perf_counter(), time.process_time()
  iterator = pipeline(tokenizer, documents, threads, batched, runner).make_iterator()
  if runner == "process":
    # Timed from the first element on: starting worker processes is not
    # tokenization. Only the first document was tokenized before.
    first = next(iterator)
    start, cpu = time.perf_counter(), time.process_time()
    documents = documents[1:]
  else:
    # Timed from the start (threads start in microseconds): a batched
    # pipeline's first element comes after its whole first batch (of every
    # thread, with 2), so timing from it would leave that text out.
    first = {"tokens": ()}
  count = len(first["tokens"]) + sum(len(e["tokens"]) for e in iterator)
  elapsed, used = time.perf_counter() - start, time.process_time() - cpu
  iterator.close()
  return elapsed, used, count, sum(map(len, documents))


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument(
    "--megabytes", type=float, default=4.0, help="text tokenized per configuration and round"
  )
  parser.add_argument("--only", default="", help="comma-separated configurations (default: all)")
  args = parser.parse_args()
  names = args.only.split(",") if args.only else list(CONFIGS)
  unknown = sorted(set(names) - set(CONFIGS))
  if unknown:
    parser.error(f"--only: no configuration {unknown}; choose from {list(CONFIGS)}")
  configs = {name: CONFIGS[name] for name in names}
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
  load_before = os.getloadavg()
  with tempfile.TemporaryDirectory() as tmp:
    tokenizer = jaxfeed.HFTokenizer.train_bpe(
      (d.decode("utf-8", "replace") for d in documents[:400]),
      os.path.join(tmp, "tokenizer.json"),
      vocab_size=4096,
    )
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    texts = [d.decode("utf-8", "replace") for d in chosen[:300]]
    for name, work in (
      ("encode", lambda: [tokenizer.encode(t) for t in texts]),
      (
        "encode_many",
        lambda: [tokenizer.encode_many(texts[i : i + BATCH]) for i in range(0, len(texts), BATCH)],
      ),
    ):
      record.row(
        {
          "workload": "hf_tokenize_gil",
          "system": name,
          "other_thread_progress": round(other_thread_progress(work), 2),
        }
      )
    rates = {name: [] for name in configs}
    busy = {name: [] for name in configs}
    tokens = {}
    for _ in range(args.rounds + 1):  # The first round warms up.
      for name, (threads, batched, runner, rust_pool) in configs.items():
        # The tokenizers library reads the variable at every batch call.
        if rust_pool is None:
          os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
          os.environ["TOKENIZERS_PARALLELISM"] = rust_pool
        elapsed, used, count, timed = run_once(tokenizer, chosen, threads, batched, runner)
        busy[name].append(used / elapsed)
        rates[name].append(timed / 1e6 / elapsed)
        tokens[name] = count
    base_name = "per_document_1_thread" if "per_document_1_thread" in rates else next(iter(rates))
    base = statistics.median(rates[base_name][1:])
    load = [round(x, 1) for x in load_before + os.getloadavg()]
    for name, values in rates.items():
      rate = statistics.median(values[1:])
      record.row(
        {
          "workload": "hf_tokenize",
          "system": name,
          "unit": "MB/s",
          "rate": round(rate, 2),
          "rates": [round(r, 2) for r in values[1:]],
          f"ratio_vs_{base_name}": round(rate / base, 2),
          "cores_busy": round(statistics.median(busy[name][1:]), 2),
          "mb_per_cpu_second": None
          if configs[name][2] == "process"
          else round(statistics.median(r / b for r, b in zip(values[1:], busy[name][1:])), 2),
          "tokens": tokens[name],
          "megabytes": round(size / 1e6, 2),
          "cpus": os.cpu_count(),
          "load_average_before_after": load,
        }
      )
    if len(set(tokens.values())) != 1:
      raise AssertionError(f"configurations disagree on the tokens: {tokens}")


if __name__ == "__main__":
  with record.run("tokenizer_threads"):
    main()
