"""A real disk that fills up: a small tmpfs, mounted for a test (root only)."""

from __future__ import annotations

import errno
import os
import pathlib
import subprocess

_CHUNK = b"\0" * (64 << 10)


class SmallDisk:
  """A tmpfs of `size` mounted at `path`; `fill()` takes all its free space
  (as another program writing there would), `free()` gives it back,
  `close()` unmounts it.

  Raises:
    OSError: it cannot be mounted (not root, or no tmpfs).
  """

  def __init__(self, path: str | os.PathLike, size: str = "2m"):
    self.path = pathlib.Path(path)
    self.path.mkdir(parents=True, exist_ok=True)
    result = subprocess.run(
      ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(self.path)],
      capture_output=True,
      text=True,
      check=False,
    )
    if result.returncode != 0:
      raise OSError(f"Cannot mount a tmpfs at {self.path}: {result.stderr.strip()}")
    self._filler = self.path / "filler"

  def fill(self) -> int:
    """Writes a file until the disk is full; returns its size."""
    written = 0
    with open(self._filler, "ab", buffering=0) as f:
      while True:
        try:
          written += f.write(_CHUNK)
        except OSError as e:
          if e.errno != errno.ENOSPC:
            raise
          break
      for size in (4096, 512, 1):  # the last pages too
        try:
          while True:
            written += f.write(_CHUNK[:size])
        except OSError as e:
          if e.errno != errno.ENOSPC:
            raise
    return written

  def free(self) -> None:
    self._filler.unlink(missing_ok=True)

  def close(self) -> None:
    subprocess.run(["umount", str(self.path)], capture_output=True, check=False)
    if os.path.ismount(self.path):  # still open somewhere: detach it
      subprocess.run(["umount", "-l", str(self.path)], capture_output=True, check=False)

  def __enter__(self) -> "SmallDisk":
    return self

  def __exit__(self, *exc) -> None:
    self.close()
