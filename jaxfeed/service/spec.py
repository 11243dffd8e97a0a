"""Pipeline definitions as they travel to workers (`DatasetDef`).

A graph is encoded as JSON: every node by its class path, its `spec_params()`
and its parents. Parameter values are encoded by kind:

- JSON scalars as themselves; tuples, lists and dicts tagged so they come back
  as the same container types;
- numpy arrays (and numpy scalars) in a side table sent in the frame format of
  `jaxfeed.service.wire` (header plus raw bytes, never pickle);
- numpy dtypes by name;
- callables by import path `module:qualname`; lambdas, closures and local
  functions have none, so they are refused unless the deployment enables
  pickled UDFs and the client signs them with the shared secret (HMAC-SHA256,
  checked before anything is unpickled);
- sources, samplers and other objects with `spec_params()` by class path and
  their own params; nested datasets as nested graphs.
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
      return {"__object__": object_path(type(value)),
              "params": {k: self.value(v, f"{where}.{k}") for k, v in params.items()}}
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
      return {"__callable__": path}
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
      pickled_udfs=encoder.pickled,
      fingerprint=node.fingerprint())
  if udf_secret:
    dataset_def.signature = sign(dataset_def, udf_secret)
  return dataset_def


NodeRewrite = Callable[[type, dict], "tuple[type, dict]"]


# How deep a spec may nest (ops on ops, containers in containers): deeper
# than the encoder can produce. Python's recursion limit may still stop a
# spec of nested containers earlier; from_dataset_def turns that into a
# SpecError too.
MAX_SPEC_DEPTH = 500


def _want(ok: bool, what: str, enc: Any, allowed: str) -> None:
  if not ok:
    raise SpecError(f"Pipeline spec has a malformed {what}: {enc!r:.100} ({allowed}).")


class _Decoder:
  """Rebuilds a graph from a DatasetDef; every part of the spec is checked
  before it is used, so a malformed spec raises SpecError."""

  def __init__(self, dataset_def: service_pb2.DatasetDef, secret: bytes | None,
               rewrite: NodeRewrite | None):
    check_signature(dataset_def, secret)
    self.arrays = []
    if dataset_def.arrays:
      try:
        self.arrays = wire.decode(dataset_def.arrays)
      except wire.WireFormatError as e:
        raise SpecError(f"Pipeline spec's array table is not valid: {e}") from e
      _want(isinstance(self.arrays, list), "array table", type(self.arrays),
            "want a list of arrays")
    self.pickled = list(dataset_def.pickled_udfs)
    self.rewrite = rewrite
    self._depth = 0

  def _enter(self) -> None:
    self._depth += 1
    if self._depth > MAX_SPEC_DEPTH:
      raise SpecError(f"Pipeline spec nests deeper than {MAX_SPEC_DEPTH} levels.")

  def node(self, spec: Any) -> base.Node:
    _want(isinstance(spec, dict) and isinstance(spec.get("class"), str)
          and isinstance(spec.get("params"), dict) and isinstance(spec.get("parents"), list),
          "op node", spec, "want {'class': str, 'params': dict, 'parents': list}")
    self._enter()
    try:
      cls = resolve_path(spec["class"])
      if not (isinstance(cls, type) and issubclass(cls, base.Node)):
        raise SpecError(f"{spec['class']!r} is not a jaxfeed op node class.")
      params = {k: self.value(v) for k, v in spec["params"].items()}
      if self.rewrite is not None:
        cls, params = self.rewrite(cls, params)
      parents = [self.node(p) for p in spec["parents"]]
    finally:
      self._depth -= 1
    try:
      return cls(*parents, **params)
    except Exception as e:
      raise SpecError(f"Cannot rebuild op {spec.get('op')!r:.80} "
                      f"({spec['class']}) from its spec: {e}") from e

  def value(self, enc: Any) -> Any:
    if not isinstance(enc, (list, dict)):
      return enc
    self._enter()
    try:
      if isinstance(enc, list):
        return [self.value(v) for v in enc]
      return self._tagged(enc)
    finally:
      self._depth -= 1

  def _tagged(self, enc: dict) -> Any:
    if len(enc) != 1:
      _want(set(enc) == {"__object__", "params"} and isinstance(enc["__object__"], str)
            and isinstance(enc["params"], dict), "object", enc,
            "want {'__object__': 'module:qualname', 'params': dict}")
      cls = resolve_path(enc["__object__"])
      if not (isinstance(cls, type) and hasattr(cls, "spec_params")):
        raise SpecError(f"{enc['__object__']!r} is not a class with spec_params().")
      params = {k: self.value(v) for k, v in enc["params"].items()}
      try:
        return cls(**params)
      except Exception as e:
        raise SpecError(f"Cannot rebuild {enc['__object__']} from its spec: {e}") from e
    (tag, body), = enc.items()
    if tag in ("__array__", "__pickled__"):
      table = self.arrays if tag == "__array__" else self.pickled
      _want(isinstance(body, int) and not isinstance(body, bool) and 0 <= body < len(table),
            tag, enc, f"want an index into the {len(table)} entries sent")
      if tag == "__array__":
        return np.array(table[body])  # writable copy owned by the op
      import cloudpickle  # pylint: disable=g-import-not-at-top  # noqa: F401
      import pickle  # pylint: disable=g-import-not-at-top
      return pickle.loads(table[body])  # signature checked in __init__
    if tag == "__dtype__":
      try:
        return wire.dtype_from_str(body)
      except wire.WireFormatError as e:
        raise SpecError(f"Pipeline spec has an invalid dtype: {e}") from e
    if tag == "__bytes__":
      _want(isinstance(body, str), tag, enc, "want a hex string")
      try:
        return bytes.fromhex(body)
      except ValueError as e:
        raise SpecError(f"Pipeline spec has malformed hex bytes: {e}") from e
    if tag == "__tuple__":
      _want(isinstance(body, list), tag, enc, "want a list")
      return tuple(self.value(v) for v in body)
    if tag == "__dict__":
      _want(isinstance(body, list) and all(isinstance(kv, list) and len(kv) == 2
                                           for kv in body), tag, enc,
            "want a list of [key, value] pairs")
      items = [(self._key(self.value(k)), self.value(v)) for k, v in body]
      try:
        return dict(items)
      except TypeError as e:
        raise SpecError(f"Pipeline spec has a dict key that is not hashable: {e}") from e
    if tag == "__node__":
      return self.node(body)
    if tag == "__dataset__":
      from jaxfeed.dataset import Dataset  # pylint: disable=g-import-not-at-top
      return Dataset(self.node(body))
    if tag == "__callable__":
      fn = resolve_path(body)
      if not callable(fn):
        raise SpecError(f"Import path {body!r} names a {type(fn).__name__}, not a callable.")
      return fn
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
  except (ValueError, RecursionError) as e:  # too deep a nesting recurses too far
    raise SpecError(f"Pipeline spec is not valid JSON: {e}") from e
  try:
    return _Decoder(dataset_def, udf_secret, rewrite).node(graph)
  except RecursionError as e:
    raise SpecError(f"Pipeline spec nests too deeply to rebuild: {e}") from e
