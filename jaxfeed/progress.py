"""One progress bar for every long operation (conversion, length index,
snapshot and cache fills), drawn with `rich` on a terminal and silent
otherwise (logs, CI, pipes)."""

from __future__ import annotations

import sys
from typing import Any


class Progress:
  """A counter with a bar: `with Progress("convert", total) as p: p.advance(n)`.

  Args:
    description: what is being done, shown before the bar.
    total: the number of units when known, or None.
    unit: what is counted ("records", "bytes", ...).
    enabled: None draws only when stderr is a terminal.
  """

  def __init__(
    self,
    description: str,
    total: int | None = None,
    unit: str = "records",
    enabled: bool | None = None,
  ):
    self.description = description
    self.total = total
    self.unit = unit
    self.count = 0
    self._enabled = sys.stderr.isatty() if enabled is None else enabled
    self._bar: Any = None
    self._task: Any = None

  def __enter__(self) -> "Progress":
    if self._enabled:
      try:  # rich comes with flax; without it there is no bar, nothing else
        from rich import console, progress  # pylint: disable=g-import-not-at-top
      except ImportError:
        return self
      self._bar = progress.Progress(
        progress.TextColumn("{task.description}"),
        progress.BarColumn(),
        progress.MofNCompleteColumn(),
        progress.TextColumn(self.unit),
        progress.TimeRemainingColumn(),
        console=console.Console(stderr=True),
      )
      self._bar.__enter__()
      self._task = self._bar.add_task(self.description, total=self.total)
    return self

  def advance(self, count: int = 1) -> None:
    self.count += count
    if self._bar is not None:
      self._bar.update(self._task, advance=count)

  def __exit__(self, *exc: Any) -> None:
    if self._bar is not None:
      self._bar.__exit__(*exc)
      self._bar = None
