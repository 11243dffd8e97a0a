"""Elastic worker pools: the dispatcher adds workers while they help.

Clients report, in every heartbeat, how many elements their consumer took,
how long it waited for them and how full their buffer is. Every `interval_s`
the dispatcher's `Autoscaler` turns the reports of the last interval into one
`Sample` and asks a `ScalingPolicy`:

- Consumers input-bound (they waited more than `scale_up_wait_fraction` of
  the interval): add a worker. If that worker did not raise the throughput
  by `min_gain`, it goes again and the pool stays below that size (more
  would not help: the machine or the source is the limit) until it shrinks
  for being well fed.
- Consumers well fed (waiting almost never, buffers `scale_down_fill` full)
  for `scale_down_intervals` intervals in a row: remove a worker.
- After adding a worker, the policy waits until it registered with the
  dispatcher (at most `START_TIMEOUT_S`) and then skips one more interval
  for it to fill its buffers: its gain is measured once it serves, however
  long its process or pod takes to start. After removing one, it skips one
  interval.

The pool is the workers its backend started: it never leaves [min_workers,
max_workers], and workers started by hand beside it are extra capacity the
policy neither counts nor stops. A backend starts and stops the workers
behind three methods (`start_worker`, `stop_worker`, `close`) and a
`num_workers` property; `AutoscaleConfig.backend` picks one:

- "local": `jaxfeed.service.pools.local_backend.LocalWorkerBackend`, worker
  processes on this machine (`python -m jaxfeed.service.worker`).
- "ray": `jaxfeed.service.pools.ray_backend.RayWorkerBackend`, one actor per worker
  spread over a Ray cluster's nodes (needs `jaxfeed[ray]`).
- "kubernetes": `jaxfeed.service.pools.kubernetes_backend.KubernetesWorkerBackend`,
  the replicas of a worker Deployment (needs `jaxfeed[kubernetes]`).

A worker leaves the pool on SIGTERM: it takes no new splits, finishes the
ones it holds, waits for its consumers to take its batches, and tells the
dispatcher it left; DYNAMIC jobs lose nothing. Its `parallel_epochs` tasks
stop at once (their epoch on that worker ends early).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from typing import Any, Callable, Sequence

from jaxfeed.service.pools import local_backend

_LOG = logging.getLogger(__name__)

# How many of its latest decisions an Autoscaler keeps.
_DECISIONS_KEPT = 1000
# The longest an Autoscaler waits for a worker it added to register before it
# decides again (one that never comes is then judged as not helping).
START_TIMEOUT_S = 60.0

# The places a pool's workers can run (AutoscaleConfig.backend).
BACKENDS = ("local", "ray", "kubernetes")
# How the workers are sized and shared (AutoscaleConfig.policy).
POOL, PER_JOB = "pool", "per_job"
POLICIES = (POOL, PER_JOB)
_DEFAULT_MIN_GAIN = {POOL: 0.1, PER_JOB: 0.03}


@dataclasses.dataclass(frozen=True)
class AutoscaleConfig:
  """When and how far the dispatcher resizes its worker pool.

  Attributes:
    min_workers: Workers the pool starts and never goes below.
    max_workers: Most workers the pool grows to.
    interval_s: Seconds between decisions.
    scale_up_wait_fraction: Consumers waiting more than this share of the
      time are input-bound.
    min_gain: A worker added must raise throughput (per_job: cut the job's
      batch time) by more than this fraction, or the pool (the job) stops
      growing; None: 0.1 for "pool", 0.03 for "per_job".
    scale_down_fill: Buffers at least this full (and consumers that waited
      less than a fifth of scale_up_wait_fraction) count as well fed.
    scale_down_intervals: Well-fed intervals in a row before a worker goes.
    worker_flags: Extra flags of the worker processes (e.g. --buffer_size).
    backend: Where workers run: one of `BACKENDS` ("local": processes on
      this machine; "ray": actors on a Ray cluster).
    ray_address: host:port of the Ray cluster's head ("ray" backend); None:
      the cluster this process is connected to, or Ray's "auto".
    kubernetes_deployment: "namespace/name" of the worker Deployment
      ("kubernetes" backend; required there).
    policy: One of `POLICIES`: "pool" sizes one pool whose workers serve
      every job; "per_job" gives each job its own workers, sized on its own
      batch time (`jaxfeed.service.dispatcher.job_scaling`), and shares
      max_workers between jobs.
    queue_growth: "per_job": a converged job whose consumers stopped waiting
      gives a worker back once its clients' buffers stay fuller than at
      convergence by this fraction (relative) for scale_down_intervals.
  """

  min_workers: int = 1
  max_workers: int = 4
  interval_s: float = 5.0
  scale_up_wait_fraction: float = 0.05
  min_gain: float | None = None
  scale_down_fill: float = 0.9
  scale_down_intervals: int = 3
  worker_flags: tuple[str, ...] = ()
  backend: str = "local"
  ray_address: str | None = None
  kubernetes_deployment: str | None = None
  policy: str = POOL
  queue_growth: float = 0.4

  def __post_init__(self):
    if self.policy not in POLICIES:
      raise ValueError(
        f"AutoscaleConfig: policy (--autoscale_policy) must be one of "
        f"{', '.join(POLICIES)}, got {self.policy!r}."
      )
    if self.min_gain is None:
      object.__setattr__(self, "min_gain", _DEFAULT_MIN_GAIN[self.policy])
    for name, flag in (
      ("min_gain", "autoscale_min_gain"),
      ("scale_up_wait_fraction", "autoscale_wait_fraction"),
    ):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1:
        raise ValueError(
          f"AutoscaleConfig: {name} (--{flag}) must be a fraction in (0, 1), got {value!r}."
        )
    if (
      isinstance(self.queue_growth, bool)
      or not isinstance(self.queue_growth, (int, float))
      or not self.queue_growth > 0
    ):
      raise ValueError(
        f"AutoscaleConfig: queue_growth (--autoscale_queue_growth) must be "
        f"a number > 0, got {self.queue_growth!r}."
      )
    if not isinstance(self.min_workers, int) or self.min_workers < 0:
      raise ValueError(
        f"AutoscaleConfig: min_workers must be an integer >= 0, got {self.min_workers!r}."
      )
    if not isinstance(self.max_workers, int) or self.max_workers < max(1, self.min_workers):
      raise ValueError(
        f"AutoscaleConfig: max_workers must be an integer >= max(1, "
        f"min_workers={self.min_workers}), got {self.max_workers!r}."
      )
    if (
      isinstance(self.interval_s, bool)
      or not isinstance(self.interval_s, (int, float))
      or not self.interval_s > 0
    ):
      raise ValueError(
        f"AutoscaleConfig: interval_s (--autoscale_interval_s) must be a "
        f"number > 0, got {self.interval_s!r}."
      )
    if (
      isinstance(self.scale_down_fill, bool)
      or not isinstance(self.scale_down_fill, (int, float))
      or not 0 < self.scale_down_fill <= 1
    ):
      raise ValueError(
        f"AutoscaleConfig: scale_down_fill (--autoscale_scale_down_fill) must "
        f"be a fraction in (0, 1], got {self.scale_down_fill!r}."
      )
    if not isinstance(self.scale_down_intervals, int) or self.scale_down_intervals < 1:
      raise ValueError(
        f"AutoscaleConfig: scale_down_intervals must be an integer >= 1, "
        f"got {self.scale_down_intervals!r}."
      )
    if isinstance(self.worker_flags, str) or not all(isinstance(f, str) for f in self.worker_flags):
      raise ValueError(
        f"AutoscaleConfig: worker_flags must be a sequence of strings, got {self.worker_flags!r}."
      )
    if self.backend not in BACKENDS:
      raise ValueError(
        f"AutoscaleConfig: backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}."
      )
    if self.ray_address is not None and (
      self.backend != "ray" or not isinstance(self.ray_address, str) or not self.ray_address
    ):
      raise ValueError(
        f"AutoscaleConfig: ray_address applies to backend='ray' only and "
        f"must be a non-empty host:port, got {self.ray_address!r} with "
        f"backend={self.backend!r}."
      )
    if (self.backend == "kubernetes") != (self.kubernetes_deployment is not None):
      raise ValueError(
        f"AutoscaleConfig: kubernetes_deployment (NAMESPACE/NAME) is "
        f"required with backend='kubernetes' and applies to it only, got "
        f"{self.kubernetes_deployment!r} with backend={self.backend!r}."
      )
    if self.kubernetes_deployment is not None:
      from jaxfeed.service.pools import kubernetes_backend  # pylint: disable=g-import-not-at-top

      kubernetes_backend.parse_deployment(self.kubernetes_deployment)


@dataclasses.dataclass(frozen=True)
class Sample:
  """What the clients reported over one interval."""

  elements_per_s: float
  wait_fraction: float  # of the interval, averaged over clients
  buffer_fill: float  # averaged over clients
  num_clients: int


class ScalingPolicy:
  """Decides +1, -1 or 0 workers from one `Sample` per interval."""

  def __init__(self, config: AutoscaleConfig):
    self.config = config
    self._settling = False
    self._throughput_before_add: float | None = None
    self._ceiling: int | None = None  # adding past this did not help
    self._well_fed = 0

  def decide(self, workers: int, sample: Sample | None) -> int:
    c = self.config
    if workers < c.min_workers:
      return 1
    if workers > c.max_workers:
      return -1
    if sample is None or sample.num_clients == 0:
      self._well_fed = 0
      return 0
    if self._settling:  # the interval right after a change
      self._settling = False
      return 0
    if self._throughput_before_add is not None:
      assert c.min_gain is not None  # resolved at construction
      gained = sample.elements_per_s >= self._throughput_before_add * (1 + c.min_gain)
      self._throughput_before_add = None
      if not gained and workers > c.min_workers:  # the last one did not help: undo
        self._ceiling = workers - 1
        self._settling = True
        return -1
    if sample.wait_fraction > c.scale_up_wait_fraction:
      self._well_fed = 0
      if workers < c.max_workers and (self._ceiling is None or workers < self._ceiling):
        self._throughput_before_add = sample.elements_per_s
        self._settling = True
        return 1
      return 0
    if (
      sample.wait_fraction < c.scale_up_wait_fraction / 5
      and sample.buffer_fill >= c.scale_down_fill
    ):
      self._well_fed += 1
      if self._well_fed >= c.scale_down_intervals and workers > c.min_workers:
        self._well_fed = 0
        self._ceiling = None
        self._settling = True
        return -1
      return 0
    self._well_fed = 0
    return 0


def direction(change: int) -> str:
  """The metrics' name of a change of workers: "up", "down" or "hold"."""
  return "up" if change > 0 else "down" if change < 0 else "hold"


def make_backend(
  config: AutoscaleConfig,
  dispatcher_address: str,
  flags: Sequence[str] = (),
  secrets: dict[str, str] | None = None,
) -> Any:
  """The backend `config.backend` names, for workers of `dispatcher_address`."""
  if config.backend == "ray":
    try:
      from jaxfeed.service.pools import ray_backend  # pylint: disable=g-import-not-at-top
    except ImportError as e:
      raise ImportError(
        "AutoscaleConfig(backend='ray') needs Ray: pip install 'jaxfeed[ray]'."
      ) from e
    return ray_backend.RayWorkerBackend(
      dispatcher_address, flags, secrets, ray_address=config.ray_address
    )
  if config.backend == "kubernetes":  # the Deployment carries flags and secrets
    try:
      from jaxfeed.service.pools import kubernetes_backend  # pylint: disable=g-import-not-at-top

      return kubernetes_backend.KubernetesWorkerBackend(config.kubernetes_deployment)
    except ImportError as e:
      raise ImportError(
        "AutoscaleConfig(backend='kubernetes') needs the kubernetes "
        "client: pip install 'jaxfeed[kubernetes]'."
      ) from e
  return local_backend.LocalWorkerBackend(dispatcher_address, flags, secrets)


class Autoscaler:
  """The dispatcher's thread that resizes the pool every interval.

  Args:
    config: The policy's settings.
    backend: Starts and stops the pool's workers.
    sample: Returns the clients' reports since the last call (or None).
    registered: Returns how many workers the dispatcher has registered; None:
      a worker added is measured after one interval, started or not.
  """

  def __init__(
    self,
    config: AutoscaleConfig,
    backend: Any,
    sample: Callable[[], Sample | None],
    registered: Callable[[], int] | None = None,
  ):
    self.config = config
    self.backend = backend
    self.policy = ScalingPolicy(config)
    self._sample = sample
    self._registered = registered
    # (workers registered before the last add, when it was made) until the
    # added worker registered.
    self._starting: tuple[int, float] | None = None
    self._stop = threading.Event()
    # The latest decisions, (workers, change), newest last; one is made every
    # interval for as long as the dispatcher runs, so only the last are kept
    # and `decision_counts` counts them all by direction.
    self.decisions: collections.deque[tuple[int, int]] = collections.deque(maxlen=_DECISIONS_KEPT)
    self.decision_counts: collections.Counter[str] = collections.Counter(
      {"up": 0, "down": 0, "hold": 0}
    )
    self._thread = threading.Thread(target=self._run, name="jaxfeed-autoscaler", daemon=True)

  def start(self) -> None:
    # A Deployment may already run workers (a restarted dispatcher's pool).
    for _ in range(self.config.min_workers - self.backend.num_workers):
      self.backend.start_worker()
    self._thread.start()

  def _run(self) -> None:
    while not self._stop.wait(self.config.interval_s):
      try:
        self._step()
      except Exception:  # pylint: disable=broad-except
        _LOG.exception("Autoscaler step failed")

  def _step(self) -> None:
    """One interval's decision, applied."""
    workers = self.backend.num_workers
    sample = self._sample()  # reports from before the new worker serves count for nothing
    change = 0 if self._still_starting() else self.policy.decide(workers, sample)
    if change > 0:
      if self._registered is not None:
        self._starting = (self._registered(), time.monotonic())
      self.backend.start_worker()
    elif change < 0:
      self.backend.stop_worker()
    if change:
      _LOG.info("Autoscaler: %d -> %d workers.", workers, workers + change)
    self.decisions.append((workers, change))
    self.decision_counts[direction(change)] += 1

  def _still_starting(self) -> bool:
    """Whether the worker added last has yet to register (for a while)."""
    if self._starting is None:
      return False
    before, added_at = self._starting
    if self._registered() <= before and time.monotonic() - added_at < START_TIMEOUT_S:
      return True
    self._starting = None
    return False

  def close(self) -> None:
    self._stop.set()
    if self._thread.is_alive():
      self._thread.join(timeout=15)
    self.backend.close()
