"""The iterator of an autocache op pointed at a folder: `cache`'s, plus the
folder's bookkeeping (see `jaxfeed.ops.autocache_folder`).

From its first element to its end (or close) it holds its entry in use, so
no process evicts or removes the entry it reads or writes. While it writes,
it reserves the bytes it is about to write before they reach the disk,
evicting least recently used entries to make room; when the folder's byte
limit leaves no room it stops writing and its pass goes on without the
cache. A write that completes is followed by an eviction, so the folder is
back within its limits.
"""

from __future__ import annotations

import copy
import os
import shutil
import time
import uuid
from typing import Any

from jaxfeed.ops import autocache_policy, tree
from jaxfeed.ops.autocache_folder import AutocacheFolder, EntryHold, WriteReservation
from jaxfeed.ops.base import OpIterator
from jaxfeed.ops.cache import _FILL, _READ, _START, CacheIterator
from jaxfeed.ops.cache_disk import DiskStore

__all__ = ["AutocacheEntryIterator", "element_bytes"]

# A reservation grows by at least this factor at a time, so that a pass
# locks the folder O(log size) times; the slack covers the chunk files'
# headers (`jaxfeed.ops.cache`'s npz format).
_GROWTH = 2
_SLACK_BYTES = 64 << 10
_SLACK_FRACTION = 0.02


def element_bytes(element: Any) -> int:
  """About the bytes an element takes in an on-disk cache."""
  total = 8  # its seed
  for leaf in tree.flatten(element):
    nbytes = getattr(leaf, "nbytes", None)
    if nbytes is None:
      nbytes = (
        len(leaf) * 4 if isinstance(leaf, str) else (len(leaf) if isinstance(leaf, bytes) else 16)
      )
    total += int(nbytes) + 8 * (1 + getattr(leaf, "ndim", 0))  # shape of a ragged leaf
  return total


class AutocacheEntryIterator(CacheIterator):
  """`CacheIterator` over entry `name` of `folder`, each pass run as the
  autocache policy decides (`jaxfeed.ops.autocache_policy`): reading the
  entry, writing it while computing, or computing only; a first pass
  profiles its first elements and then decides."""

  def __init__(
    self,
    parent: OpIterator,
    store: Any,
    folder: AutocacheFolder,
    name: str,
    policy: str = "auto",
    job: str = "",
  ):
    super().__init__(parent, store)
    self._folder = folder
    self._name = name
    self._policy = policy
    self._job = job
    self._point = autocache_policy.point(folder.path, name)
    self._hold: EntryHold | None = None
    self._reservation: WriteReservation | None = None
    self._written = 0  # estimated bytes of the elements written
    self._pass: _PassCosts | None = None
    self._profile: list | None = None  # (element, seed) while profiling

  def _begin(self) -> None:
    complete = self._store.is_complete()
    decision = self._point.decide(complete, self._policy, self._job)
    self._pass = _PassCosts()
    self._written = 0
    if decision == autocache_policy.READ and complete:
      super()._begin()
      return
    self._mode, self._count = _FILL, 0
    if decision == autocache_policy.WRITE:
      self._writer = self._store.writer()
    elif decision == autocache_policy.PROFILE:
      self._profile = []
    elif complete and self._policy == "auto":
      self._sample_reads()

  def _sample_reads(self) -> None:
    """Measures reads of the complete entry again, on its first elements."""
    started = time.perf_counter()
    reader = self._store.reader()
    count, size = 0, 0
    while count < min(autocache_policy.SAMPLE_ELEMENTS, reader.num_elements):
      element, _ = reader.get(count)
      count += 1
      size += element_bytes(element)
      if size >= autocache_policy.PROBE_MAX_BYTES:
        break
    if count:
      m = self._point.measurements
      m.update(read_s=(time.perf_counter() - started) / count, read_passes=m.read_passes + 1)

  def __next__(self) -> Any:
    if self._hold is None:
      self._hold = self._folder.hold(self._name)
    if self._mode == _START:
      self._begin()
    if self._mode == _READ:
      return self._read()
    costs = self._pass
    group = self._point.group
    started, overhead = time.perf_counter(), group.overhead_s
    try:
      element = next(self._parent)
    except StopIteration:
      self._end_fill()
      raise
    except BaseException:
      self._abort_writer()  # a pass with a failure must not be cached
      self._release(evict=False)
      raise
    if costs is not None:
      costs.compute_s += time.perf_counter() - started - (group.overhead_s - overhead)
      costs.elements += 1
      if costs.elements == autocache_policy.WARMUP_ELEMENTS:
        costs.warmup_s, costs.warmup_elements = costs.compute_s, costs.elements
    seed = self._parent.last_seed
    if self._profile is not None:
      # A copy: the profile holding the input's own arrays would make the
      # input allocate new memory for each element, and so look slower.
      self._profile.append((copy.deepcopy(element), seed))
      if costs is not None and costs.profile_done(element):
        self._decide_after_profile(ended=False)
    elif self._writer is not None:
      self._write(element, seed)
    self._count += 1
    return element

  def _read(self) -> Any:
    started = time.perf_counter()
    try:
      element = super().__next__()
    except StopIteration:
      self._end_pass()
      self._release(evict=False)
      raise
    except BaseException:
      self._release(evict=False)
      raise
    if self._pass is not None:
      self._pass.read_s += time.perf_counter() - started
      self._pass.reads += 1
    return element

  def _write(self, element: Any, seed: int) -> None:
    """Adds an element to the pass's cache (while its point stays chosen)."""
    if not self._point.chosen():
      self._abort_writer()  # another point of the pipeline caches
      self._drop_reservation()
      return
    started = time.perf_counter()
    try:
      self._writer.add(element, seed)
    except BaseException:
      self._abort_writer()
      self._release(evict=False)
      raise
    size = element_bytes(element)
    self._written += size
    self._reserve()
    spent = time.perf_counter() - started
    self._point.group.overhead_s += spent
    if self._pass is not None:
      self._pass.write_s += spent
      self._pass.writes += 1
      self._pass.bytes += size

  def _decide_after_profile(self, ended: bool) -> None:
    """Probes the folder with the profiled elements, then decides; a pass
    that writes writes them first."""
    profile, self._profile = self._profile or [], None
    costs = self._pass
    started = time.perf_counter()
    if costs is not None and profile:
      read_s, write_s = _probe(self._folder, self._name, profile)
      warm = costs.elements - costs.warmup_elements
      self._point.measurements.update(
        compute_s=(costs.compute_s - costs.warmup_s) / warm
        if warm > 0
        else costs.compute_s / max(1, costs.elements),
        read_s=read_s,
        write_s=write_s,
        bytes=sum(element_bytes(e) for e, _ in profile) / len(profile),
        elements=costs.elements if ended else None,
      )
      costs.measured = True
    decision = self._point.profiled(self._store.is_complete(), self._job)
    self._point.group.overhead_s += time.perf_counter() - started
    if decision != autocache_policy.WRITE or not profile:
      return
    self._writer = self._store.writer()
    for element, seed in profile:
      if self._writer is None:
        break
      self._write(element, seed)

  def _end_fill(self) -> None:
    """A computing pass ended: decide (a short first pass), publish what
    it wrote, note what it measured, then release the entry."""
    if self._profile is not None:
      self._decide_after_profile(ended=True)
    if self._writer is not None:
      writer, self._writer = self._writer, None
      started = time.perf_counter()
      try:
        writer.publish()
      except BaseException:
        writer.abort()
        self._release(evict=False)
        raise
      if self._pass is not None:
        self._pass.write_s += time.perf_counter() - started
    self._end_pass()
    self._release(evict=True)

  def _end_pass(self) -> None:
    costs, self._pass = self._pass, None
    if costs is None:
      return
    m = self._point.measurements
    if costs.reads:
      m.update(
        read_s=costs.read_s / costs.reads, elements=costs.reads, read_passes=m.read_passes + 1
      )
    elif costs.elements:
      m.update(
        compute_s=None if costs.measured else costs.compute_s / costs.elements,
        write_s=costs.write_s / costs.writes if costs.writes else None,
        bytes=costs.bytes / costs.writes if costs.writes else None,
        elements=costs.elements,
      )

  def _reserve(self) -> None:
    limit = self._folder.limits.max_bytes
    if limit is None or self._writer is None:
      return
    reservation = self._reservation
    if reservation is None:
      # The temporary folder the pass writes (`jaxfeed.ops.cache`'s writer).
      temporary = os.fspath(self._writer._tmp)  # pylint: disable=protected-access
      reservation = self._reservation = self._folder.reservation(temporary)
    needed = int(self._written * (1 + _SLACK_FRACTION)) + _SLACK_BYTES
    if needed <= reservation.reserved:
      return
    wanted = min(limit, max(needed, reservation.reserved * _GROWTH))
    if needed > limit or not reservation.grow(wanted, needed):
      # No room: the pass goes on from the input, without writing.
      self._abort_writer()
      self._drop_reservation()

  def _drop_reservation(self) -> None:
    reservation, self._reservation = self._reservation, None
    if reservation is not None:
      reservation.release()

  def _release(self, evict: bool) -> None:
    """Ends the pass's use of the entry: published or not, its reservation
    goes; the entry is no longer held; then, after a write, the folder is
    brought back within its limits."""
    wrote = self._reservation is not None
    self._drop_reservation()
    hold, self._hold = self._hold, None
    if hold is not None:
      hold.release()
    if evict and wrote:
      self._folder.evict()

  def skip_elements(self, count: int) -> int:
    if self._hold is None:
      self._hold = self._folder.hold(self._name)
    return super().skip_elements(count)

  def set_state(self, state: dict) -> None:
    super().set_state(state)
    self._release(evict=False)
    self._written = 0
    self._profile = None
    self._pass = _PassCosts() if self._mode == _FILL else None  # resumed mid-pass: computes

  def _close_own(self) -> None:
    super()._close_own()
    self._profile = None
    self._release(evict=False)


class _PassCosts:
  """What one pass measured."""

  def __init__(self) -> None:
    self.started = time.perf_counter()
    self.compute_s = self.read_s = self.write_s = 0.0
    self.elements = self.reads = self.writes = 0
    self.warmup_s, self.warmup_elements = 0.0, 0  # the profile's first elements
    self.bytes = 0
    self.profile_bytes = 0
    self.measured = False  # its compute went into a profile's measurement

  def profile_done(self, element: Any) -> bool:
    """Whether the profile has seen enough (after `element`)."""
    self.profile_bytes += element_bytes(element)
    elapsed = time.perf_counter() - self.started
    return (
      (
        self.elements >= autocache_policy.PROFILE_ELEMENTS
        and (
          elapsed >= autocache_policy.PROFILE_MIN_S
          or self.profile_bytes >= autocache_policy.PROFILE_ENOUGH_BYTES
        )
      )
      or elapsed >= autocache_policy.PROFILE_MAX_S
      or self.profile_bytes >= autocache_policy.PROFILE_MAX_BYTES
    )


def _probe(folder: AutocacheFolder, name: str, elements: list) -> tuple[float, float]:
  """Seconds per element to write `elements` into the folder in the cache's
  format and to read them back."""
  directory = os.path.join(folder.path, ".jaxfeed", "probes")
  os.makedirs(directory, exist_ok=True)
  path = os.path.join(directory, f"{name[:16]}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
  store = DiskStore(path)
  probed, size = [], 0
  for element, seed in elements:
    probed.append((element, seed))
    size += element_bytes(element)
    if size >= autocache_policy.PROBE_MAX_BYTES:
      break
  elements = probed
  try:
    started = time.perf_counter()
    writer = store.writer()
    for element, seed in elements:
      writer.add(element, seed)
    writer.publish()
    written = time.perf_counter()
    reader = store.reader()
    for index in range(reader.num_elements):
      reader.get(index)
    read = time.perf_counter()
  finally:
    shutil.rmtree(path, ignore_errors=True)
  count = max(1, len(elements))
  return (read - written) / count, (written - started) / count
