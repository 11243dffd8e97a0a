"""The chain `process_batch` fuses: input -> element ops -> batch.

`FusedChain` takes the chain apart (its input node, element ops and batch
parameters), builds what the chunk workers run (`payload`) and the same chain
run element by element in one thread (`sequential`), and converts between
the chain's state, in the layout its element-wise iterator saves, and an
input position (a batch boundary with nothing in flight), so a checkpoint
restores into either way of running it.
"""

from __future__ import annotations

import copy

from jaxfeed.ops import base, index_ranges

__all__ = ["FusedChain", "INPUT_OPS", "ELEMENT_OPS"]

INPUT_OPS = ("range", "from_tensor_slices", "from_source")
ELEMENT_OPS = ("map", "random_map", "filter", "map_and_filter")


class FusedChain:
  """The parts of a fusable chain ending at `batch_node`.

  Raises:
    ValueError: the chain is not `INPUT_OPS -> ELEMENT_OPS+ -> batch`.
  """

  def __init__(self, batch_node: base.Node, op_name: str = "process_batch"):
    if batch_node.op_name != "batch":
      raise ValueError(f"{op_name}: expects a batch node, got {batch_node.op_name!r}.")
    params = batch_node.spec_params()
    self.batch_size = params["batch_size"]
    self.drop_remainder = params["drop_remainder"]
    stages = []
    node = batch_node.parents[0]
    while node.op_name in ELEMENT_OPS:
      stages.append(node)
      node = node.parents[0]
    if node.op_name not in INPUT_OPS or not stages:
      raise ValueError(
        f"{op_name}: fuses {' | '.join(INPUT_OPS)} -> "
        f"({' | '.join(ELEMENT_OPS)})+ -> batch, got a chain from "
        f"{node.op_name!r}."
      )
    self.input = node
    self.stage_nodes = stages[::-1]
    self.stages = [_stage_spec(n) for n in self.stage_nodes]
    self.filters = any(s[0] in ("filter", "map_and_filter") for s in self.stages)
    # The last op writes each element into its batch row (writes_out).
    self.writes_rows = bool(self.stages[-1][-1]) and not self.filters
    self.batch_node = batch_node

  def sequential(self) -> base.Node:
    """The chain with every element op in the consumer thread."""
    node = self.input
    for stage in self.stage_nodes:
      params = dict(stage.spec_params())
      if "num_parallel_calls" in params:
        params["num_parallel_calls"] = None
      if "backend" in params:
        params["backend"] = "thread"
      node = type(stage)(node, **params)
    return type(self.batch_node)(node, **self.batch_node.spec_params())

  def payload(self) -> tuple:
    """What chunk workers rebuild: the input as (type, params), the stages,
    the batch size and drop_remainder (see `chunk_runner.ChunkRunner`)."""
    return (
      (type(self.input), self.input.spec_params()),
      self.stages,
      self.batch_size,
      self.drop_remainder,
    )

  def num_positions(self) -> int | None:
    """The input's positions in one iteration (None: endless)."""
    return self.input.num_positions()

  def first_state(self) -> dict:
    """The state the chain starts from in its input's current iteration
    (the template `state_at` moves)."""
    with self.sequential().make_iterator() as iterator:
      return iterator.get_state()

  def span(self, state: dict) -> tuple[int, int | None] | None:
    """The input position a chain state reads next and the end of its
    iteration's positions (None: endless); None when the input's state holds
    more than a position (workers, which read positions of the node they
    rebuilt, cannot resume it). See `index_ranges.iteration_span`."""
    return index_ranges.iteration_span(self.input, _bottom(state)["own"])

  def state_at(self, template: dict, position: int) -> dict:
    """`template` (a chain state) with every op caught up and the input at
    `position` of its iteration."""
    state = copy.deepcopy(template)
    bottom = _bottom(state)
    bottom["own"] = index_ranges.own_state_at(self.input, bottom["own"], position)
    return state

  def restored(self, state: dict) -> dict:
    """`state` checked (a PipelineStateError names what does not fit) and as
    the element-wise iterator saves it; its iteration becomes the input's."""
    with self.sequential().make_iterator() as iterator:
      iterator.set_state(state)
      return iterator.get_state()

  def element_params(self) -> list[dict]:
    return [n.spec_params() for n in self.stage_nodes]


def _bottom(state: dict) -> dict:
  """The state of the chain's input inside a chain state."""
  while state["parents"]:
    state = state["parents"][0]
  return state


def _stage_spec(node: base.Node) -> tuple:
  """(kind, functions..., writes_out): what a worker rebuilds an op from."""
  params = node.spec_params()
  writes_out = bool(params.get("writes_out"))
  if node.op_name == "map":
    return ("map", params["fn"], writes_out)
  if node.op_name == "random_map":
    return ("random_map", params["fn"], params["seed"] or 0, writes_out)
  if node.op_name == "filter":
    return ("filter", params["predicate"], False)
  return ("map_and_filter", params["fn"], params["predicate"], False)
