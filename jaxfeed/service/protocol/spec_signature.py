"""Signatures of pipeline definitions (`DatasetDef`) with the deployment's
shared secret, which a spec that ships pickled UDFs needs.

A signature covers every field of the spec, the key id of the secret and an
expiry time (HMAC-SHA256), so a signed spec can be neither altered nor
registered again after it expired. It is checked before anything in the
spec is unpickled.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
import time

from jaxfeed.service.protocol.import_paths import SpecError
from jaxfeed.service.protocol.protos import service_pb2

SPEC_TTL_S = 600.0  # how long a signed spec may be registered after signing
_SIGNATURE_MAGIC = b"JFS2"
_SIGNATURE_HEAD = struct.Struct("<4sB")
_EXPIRY = struct.Struct("<q")
_UNSIGNED_FIELDS = ("signature",)


def key_id(secret: bytes) -> str:
  """A public name of a secret: tells which key signed a spec, reveals nothing."""
  return hashlib.sha256(b"jaxfeed spec key id\0" + secret).hexdigest()[:16]


def _canonical_fields(dataset_def: service_pb2.DatasetDef) -> bytes:
  """Every field but the signature, each tagged with its number and length, so
  that a field added to DatasetDef later is covered without a change here."""
  parts = []
  for field in sorted(dataset_def.DESCRIPTOR.fields, key=lambda f: f.number):
    if field.name in _UNSIGNED_FIELDS:
      continue
    value = getattr(dataset_def, field.name)
    values = list(value) if field.is_repeated else [value]
    encoded = []
    for v in values:
      if isinstance(v, bytes):
        encoded.append(v)
      elif isinstance(v, str):
        encoded.append(v.encode())
      elif hasattr(v, "SerializeToString"):
        encoded.append(v.SerializeToString(deterministic=True))
      else:
        encoded.append(repr(v).encode())
    parts.append(struct.pack("<IQ", field.number, len(encoded)))
    parts.extend(struct.pack("<Q", len(e)) + e for e in encoded)
  return b"".join(parts)


def _mac(secret: bytes, head: bytes, dataset_def: service_pb2.DatasetDef) -> bytes:
  return hmac.new(secret, head + _canonical_fields(dataset_def), hashlib.sha256).digest()


def sign(
  dataset_def: service_pb2.DatasetDef,
  secret: bytes,
  ttl_s: float = SPEC_TTL_S,
  now: float | None = None,
) -> bytes:
  """A signature over every field of the spec, the key id and an expiry time."""
  kid = key_id(secret).encode()
  expires = int((time.time() if now is None else now) + ttl_s)
  head = _SIGNATURE_HEAD.pack(_SIGNATURE_MAGIC, len(kid)) + kid + _EXPIRY.pack(expires)
  return head + _mac(secret, head, dataset_def)


def check_signature(
  dataset_def: service_pb2.DatasetDef,
  secret: bytes | None,
  check_expiry: bool = True,
  now: float | None = None,
) -> None:
  """Raises SpecError unless the spec's signature (if any) is valid.

  A spec that ships pickled UDFs must be signed with this deployment's
  secret; one without them may be unsigned.

  Args:
    dataset_def: the spec.
    secret: the deployment's secret; None refuses pickled UDFs.
    check_expiry: refuse a signature past its expiry time (the dispatcher
      does when a spec is registered; workers get specs only from it).
    now: the current Unix time (tests).
  """
  name = f"Dataset {dataset_def.fingerprint!r}"
  if dataset_def.pickled_udfs and not secret:
    raise SpecError(
      f"{name} ships {len(dataset_def.pickled_udfs)} pickled UDF(s), but this "
      "deployment does not accept pickled UDFs (no pickled_udf_secret "
      "configured). Use UDFs importable as module:qualname."
    )
  if not secret or (not dataset_def.signature and not dataset_def.pickled_udfs):
    return
  signature = dataset_def.signature
  head_size = _SIGNATURE_HEAD.size
  if len(signature) < head_size or signature[:4] != _SIGNATURE_MAGIC:
    raise SpecError(
      f"{name} has no valid signature (pickled UDFs must be signed "
      "with the deployment's secret); refusing it."
    )
  kid_size = signature[4]
  body = head_size + kid_size + _EXPIRY.size
  if len(signature) != body + hashlib.sha256().digest_size:
    raise SpecError(f"{name}: malformed signature of {len(signature)} bytes; refusing it.")
  kid = signature[head_size : head_size + kid_size].decode("ascii", "replace")
  if kid != key_id(secret):
    raise SpecError(
      f"{name}: its HMAC signature is by key id {kid!r}, but this "
      f"deployment's secret has key id {key_id(secret)!r}; refusing it."
    )
  if not hmac.compare_digest(_mac(secret, signature[:body], dataset_def), signature[body:]):
    raise SpecError(
      f"{name}: the HMAC signature does not match the spec (altered after signing); refusing it."
    )
  (expires,) = _EXPIRY.unpack(signature[body - _EXPIRY.size : body])
  current = time.time() if now is None else now
  if check_expiry and current > expires:
    raise SpecError(
      f"{name}: the signature expired {current - expires:.0f} s ago (signed "
      f"specs are valid for {SPEC_TTL_S:g} s after signing, so that a copy "
      "cannot be registered again later); sign it again."
    )
