"""What a saved `from_source` state records of its pipeline, checked on restore.

A state restored into a pipeline with another sampler seed or another source
would read records twice and skip others without an error. So every
`from_source` state records what defines its order and content, and
`set_state` refuses a state whose record differs, naming what differs:

- the sampler's `identity()`: for an `IndexSampler` its number of records,
  shuffle, seed, epochs, shard options and `reshuffle_each_iteration`; for a
  mixture its schedule seed, shard options and components (not its weights:
  a restored mixture may have new ones);
- the source's identity: its type, its number of records and the cheap
  facts its `identity()` gives (array leaves' dtypes and shapes, file names;
  no record is read).

The documented changes stay allowed: new mixture weights, and another number
of processes through `reshard_loader_states` (a resharded state may be
restored on any shard). File sources record file names, not directories, so
data copied elsewhere restores too. States saved before these records
existed are restored with a warning.
"""

from __future__ import annotations

from typing import Any
import warnings

from jaxfeed.ops.base import PipelineStateError
from jaxfeed.sources.base import source_identity

__all__ = ["check_identity", "pipeline_identity"]

_SHARD_FIELDS = ("shard_index", "shard_count")


def pipeline_identity(source: Any, sampler: Any) -> dict | None:
  """What a `from_source` state over `source` and `sampler` records; None
  when the sampler cannot say what defines its order."""
  identity = getattr(sampler, "identity", None)
  if not callable(identity):
    return None
  return {"sampler": identity(), "source": source_identity(source)}


def _differences(saved: Any, current: Any, path: str = "") -> list[tuple[str, Any, Any]]:
  """(field, saved value, current value) for every field that differs."""
  if isinstance(saved, dict) and isinstance(current, dict):
    found = []
    for key in sorted(set(saved) | set(current), key=str):
      found += _differences(saved.get(key), current.get(key), f"{path}.{key}" if path else str(key))
    return found
  if isinstance(saved, list) and isinstance(current, list) and len(saved) == len(current):
    found = []
    for i, (a, b) in enumerate(zip(saved, current)):
      found += _differences(a, b, f"{path}[{i}]")
    return found
  return [] if saved == current else [(path, saved, current)]


def _describe(identity: dict) -> str:
  """A sampler or source identity as one line, e.g. `IndexSampler(seed=1, ...)`."""
  fields = ", ".join(f"{k}={v!r}" for k, v in identity.items() if k not in ("type", "components"))
  if "components" in identity:
    fields += f", components=[{', '.join(_describe(c) for c in identity['components'])}]"
  return f"{identity.get('type', '?')}({fields})"


def check_identity(saved: Any, current: dict | None, op_name: str, *, resharded: bool) -> None:
  """Raises PipelineStateError unless a state's recorded identity `saved`
  matches the pipeline's `current` one.

  Args:
    saved: the "identity" of the own state; None for a state saved before
      states recorded it (accepted with a warning).
    current: `pipeline_identity` of the restoring pipeline; None when its
      sampler records none (nothing is checked).
    op_name: named in the error.
    resharded: the state comes from `reshard_loader_states`, for any shard.
  """
  if current is None:
    return
  if saved is None:
    warnings.warn(
      f"{op_name}: restoring a state saved without the record of its "
      f"sampler and source (saved by an older jaxfeed); it cannot be "
      f"checked against this pipeline's {_describe(current['sampler'])} "
      f"over {_describe(current['source'])}.",
      stacklevel=4,
    )
    return
  if not isinstance(saved, dict) or set(saved) != {"sampler", "source"}:
    raise PipelineStateError(
      f"Cannot restore op {op_name!r}: its 'identity' must be a dict with "
      f"'sampler' and 'source', got {str(saved):.200}."
    )
  found = []
  for part in ("sampler", "source"):
    for field, was, now in _differences(saved[part], current[part]):
      if resharded and field in _SHARD_FIELDS:
        continue  # Dealt out anew to this shard (see reshard_states).
      found.append((part, field, was, now))
  if not found:
    return
  part = found[0][0]
  changes = "; ".join(
    f"{field}={now!r} (saved {field}={was!r})" for p, field, was, now in found if p == part
  )
  message = (
    f"Cannot restore op {op_name!r}: the state was saved with "
    f"{_describe(saved[part])} but this pipeline has {changes}."
  )
  if part == "sampler" and all(f in _SHARD_FIELDS for p, f, _, _ in found):
    message += (
      " Each process restores the state it saved; to resume on "
      "another number of processes, merge all processes' states "
      "with jaxfeed.reshard_loader_states."
    )
  else:
    message += " A state restores only into a pipeline with the same sampler and source."
  if any(p != part for p, _, _, _ in found):
    other = "source" if part == "sampler" else "sampler"
    message += f" Its {other} differs too."
  raise PipelineStateError(message)
