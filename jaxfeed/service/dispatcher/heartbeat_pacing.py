"""How often the dispatcher asks its workers and clients to call.

A worker heartbeats every 0.5 s and a client every 0.1 s by default: right for
a few dozen parties, but 1,024 workers and 2,048 clients at those rates are
over 20,000 RPCs a second, more than one Python dispatcher serves. The
dispatcher therefore tells every party in its heartbeat answers how long to
wait before the next one: the parties' own default while they are few, longer
as they grow, so that the total heartbeat rate stays near a budget -- never so
long that a live party could be taken for a dead one.

Joins count against the clients' budget: a join answers the client's first
heartbeat, and while a pod's hosts join (thousands in seconds) the clients
that joined first would otherwise keep the short interval of the few clients
there were, and call many times a second each (`JoinRate`).

Likewise DYNAMIC splits grow with the number of workers reading a job, so
that the split requests of a large job stay few (see `split_size`).
"""

from __future__ import annotations

import collections
import dataclasses

# The parties' own defaults (WorkerConfig.heartbeat_interval_s, the client's loop).
WORKER_DEFAULT_INTERVAL_S = 0.5
CLIENT_DEFAULT_INTERVAL_S = 0.1
# The live clients are counted at most this often (seconds).
COUNT_EVERY_S = 0.1
# Joins leave at least this share of the budget to the heartbeats.
HEARTBEAT_SHARE_LEFT = 0.25


@dataclasses.dataclass(frozen=True)
class HeartbeatPacing:
  """The dispatcher's budget for control-plane calls.

  Attributes:
    worker_heartbeats_per_s: Worker heartbeats a second the dispatcher aims
      for in total; workers beyond rate x default interval are slowed down.
    client_heartbeats_per_s: The same for client heartbeats and joins (a join
      answers a client's first heartbeat).
    worker_timeout_fraction: A worker's interval is at most this fraction of
      heartbeat_timeout_s (it may miss 1/fraction - 1 heartbeats in a row).
    client_timeout_fraction: The same of client_timeout_s for clients.
    tasks_per_split_step: DYNAMIC jobs with more live tasks than this hand out
      splits of split_size x ceil(tasks / tasks_per_split_step) positions;
      0 keeps split_size.
    goodbye_via_worker_clients: From this many live clients on, clients say
      goodbye through a worker they read from, which forwards it in its next
      heartbeat, instead of a ReleaseJobClient call each: a pod's hosts all
      leave at once, and 2,048 calls at once take the dispatcher about a
      second to drain. 0: never.
  """

  worker_heartbeats_per_s: float = 300.0
  client_heartbeats_per_s: float = 300.0
  worker_timeout_fraction: float = 1 / 3
  client_timeout_fraction: float = 1 / 10
  tasks_per_split_step: int = 32
  goodbye_via_worker_clients: int = 256

  def __post_init__(self):
    for name in ("worker_heartbeats_per_s", "client_heartbeats_per_s"):
      value = getattr(self, name)
      if not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"HeartbeatPacing: {name} must be > 0 calls a second, got {value!r}.")
    for name in ("worker_timeout_fraction", "client_timeout_fraction"):
      value = getattr(self, name)
      if not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise ValueError(f"HeartbeatPacing: {name} must be in (0, 1], got {value!r}.")
    if not isinstance(self.tasks_per_split_step, int) or self.tasks_per_split_step < 0:
      raise ValueError(
        "HeartbeatPacing: tasks_per_split_step must be an integer >= 0 "
        f"(0: fixed split size), got {self.tasks_per_split_step!r}."
      )
    if not isinstance(self.goodbye_via_worker_clients, int) or self.goodbye_via_worker_clients < 0:
      raise ValueError(
        "HeartbeatPacing: goodbye_via_worker_clients must be an integer "
        f">= 0 (0: never), got {self.goodbye_via_worker_clients!r}."
      )

  def worker_interval(self, num_workers: int, heartbeat_timeout_s: float) -> float:
    """Seconds between a worker's heartbeats; 0: the worker's own default."""
    return heartbeat_interval(
      num_workers,
      self.worker_heartbeats_per_s,
      WORKER_DEFAULT_INTERVAL_S,
      heartbeat_timeout_s * self.worker_timeout_fraction,
    )

  def client_interval(
    self, num_clients: int, client_timeout_s: float, joins_per_s: float = 0.0
  ) -> float:
    """Seconds between a client's heartbeats; 0: the client's own default.

    The joins (`joins_per_s`) take their share of the budget first, but
    leave the heartbeats at least HEARTBEAT_SHARE_LEFT of it.
    """
    heartbeats_per_s = max(
      self.client_heartbeats_per_s - joins_per_s,
      self.client_heartbeats_per_s * HEARTBEAT_SHARE_LEFT,
    )
    return heartbeat_interval(
      num_clients,
      heartbeats_per_s,
      CLIENT_DEFAULT_INTERVAL_S,
      client_timeout_s * self.client_timeout_fraction,
    )

  def goodbye_via_worker(self, num_clients: int) -> bool:
    """Whether `num_clients` live clients say goodbye through their workers."""
    return 0 < self.goodbye_via_worker_clients <= num_clients

  def split_size(self, base: int, num_tasks: int) -> int:
    """Positions per split of a DYNAMIC job read by `num_tasks` live tasks."""
    if not self.tasks_per_split_step or num_tasks <= self.tasks_per_split_step:
      return base
    return base * -(-num_tasks // self.tasks_per_split_step)


def heartbeat_interval(parties: int, calls_per_s: float, default_s: float, most_s: float) -> float:
  """The interval that keeps `parties` heartbeats near `calls_per_s` in total.

  Args:
    parties: Workers (or clients) heartbeating.
    calls_per_s: Heartbeats a second they may send together.
    default_s: The parties' own interval.
    most_s: The longest interval allowed (a fraction of the timeout).

  Returns:
    0 while the default keeps within the budget (the party keeps its own
    interval), else parties / calls_per_s capped at most_s (never below
    the default).
  """
  paced = parties / calls_per_s
  if paced <= default_s:
    return 0.0
  return max(default_s, min(paced, most_s))


class JoinRate:
  """Joins a second, over the joins of the last `window_s` seconds.

  The rate is taken over the span from the oldest of those joins to now (at
  least `shortest_s`), not the whole window, so that it is right from the
  first moments of a burst of joins rather than a window later.
  """

  def __init__(self, window_s: float = 1.0, shortest_s: float = 0.1):
    self.window_s = window_s
    self._shortest_s = shortest_s
    self._times: collections.deque[float] = collections.deque()

  def note(self, now: float) -> None:
    """Counts a join at time `now` (seconds, monotonic)."""
    self._times.append(now)
    self._forget(now)

  def per_s(self, now: float) -> float:
    self._forget(now)
    if not self._times:
      return 0.0
    return len(self._times) / max(now - self._times[0], self._shortest_s)

  def _forget(self, now: float) -> None:
    while self._times and now - self._times[0] > self.window_s:
      self._times.popleft()
