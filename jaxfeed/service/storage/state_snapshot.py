"""Snapshots of the dispatcher's live state, which compact its journal.

A snapshot is the list of journal records that rebuilds the live state on an
empty `DispatcherState`: one `dataset` record per registered dataset, per job
its `job`, `fix_workers`, `task`, `task_finished` and `client` records, its
split positions, the clients that hold unacknowledged splits and the workers
lost on its splits, and an `ids` record so that ids are never handed out twice.
Replaying it costs time in proportion to the live state, however long the
history that led there.

The file holds a header line, then one record per line:

  {"format": "jaxfeed-dispatcher-snapshot", "version": 1, "journal": G,
   "records": N, "crc32": C}

`journal` is the first journal generation that is not part of the snapshot,
`records` the number of record lines and `crc32` the CRC-32 of everything
after the header line, so that a damaged snapshot is refused with a clear
error instead of being half replayed.
"""

from __future__ import annotations

import base64
import json
import zlib
from typing import Any, Mapping

FORMAT = "jaxfeed-dispatcher-snapshot"
VERSION = 1


def state_records(datasets: Mapping[str, Any], jobs: Mapping[int, Any],
                  next_id: int) -> list[dict[str, Any]]:
  """The records that rebuild a dispatcher's live state.

  Args:
    datasets: dataset id -> `DatasetDef` of the registered datasets.
    jobs: job id -> the dispatcher's job bookkeeping.
    next_id: the next id the dispatcher would hand out.

  Returns:
    Journal records, in the order they must be applied.
  """
  records: list[dict[str, Any]] = [{"kind": "ids", "id": next_id - 1}]
  for dataset_id, dataset_def in datasets.items():
    records.append({"kind": "dataset", "id": dataset_id, "dataset_id": dataset_id,
                    "def": base64.b64encode(dataset_def.SerializeToString()).decode()})
  for job in jobs.values():
    records.append({"kind": "job", "id": job.job_id, "dataset_id": job.dataset_id,
                    "policy": job.policy.value, "job_name": job.job_name,
                    "num_consumers": job.num_consumers,
                    "num_positions": job.num_positions,
                    "round_timeout_s": job.round_timeout_s,
                    "exactly_once": job.exactly_once,
                    "ephemeral_sharing": job.ephemeral_sharing,
                    **({"skip": job.skip} if job.skip else {})})
    if job.fixed_workers is not None:
      records.append({"kind": "fix_workers", "job_id": job.job_id,
                      "workers": [[a, i] for a, i in job.fixed_workers.items()]})
    for task in job.tasks.values():
      records.append({"kind": "task", "id": task.task_id, "job_id": job.job_id,
                      "worker_address": task.worker_address,
                      "worker_index": task.worker_index, "num_workers": task.num_workers})
      if task.finished:
        records.append({"kind": "task_finished", "job_id": job.job_id,
                        "task_id": task.task_id})
    for client_id in job.clients:
      records.append({"kind": "client", "id": client_id, "job_id": job.job_id,
                      "consumer_index": job.consumers.get(client_id, 0)})
    if job.next_position:
      records.append({"kind": "splits", "job_id": job.job_id,
                      "next_position": job.next_position})
    by_task: dict[int, list[list[int]]] = {}
    for start, (stop, task_id) in job.unacked.items():
      by_task.setdefault(task_id, []).append([start, stop])
    for task_id, ranges in by_task.items():
      records.append({"kind": "splits_issued", "job_id": job.job_id,
                      "task_id": task_id, "ranges": ranges})
    for task_id, (request_seq, ranges) in job.last_splits.items():
      records.append({"kind": "splits_reply", "job_id": job.job_id, "task_id": task_id,
                      "request_seq": request_seq, "ranges": ranges})
    if job.reissue:
      records.append({"kind": "splits_lost", "job_id": job.job_id,
                      "ranges": [[start, stop] for start, stop in job.reissue.items()]})
    records.extend(_failure_records(job))
    by_client: dict[int, list[int]] = {}
    for start, client_id in job.holders.items():
      by_client.setdefault(client_id, []).append(start)
    for client_id, starts in by_client.items():
      records.append({"kind": "splits_held", "job_id": job.job_id,
                      "client_id": client_id, "starts": starts})
  return records


def _failure_records(job: Any) -> list[dict[str, Any]]:
  """The records of the workers lost on a job's splits, and of its failure."""
  records = []
  for start, (stop, losses) in job.split_losses.items():
    for loss in losses:
      worker, _, how = loss.partition(": ")
      records.append({"kind": "splits_failed", "job_id": job.job_id,
                      "ranges": [[start, stop]], "worker": worker, "how": how})
  if job.lost:
    records.append({"kind": "splits_failed", "job_id": job.job_id, "ranges": job.lost,
                    "worker": "", "how": ""})
  for start, stop in job.failed_splits.items():
    records.append({"kind": "split_poisoned", "job_id": job.job_id, "start": start,
                    "stop": stop, "error": job.error})
  return records


def encode(records: list[dict[str, Any]], journal_generation: int) -> bytes:
  """The snapshot file's bytes for `records`, followed by `journal_generation`."""
  body = b"".join(json.dumps(r, separators=(",", ":")).encode() + b"\n" for r in records)
  header = {"format": FORMAT, "version": VERSION, "journal": journal_generation,
            "records": len(records), "crc32": zlib.crc32(body)}
  return json.dumps(header, separators=(",", ":")).encode() + b"\n" + body


def decode(data: bytes, path: str) -> tuple[int, list[dict[str, Any]]]:
  """Reads a snapshot file's bytes.

  Args:
    data: the bytes `encode` wrote.
    path: the file they came from (named in errors).

  Returns:
    The first journal generation after the snapshot, and its records.

  Raises:
    ValueError: the file is not a complete, intact snapshot of this version.
  """
  header_line, _, body = data.partition(b"\n")
  try:
    header = json.loads(header_line)
  except ValueError:
    header = None
  if not isinstance(header, dict) or header.get("format") != FORMAT:
    raise ValueError(f"Dispatcher snapshot {path} has no valid header line: it is "
                     "not a jaxfeed dispatcher snapshot or it is damaged.")
  if header.get("version") != VERSION:
    raise ValueError(f"Dispatcher snapshot {path} has version {header.get('version')!r}; "
                     f"this jaxfeed reads version {VERSION}.")
  if zlib.crc32(body) != header.get("crc32"):
    raise ValueError(f"Dispatcher snapshot {path} is damaged: its checksum does not "
                     f"match ({len(body)} bytes after the header).")
  records = [json.loads(line) for line in body.splitlines()]
  if len(records) != header.get("records"):
    raise ValueError(f"Dispatcher snapshot {path} holds {len(records)} records; its "
                     f"header says {header.get('records')}.")
  return int(header["journal"]), records
