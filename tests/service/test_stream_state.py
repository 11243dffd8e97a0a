"""The state of a parallel_epochs read: what the consumer took per stream."""

from __future__ import annotations

import pytest

from jaxfeed.service.protocol import read_state
from jaxfeed.service.protocol import stream_state


class FakeFetcher:
  """A task's fetcher as `StreamProgress.state` sees it."""

  def __init__(self, ended: bool, handed_on: int):
    self.ended = ended
    self.handed_on = handed_on


def test_a_stream_is_closed_once_its_fetcher_ended_and_the_consumer_took_all_it_handed_on():
  progress = stream_state.StreamProgress()
  fetchers = [FakeFetcher(False, 2), FakeFetcher(True, 2)]
  for fetcher in fetchers:
    slot, skip = progress.assign()
    assert skip == 0
    progress.reading(slot, skip, fetcher)
  progress.took(0)
  progress.took(1)
  assert progress.state() == {"version": 2, "streams": [[1, False, 0], [1, False, 0]]}
  progress.took(1)  # all that the ended stream handed on
  assert progress.state()["streams"] == [[1, False, 0], [2, True, 0]]


def test_a_restored_version_1_read_gives_its_tasks_the_open_streams_in_order_then_new_ones():
  progress = stream_state.StreamProgress(
    {"version": 1, "streams": [[5, True], [3, False], [7, False]]}
  )
  assert progress.resumed and progress.open_streams == 2
  assert progress.open_orders() == [0, 0]  # all in the pipeline's own order
  progress.check_orders(identical=True)
  with pytest.raises(read_state.ResumeStateError, match="identical_worker_streams=True"):
    progress.check_orders(identical=False)
  assert [progress.assign() for _ in range(3)] == [(1, 3), (2, 7), (3, 0)]
  assert progress.unassigned == 0
  progress.reading(1, 3, FakeFetcher(True, 1))
  progress.took(1)  # the one element after the 3 dropped
  assert progress.state()["streams"] == [[5, True, 0], [4, True, 0], [7, False, 0], [0, False, 0]]


def test_a_restored_read_gives_each_task_the_open_stream_of_its_worker_index():
  progress = stream_state.StreamProgress(
    {"version": 2, "streams": [[5, True, 0], [3, False, 2], [7, False, 1]]}
  )
  assert progress.open_orders() == [2, 1]
  progress.check_orders(identical=False)
  with pytest.raises(read_state.ResumeStateError, match="identical_worker_streams=False"):
    progress.check_orders(identical=True)
  # Index 0's stream was over: its task starts a new one.
  assert [progress.assign(i) for i in (1, 0, 2)] == [(2, 7), (3, 0), (1, 3)]
  assert progress.unassigned == 0


@pytest.mark.parametrize(
  "state",
  [
    None,
    [],
    {"version": 3, "streams": []},
    {"version": 1},
    {"version": 1, "streams": [[-1, False]]},
    {"version": 1, "streams": [[1, 0]]},
    {"version": 1, "streams": [[1, False]], "extra": 1},
    {"version": 2, "streams": [[1, False]]},
    {"version": 2, "streams": [[1, False, -1]]},
    {"version": True, "streams": []},
  ],
)
def test_a_malformed_state_is_refused_naming_it(state):
  with pytest.raises(read_state.ResumeStateError, match="parallel_epochs read's state"):
    stream_state.check_state(state)
