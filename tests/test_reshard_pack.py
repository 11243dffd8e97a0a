"""Resuming a pipeline with `pack` on another number of processes: the
elements `pack` held are folded back into the global order, and a partly
emitted document (`overflow="split"`) resumes at its exact token offset.

Each process of a run is simulated in this process (shard `h` of `N` of one
IndexSampler); states go through the public `jaxfeed.reshard_loader_states`.
"""

import collections

import numpy as np
import pytest

import jaxfeed
from jaxfeed import reshard_loader_states
from jaxfeed.sampler import IndexSampler, ShardOptions

NUM_DOCS = 80
ROW = 16
SEED = 7


def doc_lengths(num_docs=NUM_DOCS):
  return np.random.default_rng(11).integers(1, 3 * ROW, num_docs)


def documents(num_docs=NUM_DOCS):
  """Document `r`'s tokens are `r * 1000 + offset`: a token names its
  (document, offset) piece."""
  lengths = doc_lengths(num_docs)
  tokens = np.zeros((num_docs, lengths.max()), np.int64)
  for r, n in enumerate(lengths):
    tokens[r, :n] = r * 1000 + np.arange(n)
  return jaxfeed.ArraySource({"doc": np.arange(num_docs), "tokens": tokens, "length": lengths})


def keep(element):
  return element["doc"] % 5 != 0


def trim(element):
  return {"tokens": element["tokens"][: element["length"]]}


def pipeline(
  shard,
  count,
  *,
  overflow="split",
  num_epochs=2,
  bins=3,
  batch=6,
  shuffle_buffer=False,
  num_docs=NUM_DOCS,
  num_parallel_calls=None,
):
  assert batch % count == 0
  sampler = IndexSampler(
    num_docs,
    shuffle=True,
    seed=SEED,
    num_epochs=num_epochs,
    shard_options=ShardOptions(shard, count),
  )
  ds = jaxfeed.Dataset.from_source(documents(num_docs), sampler).filter(keep)
  if shuffle_buffer:
    ds = ds.shuffle(4, seed=1)
  ds = ds.map(trim, num_parallel_calls=num_parallel_calls)
  if overflow == "truncate_in_map":  # Documents fit a row: no overflow.
    ds, overflow = ds.map(lambda e: {"tokens": e["tokens"][:ROW]}), "error"
  return ds.pack({"tokens": ROW}, num_packing_bins=bins, overflow=overflow).batch(batch // count)


def tokens_of(batch):
  """The real tokens of a packed batch, as a Counter."""
  real = batch["tokens_segment_ids"] > 0
  return collections.Counter(batch["tokens"][real].tolist())


def check_pieces(batch):
  """Each segment is one contiguous run of one document's tokens, its
  positions counting from 0."""
  for tokens, segments, positions in zip(
    batch["tokens"], batch["tokens_segment_ids"], batch["tokens_positions"]
  ):
    for s in set(segments.tolist()) - {0}:
      run = tokens[segments == s]
      assert len(set((run // 1000).tolist())) == 1
      assert np.array_equal(np.diff(run), np.ones(len(run) - 1))
      assert np.array_equal(positions[segments == s], np.arange(len(run)))


def run_processes(count, steps, **kwargs):
  """Runs `count` simulated processes `steps` batches each; returns their
  Loader-like states, the tokens they emitted, and the tokens they would
  still emit to the end (the uninterrupted run)."""
  states, before, after = [], collections.Counter(), collections.Counter()
  for h in range(count):
    with pipeline(h, count, **kwargs).make_iterator() as it:
      for _ in range(steps):
        before += tokens_of(next(it))
      states.append({"pipeline": it.get_state(), "batches": steps})
      for batch in it:
        after += tokens_of(batch)
  return states, before, after


def resume(state, count, **kwargs):
  """The tokens `count` processes emit from `state`, and each process's
  batch sizes but for its last (which may be short)."""
  got, sizes = collections.Counter(), set()
  for i in range(count):
    with pipeline(i, count, **kwargs).make_iterator() as it:
      it.set_state(state["pipeline"])
      rows = []
      for batch in it:
        check_pieces(batch)
        got += tokens_of(batch)
        rows.append(len(batch["tokens"]))
      sizes.update(rows[:-1])
  return got, sizes


def all_tokens(num_epochs=2, num_docs=NUM_DOCS, row_cap=None):
  lengths = doc_lengths(num_docs)
  tokens = collections.Counter()
  for r, n in enumerate(lengths):
    if r % 5:
      n = n if row_cap is None else min(n, row_cap)
      tokens.update((r * 1000 + np.arange(n)).tolist() * num_epochs)
  return tokens


@pytest.mark.parametrize("overflow", ["split", "truncate_in_map"])
@pytest.mark.parametrize(
  "old, new, steps, bins",
  [
    (2, 3, 2, 3),
    (3, 2, 3, 3),
    (2, 1, 1, 1),
    (1, 3, 4, 5),
    (3, 3, 2, 2),
    (2, 3, 7, 3),
    (3, 2, 0, 3),
  ],
)
def test_resumed_processes_emit_every_remaining_token_exactly_once(overflow, old, new, steps, bins):
  states, before, after = run_processes(old, steps, overflow=overflow, bins=bins)
  row_cap = ROW if overflow == "truncate_in_map" else None
  assert before + after == all_tokens(row_cap=row_cap)
  got, sizes = resume(reshard_loader_states(states), new, overflow=overflow, bins=bins)
  assert got == after
  assert sizes <= {6 // new}  # The same global batch size.


def mixed(shard, count):
  """Two document sets mixed 70/30 by index (`Dataset.mix`), packed."""
  components = [
    jaxfeed.Dataset.from_source(
      documents(n), IndexSampler(n, shuffle=True, seed=SEED + n, num_epochs=1)
    )
    for n in (60, 40)
  ]
  return (
    jaxfeed.Dataset.mix(components, [0.7, 0.3], seed=SEED, shard_options=ShardOptions(shard, count))
    .filter(keep)
    .map(trim)
    .pack({"tokens": ROW}, num_packing_bins=3, overflow="split")
    .batch(6 // count)
  )


def test_a_packed_mixture_resumes_on_another_process_count_exactly():
  states, after = [], collections.Counter()
  for h in range(2):
    with mixed(h, 2).make_iterator() as it:
      for _ in range(3):
        next(it)
      states.append({"pipeline": it.get_state(), "batches": 3})
      for batch in it:
        after += tokens_of(batch)
  state = reshard_loader_states(states)
  got = collections.Counter()
  for i in range(3):
    with mixed(i, 3).make_iterator() as it:
      it.set_state(state["pipeline"])
      for batch in it:
        got += tokens_of(batch)
  assert got == after and sum(after.values()) > 0


def test_a_parallel_map_before_pack_resumes_exactly():
  states, _, after = run_processes(2, 3, num_parallel_calls=2)
  got, _ = resume(reshard_loader_states(states), 3, num_parallel_calls=2)
  assert got == after


def test_a_partly_emitted_document_resumes_at_its_exact_token_offset():
  # With one bin, a long document's pieces fill consecutive rows: stopping
  # after an odd number of rows leaves some document half emitted.
  states, before, after = run_processes(2, 3, bins=1, batch=2)
  keep_state = [s["pipeline"] for s in states]
  partial = [
    own for s in keep_state for own in [s["parents"][0]["own"]["unemitted"]["pieces"]] if own
  ]
  assert partial, "the test needs a document cut across the checkpoint"
  state = reshard_loader_states(states)
  split = state["pipeline"]["parents"][0]["parents"][0]["own"]
  assert sorted(split["keep"]) == sorted(p for ps in partial for p in ps)
  got, _ = resume(state, 3, bins=1, batch=6)
  assert got == after
  for _, pieces in split["keep"]:  # Its first tokens were emitted before.
    assert pieces[0] > 0


def test_a_resumed_run_saved_again_inside_the_dealt_out_epoch_resumes_exactly():
  states, _, after = run_processes(2, 2)
  state = reshard_loader_states(states)
  got = collections.Counter()
  second = []
  for i in range(3):
    with pipeline(i, 3).make_iterator() as it:
      it.set_state(state["pipeline"])
      got += tokens_of(next(it))
      second.append({"pipeline": it.get_state(), "batches": 3})
  for i in range(3):  # The same number of processes: their own states.
    with pipeline(i, 3).make_iterator() as it:
      it.set_state(second[i]["pipeline"])
      for batch in it:
        got += tokens_of(batch)
  assert got == after


def test_the_state_names_exactly_the_held_documents():
  with pipeline(0, 1, overflow="truncate_in_map", bins=4, batch=1).make_iterator() as it:
    row = next(it)
    own = it.get_state()["parents"][0]["own"]
  held = own["unemitted"]["elements"]
  emitted = len(set((row["tokens"][row["tokens_segment_ids"] > 0] // 1000).tolist()))
  read = own["input"]["num_read"]
  assert len(held) == len(set(held)) == read - emitted
  assert own["unemitted"]["pieces"] == []


@pytest.mark.parametrize(
  "build, op",
  [
    (lambda h, n: pipeline(h, n, shuffle_buffer=True), "shuffle"),
    (lambda h, n: pipeline(h, n).unbatch().batch(2), "unbatch"),
  ],
)
def test_an_op_that_cannot_move_between_processes_is_named(build, op):
  with build(0, 2).make_iterator() as it:
    next(it)
    state = {"pipeline": it.get_state(), "batches": 1}
  with pytest.raises(ValueError, match=f"op '{op}' cannot be resumed.*pack"):
    reshard_loader_states([state, state])


def test_packing_twice_is_rejected():
  sampler = IndexSampler(NUM_DOCS, shuffle=True, seed=SEED)
  ds = (
    jaxfeed.Dataset.from_source(documents(), sampler)
    .map(trim)
    .pack({"tokens": ROW}, num_packing_bins=2, overflow="split")
    .pack({"tokens": 2 * ROW}, num_packing_bins=2)
    .batch(2)
  )
  with ds.make_iterator() as it:
    next(it)
    state = {"pipeline": it.get_state(), "batches": 1}
  with pytest.raises(ValueError, match="packs twice"):
    reshard_loader_states([state])
