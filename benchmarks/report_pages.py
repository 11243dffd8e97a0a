"""The generated tables of docs pages other than the benchmark page: which
page carries which blocks, each rendered from one recorded benchmark, so
that the figures a guide quotes are the recorded ones."""

from __future__ import annotations

from typing import Callable

from benchmarks import report_dispatcher
from benchmarks import report_rows
from benchmarks.report_rows import percent
from benchmarks.report_rows import rate
from benchmarks.report_rows import ratio
from benchmarks.report_rows import table

Results = report_rows.Results

# W8's rows, as `benchmarks.w8_text` names them, and how the page names them.
W8_SYSTEMS = (
  ("jaxfeed (mix)", "jaxfeed, `Dataset.mix`"),
  ("jaxfeed (sample_from_datasets)", "jaxfeed, `sample_from_datasets`"),
  ("grain", "Grain"),
  ("tf.data", "tf.data (bucketing, no packing)"),
)
# W6's BucketPlan rows (`benchmarks.w6_coordinated`).
W6_PLANS = (
  ("coordinated (BucketPlan)", "`BucketPlan`"),
  ("coordinated (BucketPlan, carry_remainders)", "`BucketPlan(..., carry_remainders=True)`"),
)


def w8_text(results: Results) -> str:
  """W8's systems: tokens/s, tokens per CPU second, padding."""
  found = [(name, results.get("w8_text", "W8", system)) for system, name in W8_SYSTEMS]
  rows = [
    [
      name,
      rate(line["rate"]),
      rate(line["tokens_per_cpu_second"]),
      percent(line["padding_fraction"]),
      report_rows.measured(context),
    ]
    for name, (line, context) in ((n, f) for n, f in found if f)
  ]
  if not rows:
    return "No run recorded yet: `python -m benchmarks.w8_text --repeats=3`.\n"
  text = table(["system", "tokens/s", "tokens per CPU second", "padding", "measured"], rows)
  mix, grain = found[0][1], found[2][1]
  if mix and grain:
    per_cpu = mix[0]["tokens_per_cpu_second"] / grain[0]["tokens_per_cpu_second"]
    text += (
      f"\n`Dataset.mix` is {ratio(mix[0]['rate'] / grain[0]['rate'])} Grain by wall "
      f"clock and {ratio(per_cpu)} per CPU second.\n"
    )
  return text


def w6_remainders(results: Results) -> str:
  """W6's plans with and without carried remainders: tokens covered, padding."""
  found = [(name, results.get("w6_coordinated", "W6", way=way)) for way, name in W6_PLANS]
  rows = [
    [
      name,
      percent(line["token_coverage"]),
      percent(line["padding_fraction"]),
      report_rows.measured(context),
    ]
    for name, (line, context) in ((n, f) for n, f in found if f)
  ]
  if not rows:
    return "No run recorded yet: `python -m benchmarks.w6_coordinated`.\n"
  return table(
    ["W6, 4 hosts, buckets every 8 tokens", "tokens covered an epoch", "padding", "measured"], rows
  )


# Page (relative to the repository) -> its generated blocks.
PAGES: dict[str, Callable[[Results], dict[str, str]]] = {
  "docs/dispatcher_scale.md": report_dispatcher.blocks,
  "docs/llm_text.md": lambda results: {"w8": w8_text(results)},
  "docs/concepts/coordinated_reads.md": lambda results: {"w6-remainders": w6_remainders(results)},
}
