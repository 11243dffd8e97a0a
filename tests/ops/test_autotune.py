"""The autotuner's policy and its thread."""

import gc
import threading
import time

import pytest

import jaxfeed
from jaxfeed.ops import autotune
from op_testing import wait_until


class FakeKnob:
  """A knob whose clocks the test advances by hand."""

  def __init__(
    self, name, kind="threads", value=1, minimum=1, maximum=8, unit_bytes=0, reports_blocking=False
  ):
    self.value, self.wait, self.busy, self.blocked = value, 0.0, 0.0, 0.0
    self.knob = autotune.Knob(
      name=name,
      kind=kind,
      get=lambda: self.value,
      set=self._set,
      minimum=minimum,
      maximum=maximum,
      wait_s=lambda: self.wait,
      busy_s=lambda: self.busy,
      unit_bytes=lambda: unit_bytes,
      producer_blocked_s=(lambda: self.blocked) if reports_blocking else None,
    )

  def _set(self, value):
    self.value = value


def test_a_waited_on_op_grows_until_the_cpu_budget():
  fake = FakeKnob("map")
  policy = autotune.AutotunePolicy([fake.knob], cpu_budget=4, ram_budget_bytes=1 << 30)
  for _ in range(10):
    fake.wait += 0.05  # the consumer waits half of every 0.1 s interval
    fake.busy += 0.1 * fake.value
    policy.step(0.1)
  assert fake.value == 4


def test_the_budget_goes_to_the_op_that_is_waited_on():
  slow, fast = FakeKnob("slow", value=1), FakeKnob("fast", value=1)
  policy = autotune.AutotunePolicy([slow.knob, fast.knob], cpu_budget=5, ram_budget_bytes=1 << 30)
  for _ in range(10):
    slow.wait += 0.08
    slow.busy += 0.1 * slow.value
    fast.busy += 0.01
    policy.step(0.1)
  assert slow.value == 4 and fast.value == 1


def test_an_idle_op_shrinks_after_calm_intervals():
  fake = FakeKnob("map", value=6)
  policy = autotune.AutotunePolicy([fake.knob], cpu_budget=8, ram_budget_bytes=1 << 30)
  for _ in range(30):
    policy.step(0.1)  # nobody waits, workers idle
  assert fake.value == 1


def test_a_busy_op_without_waits_keeps_its_threads():
  fake = FakeKnob("map", value=3)
  policy = autotune.AutotunePolicy([fake.knob], cpu_budget=8, ram_budget_bytes=1 << 30)
  for _ in range(30):
    fake.busy += 0.1 * fake.value  # fully busy, just keeping up
    policy.step(0.1)
  assert fake.value == 3


def test_buffers_grow_only_within_the_ram_budget():
  fake = FakeKnob("prefetch", kind="buffer", value=1, maximum=100, unit_bytes=1000)
  policy = autotune.AutotunePolicy([fake.knob], cpu_budget=8, ram_budget_bytes=5500)
  for _ in range(20):
    fake.wait += 0.05
    policy.step(0.1)
  assert fake.value == 5


@pytest.mark.parametrize(
  "steps, producer_blocked_s, expected_size",
  [
    # The consumer waits, but the buffer never fills: no growth.
    pytest.param(20, 0.0, 2, id="behind_a_slow_producer_does_not_grow"),
    # Bursty: the producer also waits for room; the buffer grows.
    pytest.param(10, 0.02, 12, id="that_fills_and_still_starves_the_consumer_grows"),
  ],
)
def test_a_buffer_grows_only_when_its_producer_fills_it(steps, producer_blocked_s, expected_size):
  fake = FakeKnob(
    "prefetch", kind="buffer", value=2, maximum=100, unit_bytes=10, reports_blocking=True
  )
  policy = autotune.AutotunePolicy([fake.knob], cpu_budget=8, ram_budget_bytes=1 << 30)
  for _ in range(steps):
    fake.wait += 0.05
    fake.blocked += producer_blocked_s
    policy.step(0.1)
  assert fake.value == expected_size


def test_knob_rejects_bad_ranges():
  with pytest.raises(ValueError, match="kind"):
    FakeKnob("x", kind="gpus")
  with pytest.raises(ValueError, match="minimum"):
    FakeKnob("x", minimum=3, maximum=2)


class KnobbedIterator(jaxfeed.ops.base.OpIterator):
  op_name = "knobbed"

  def __init__(self, knob):
    super().__init__(())
    self._knob = knob
    self.n = 0

  def __next__(self):
    if self.n >= 50:
      raise StopIteration
    self.n += 1
    return self.n

  def tunables(self):
    return [self._knob]

  def _get_own_state(self):
    return {"n": self.n}

  def _set_own_state(self, state):
    self.n = state["n"]


def tuner_threads():
  return [t for t in threading.enumerate() if t.name == "jaxfeed-autotune"]


def test_tuned_iterator_runs_the_root_unchanged_and_stops_its_thread():
  fake = FakeKnob("k")
  it = autotune.autotuned(KnobbedIterator(fake.knob), jaxfeed.Options())
  assert isinstance(it, autotune.AutotunedIterator)
  assert len(tuner_threads()) == 1
  assert [next(it) for _ in range(5)] == [1, 2, 3, 4, 5]
  state = it.get_state()
  assert state == {"op": "knobbed", "own": {"n": 5}, "parents": []}
  it.close()
  assert not tuner_threads()


def test_tuner_thread_ends_when_iterator_is_garbage_collected():
  fake = FakeKnob("k")
  it = autotune.autotuned(KnobbedIterator(fake.knob), jaxfeed.Options())
  assert tuner_threads()
  del it
  gc.collect()
  wait_until(lambda: not tuner_threads(), timeout_s=5)


def test_autotune_off_or_no_knobs_means_no_tuner():
  fake = FakeKnob("k")
  root = KnobbedIterator(fake.knob)
  assert autotune.autotuned(root, jaxfeed.Options(autotune=False)) is root
  plain = jaxfeed.Dataset.range(3).make_iterator()
  assert not isinstance(plain, autotune.AutotunedIterator)
  plain.close()


def test_tuner_thread_adjusts_a_live_knob():
  fake = FakeKnob("k", maximum=3)
  it = autotune.AutotunedIterator(
    KnobbedIterator(fake.knob), jaxfeed.Options(autotune_cpu_budget=8), interval_s=0.01
  )
  deadline = time.time() + 5
  while fake.value < 3 and time.time() < deadline:
    fake.wait += 0.01
    time.sleep(0.005)
  it.close()
  assert fake.value == 3
  assert it.history and it.history[-1]["k"] >= 2


def sleepy_identity(x):
  time.sleep(0.003)  # releases the GIL, like I/O or numpy work
  return x


def test_autotune_raises_parallelism_of_a_real_slow_map():
  options = jaxfeed.Options(autotune_cpu_budget=6)
  ds = (
    jaxfeed.Dataset.range(600)
    .map(sleepy_identity, num_parallel_calls=jaxfeed.AUTOTUNE)
    .with_options(options)
  )
  it = ds.make_iterator()
  assert isinstance(it, autotune.AutotunedIterator)
  out = [int(x) for x in it]
  history = list(it.history)
  it.close()
  assert out == list(range(600))  # tuning never changes the output
  assert max(h["map/parallelism"] for h in history) > 2, history
