"""`from_source`: the records of a random-access source in sampler order."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

from jaxfeed.ops import stacking
from jaxfeed.ops.base import IterationCounter, Node, OpIterator, PipelineStateError, state_int
from jaxfeed.ops.state_identity import check_identity, pipeline_identity
from jaxfeed.resharded_sampler import RESHARD_STATE_VERSION, ReshardedSampler
from jaxfeed.sampler import IndexSampler, ShardOptions


def records_reader(source: Any) -> Callable[[np.ndarray], Sequence]:
  """Reads the records at an array of indices: `source.get_many` when the
  source has it, else `source[i]` one by one."""
  get_many = getattr(source, "get_many", None)
  if callable(get_many):
    return get_many
  return lambda indices: [source[i] for i in np.asarray(indices).tolist()]


class _Failed:
  """Stands for a record whose read raised: the error is raised when the
  pipeline reaches it, so the records before it arrive and those after it can
  still be read (`ignore_errors`)."""

  __slots__ = ("error",)

  def __init__(self, error: Exception):
    self.error = error


def _read_each(read_many: Callable[[np.ndarray], Sequence], indices: np.ndarray) -> list:
  """The records at `indices` read one at a time, a `_Failed` for each that
  raises."""
  records: list = []
  for index in indices:
    try:
      records.extend(read_many(np.asarray([index])))
    except Exception as e:  # noqa: BLE001 -- raised when the pipeline reaches it
      records.append(_Failed(e))
  return records


_OP = "from_source"
# Records are read ahead in chunks that grow from the first to the largest
# size: a pipeline that takes a few elements reads few records, a long run
# pays the per-call overhead of the source once per chunk. Sampler lookups are
# cheap per position but not per call, so they run in larger blocks of
# positions (a few int arrays, unlike chunks of records).
_FIRST_CHUNK = 16
_MAX_CHUNK = 256
_FIRST_BLOCK = 64
_MAX_BLOCK = 4096


class SourceNode(Node):
  """Reads `source[record_index]` for every position of `sampler`.

  Args:
    source: A random-access source: `len(source)`, `source[i]` and optionally
      the batched `source.get_many(indices) -> list`.
    sampler: An `IndexSampler` over `len(source)` records; default: every
      record once, in order (`IndexSampler(len(source))`).
  """

  op_name = _OP

  def __init__(self, source: Any, sampler: IndexSampler | None = None):
    super().__init__()
    if not (hasattr(source, "__len__") and hasattr(source, "__getitem__")):
      raise TypeError(
        f"{_OP}: source must be a random-access source with __len__ and "
        f"__getitem__ (e.g. jaxfeed.ArraySource), got "
        f"{type(source).__name__}."
      )
    num_records = len(source)
    if sampler is None:
      sampler = IndexSampler(num_records)
    elif not all(hasattr(sampler, a) for a in ("get_many", "num_records", "num_positions")):
      raise TypeError(
        f"{_OP}: sampler must be a jaxfeed.IndexSampler (or provide "
        f"get_many, num_records and num_positions), got "
        f"{type(sampler).__name__}."
      )
    if sampler.num_records != num_records:
      raise ValueError(
        f"{_OP}: the sampler indexes {sampler.num_records} records but the "
        f"source {type(source).__name__} holds {num_records}; build the "
        f"sampler with num_records=len(source)."
      )
    self.source = source
    self.sampler = sampler
    for_iteration = getattr(sampler, "for_iteration", None)
    # Whether iterations read different data (a reshuffling sampler).
    self.iterates_anew = callable(for_iteration) and for_iteration(1) is not sampler
    self.iterations = IterationCounter()
    self._identity: dict | None = None

  def spec_params(self) -> dict:
    return {"source": self.source, "sampler": self.sampler}

  def cardinality(self) -> int:
    num = self.sampler.num_positions
    return -1 if num is None else num

  def begin_iteration(self) -> None:
    if self.iterates_anew:
      self.iterations.begin()

  @property
  def identity(self) -> dict | None:
    """What this node's states record of its sampler and source."""
    if self._identity is None:
      self._identity = pipeline_identity(self.source, self.sampler)
    return self._identity

  def make_iterator(self) -> "SourceIterator":
    return SourceIterator(self.source, self.sampler, iteration=self.iterations.current, node=self)

  # Index addressing (see jaxfeed.ops.index_ranges): the sampler's positions.
  # Iteration i of a reshuffling sampler (P positions each) has the positions
  # [i * P, (i + 1) * P), so worker processes reading ranges of them need no
  # other word of which iteration they read.
  def index_addressable(self) -> bool:
    return True

  def num_positions(self) -> int | None:
    """The positions of one iteration (the service splits iteration 0)."""
    return self.sampler.num_positions

  def range_iterator(self, start: int, stop: int) -> "SourceIterator":
    iteration = 0
    per_iteration = self.sampler.num_positions
    if self.iterates_anew and per_iteration and start >= per_iteration:
      iteration = start // per_iteration
      start -= iteration * per_iteration
      stop -= iteration * per_iteration
      if stop > per_iteration:
        raise ValueError(
          f"{_OP}: positions [{start}, {stop}) of iteration {iteration} "
          f"run past its {per_iteration} positions; a range reads within "
          "one iteration."
        )
    return SourceIterator(self.source, self.sampler, start, stop, iteration=iteration, node=self)

  def iteration_span(self, own_state: dict) -> tuple[int, int | None] | None:
    """For an own state of this node's iterator: the index position it reads
    next and where its iteration's positions end (None: endless). None when
    the state holds more than a position (a resharded or mixture resume)."""
    if set(own_state) - {"position", "iteration", "identity"}:
      return None
    per_iteration = self.sampler.num_positions
    offset = own_state.get("iteration", 0) * (per_iteration or 0)
    end = None if per_iteration is None else offset + per_iteration
    return offset + own_state["position"], end

  def own_state_at(self, own_state: dict, index_position: int) -> dict:
    """`own_state` (from `iteration_span`) moved to `index_position` of its
    iteration."""
    offset = own_state.get("iteration", 0) * (self.sampler.num_positions or 0)
    return {**own_state, "position": index_position - offset}

  def __repr__(self) -> str:
    return f"SourceNode({self.source!r}, {self.sampler!r})"


class SourceIterator(OpIterator):
  """Yields records in sampler order; state is the next sampler position.

  The state also holds the iteration when it is not the first (the
  sampler's `for_iteration`) and what defines the order: the sampler's and
  the source's identity, checked on restore (`jaxfeed.ops.state_identity`;
  a state without it, saved by an older jaxfeed, restores with a warning).

  Implements the batched-read protocol of `jaxfeed.ops.stacking`
  (`next_batch`): sources with `get_batch(indices)` (like `ArraySource`)
  gather a whole batch in one call, other sources are read in chunks and
  their records stacked. With `first` and `stop` it reads only the sampler
  positions [first, stop).
  """

  op_name = _OP

  def __init__(
    self,
    source: Any,
    sampler: IndexSampler,
    first: int = 0,
    stop: int | None = None,
    *,
    iteration: int = 0,
    node: SourceNode | None = None,
  ):
    super().__init__()
    self._source = source
    self._node = node
    self._node_sampler = sampler  # Iteration 0's.
    self._iteration = iteration
    self._base_sampler = _for_iteration(sampler, iteration)
    # A ReshardedSampler after a resharded resume.
    self._sampler: Any = self._base_sampler
    self._stop = stop
    self._end = _end_of(self._base_sampler, stop)  # None when endless.
    self._read_many = records_reader(source)
    get_batch = getattr(source, "get_batch", None)
    # Cleared when a gathered batch does not have the batch layout (e.g.
    # object leaves of non-strings): then records are stacked instead.
    self._get_batch = get_batch if callable(get_batch) else None
    # A range is read to its end (a service split), so in full-size chunks.
    self._chunk = _FIRST_CHUNK if stop is None else _MAX_CHUNK
    # Read-ahead records, and their seeds: positions [buffer_start, +len).
    self._buffer_start = first
    self._records: list = []
    self._seeds = np.zeros(0, np.uint64)
    self._buffered = 0
    self._offset = 0  # Index in self._records of the next element.
    # Sampler lookups for positions [block_start, +len).
    self._block = _FIRST_BLOCK
    self._block_start = first
    self._block_indices = np.zeros(0, np.int64)
    self._block_seeds = np.zeros(0, np.uint64)

  def __next__(self) -> Any:
    offset = self._offset
    if offset >= self._buffered:
      self._read_ahead()
      offset = 0
    self._offset = offset + 1
    record = self._records[offset]
    if type(record) is _Failed:
      raise record.error
    return record

  def _read_ahead(self, min_count: int = 1) -> None:
    start = self._buffer_start + self._buffered
    count = max(self._chunk, min_count)
    if self._end is not None:
      count = min(count, self._end - start)
      if count <= 0:
        raise StopIteration
    record_indices, seeds = self._lookup(start, count)
    try:
      records = self._read_many(record_indices)
    except Exception:  # noqa: BLE001 -- find the failing record(s)
      records = _read_each(self._read_many, record_indices)
    if len(records) != count:
      raise RuntimeError(
        f"{_OP}: {type(self._source).__name__}.get_many returned "
        f"{len(records)} records for {count} indices."
      )
    self._buffer_start, self._buffered, self._offset = start, count, 0
    self._records, self._seeds = records, seeds
    self._chunk = min(2 * self._chunk, _MAX_CHUNK)

  def _lookup(self, start: int, count: int) -> tuple[np.ndarray, np.ndarray]:
    """Record indices and seeds of positions [start, start + count)."""
    offset = start - self._block_start
    if offset < 0 or offset + count > len(self._block_indices):
      size = max(count, self._block)
      # Lookups may go past `stop` (a later `reposition` reads on there);
      # records are read up to it only.
      end = self._sampler.num_positions
      if end is not None:
        size = min(size, end - start)
      _, self._block_indices, self._block_seeds = self._sampler.get_many(
        np.arange(start, start + size, dtype=np.int64)
      )
      self._block_start, offset = start, 0
      self._block = min(4 * self._block, _MAX_BLOCK)
    return (
      self._block_indices[offset : offset + count],
      self._block_seeds[offset : offset + count],
    )

  def next_batch(self, max_count: int) -> tuple[Any, np.ndarray]:
    """The next `k <= max_count` records stacked, and their seeds.

    See the batched-read protocol in `jaxfeed.ops.stacking`.
    """
    start = self.position
    count = max_count
    if self._end is not None:
      count = min(count, self._end - start)
    if count <= 0:
      raise StopIteration
    if self._get_batch is not None and self._offset >= self._buffered:
      record_indices, seeds = self._lookup(start, count)
      batch = stacking.as_batch(self._get_batch(record_indices))
      if batch is not None:
        self._seek(start + count)
        return batch, seeds.copy()
      self._get_batch = None
    records, seeds = self._take_records(count)
    return stacking.stack(records, "batch"), seeds

  def _take_records(self, count: int) -> tuple[list, np.ndarray]:
    """The next `count` records (all exist) and their seeds, in order."""
    records: list = []
    seeds = []
    while count:
      offset = self._offset
      if offset >= self._buffered:
        self._read_ahead(count)
        offset = 0
      stop = min(offset + count, self._buffered)
      taken = self._records[offset:stop]
      for i, record in enumerate(taken):
        if type(record) is _Failed:
          self._offset = offset + i + 1
          raise record.error
      records.extend(taken)
      seeds.append(self._seeds[offset:stop])
      count -= stop - offset
      self._offset = stop
    return records, np.concatenate(seeds)

  @property
  def position(self) -> int:
    """The sampler position of the next element."""
    return self._buffer_start + self._offset

  @property
  def last_seed(self) -> int:
    if self._offset:
      return int(self._seeds[self._offset - 1])
    position = self.position
    if not position:
      return 0
    looked_up = position - 1 - self._block_start
    if 0 <= looked_up < len(self._block_seeds):
      return int(self._block_seeds[looked_up])
    return self._sampler[position - 1].rng_seed

  def skip_elements(self, count: int) -> int:
    """Skips up to `count` elements without reading them; returns how many."""
    position = self.position
    end = position + count if self._end is None else min(position + count, self._end)
    skipped = max(0, end - position)
    self._seek(position + skipped)
    return skipped

  def reposition(self, start: int, stop: int | None) -> None:
    """Reads positions [start, stop) from now on, keeping the sampler
    lookups made so far (one iterator reads a worker's chunks of an epoch
    in turn, looking records up in large blocks)."""
    self._stop = stop
    self._end = _end_of(self._sampler, stop)
    self._seek(start)

  def _seek(self, position: int) -> None:
    buffered = position - self._buffer_start
    if 0 <= buffered <= self._buffered:
      self._offset = buffered
    else:
      self._buffer_start, self._buffered, self._offset = position, 0, 0
      self._records = []
      self._seeds = self._seeds[:0]

  def _stats_fields(self) -> dict:
    return {"elements": self.position}

  def _get_own_state(self) -> dict:
    position = self.position
    state: dict[str, Any] = {"position": position}
    if self._iteration:
      state["iteration"] = self._iteration
    identity = None if self._node is None else self._node.identity
    if identity is not None:
      state["identity"] = identity
    if self._sampler is not self._base_sampler:
      base_position = self._sampler.base_position(position)
      if base_position is not None:  # Past the dealt-out epochs, if any.
        state["position"] = base_position
      elif self._sampler.reshard_state() is not None:
        state["resharded"] = self._sampler.reshard_state()
    saved_state = getattr(self._sampler, "saved_state", None)
    if saved_state is not None:  # A mixture's weight history.
      state["mixture"] = saved_state(position)
    return state

  def _set_own_state(self, state: dict) -> None:
    resharded = state.get("resharded")
    mixture = state.get("mixture")
    if self._node is not None:
      check_identity(
        state.get("identity"), self._node.identity, _OP, resharded=resharded is not None
      )
    iteration = 0
    if "iteration" in state:
      iteration = state_int(state, "iteration", _OP, 1)
      if self._node is not None and not self._node.iterates_anew:
        raise PipelineStateError(
          f"Cannot restore op {_OP!r}: the state is in iteration "
          f"{iteration} of a sampler that reshuffles each iteration, but "
          f"this pipeline's {self._node_sampler!r} reads the same order "
          f"every iteration."
        )
    if iteration != self._iteration:
      self._iteration = iteration
      self._base_sampler = _for_iteration(self._node_sampler, iteration)
      self._sampler = self._base_sampler
      self._end = _end_of(self._base_sampler, self._stop)
      self._seek_anew()
    if self._node is not None and self._node.iterates_anew:
      self._node.iterations.restored(iteration)
    sampler = self._base_sampler
    if mixture is not None:
      if not hasattr(sampler, "restored"):
        raise ValueError(
          f"{_OP}: the state was saved by a mixture (Dataset.mix) but this "
          f"pipeline reads a {type(sampler).__name__}."
        )
      sampler = sampler.restored(mixture)
    if resharded is not None:
      sampler = _resharded_sampler(sampler, resharded)
    if sampler is not self._sampler or resharded is not None or mixture is not None:
      self._sampler = sampler
      self._end = _end_of(sampler, self._stop)
      self._seek_anew()
    self._seek(state_int(state, "position", _OP, 0, self._end))

  def _seek_anew(self) -> None:
    """Forgets every record and lookup read ahead (the sampler changed)."""
    self._buffer_start, self._buffered, self._offset = 0, 0, 0
    self._records = []
    self._block_start, self._block_indices = 0, np.zeros(0, np.int64)


def _for_iteration(sampler: Any, iteration: int) -> Any:
  """The sampler iteration `iteration` reads (samplers without iterations
  read the same in every one)."""
  if not iteration:
    return sampler
  return sampler.for_iteration(iteration)


def _end_of(sampler: Any, stop: int | None) -> int | None:
  """The position reading ends at: the sampler's end, or `stop` if earlier."""
  end = sampler.num_positions
  if stop is not None:
    end = stop if end is None else min(stop, end)
  return end


def _resharded_sampler(base: Any, resharded: Any) -> ReshardedSampler:
  """The sampler a resharded state (see `reshard_states`) describes."""
  if not isinstance(base, IndexSampler) and not hasattr(base, "reshard"):
    raise ValueError(
      f"{_OP}: a state saved with another number of processes can only be "
      f"restored with an IndexSampler or a mixture of them, got "
      f"{type(base).__name__}."
    )
  keys = {"version", "shard_count", "positions"}
  if not isinstance(resharded, dict) or not (
    (resharded.get("version") == 1 and set(resharded) == keys)
    or (
      resharded.get("version") == RESHARD_STATE_VERSION
      and (set(resharded) == keys | {"unread"} or set(resharded) == keys | {"pending"})
    )
  ):
    raise ValueError(
      f"{_OP}: 'resharded' state must be a dict with keys 'version' "
      f"(= {RESHARD_STATE_VERSION}), 'shard_count', 'positions' and "
      f"'unread' or 'pending', got {str(resharded):.200}."
    )
  count, positions = resharded["shard_count"], resharded["positions"]
  unread = resharded.get("unread")
  if "pending" in resharded:
    unread = _unread_positions(base, count, positions, resharded["pending"])
  if isinstance(base, IndexSampler):
    return ReshardedSampler(base, count, positions, unread)
  return base.reshard(count, positions, unread)


def _unread_positions(base: Any, count: Any, positions: Any, pending: Any) -> list[list[int]]:
  """Per old shard, its positions whose records an op (`pack`) held but had
  not emitted: those in `[pending[h]["from"], positions[h])` whose seed is in
  `pending[h]["seeds"]`."""
  if (
    not isinstance(pending, list)
    or not isinstance(positions, list)
    or len(pending) != len(positions)
    or not all(
      isinstance(p, dict) and set(p) == {"from", "seeds"} and isinstance(p["seeds"], list)
      for p in pending
    )
  ):
    raise ValueError(
      f"{_OP}: 'pending' must hold one {{'from', 'seeds'}} dict per old "
      f"process, got {str(pending):.200}."
    )
  unread = []
  drop = base.shard_options.drop_remainder
  for h, (stop, entry) in enumerate(zip(positions, pending)):
    wanted = np.array(entry["seeds"], np.uint64)
    if not wanted.size:
      unread.append([])
      continue
    start = state_int(entry, "from", _OP, 0, stop)
    old_shard = type(base)(**{**base.spec_params(), "shard_options": ShardOptions(h, count, drop)})
    window = np.arange(start, stop, dtype=np.int64)
    _, _, seeds = old_shard.get_many(window)
    found = np.isin(seeds, wanted)
    if int(found.sum()) != np.unique(wanted).size:
      raise PipelineStateError(
        f"Cannot restore op {_OP!r}: {np.unique(wanted).size} records held "
        f"by process {h} of {count} are not all among its positions "
        f"[{start}, {stop}); the state belongs to other data."
      )
    unread.append(window[found].tolist())
  return unread
