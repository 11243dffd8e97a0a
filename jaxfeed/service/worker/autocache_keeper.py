"""A worker's autocache folder: its limits for the worker's tasks, applied
again every little while (`--autocache_max_bytes`, `--autocache_ttl_s`).

The worker's tasks find the folder object, and so its limits, by path
(`folder_at`); the keeper's thread removes what the limits no longer allow
(entries unused for `ttl_s`, abandoned writes, least recently used entries
over `max_bytes`), never an entry in use (see
`jaxfeed.ops.autocache_folder`).
"""

from __future__ import annotations

import logging
import os
import threading

from jaxfeed.ops.autocache_folder import AutocacheFolder, FolderLimits

__all__ = ["AutocacheKeeper", "folder_at"]

_MAX_INTERVAL_S = 10.0
_MIN_INTERVAL_S = 0.05

_lock = threading.Lock()
_keepers: dict[str, list["AutocacheKeeper"]] = {}


def folder_at(path: str) -> AutocacheFolder:
  """The folder at `path` with the limits of the first live keeper of this
  process that keeps it; without one, a folder without limits."""
  with _lock:
    keepers = _keepers.get(os.path.abspath(path))
    return keepers[0].folder if keepers else AutocacheFolder(path)


class AutocacheKeeper:
  """Keeps the autocache folder `path` within `limits` while it is open.

  Args:
    path: The folder (made if missing).
    limits: Its byte and time limits.
    interval_s: Seconds between passes; None: a quarter of the time limit,
      between 0.05 and 10 s.
  """

  def __init__(self, path: str, limits: FolderLimits, interval_s: float | None = None):
    os.makedirs(path, exist_ok=True)
    self.folder = AutocacheFolder(path, limits)
    if interval_s is None:
      quarter = limits.ttl_s / 4 if limits.ttl_s is not None else _MAX_INTERVAL_S
      interval_s = min(_MAX_INTERVAL_S, max(_MIN_INTERVAL_S, quarter))
    self._interval_s = interval_s
    self._stop = threading.Event()
    with _lock:
      _keepers.setdefault(self.folder.path, []).append(self)
    self._thread: threading.Thread | None = None
    if limits.max_bytes is not None or limits.ttl_s is not None:
      self._thread = threading.Thread(
        target=self._run, name="jaxfeed-autocache-keeper", daemon=True
      )
      self._thread.start()

  def _run(self) -> None:
    while True:
      try:
        self.folder.evict()
      except OSError:  # a folder on a failing disk: say so, keep serving
        logging.exception("Applying the limits of autocache folder %s failed", self.folder.path)
      if self._stop.wait(self._interval_s):
        return

  def close(self) -> None:
    """Stops the passes; the folder's tasks no longer see its limits."""
    self._stop.set()
    if self._thread is not None:
      self._thread.join(timeout=10)
    with _lock:
      keepers = _keepers.get(self.folder.path, [])
      if self in keepers:
        keepers.remove(self)
      if not keepers:
        _keepers.pop(self.folder.path, None)

  def __enter__(self) -> "AutocacheKeeper":
    return self

  def __exit__(self, *exc: object) -> None:
    self.close()
