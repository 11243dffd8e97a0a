"""How many rows a complete batch of a pipeline has, when the graph says.

The Loader pads or drops a *partial* batch (fewer rows than a complete one,
e.g. the last batch of an epoch without `drop_remainder`); to know one on a
single process it needs the complete size. It is the `batch_size` of the
pipeline's last batching op (`batch`, `padded_batch`, `rebatch` with one
size), seen through the ops above it that keep each element a batch of at
most that many rows.

Any other op above it (a `map`, which may reshape a batch; `unbatch`; ...),
a last batching op whose sizes vary by design (`bucket_by_sequence_length`,
`pack`, `rebatch` with several sizes) and a service read (`distribute`: an
exactly-once read ends a batch at every split, so partial batches there are
not the end of anything) give None: rows then count as partial only against
another process's rows at the same step.
"""

from __future__ import annotations

from jaxfeed.ops.base import Node

__all__ = ["SAME_ELEMENT_OPS", "full_batch_rows"]

# Ops that hand on their one parent's elements as they are (some dropped,
# repeated or reordered): a batch stays a batch of at most as many rows, and
# an element keeps its spec (`jaxfeed.ops.element_spec`).
SAME_ELEMENT_OPS = (
  "take",
  "skip",
  "repeat",
  "shuffle",
  "filter",
  "prefetch",
  "cache",
  "snapshot",
  "shard",
  "take_while",
  "ignore_errors",
  "autocache",
)


def full_batch_rows(node: Node) -> int | None:
  """The rows of a complete batch of `node`'s dataset, or None (see above)."""
  while True:
    if node.op_name in ("batch", "padded_batch"):
      return node.batch_size  # type: ignore[attr-defined]
    if node.op_name == "rebatch":
      sizes = set(node.batch_sizes)  # type: ignore[attr-defined]
      return sizes.pop() if len(sizes) == 1 else None
    if node.op_name in SAME_ELEMENT_OPS and len(node.parents) == 1:
      node = node.parents[0]
    else:
      return None
