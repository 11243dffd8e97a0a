"""Prometheus metrics of dispatchers and workers (`--metrics_port`).

Every name starts with `jaxfeed_`. Most values are read from the server's
state when Prometheus scrapes (a custom collector), so serving costs nothing
between scrapes; the worker counts what it serves in `ServedCounts`, which
needs no Prometheus at all. `prometheus-client` is an optional dependency
(`pip install jaxfeed[metrics]`), imported only by `serve_*`.

Dispatcher (per job where labelled `job`: the job's `job_name`, or its id
when it has none; the same label as the workers' metrics):
  jaxfeed_dispatcher_workers            registered workers
  jaxfeed_dispatcher_jobs               jobs
  jaxfeed_job_clients                   clients reading the job
  jaxfeed_job_workers                   live workers serving the job (with a
                                        task of it that has not finished)
  jaxfeed_dispatcher_client_goodbyes_total  how clients left, by `via`: call
                                        (ReleaseJobClient calls), worker (goodbyes
                                        forwarded by workers), timeout; and goodbyes
                                        ignored: refused (wrong ticket or job), stale
  jaxfeed_job_split_lag                 exactly-once splits issued, not yet acknowledged
  jaxfeed_job_splits_to_reissue         splits of lost workers waiting to be issued again
  jaxfeed_job_positions_issued          sampler positions handed out in splits
  jaxfeed_dispatcher_split_answers_total  DYNAMIC split answers, by the call that
                                        carried them (`via`: GetSplits, or
                                        WorkerHeartbeat with a new task) and
                                        whether it was a task's first (`first`)
  jaxfeed_job_client_elements_total     elements the clients' consumers took, clients
                                        that left included (monotonic while the job lives)
  jaxfeed_job_client_wait_seconds_total seconds the consumers waited for input (likewise)
  jaxfeed_job_client_buffer_fill        the clients' buffer fill (0..1, mean)
  jaxfeed_dispatcher_journal_healthy    1 while the journal takes writes; 0 while a
                                        full disk refuses them (changes that must be
                                        durable are refused, heartbeats go on) or
                                        once it failed for good
  jaxfeed_journal_bytes                 size of the journal and snapshot files
  jaxfeed_journal_replay_records        records the last restart replayed
  jaxfeed_journal_replay_seconds        how long that replay took
  jaxfeed_pool_workers                  workers of the elastic pool
  jaxfeed_pool_scaling_decisions_total  the pool's decisions, by direction
  jaxfeed_job_scaling_decisions_total   --autoscale_policy=per_job's decisions, by
                                        job, direction and reason
  jaxfeed_rpc_errors_total              calls answered with a status other than OK,
                                        by method and code
Worker (`job`: as the dispatcher's):
  jaxfeed_worker_tasks                  tasks it runs
  jaxfeed_worker_buffer_fill            fill (0..1) of its tasks' buffers of produced
                                        batches, by job (the mean over its tasks)
  jaxfeed_worker_elements_served_total  elements (batches) sent to consumers, by job
  jaxfeed_worker_bytes_served_total     their encoded bytes, by job
  jaxfeed_worker_errors_total           task failures sent to consumers, by job
  jaxfeed_worker_connections_total      clients' connections to its tasks, by
                                        transport (grpc, socket, memory: a client
                                        in the worker's own process)
  jaxfeed_rpc_errors_total              calls answered with a status other than OK,
                                        by method ("data_socket": the data socket's
                                        refusals and failures) and code
  jaxfeed_client_rpc_errors_total       the worker's own calls (to the dispatcher)
                                        that failed, by method and code
  jaxfeed_autocache_decisions_total     the autocache policy's decisions in the
                                        worker's process, by job, point (its entry,
                                        shortened) and decision (compute, write, read)
Client (`jaxfeed.service.serve_client_metrics()`, in the trainer's process):
  jaxfeed_client_rpc_errors_total       the process's calls to dispatcher and
                                        workers that failed, by method and code
                                        (cancelled calls are no errors)
"""

from __future__ import annotations

import collections
import os
import threading
from typing import Any, Iterator

from jaxfeed.ops import autocache_policy
from jaxfeed.service.protocol import rpc_errors

# --metrics_port's value that serves no metrics.
OFF = -1


def job_label(job_name: str, job_id: int) -> str:
  """The `job` label of a job's metrics: the name its clients gave it (what
  an operator knows it by), or its id when it has none."""
  return job_name or str(job_id)


class _CountedSource:
  """A task source whose `take()` results are counted (see
  `ServedCounts.counting`); everything else is the source's."""

  def __init__(self, counts: "ServedCounts", job: str, source: Any):
    self._counts = counts
    self._job = job
    self._source = source

  def take(self, *args: Any) -> Any:
    try:
      got = self._source.take(*args)
    except Exception:
      self._counts._error(self._job)  # pylint: disable=protected-access
      raise
    if isinstance(got, tuple) and len(got) == 2:
      first, second = got
      # Exactly-once: (split start, [frames]); otherwise (frame, round).
      frames = second if isinstance(second, list) else [first]
      self._counts._add(self._job, [f for f in frames if f is not None])  # pylint: disable=protected-access
    return got

  def __getattr__(self, name: str) -> Any:
    return getattr(self._source, name)


class ServedCounts:
  """What a worker sent to its consumers, by job (thread-safe)."""

  def __init__(self):
    self._lock = threading.Lock()
    self._job_of: dict[int, tuple[int, str]] = {}  # task id -> (job id, job label)
    self.elements: collections.Counter = collections.Counter()
    self.bytes: collections.Counter = collections.Counter()
    self.errors: collections.Counter = collections.Counter()
    # Client connections to tasks, by transport: "grpc", "socket" or
    # "memory" (a client in the worker's process, see
    # jaxfeed.service.worker.local_workers).
    self.connections: collections.Counter = collections.Counter()

  def connected(self, transport: str) -> None:
    with self._lock:
      self.connections[transport] += 1

  def track(self, task: Any) -> None:
    """Remembers the job of a task (a `TaskInfo`) the worker starts."""
    with self._lock:
      self._job_of[task.task_id] = (task.job_id, job_label(task.job_name, task.job_id))

  def job_of(self, task_id: int) -> str:
    """The job of a tracked task, as a label ("" if not tracked)."""
    with self._lock:
      return self._job_of.get(task_id, (0, ""))[1]

  def job_id_of(self, task_id: int) -> int | None:
    """The job id of a tracked task (None if not tracked)."""
    with self._lock:
      known = self._job_of.get(task_id)
      return None if known is None else known[0]

  def counting(self, task_id: int, source: Any) -> "_CountedSource":
    """`source` (a task's runner or shared-stream reader) with what its
    `take()` hands out counted: each produced frame once, however often a
    client's stream sends it again after a broken connection."""
    return _CountedSource(self, self.job_of(task_id), source)

  def _add(self, job: str, frames: list) -> None:
    with self._lock:
      self.elements[job] += len(frames)
      self.bytes[job] += sum(frame.nbytes for frame in frames)

  def _error(self, job: str) -> None:
    with self._lock:
      self.errors[job] += 1

  def snapshot(self) -> tuple[dict, dict, dict]:
    with self._lock:
      return dict(self.elements), dict(self.bytes), dict(self.errors)


class MetricsServer:
  """An HTTP server of /metrics on its own thread; `close()` stops it."""

  def __init__(self, collector: Any, host: str, port: int):
    import prometheus_client  # pylint: disable=g-import-not-at-top

    self.registry = prometheus_client.CollectorRegistry(auto_describe=False)
    self.registry.register(collector)
    self._server, self._thread = prometheus_client.start_http_server(
      port, addr=host, registry=self.registry
    )
    self.port = self._server.server_address[1]
    self.url = f"http://{host}:{self.port}/metrics"

  def close(self) -> None:
    self._server.shutdown()
    self._server.server_close()
    self._thread.join(timeout=5)


def _families():
  from prometheus_client import core  # pylint: disable=g-import-not-at-top

  return core.GaugeMetricFamily, core.CounterMetricFamily


def _error_family(name: str, doc: str, *counts: rpc_errors.ErrorCounts) -> Any:
  """A counter by method and code of what `counts` hold together."""
  _, counter = _families()
  total: collections.Counter = collections.Counter()
  for one in counts:
    total.update(one.snapshot())
  family = counter(name, doc, labels=["method", "code"])
  for (method, code), value in sorted(total.items()):
    family.add_metric([method, code], value)
  return family


_SERVED_ERRORS_DOC = "Calls answered with a status other than OK, by method and code."
_CLIENT_ERRORS_DOC = "Calls this process made that failed, by method and code."


class _DispatcherCollector:
  """Reads a `DispatchServer`'s state at each scrape."""

  def __init__(self, server: Any):
    self._server = server

  def collect(self) -> Iterator[Any]:
    gauge, counter = _families()
    state = self._server.state

    def job_family(family: Any, name: str, doc: str) -> Any:
      return family(name, doc, labels=["job"])

    clients = job_family(gauge, "jaxfeed_job_clients", "Clients reading the job.")
    workers = job_family(
      gauge, "jaxfeed_job_workers", "Live workers with an unfinished task of the job."
    )
    lag = job_family(
      gauge, "jaxfeed_job_split_lag", "Exactly-once splits issued but not yet acknowledged."
    )
    reissue = job_family(
      gauge, "jaxfeed_job_splits_to_reissue", "Splits of lost workers waiting to be issued again."
    )
    issued = job_family(
      gauge, "jaxfeed_job_positions_issued", "Sampler positions handed out in splits."
    )
    elements = job_family(
      counter,
      "jaxfeed_job_client_elements",
      "Elements the job's consumers took (clients that left included).",
    )
    waited = job_family(
      counter,
      "jaxfeed_job_client_wait_seconds",
      "Seconds the job's consumers waited for input (clients that left included).",
    )
    fill = job_family(
      gauge, "jaxfeed_job_client_buffer_fill", "Mean fill (0..1) of the clients' buffers."
    )
    goodbyes = counter(
      "jaxfeed_dispatcher_client_goodbyes",
      "How clients left (call, worker, timeout) and goodbyes ignored (refused, stale).",
      labels=["via"],
    )
    with state.lock:
      state.lock.answer_without_fsync()
      for via in ("call", "worker", "timeout", "refused", "stale"):
        goodbyes.add_metric([via], state.goodbyes[via])
      reports = dict(state._reports)  # pylint: disable=protected-access
      split_answers = sorted(state.split_answers.items())
      num_workers, num_jobs = len(state.workers), len(state.jobs)
      totals = state.job_counts.totals()
      for job in state.jobs.values():
        label = [job_label(job.job_name, job.job_id)]
        clients.add_metric(label, len(job.clients))
        workers.add_metric(
          label,
          len(
            {
              t.worker_address
              for t in job.tasks.values()
              if not t.finished and t.worker_address in state.workers
            }
          ),
        )
        lag.add_metric(label, len(job.unacked))
        reissue.add_metric(label, len(job.reissue))
        issued.add_metric(label, job.next_position)
        total = totals.get(job.job_id)
        elements.add_metric(label, total.elements if total else 0)
        waited.add_metric(label, total.wait_s if total else 0.0)
        mine = [reports[c] for c in job.clients if c in reports]
        fill.add_metric(label, sum(r[3] for r in mine) / len(mine) if mine else 0.0)
    yield gauge("jaxfeed_dispatcher_workers", "Registered workers.", value=num_workers)
    yield gauge("jaxfeed_dispatcher_jobs", "Jobs.", value=num_jobs)
    yield from (clients, workers, lag, reissue, issued, elements, waited, fill, goodbyes)
    answers = counter(
      "jaxfeed_dispatcher_split_answers",
      "DYNAMIC split answers, by the call that carried them and whether it was a task's first.",
      labels=["via", "first"],
    )
    for (via, first), count in split_answers:
      answers.add_metric([via, str(first).lower()], count)
    yield answers
    journal = state.journal
    yield gauge(
      "jaxfeed_dispatcher_journal_healthy",
      "1 while the dispatcher's journal takes writes, else 0.",
      value=1 if journal is None or journal.healthy else 0,
    )
    yield gauge(
      "jaxfeed_journal_bytes",
      "Size of the journal and snapshot files.",
      value=_folder_bytes(state.config.work_dir),
    )
    yield gauge(
      "jaxfeed_journal_replay_records",
      "Records the last restart replayed.",
      value=state.replay_stats.records,
    )
    yield gauge(
      "jaxfeed_journal_replay_seconds",
      "How long the last restart's replay took.",
      value=getattr(state, "replay_seconds", 0.0),
    )
    yield _error_family("jaxfeed_rpc_errors", _SERVED_ERRORS_DOC, self._server._server.errors)  # pylint: disable=protected-access
    autoscaler = self._server.autoscaler
    if autoscaler is not None:
      decisions = list(autoscaler.decisions)
      workers = decisions[-1][0] + decisions[-1][1] if decisions else autoscaler.config.min_workers
      yield gauge("jaxfeed_pool_workers", "Workers of the elastic pool.", value=workers)
      made = counter(
        "jaxfeed_pool_scaling_decisions",
        "The elastic pool's decisions, by direction.",
        labels=["direction"],
      )
      counts = autoscaler.decision_counts.copy()
      for direction in ("up", "down", "hold"):
        made.add_metric([direction], counts[direction])
      yield made
      per_job = getattr(autoscaler, "metric_families", None)  # --autoscale_policy=per_job
      if per_job is not None:
        yield from per_job(gauge, counter)


def _folder_bytes(folder: str | None) -> int:
  if not folder:
    return 0
  total = 0
  for entry in os.scandir(folder):
    if entry.is_file() and entry.name != "LOCK":
      total += entry.stat().st_size
  return total


class _WorkerCollector:
  """Reads a `WorkerServer`'s counts at each scrape."""

  def __init__(self, server: Any):
    # pylint: disable=protected-access
    self._worker = server._worker
    self._errors = [server._server.errors]
    if server._data_server is not None:
      self._errors.append(server._data_server.errors)

  def collect(self) -> Iterator[Any]:
    gauge, counter = _families()
    yield _error_family("jaxfeed_rpc_errors", _SERVED_ERRORS_DOC, *self._errors)
    yield _error_family("jaxfeed_client_rpc_errors", _CLIENT_ERRORS_DOC, rpc_errors.CLIENT_ERRORS)
    with self._worker.lock:
      tasks = dict(self._worker.tasks)
    yield gauge("jaxfeed_worker_tasks", "Tasks the worker runs.", value=len(tasks))
    fills = collections.defaultdict(list)
    for task_id, runner in tasks.items():
      if hasattr(runner, "buffer_fill"):  # a shared stream's reader has none of its own
        fills[self._worker.served.job_of(task_id)].append(runner.buffer_fill())
    fill = gauge(
      "jaxfeed_worker_buffer_fill",
      "Mean fill (0..1) of the buffers of produced batches.",
      labels=["job"],
    )
    for job, values in sorted(fills.items()):
      fill.add_metric([job], sum(values) / len(values))
    yield fill
    served, sent, errors = self._worker.served.snapshot()
    for name, doc, values in (
      ("jaxfeed_worker_elements_served", "Elements (batches) sent to consumers.", served),
      ("jaxfeed_worker_bytes_served", "Encoded bytes sent to consumers.", sent),
      ("jaxfeed_worker_errors", "Task failures sent to consumers.", errors),
    ):
      family = counter(name, doc, labels=["job"])
      for job, value in sorted(values.items()):
        family.add_metric([job], value)
      yield family
    with self._worker.served._lock:  # pylint: disable=protected-access
      connections = dict(self._worker.served.connections)
    family = counter(
      "jaxfeed_worker_connections",
      "Client connections to tasks, by transport (grpc, socket, memory).",
      labels=["transport"],
    )
    for transport, value in sorted(connections.items()):
      family.add_metric([transport], value)
    yield family
    family = counter(
      "jaxfeed_autocache_decisions",
      "Decisions of the autocache policy, by job, autocache point (its "
      "entry's name, shortened) and decision: compute, write or read.",
      labels=["job", "point", "decision"],
    )
    for (job, point, decision), value in sorted(autocache_policy.decision_counts().items()):
      family.add_metric([job, point, decision], value)
    yield family


def serve_dispatcher(server: Any, host: str, port: int) -> MetricsServer | None:
  """Serves a `DispatchServer`'s metrics on host:port (0: a free port); None when port is OFF."""
  if check_port(port) == OFF:
    return None
  return MetricsServer(_DispatcherCollector(server), host, port)


def serve_worker(server: Any, host: str, port: int) -> MetricsServer | None:
  """Serves a `WorkerServer`'s metrics on host:port (0: a free port); None when port is OFF."""
  if check_port(port) == OFF:
    return None
  return MetricsServer(_WorkerCollector(server), host, port)


class _ClientCollector:
  """The process's failed calls, at each scrape."""

  def collect(self) -> Iterator[Any]:
    yield _error_family("jaxfeed_client_rpc_errors", _CLIENT_ERRORS_DOC, rpc_errors.CLIENT_ERRORS)


def serve_client_metrics(host: str = "127.0.0.1", port: int = 0) -> MetricsServer | None:
  """Serves the client side's metrics of this process (the trainer's) on
  host:port (0: a free port); None when port is OFF. `close()` stops it."""
  if check_port(port) == OFF:
    return None
  return MetricsServer(_ClientCollector(), host, port)


def check_port(port: int) -> int:
  """Validates a --metrics_port value."""
  if not isinstance(port, int) or not OFF <= port < 65536:
    raise ValueError(
      f"metrics_port must be {OFF} (off), 0 (a free port) or a port up to 65535, got {port!r}."
    )
  return port
