"""`list_files`: the file names matching glob patterns
(tf.data's `Dataset.list_files`).

The patterns are matched once, when the dataset is built, through
`etils.epath` (so `gs://` patterns work where its filesystem backend is
installed), with tf.data's rules: `*`, `?` and `[...]` in any path component,
matching within one component (`*` matches hidden files too); the names of
every pattern together, sorted, duplicates kept; a pattern without a
directory gives `./name`; no match at all is an error naming the patterns. The dataset is
`from_tensor_slices(names)` (elements are `bytes`, like tf.data's strings),
then, with `shuffle=True` (the default, as in tf.data), `shuffle` over all of
them: a uniform random order, a new one each iteration (epoch), from `seed`.

How the default differs from tf.data: `seed=None` shuffles in an order that
differs from run to run, as in tf.data, but the seed drawn is saved in the
iterator's state, so a checkpoint resumes the same order; in a multi-process
job each process draws its own, so give a `seed` when every process must see
the same list (or shard it).
"""

from __future__ import annotations

import fnmatch
import os
from typing import Any

from etils import epath
import numpy as np

from jaxfeed.ops.base import Node
from jaxfeed.ops.from_tensor_slices import TensorSlicesNode
from jaxfeed.ops.shuffle import ShuffleNode

__all__ = ["match_files", "list_files_node"]

_OP = "list_files"
_WILDCARDS = frozenset("*?[")


def _patterns(file_pattern: Any) -> list[str]:
  if isinstance(file_pattern, (str, bytes, os.PathLike)):
    file_pattern = [file_pattern]
  elif isinstance(file_pattern, np.ndarray):
    file_pattern = file_pattern.reshape(-1).tolist()
  patterns = []
  for pattern in file_pattern:
    if isinstance(pattern, bytes):
      pattern = pattern.decode()
    if not isinstance(pattern, (str, os.PathLike)):
      raise TypeError(
        f"{_OP}: file_pattern must be a string, a path or a list of them, "
        f"got {type(pattern).__name__}: {pattern!r:.80}."
      )
    patterns.append(os.fspath(pattern))
  if not patterns:
    raise ValueError(f"{_OP}: file_pattern is an empty list; give at least one glob pattern.")
  return patterns


def _matches(pattern: str) -> list[str]:
  """The names one pattern matches, spelled as tf.data spells them."""
  parts = pattern.split("/")
  first = next((i for i, part in enumerate(parts) if _WILDCARDS.intersection(part)), None)
  if first is None:
    return [pattern] if epath.Path(pattern).exists() else []
  directory = "/".join(parts[:first]) or ("/" if first else ".")
  prefix = directory if directory.endswith("/") else directory + "/"
  paths = [epath.Path(directory)]
  for depth, part in enumerate(parts[first:], first + 1):
    found = []
    for path in paths:
      if not path.is_dir():
        continue
      if _WILDCARDS.intersection(part):
        # fnmatch, not pathlib's glob: as in tf.data, `*` matches a leading
        # dot too (hidden files).
        found.extend(child for child in path.iterdir() if fnmatch.fnmatchcase(child.name, part))
      elif (path / part).exists():
        found.append(path / part)
    paths = found if depth == len(parts) else [p for p in found if p.is_dir()]
  return [prefix + "/".join(path.parts[-(len(parts) - first) :]) for path in paths]


def match_files(file_pattern: Any) -> list[str]:
  """Every name the patterns match, sorted (tf.data's `matching_files`).

  Raises:
    ValueError: nothing matches.
  """
  patterns = _patterns(file_pattern)
  names = sorted(name for pattern in patterns for name in _matches(pattern))
  if not names:
    raise ValueError(f"{_OP}: no files matched pattern: {', '.join(patterns)}.")
  return names


def list_files_node(
  file_pattern: Any, shuffle: bool | None = None, seed: int | None = None
) -> Node:
  """The graph of `Dataset.list_files`: the names, shuffled if asked."""
  if shuffle is not None and not isinstance(shuffle, (bool, np.bool_)):
    raise TypeError(f"{_OP}: shuffle must be a bool or None, got {shuffle!r}.")
  node: Node = TensorSlicesNode(np.array(match_files(file_pattern)))
  if shuffle is None or shuffle:
    node = ShuffleNode(node, max(node.cardinality(), 1), seed=seed, reshuffle_each_iteration=True)
  return node
