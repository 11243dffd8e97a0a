"""What the example trainers share: the data-parallel mesh, checkpoints that
hold model, optimizer and loader state together, and the progress log."""

from __future__ import annotations

import os
import time
from typing import Any, Callable

import numpy as np


def log(message: str, *args: Any) -> None:
  print(message % args, flush=True)


def data_parallel(batch_size: int) -> tuple[Any, Any, Any]:
  """A 1-D mesh over every device: (mesh, replicated, batch-split sharding)."""
  import jax  # pylint: disable=g-import-not-at-top

  devices = jax.devices()
  if batch_size % len(devices):
    raise ValueError(f"--batch_size={batch_size} must be divisible by the {len(devices)} devices.")
  mesh = jax.sharding.Mesh(np.array(devices), ("data",))
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  split = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
  return mesh, replicated, split


def optimizer_update(optimizer: Any, model: Any, grads: Any) -> None:
  """`optimizer.update` across flax releases: 0.11 and later pass the model
  to each update; 0.10 (the newest for Python 3.10) binds it at creation."""
  import flax  # pylint: disable=g-import-not-at-top

  if tuple(map(int, flax.__version__.split(".")[:2])) >= (0, 11):
    optimizer.update(model, grads)
  else:
    optimizer.update(grads)


class TrainState:
  """The model and optimizer state as one checkpointable tree."""

  def __init__(self, model: Any, optimizer: Any):
    self.model = model
    self.optimizer = optimizer

  def get(self) -> dict:
    from flax import nnx  # pylint: disable=g-import-not-at-top

    return {"model": nnx.state(self.model), "optimizer": nnx.state(self.optimizer)}

  def load(self, state: dict) -> None:
    from flax import nnx  # pylint: disable=g-import-not-at-top

    nnx.update(self.model, state["model"])
    nnx.update(self.optimizer, state["optimizer"])


def checkpoint_manager(workdir: str) -> Any:
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top

  return ocp.CheckpointManager(
    os.path.abspath(workdir), options=ocp.CheckpointManagerOptions(max_to_keep=2, create=True)
  )


def resume(manager: Any, loader: Any, train_state: TrainState, restore_loader: bool = True) -> int:
  """Restores the latest checkpoint (model, optimizer, loader); its step."""
  import jaxfeed  # pylint: disable=g-import-not-at-top

  step = manager.latest_step()
  if step is None:
    return 0
  restored = jaxfeed.restore_checkpoint(
    manager, step, loader, model_state=train_state.get(), restore_loader=restore_loader
  )
  train_state.load(restored)
  log("Resumed from step %d (loader at batch %d).", step, loader.get_state()["batches"])
  return step


class ProgressLog:
  """Prints one line every `every` steps: mean loss, rates, input wait."""

  def __init__(
    self,
    loader: Any,
    every: int,
    last_step: int,
    line: Callable[[int, float, float, float, float], str],
  ):
    """Logs the training's progress every `every` steps.

    Args:
      loader: the jaxfeed.Loader (for its input-bound fraction).
      every: steps between lines.
      last_step: the final step, always logged.
      line: (step, mean loss, steps/s, items/s, input wait %) -> the line.
    """
    self._loader = loader
    self._every = every
    self._last_step = last_step
    self._line = line
    self._start = time.perf_counter()
    self._steps = 0
    self._losses: list[float] = []
    self._items = 0

  def step(self, step: int, loss: Any, items: Any = 0) -> None:
    """Records a finished step: its loss and the items (tokens, images) in it."""
    self._steps += 1
    self._losses.append(float(loss))
    self._items += int(items)
    if step % self._every and step != self._last_step:
      return
    elapsed = time.perf_counter() - self._start
    wait = self._loader.stats()["input_bound_fraction"]
    print(
      self._line(
        step,
        float(np.mean(self._losses)),
        self._steps / elapsed,
        self._items / elapsed,
        100.0 * wait,
      ),
      flush=True,
    )
    self._start, self._steps, self._losses, self._items = time.perf_counter(), 0, [], 0


def train(
  loader: Any,
  manager: Any,
  state: TrainState,
  run_step: Callable[[Any], tuple],
  progress: ProgressLog,
  *,
  step: int,
  num_steps: int,
  checkpoint_every: int,
  workdir: str,
) -> int:
  """The loop every example shares: `run_step(batch) -> (loss, items)` from
  `step` up to `num_steps`, logging through `progress` and checkpointing the
  model, optimizer and loader every `checkpoint_every` steps and at the end.

  Returns:
    The last step taken.
  """
  import jaxfeed  # pylint: disable=g-import-not-at-top

  with loader:
    for batch in loader:
      if step >= num_steps:
        break
      loss, items = run_step(batch)
      step += 1
      progress.step(step, loss, items)
      if step % checkpoint_every == 0 or step == num_steps:
        jaxfeed.save_checkpoint(manager, step, loader, model_state=state.get())
  manager.wait_until_finished()
  manager.close()
  log("Done at step %d; checkpoints in %s.", step, workdir)
  return step


def train_with_flags(
  flags: Any,
  loader: Any,
  manager: Any,
  state: TrainState,
  run_step: Callable[[Any], tuple],
  line: Callable[[int, float, float, float, float], str],
  step: int,
) -> int:
  """`train` with the flags every example defines (`log_every`, `num_steps`,
  `checkpoint_every`, `workdir`), logging `line` (see `ProgressLog`).

  Returns:
    The last step taken.
  """
  progress = ProgressLog(loader, flags.log_every, flags.num_steps, line)
  return train(
    loader,
    manager,
    state,
    run_step,
    progress,
    step=step,
    num_steps=flags.num_steps,
    checkpoint_every=flags.checkpoint_every,
    workdir=flags.workdir,
  )
