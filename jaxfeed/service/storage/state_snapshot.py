"""Snapshots of the dispatcher's live state, which compact its journal.

A snapshot is the list of journal records that rebuilds the live state on an
empty `DispatcherState`: one `dataset` record per registered dataset, per job
its `job`, `fix_workers`, `task`, `task_finished` and `client` records, its
split positions, the clients that hold unacknowledged splits and the workers
lost on its splits, and an `ids` record so that ids are never handed out twice.
Replaying it costs time in proportion to the live state, however long the
history that led there.

The file is made of checked lines (`journal_lines`: each carries a rolling
CRC-32C), a header, then one record per line:

  {"format": "jaxfeed-dispatcher-snapshot", "version": 2, "journal": G,
   "records": N}

`journal` is the first journal generation that is not part of the snapshot
and `records` the number of record lines. The checksums cover every byte,
the header included: a snapshot with a flipped bit, or cut short, is refused
with an error naming the file and the offset, never half replayed (a
damaged header could otherwise name the wrong journal generations).

Version 1 (the previous release) kept a CRC-32 of the records in its header
line, which nothing checked: it is still read, once, and the dispatcher
rewrites its state in version 2 at once (see `jaxfeed.service.storage.journal`).
"""

from __future__ import annotations

import base64
import dataclasses
import json
import zlib
from typing import Any, Mapping

from jaxfeed.service.protocol import target_workers
from jaxfeed.service.storage import journal_lines
from jaxfeed.service.storage.journal_lines import JournalDamageError

FORMAT = "jaxfeed-dispatcher-snapshot"
VERSION = 2
LEGACY_VERSION = 1


def state_records(
  datasets: Mapping[str, Any], jobs: Mapping[int, Any], next_id: int
) -> list[dict[str, Any]]:
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
    # A dataset id a user chose is no number of the dispatcher's (the "ids"
    # record above keeps its numbers).
    numbered = dataset_id.isdigit() and int(dataset_id) < next_id
    records.append(
      {
        "kind": "dataset",
        **({"id": dataset_id} if numbered else {}),
        "dataset_id": dataset_id,
        "def": base64.b64encode(dataset_def.SerializeToString()).decode(),
      }
    )
  for job in jobs.values():
    records.append(
      {
        "kind": "job",
        "id": job.job_id,
        "dataset_id": job.dataset_id,
        "policy": job.policy.value,
        "job_name": job.job_name,
        "num_consumers": job.num_consumers,
        "num_positions": job.num_positions,
        "round_timeout_s": job.round_timeout_s,
        "exactly_once": job.exactly_once,
        "ephemeral_sharing": job.ephemeral_sharing,
        **({"skip": job.skip} if job.skip else {}),
        **({"identical_worker_streams": True} if job.identical_worker_streams else {}),
        **({"resume_orders": job.resume_orders} if job.resume_orders else {}),
        **(
          {"target_workers": job.target_workers}
          if job.target_workers != target_workers.AUTO
          else {}
        ),
      }
    )
    if job.fixed_workers is not None:
      records.append(
        {
          "kind": "fix_workers",
          "job_id": job.job_id,
          "workers": [[a, i] for a, i in job.fixed_workers.items()],
        }
      )
    for task in job.tasks.values():
      records.append(
        {
          "kind": "task",
          "id": task.task_id,
          "job_id": job.job_id,
          "worker_address": task.worker_address,
          "worker_index": task.worker_index,
          "num_workers": task.num_workers,
        }
      )
      if task.finished:
        records.append({"kind": "task_finished", "job_id": job.job_id, "task_id": task.task_id})
    for client_id in job.clients:
      records.append(
        {
          "kind": "client",
          "id": client_id,
          "job_id": job.job_id,
          "consumer_index": job.consumers.get(client_id, 0),
          **(
            {"process": job.client_processes[client_id]}
            if job.client_processes.get(client_id)
            else {}
          ),
        }
      )
    if job.next_position:
      records.append({"kind": "splits", "job_id": job.job_id, "next_position": job.next_position})
    by_task: dict[int, list[list[int]]] = {}
    for start, (stop, task_id) in job.unacked.items():
      by_task.setdefault(task_id, []).append([start, stop])
    for task_id, ranges in by_task.items():
      records.append(
        {"kind": "splits_issued", "job_id": job.job_id, "task_id": task_id, "ranges": ranges}
      )
    for task_id, (request_seq, ranges) in job.last_splits.items():
      records.append(
        {
          "kind": "splits_reply",
          "job_id": job.job_id,
          "task_id": task_id,
          "request_seq": request_seq,
          "ranges": ranges,
        }
      )
    if job.reissue:
      records.append(
        {
          "kind": "splits_lost",
          "job_id": job.job_id,
          "ranges": [[start, stop] for start, stop in job.reissue.items()],
        }
      )
    records.extend(_failure_records(job))
    by_client: dict[int, list[int]] = {}
    for start, client_id in job.holders.items():
      by_client.setdefault(client_id, []).append(start)
    for client_id, starts in by_client.items():
      records.append(
        {"kind": "splits_held", "job_id": job.job_id, "client_id": client_id, "starts": starts}
      )
  return records


def _failure_records(job: Any) -> list[dict[str, Any]]:
  """The records of the workers lost on a job's splits, and of its failure."""
  records = []
  for start, (stop, losses) in job.split_losses.items():
    for loss in losses:
      worker, _, how = loss.partition(": ")
      records.append(
        {
          "kind": "splits_failed",
          "job_id": job.job_id,
          "ranges": [[start, stop]],
          "worker": worker,
          "how": how,
        }
      )
  if job.lost:
    records.append(
      {"kind": "splits_failed", "job_id": job.job_id, "ranges": job.lost, "worker": "", "how": ""}
    )
  for start, stop in job.failed_splits.items():
    records.append(
      {
        "kind": "split_poisoned",
        "job_id": job.job_id,
        "start": start,
        "stop": stop,
        "error": job.error,
      }
    )
  return records


def encode(records: list[dict[str, Any]], journal_generation: int) -> bytes:
  """The snapshot file's bytes for `records`, followed by `journal_generation`."""
  header = {
    "format": FORMAT,
    "version": VERSION,
    "journal": journal_generation,
    "records": len(records),
  }
  return journal_lines.encode_all(
    json.dumps(value, separators=(",", ":")).encode() for value in [header, *records]
  )[0]


@dataclasses.dataclass(frozen=True)
class Snapshot:
  """A snapshot file read back.

  Attributes:
    journal_generation: the first journal generation after it.
    records: its records, in order.
    offsets: the byte offset of each record's line (for errors).
    legacy: it has the previous release's format (rewrite it).
  """

  journal_generation: int
  records: list[dict[str, Any]]
  offsets: list[int]
  legacy: bool = False


def decode(data: bytes, path: str) -> Snapshot:
  """Reads a snapshot file's bytes.

  Args:
    data: the bytes `encode` (or the previous release) wrote.
    path: the file they came from (named in errors).

  Raises:
    JournalDamageError: the file is damaged or incomplete (the message names
      it and the offset).
  """
  if data[:1] == b"{":
    return _decode_legacy(data, path)
  checked = journal_lines.check(data)
  if checked.bad_offset is not None:
    raise JournalDamageError(
      f"Dispatcher snapshot {path} is damaged at byte {checked.bad_offset} (line "
      f"{checked.bad_line}): its checksum does not match. A snapshot is never cut: "
      "restore the work_dir from a backup (or remove it to start empty, losing every "
      "dataset and job).",
      path,
      checked.bad_offset,
    )
  values = [_json(p, path, o) for p, o in zip(checked.payloads, checked.offsets)]
  header = values[0] if values else None
  if not isinstance(header, dict) or header.get("format") != FORMAT:
    raise JournalDamageError(
      f"Dispatcher snapshot {path} has no valid header line: it "
      "is not a jaxfeed dispatcher snapshot.",
      path,
      0,
    )
  if header.get("version") != VERSION or not isinstance(header.get("journal"), int):
    raise JournalDamageError(
      f"Dispatcher snapshot {path} has version "
      f"{header.get('version')!r}; this jaxfeed reads versions "
      f"{LEGACY_VERSION} and {VERSION}.",
      path,
      0,
    )
  if len(values) - 1 != header.get("records"):
    raise JournalDamageError(
      f"Dispatcher snapshot {path} ends at byte {len(data)} after {len(values) - 1} "
      f"records; its header says {header.get('records')}: it was cut short.",
      path,
      len(data),
    )
  return Snapshot(header["journal"], values[1:], checked.offsets[1:])


def _json(payload: bytes, path: str, offset: int) -> Any:
  try:
    return journal_lines.decode(payload)
  except (ValueError, RecursionError) as e:
    raise JournalDamageError(
      f"Dispatcher snapshot {path} at byte {offset}: its checksum matches but it is no JSON ({e}).",
      path,
      offset,
    ) from e


def _decode_legacy(data: bytes, path: str) -> Snapshot:
  """Version 1: a header line with a CRC-32 of the lines after it."""
  header_line, _, body = data.partition(b"\n")
  try:
    header = json.loads(header_line)
  except ValueError:
    header = None
  if not isinstance(header, dict) or header.get("format") != FORMAT:
    raise JournalDamageError(
      f"Dispatcher snapshot {path} has no valid header line: it "
      "is not a jaxfeed dispatcher snapshot or it is damaged.",
      path,
      0,
    )
  if header.get("version") != LEGACY_VERSION:
    raise JournalDamageError(
      f"Dispatcher snapshot {path} has version "
      f"{header.get('version')!r}; this jaxfeed reads versions "
      f"{LEGACY_VERSION} and {VERSION}.",
      path,
      0,
    )
  if zlib.crc32(body) != header.get("crc32"):
    raise JournalDamageError(
      f"Dispatcher snapshot {path} is damaged: its checksum does "
      f"not match ({len(body)} bytes after the header).",
      path,
      len(header_line) + 1,
    )
  records = [json.loads(line) for line in body.splitlines()]
  if len(records) != header.get("records") or not isinstance(header.get("journal"), int):
    raise JournalDamageError(
      f"Dispatcher snapshot {path} holds {len(records)} records; "
      f"its header says {header.get('records')}.",
      path,
      0,
    )
  offsets, offset = [], len(header_line) + 1
  for line in body.splitlines(keepends=True):
    offsets.append(offset)
    offset += len(line)
  return Snapshot(header["journal"], records, offsets, legacy=True)
