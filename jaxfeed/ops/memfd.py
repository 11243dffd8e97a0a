"""Memory shared with worker processes through file descriptors, not names.

A memfd has no name that could outlive the processes using it (unlike POSIX
shared memory, which needs someone to unlink it and, in multiprocessing, a
resource-tracker process to do so after a crash): its memory goes with the
last descriptor and the last mapping. Descriptors reach a worker over its
socket (`multiprocessing.reduction.send_handle`).
"""

from __future__ import annotations

import mmap
import os
import tempfile

__all__ = ["anonymous_file", "map_file", "ArrayRef", "PREFIX"]

PREFIX = "jaxfeed-"
"""How the memfds of jaxfeed start (`/proc/<pid>/fd` shows `/memfd:<name>`)."""

# Mapping with all pages at once: touching them one by one costs a page fault
# each (a 77 MB batch: 19k faults, ~15x slower).
_POPULATE = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)


def anonymous_file(name: str, size: int = 0) -> int:
  """A descriptor of a new file of `size` bytes in memory that no name
  leads to (`PREFIX + name` in /proc, for tests and debugging)."""
  if hasattr(os, "memfd_create"):
    fd = os.memfd_create(PREFIX + name, os.MFD_CLOEXEC)
  else:  # no memfd (macOS): a file unlinked at once
    fd, path = tempfile.mkstemp(
      prefix=PREFIX + name + "-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None
    )
    os.unlink(path)
  if size:
    try:
      os.ftruncate(fd, size)
    except BaseException:
      os.close(fd)
      raise
  return fd


def map_file(fd: int, size: int, readonly: bool = False) -> mmap.mmap:
  """A shared mapping of the first `size` bytes of `fd`, writable or not,
  with all its pages at once: a worker maps an input array when it starts,
  so that its first epoch does not pay a page fault per page it reads."""
  if readonly:
    return mmap.mmap(fd, size, flags=_POPULATE, prot=mmap.PROT_READ)
  return mmap.mmap(fd, size, flags=_POPULATE)


class ArrayRef:
  """Where one array leaf of an output lies in shared memory (what travels
  through a worker's pipe instead of the array)."""

  __slots__ = ("offset", "dtype", "shape")

  def __init__(self, offset: int, dtype: str, shape: tuple):
    self.offset, self.dtype, self.shape = offset, dtype, shape

  def __reduce__(self):
    return ArrayRef, (self.offset, self.dtype, self.shape)
