"""Pipeline definitions as they travel to workers (`DatasetDef`).

A graph is encoded as JSON: every node by its class path, its `spec_params()`
and its parents. Parameter values are encoded by kind:

- JSON scalars as themselves; tuples, lists and dicts tagged so they come back
  as the same container types;
- numpy arrays (and numpy scalars) in a side table sent in the frame format of
  `jaxfeed.service.wire` (header plus raw bytes, never pickle);
- numpy dtypes by name;
- callables by import path `module:qualname` plus the hash of their code
  (`jaxfeed.ops.fingerprint.digest`), which the worker checks after importing
  them; lambdas, closures and local functions have no import path, so they
  are refused unless the deployment enables pickled UDFs and the client signs
  them with the shared secret (HMAC-SHA256, checked before anything is
  unpickled);
- sources, samplers and other objects with `spec_params()` by class path,
  their own params and their `fingerprint_params()` (what identifies their
  records, e.g. file sizes and modification times); nested datasets as nested
  graphs.

Everything that decides a pipeline's output is thus in the spec's bytes, and
`fingerprint(dataset_def)` hashes them: the dispatcher keys datasets (and so
ephemeral sharing) by it, whatever fingerprint a client claims.
"""

from __future__ import annotations

import hashlib
import hmac
import importlib
import json
import struct
from typing import Any, Callable

import numpy as np

from jaxfeed.ops import base
from jaxfeed.ops import fingerprint as fingerprint_lib
from jaxfeed.service import wire
from jaxfeed.service.protos import service_pb2


class SpecError(ValueError):
  """A pipeline cannot be encoded for, or rebuilt on, a service worker."""


class UDFImportError(SpecError):
  """A UDF's import path does not resolve where the pipeline is rebuilt."""


def object_path(obj: Any) -> str:
  return f"{obj.__module__}:{obj.__qualname__}"


def resolve_path(path: str) -> Any:
  """Imports `module:qualname` and returns the object."""
  if not isinstance(path, str) or ":" not in path:
    raise UDFImportError(f"Import path {path!r} is not of the form 'module:qualname'.")
  module_name, qualname = path.split(":", 1)
  try:
    value = importlib.import_module(module_name)
  except ImportError as e:
    raise UDFImportError(
        f"Cannot import module {module_name!r} of {path!r} on this host: {e}. "
        "Install the module on every service worker (or put it on PYTHONPATH)."
    ) from e
  for part in qualname.split("."):
    try:
      value = getattr(value, part)
    except AttributeError as e:
      raise UDFImportError(
          f"Module {module_name!r} has no attribute {qualname!r} (import path "
          f"{path!r}) on this host.") from e
  return value


def _is_dtype_like(value: Any) -> bool:
  return isinstance(value, np.dtype) or (
      isinstance(value, type) and issubclass(value, np.generic))


class _Encoder:
  """Encodes one graph; collects arrays and pickled UDFs on the side."""

  def __init__(self, pickle_udfs: bool):
    self.arrays: list[np.ndarray] = []
    self.pickled: list[bytes] = []
    self.pickle_udfs = pickle_udfs

  def node(self, node: base.Node) -> dict:
    cls = type(node)
    try:
      params = node.spec_params()
    except Exception as e:
      raise SpecError(f"Op {node.op_name!r} ({object_path(cls)}) cannot list "
                      f"its spec_params(): {e}") from e
    return {
        "class": object_path(cls),
        "op": node.op_name,
        "params": {k: self.value(v, f"{node.op_name}.{k}") for k, v in params.items()},
        "parents": [self.node(p) for p in node.parents],
    }

  def value(self, value: Any, where: str) -> Any:
    if value is None or isinstance(value, (bool, str)):
      return value
    if isinstance(value, (int, float)):
      return value
    if isinstance(value, (np.ndarray, np.generic)):
      self.arrays.append(np.asarray(value))
      return {"__array__": len(self.arrays) - 1}
    if _is_dtype_like(value):
      return {"__dtype__": np.dtype(value).str}
    if isinstance(value, bytes):
      return {"__bytes__": value.hex()}
    if isinstance(value, tuple):
      return {"__tuple__": [self.value(v, where) for v in value]}
    if isinstance(value, list):
      return [self.value(v, where) for v in value]
    if isinstance(value, dict):
      return {"__dict__": [[self.value(k, where), self.value(v, where)]
                           for k, v in value.items()]}
    if isinstance(value, base.Node):
      return {"__node__": self.node(value)}
    if isinstance(getattr(value, "node", None), base.Node):
      return {"__dataset__": self.node(value.node)}
    if hasattr(value, "spec_params") and not isinstance(value, type):
      params = value.spec_params()
      encoded = {"__object__": object_path(type(value)),
                 "params": {k: self.value(v, f"{where}.{k}") for k, v in params.items()}}
      content = getattr(value, "fingerprint_params", None)
      if content is not None:  # part of the fingerprint; not rebuilt from
        encoded["content"] = self.value(content(), f"{where}.fingerprint_params")
      return encoded
    if callable(value):
      return self.callable(value, where)
    raise SpecError(
        f"Parameter {where} = {value!r:.80} of type {type(value).__name__} "
        "cannot travel to service workers: allowed are JSON scalars, "
        "containers, numpy arrays and dtypes, datasets, objects with "
        "spec_params() and importable callables.")

  def callable(self, fn: Callable, where: str) -> dict:
    path = None
    module = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", None)
    if module and qualname and "<" not in qualname and module != "__main__":
      path = f"{module}:{qualname}"
      try:
        found = resolve_path(path)
      except UDFImportError:
        found = None
      if found is not fn:
        path = None
    if path is not None:
      return {"__callable__": {"path": path, "code": fingerprint_lib.digest(fn)}}
    if self.pickle_udfs:
      try:
        import cloudpickle  # pylint: disable=g-import-not-at-top
      except ImportError as e:
        raise SpecError("Shipping pickled UDFs needs the cloudpickle package.") from e
      self.pickled.append(cloudpickle.dumps(fn))
      return {"__pickled__": len(self.pickled) - 1}
    raise SpecError(
        f"UDF {where} = {fn!r:.80} has no import path that workers can resolve "
        f"(module {module!r}, qualname {qualname!r}). Lambdas, closures, local "
        "functions and functions of __main__ cannot travel to service "
        "workers: move the function to module level in a module the workers "
        "can import, or enable signed pickled UDFs on the deployment and pass "
        "udf_secret=...")


def _signed_bytes(dataset_def: service_pb2.DatasetDef) -> bytes:
  parts = [dataset_def.graph_json, dataset_def.arrays, *dataset_def.pickled_udfs]
  return b"".join(struct.pack("<Q", len(p)) + p for p in parts)


def sign(dataset_def: service_pb2.DatasetDef, secret: bytes) -> bytes:
  return hmac.new(secret, _signed_bytes(dataset_def), hashlib.sha256).digest()


def check_signature(dataset_def: service_pb2.DatasetDef,
                    secret: bytes | None) -> None:
  """Raises SpecError unless pickled UDFs are allowed and correctly signed."""
  if not dataset_def.pickled_udfs:
    return
  if not secret:
    raise SpecError(
        f"Dataset {dataset_def.fingerprint!r} ships "
        f"{len(dataset_def.pickled_udfs)} pickled UDF(s), but this deployment "
        "does not accept pickled UDFs (no pickled_udf_secret configured). Use "
        "UDFs importable as module:qualname.")
  if not hmac.compare_digest(sign(dataset_def, secret), dataset_def.signature):
    raise SpecError(
        f"Dataset {dataset_def.fingerprint!r} ships pickled UDF(s) without a "
        "valid HMAC signature of the deployment's shared secret; refusing to "
        "unpickle them.")


def to_dataset_def(node: base.Node, udf_secret: bytes | None = None
                   ) -> service_pb2.DatasetDef:
  """Encodes a graph; with udf_secret, unimportable UDFs are pickled and signed."""
  encoder = _Encoder(pickle_udfs=bool(udf_secret))
  graph = encoder.node(node)
  dataset_def = service_pb2.DatasetDef(
      graph_json=json.dumps(graph, sort_keys=True).encode(),
      arrays=bytes(wire.encode(encoder.arrays)),
      pickled_udfs=encoder.pickled)
  dataset_def.fingerprint = fingerprint(dataset_def)
  if udf_secret:
    dataset_def.signature = sign(dataset_def, udf_secret)
  return dataset_def


def fingerprint(dataset_def: service_pb2.DatasetDef) -> str:
  """A hash of everything in a DatasetDef that decides the pipeline's output.

  The graph JSON (which carries each import-path UDF's code hash and each
  source's content identity), the arrays, the pickled UDFs' bytes and the
  number of positions; not the signature, nor the `fingerprint` field a
  client may have set.
  """
  digest = hashlib.sha256(b"jaxfeed.DatasetDef/1")
  parts = [dataset_def.graph_json, dataset_def.arrays, *dataset_def.pickled_udfs,
           str(dataset_def.num_positions).encode()]
  digest.update(struct.pack("<Q", len(parts)))
  for part in parts:
    digest.update(struct.pack("<Q", len(part)))
    digest.update(part)
  return digest.hexdigest()[:32]


NodeRewrite = Callable[[type, dict], "tuple[type, dict]"]


def _check_code(path: str, code: Any, fn: Callable) -> None:
  """Raises UDFImportError unless `fn` has the code the client hashed."""
  if not isinstance(code, str):
    raise UDFImportError(
        f"UDF {path!r} comes without the hash of its code (got {code!r:.80}); "
        "the client runs a jaxfeed version that does not send it. Use the "
        "same jaxfeed version on clients and workers.")
  if fingerprint_lib.digest(fn) != code:
    module = path.split(":", 1)[0]
    raise UDFImportError(
        f"UDF {path!r} on this worker is not the code the client sent: client "
        f"and worker run different versions of module {module!r} (or of a "
        "module, package or Python it uses, or module-level values it reads "
        "differ). Deploy the same code on clients and workers.")


class _Decoder:
  """Rebuilds a graph from a DatasetDef."""

  def __init__(self, dataset_def: service_pb2.DatasetDef, secret: bytes | None,
               rewrite: NodeRewrite | None):
    check_signature(dataset_def, secret)
    self.arrays = wire.decode(dataset_def.arrays) if dataset_def.arrays else []
    self.pickled = list(dataset_def.pickled_udfs)
    self.rewrite = rewrite

  def node(self, spec: dict) -> base.Node:
    cls = resolve_path(spec["class"])
    if not (isinstance(cls, type) and issubclass(cls, base.Node)):
      raise SpecError(f"{spec['class']!r} is not a jaxfeed op node class.")
    params = {k: self.value(v) for k, v in spec["params"].items()}
    if self.rewrite is not None:
      cls, params = self.rewrite(cls, params)
    parents = [self.node(p) for p in spec["parents"]]
    try:
      return cls(*parents, **params)
    except Exception as e:
      raise SpecError(f"Cannot rebuild op {spec.get('op')!r} "
                      f"({spec['class']}) from its spec: {e}") from e

  def value(self, enc: Any) -> Any:
    if isinstance(enc, list):
      return [self.value(v) for v in enc]
    if not isinstance(enc, dict):
      return enc
    (tag, body), = enc.items() if len(enc) == 1 else (("__object__", None),)
    if tag == "__array__":
      return np.array(self.arrays[body])  # writable copy owned by the op
    if tag == "__dtype__":
      return np.dtype(body)
    if tag == "__bytes__":
      return bytes.fromhex(body)
    if tag == "__tuple__":
      return tuple(self.value(v) for v in body)
    if tag == "__dict__":
      return {self._key(self.value(k)): self.value(v) for k, v in body}
    if tag == "__node__":
      return self.node(body)
    if tag == "__dataset__":
      from jaxfeed.dataset import Dataset  # pylint: disable=g-import-not-at-top
      return Dataset(self.node(body))
    if tag == "__callable__":
      path, code = (body.get("path"), body.get("code")) if isinstance(body, dict) else (body, None)
      fn = resolve_path(path)
      if not callable(fn):
        raise SpecError(f"Import path {path!r} names a {type(fn).__name__}, not a callable.")
      _check_code(path, code, fn)
      return fn
    if tag == "__pickled__":
      import cloudpickle  # pylint: disable=g-import-not-at-top  # noqa: F401
      import pickle  # pylint: disable=g-import-not-at-top
      return pickle.loads(self.pickled[body])  # signature checked in __init__
    if "__object__" in enc:
      cls = resolve_path(enc["__object__"])
      if not (isinstance(cls, type) and hasattr(cls, "spec_params")):
        raise SpecError(f"{enc['__object__']!r} is not a class with spec_params().")
      params = {k: self.value(v) for k, v in enc["params"].items()}
      try:
        return cls(**params)
      except Exception as e:
        raise SpecError(f"Cannot rebuild {enc['__object__']} from its spec: {e}") from e
    raise SpecError(f"Unknown value tag in pipeline spec: {enc!r:.80}.")

  @staticmethod
  def _key(key: Any) -> Any:
    return key if not isinstance(key, list) else tuple(key)


def from_dataset_def(dataset_def: service_pb2.DatasetDef,
                     udf_secret: bytes | None = None,
                     rewrite: NodeRewrite | None = None) -> base.Node:
  """Rebuilds the graph of a DatasetDef (verifying pickled UDFs first).

  Args:
    dataset_def: the encoded pipeline.
    udf_secret: the deployment's shared secret, or None to refuse pickled UDFs.
    rewrite: called as rewrite(node_class, params) -> (node_class, params)
      before each node is built (the service uses it to shard samplers).

  Returns:
    The root node.
  """
  try:
    graph = json.loads(dataset_def.graph_json)
  except ValueError as e:
    raise SpecError(f"Pipeline spec is not valid JSON: {e}") from e
  return _Decoder(dataset_def, udf_secret, rewrite).node(graph)
