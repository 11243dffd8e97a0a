"""Checkpoints of a `jaxfeed.Loader` with orbax, and its states resharded to
another number of JAX processes.

Checkpointing with orbax, next to the model state::

  manager = ocp.CheckpointManager(workdir)
  jaxfeed.save_checkpoint(manager, step, loader, model_state=state)
  ...
  state = jaxfeed.restore_checkpoint(manager, step, loader, model_state=state)

or, composing the items yourself::

  manager.save(step, args=ocp.args.Composite(
      model=ocp.args.StandardSave(state), loader=jaxfeed.LoaderSave(loader)))
  restored = manager.restore(step, args=ocp.args.Composite(
      model=ocp.args.StandardRestore(state), loader=jaxfeed.LoaderRestore(loader)))

The loader item is written by `LoaderCheckpointHandler`: one JSON file per JAX
process (`process_<i>-of-<n>.json`), since every process reads its own shard.
Restoring with another number of processes works for pipelines that read an
`IndexSampler` sharded by process through `map`, `random_map`, `filter`,
`pack` and `batch` (see `reshard_loader_states`); others fail with an error
naming the op.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
from typing import Any

from etils import epath
import jax
import orbax.checkpoint as ocp

from jaxfeed.device.agreement import distributed_client
from jaxfeed.loader import Loader
from jaxfeed.ops.reshard import reshard_states
from jaxfeed.service.protocol import read_state

_MODEL_ITEM = "model"
_LOADER_ITEM = "loader"


def reshard_loader_states(states: list[dict[str, Any]]) -> dict[str, Any]:
  """A Loader state that resumes, on any number of JAX processes, the run whose
  process `h` of `len(states)` saved `states[h]` (`Loader.get_state()`).

  Every new process restores the same state (`Loader.set_state`); its pipeline
  must be the old one, with the sampler sharded by the new process count (e.g.
  `ShardByJaxProcess()`) and, for the same global batch, a per-process batch
  size of `global_batch // jax.process_count()`. The records the old processes
  had not read are dealt out to the new ones, each read once over all of them;
  later epochs are read as usual. Pipelines: `from_source` with an
  `IndexSampler` (or `Dataset.mix`), then `map`, `random_map`, `filter`, at
  most one `pack`, `batch` / `padded_batch`; the elements `pack` held count
  as unread (a partly emitted `overflow="split"` element as its missing
  pieces). Anything else holding elements of one process's shard (a
  `shuffle` buffer, ...) raises a ValueError naming it.
  """
  batches = {state.get("batches") for state in states}
  if len(batches) != 1:
    raise ValueError(
      f"reshard: the processes' Loader states have received different "
      f"numbers of batches {sorted(map(str, batches))}; they must be "
      "taken at the same step."
    )
  merged = {
    "pipeline": reshard_states([state["pipeline"] for state in states]),
    "batches": batches.pop(),
  }
  if all(state.get("end_of_epoch") for state in states):
    merged["end_of_epoch"] = True
  return merged


def _state_file(directory: epath.Path) -> epath.Path:
  return epath.Path(directory) / (f"process_{jax.process_index()}-of-{jax.process_count()}.json")


_restores = itertools.count()  # this process's restores of shared reads


def _agreed_restore_id() -> str:
  """A new random id, the same on every JAX process: process 0 draws it
  and hands it on through the coordination service. Every process restores
  in the same order, so the n-th restore of each shares a key."""
  key = f"jaxfeed/loader_restore/{next(_restores)}"
  client = distributed_client()
  if client is None:
    raise RuntimeError(
      "Restoring a shared service read in a multi-process job needs "
      "jax.distributed.initialize(): its processes agree on the new job "
      "through it."
    )
  if jax.process_index() == 0:
    restore_id = read_state.new_restore_id()
    client.key_value_set(key, restore_id)
    return restore_id
  return str(client.blocking_key_value_get(key, 300_000))


def _read_state(directory: epath.Path) -> dict[str, Any]:
  """This process's state, or one resharded from another process count's.

  An exactly-once read of a shared service job resumes what all processes
  took together (`read_state.merge_process_states`), so it reads every
  process's file, on one new job per restore (`_agreed_restore_id`).
  """
  path = _state_file(directory)
  if path.exists():
    state: dict[str, Any] = json.loads(path.read_text())
    if jax.process_count() > 1 and read_state.has_shared_read(state["pipeline"]):
      states = [
        json.loads(
          (epath.Path(directory) / (f"process_{i}-of-{jax.process_count()}.json")).read_text()
        )
        for i in range(jax.process_count())
      ]
      merged = read_state.merge_process_states(
        [s["pipeline"] for s in states], _agreed_restore_id()
      )
      state["pipeline"] = merged[jax.process_index()]
    return state
  found = sorted(p.name for p in epath.Path(directory).glob("process_*.json"))
  counts = {name.rsplit("-of-", 1)[-1].removesuffix(".json") for name in found}
  if len(counts) != 1 or not next(iter(counts)).isdigit():
    raise FileNotFoundError(
      f"Loader checkpoint: {path} does not exist and the files there "
      f"({found}) are not one set written by one number of JAX processes."
    )
  count = int(counts.pop())
  files = [epath.Path(directory) / f"process_{i}-of-{count}.json" for i in range(count)]
  missing = [f.name for f in files if not f.exists()]
  if missing:
    raise FileNotFoundError(
      f"Loader checkpoint: written by {count} JAX processes, restoring with "
      f"{jax.process_count()}; resharding needs every process's file but "
      f"{missing} are missing in {directory}."
    )
  return reshard_loader_states([json.loads(f.read_text()) for f in files])


class LoaderCheckpointHandler(ocp.CheckpointHandler):  # type: ignore[misc]  # Orbax: no hints
  """Orbax handler for a `Loader`'s state: one JSON file per JAX process.

  Restoring with another number of JAX processes than saved reads every
  process's file and reshards them (`reshard_loader_states`).

  Use through its args, `LoaderSave(loader)` / `LoaderRestore(loader)`, inside
  `ocp.args.Composite` (see `save_checkpoint`).
  """

  def save(self, directory: epath.Path, args: "LoaderSave") -> None:
    _state_file(directory).write_text(json.dumps(args.state))

  def restore(self, directory: epath.Path, args: "LoaderRestore") -> Any:
    state = _read_state(directory)
    if args.loader is None:
      return state
    args.loader.set_state(state)
    return args.loader

  def metadata(self, directory: epath.Path) -> None:
    del directory
    return None


@ocp.args.register_with_handler(LoaderCheckpointHandler, for_save=True)
@dataclasses.dataclass
class LoaderSave(ocp.args.CheckpointArgs):  # type: ignore[misc]  # Orbax: no hints
  """Saves `loader`'s state as of now (the state is taken at construction)."""

  loader: Any
  state: dict[str, Any] = dataclasses.field(init=False)

  def __post_init__(self) -> None:
    self.state = self.loader.get_state()


@ocp.args.register_with_handler(LoaderCheckpointHandler, for_restore=True)
@dataclasses.dataclass
class LoaderRestore(ocp.args.CheckpointArgs):  # type: ignore[misc]  # Orbax: no hints
  """Restores into `loader` (restore returns it), or returns the state dict
  when `loader` is None."""

  loader: Any = None


def save_checkpoint(
  manager: ocp.CheckpointManager,
  step: int,
  loader: Loader,
  *,
  model_state: Any,
  force: bool = False,
) -> bool:
  """Saves `model_state` (item "model") and the loader state (item "loader").

  Returns whether the manager saved (see `ocp.CheckpointManager.save`).
  """
  return bool(
    manager.save(
      step,
      args=ocp.args.Composite(
        **{_MODEL_ITEM: ocp.args.StandardSave(model_state), _LOADER_ITEM: LoaderSave(loader)}
      ),
      force=force,
    )
  )


def restore_checkpoint(
  manager: ocp.CheckpointManager,
  step: int | None,
  loader: Loader,
  *,
  model_state: Any,
  restore_loader: bool = True,
) -> Any:
  """Restores the loader in place and returns the model state of `step`.

  Args:
    manager: the manager `save_checkpoint` wrote with.
    step: the step to restore; None for the latest.
    loader: restored in place (`loader.set_state`).
    model_state: a pytree like the saved one (arrays or
      `jax.ShapeDtypeStruct`s) giving the shapes, dtypes and shardings.
    restore_loader: False leaves the loader where it is and restores only
      the model (e.g. a service read that cannot resume at a position: one
      neither `distributed_epoch` with `visitation="exactly_once"` nor an
      unshared `parallel_epochs` read of an index-based pipeline, see
      docs/service.md, "Resuming a read").

  Returns:
    The restored model state.
  """
  if step is None:
    step = manager.latest_step()
    if step is None:
      raise FileNotFoundError(f"restore_checkpoint: no checkpoint in {manager.directory}.")
  items = {_MODEL_ITEM: ocp.args.StandardRestore(model_state)}
  if restore_loader:
    items[_LOADER_ITEM] = LoaderRestore(loader)
  restored = manager.restore(step, args=ocp.args.Composite(**items))
  return restored[_MODEL_ITEM]
