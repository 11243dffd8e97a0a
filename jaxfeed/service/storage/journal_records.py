"""The fields of the dispatcher's journal records, checked before one is applied.

A record read back from the journal may be damaged or hand-edited. Applying
it unchecked could stop the replay half-way through a record, or worse, store
a value of the wrong type that breaks a request much later. `check_record`
rejects such a record first, naming the record and the bad field.
"""

from __future__ import annotations

import base64
import binascii
from typing import Any, Callable, Container

from google.protobuf import message as pb_message

from jaxfeed.service.protocol import target_workers
from jaxfeed.service.protocol import wire
from jaxfeed.service.protocol.protos import service_pb2 as pb
from jaxfeed.service.protocol.sharding import ShardingPolicy


class JournalRecordError(ValueError):
  """A journal record lacks a field, has one of the wrong type, or names an
  unknown job."""


_is_int = wire.is_int


def _is_id(value: Any) -> bool:  # dataset ids are journaled as digit strings
  return _is_int(value) or (isinstance(value, str) and value.isdigit())


def _is_number(value: Any) -> bool:
  return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_str(value: Any) -> bool:
  return isinstance(value, str)


def _is_bool(value: Any) -> bool:
  return isinstance(value, bool)


def _is_policy(value: Any) -> bool:
  return isinstance(value, str) and value in {p.value for p in ShardingPolicy}


def _is_dataset_def(value: Any) -> bool:
  try:
    pb.DatasetDef.FromString(base64.b64decode(value, validate=True))
  except (TypeError, binascii.Error, pb_message.DecodeError):
    return False
  return True


def _list_of(item: Callable[[Any], bool]) -> Callable[[Any], bool]:
  return lambda value: isinstance(value, list) and all(item(v) for v in value)


def _pair(first: Callable[[Any], bool], second: Callable[[Any], bool]) -> Callable[[Any], bool]:
  return lambda v: isinstance(v, list) and len(v) == 2 and first(v[0]) and second(v[1])


_JOB_TASK = {"job_id": _is_int, "task_id": _is_int}
# kind -> ({field: check} of required fields, {field: check} of optional ones)
_FIELDS: dict[str, tuple[dict, dict]] = {
  "dataset": ({"dataset_id": _is_str, "def": _is_dataset_def}, {}),
  "job": (
    {
      "id": _is_int,
      "dataset_id": _is_str,
      "policy": _is_policy,
      "job_name": _is_str,
      "num_consumers": _is_int,
      "num_positions": _is_int,
    },
    {
      "round_timeout_s": _is_number,
      "exactly_once": _is_bool,
      "ephemeral_sharing": _is_bool,
      "skip": _list_of(_pair(_is_int, _is_int)),
      "identical_worker_streams": _is_bool,
      "resume_orders": _list_of(_is_int),
      "target_workers": lambda v: v in target_workers.TARGET_WORKERS,
    },
  ),
  "fix_workers": ({"job_id": _is_int, "workers": _list_of(_pair(_is_str, _is_int))}, {}),
  "task": (
    {
      "id": _is_int,
      "job_id": _is_int,
      "worker_address": _is_str,
      "worker_index": _is_int,
      "num_workers": _is_int,
    },
    {},
  ),
  "task_finished": (_JOB_TASK, {}),
  "task_lost": (_JOB_TASK, {}),
  "client": ({"id": _is_int, "job_id": _is_int}, {"consumer_index": _is_int, "process": _is_str}),
  "client_released": ({"job_id": _is_int, "client_id": _is_int}, {}),
  "job_deleted": ({"job_id": _is_int}, {}),
  "splits": ({"job_id": _is_int, "next_position": _is_int}, {}),
  "splits_issued": ({**_JOB_TASK, "ranges": _list_of(_pair(_is_int, _is_int))}, {}),
  "splits_acked": ({"job_id": _is_int, "starts": _list_of(_is_int)}, {}),
  "splits_failed": (
    {
      "job_id": _is_int,
      "ranges": _list_of(_pair(_is_int, _is_int)),
      "worker": _is_str,
      "how": _is_str,
    },
    {},
  ),
  "split_poisoned": ({"job_id": _is_int, "start": _is_int, "stop": _is_int, "error": _is_str}, {}),
  "incarnation": ({"id": _is_int}, {}),
}
# Records of these kinds may name a job that is gone (they change nothing then).
_MAY_NAME_A_GONE_JOB = frozenset({"job_deleted"})


def check_record(record: Any, jobs: Container[int]) -> None:
  """Raises JournalRecordError unless `record` is a well-formed record whose
  job (if it names one) is among `jobs`. Kinds it does not know pass: the
  dispatcher refuses those itself."""
  if not isinstance(record, dict) or not isinstance(record.get("kind"), str):
    raise JournalRecordError(f"Journal record {record!r:.200} is not a JSON object with a 'kind'.")
  kind = record["kind"]
  if "id" in record and not _is_id(record["id"]):
    raise JournalRecordError(
      f"Journal record {record!r:.200} has id {record['id']!r:.40}; want an integer."
    )
  required, optional = _FIELDS.get(kind, ({}, {}))
  for name in required:
    if name not in record:
      raise JournalRecordError(
        f"Journal record {record!r:.200} of kind {kind!r} lacks its field {name!r}."
      )
  for name, check in {**required, **optional}.items():
    if name in record and not check(record[name]):
      raise JournalRecordError(
        f"Journal record {record!r:.200} of kind {kind!r} has "
        f"a malformed field {name!r}: {record[name]!r:.80}."
      )
  if "job_id" in required and kind not in _MAY_NAME_A_GONE_JOB and record["job_id"] not in jobs:
    raise JournalRecordError(
      f"Journal record {record!r:.200} names job "
      f"{record['job_id']}, which no earlier record created."
    )
