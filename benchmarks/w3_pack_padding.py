r"""W3(b) of BENCHMARKS.md: packing padding fraction and speed.

50,000 int32 token sequences, lengths lognormal(4.5, 0.8) clipped to [8, 512],
packed into 512-token rows, 32 rows at a time. Prints one JSON line per
(system, algorithm): sequences/s (median of the epochs after a warm-up) and the
padding fraction (1 - real tokens / row tokens).

  python -m benchmarks.w3_pack_padding [--epochs 3] [--scale 1.0] [--grain]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from benchmarks import record
from benchmarks import workloads

ROW_LENGTH = 512
NUM_ROWS = 32


def _measure(make_epoch, epochs: int) -> tuple[float, list]:
  """(median sequences/s over `epochs` after one warm-up, the last epoch's rows)."""
  rates, rows = [], []
  for epoch in range(epochs + 1):
    start = time.perf_counter()
    rows = list(make_epoch())
    elapsed = time.perf_counter() - start
    sequences = sum(int(r["tokens_segment_ids"].max()) for r in rows)
    if epoch:
      rates.append(sequences / elapsed)
  return statistics.median(rates), rows


def _padding_fraction(rows: list) -> float:
  real = sum(int(np.count_nonzero(r["tokens_segment_ids"])) for r in rows)
  return 1.0 - real / (len(rows) * ROW_LENGTH)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--epochs", type=int, default=3)
  parser.add_argument("--scale", type=float, default=1.0)
  parser.add_argument(
    "--grain", action="store_true", help="also run Grain's FirstFitPackIterDataset"
  )
  args = parser.parse_args()

  import jaxfeed

  lengths = workloads.w3_lengths(args.scale)
  examples = [{"tokens": s} for s in workloads.w3_sequences(lengths)]
  source = jaxfeed.Dataset.from_source(examples)
  total_tokens = int(lengths.sum())
  for algorithm in ("first_fit", "best_fit"):
    packed = source.pack({"tokens": ROW_LENGTH}, num_packing_bins=NUM_ROWS, algorithm=algorithm)
    rate, rows = _measure(lambda: iter(packed), args.epochs)
    real = sum(int(np.count_nonzero(r["tokens_segment_ids"])) for r in rows)
    assert real == total_tokens, (real, total_tokens)  # no token lost
    record.row(
      {
        "workload": "W3-packing",
        "system": f"jaxfeed-{algorithm}",
        "sequences_per_s": round(rate),
        "rows": len(rows),
        "padding_fraction": round(_padding_fraction(rows), 4),
      }
    )
  if args.grain:
    import grain

    packed = grain.experimental.FirstFitPackIterDataset(
      grain.MapDataset.source(examples).to_iter_dataset(),
      length_struct={"tokens": ROW_LENGTH},
      num_packing_bins=NUM_ROWS,
      shuffle_bins=False,
    )
    rate, rows = _measure(lambda: iter(packed), args.epochs)
    record.row(
      {
        "workload": "W3-packing",
        "system": "grain-first_fit",
        "sequences_per_s": round(rate),
        "rows": len(rows),
        "padding_fraction": round(_padding_fraction(rows), 4),
      }
    )


if __name__ == "__main__":
  with record.run("w3_pack_padding"):
    main()
