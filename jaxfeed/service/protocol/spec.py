"""Pipeline definitions as they travel to workers (`DatasetDef`).

A graph is encoded as JSON: every node by its class path, its `spec_params()`
and its parents. Parameter values are encoded by kind:

- JSON scalars as themselves; tuples, lists and dicts tagged so they come back
  as the same container types;
- numpy arrays (and numpy scalars) in a side table sent in the frame format of
  `jaxfeed.service.protocol.wire` (header plus raw bytes, never pickle);
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
shared jobs and ephemeral sharing) by it, whatever fingerprint a client
claims. A Dataset's `jaxfeed.Options` travel with it (the root of the graph)
but are left out of the hash: they change how a pipeline runs, never its
elements.

Where a spec is rebuilt (workers) or registered (the dispatcher), every import
path must lie in an allowed module (see `import_paths`), and a spec with
pickled UDFs must carry a valid signature (see `spec_signature`).
"""

from __future__ import annotations

import hashlib
import json
import struct
from typing import Any, Callable, Sequence

import numpy as np

from jaxfeed.dataset import Dataset
from jaxfeed.ops import base
from jaxfeed.ops import fingerprint as fingerprint_lib
from jaxfeed.service.protocol import wire
from jaxfeed.service.protocol.import_paths import (
  SpecError,
  UDFImportError,
  check_spec_paths,
  object_path,
  resolve_path,
)
from jaxfeed.service.protocol.protos import service_pb2
from jaxfeed.service.protocol.spec_signature import check_signature, sign


def _is_dtype_like(value: Any) -> bool:
  return isinstance(value, np.dtype) or (isinstance(value, type) and issubclass(value, np.generic))


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
      raise SpecError(
        f"Op {node.op_name!r} ({object_path(cls)}) cannot list its spec_params(): {e}"
      ) from e
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
      return {"__dict__": [[self.value(k, where), self.value(v, where)] for k, v in value.items()]}
    if isinstance(value, base.Node):
      return {"__node__": self.node(value)}
    if isinstance(getattr(value, "node", None), base.Node):
      return {"__dataset__": self.node(value.node)}
    if hasattr(value, "spec_params") and not isinstance(value, type):
      params = value.spec_params()
      encoded = {
        "__object__": object_path(type(value)),
        "params": {k: self.value(v, f"{where}.{k}") for k, v in params.items()},
      }
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
      "spec_params() and importable callables."
    )

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
      "udf_secret=..."
    )


def to_dataset_def(
  node: base.Node,
  udf_secret: bytes | None = None,
  num_positions: int = 0,
  positions_are_files: bool = False,
) -> service_pb2.DatasetDef:
  """Encodes a graph; with udf_secret, unimportable UDFs are pickled and the
  spec (num_positions and positions_are_files included) is signed."""
  encoder = _Encoder(pickle_udfs=bool(udf_secret))
  graph = encoder.node(node)
  dataset_def = service_pb2.DatasetDef(
    graph_json=json.dumps(graph, sort_keys=True).encode(),
    arrays=bytes(wire.encode(encoder.arrays)),
    pickled_udfs=encoder.pickled,
    num_positions=num_positions,
    positions_are_files=positions_are_files,
  )
  dataset_def.fingerprint = fingerprint(dataset_def)
  if udf_secret:
    dataset_def.signature = sign(dataset_def, udf_secret)
  return dataset_def


# The root a client ships a Dataset's Options in (`task_pipeline.WithOptionsNode`).
_WITH_OPTIONS_CLASS = "jaxfeed.service.worker.task_pipeline:WithOptionsNode"
# The class paths of the service's own nodes before its modules moved into
# folders, by their path now: a dispatcher's journal may hold specs that
# name them, and they rebuild (and fingerprint) as the same nodes.
_MOVED_CLASSES = {
  "jaxfeed.service.task_pipeline:WithOptionsNode": _WITH_OPTIONS_CLASS,
  "jaxfeed.service.client:DistributedNode": "jaxfeed.service.client.distribute:DistributedNode",
}


def _current_class_path(path: Any) -> Any:
  """A node's class path as of now: `path`, or where its class moved to."""
  return _MOVED_CLASSES.get(path, path) if isinstance(path, str) else path


def _computed_graph(graph_json: bytes) -> bytes:
  """The graph JSON without the Options root: the same bytes as the graph of
  the same pipeline without Options."""
  try:
    graph = json.loads(graph_json)
  except (ValueError, RecursionError):
    return graph_json  # refused where the graph is decoded
  if (
    isinstance(graph, dict)
    and _current_class_path(graph.get("class")) == _WITH_OPTIONS_CLASS
    and isinstance(graph.get("parents"), list)
    and len(graph["parents"]) == 1
  ):
    return json.dumps(graph["parents"][0], sort_keys=True).encode()
  return graph_json


def fingerprint(dataset_def: service_pb2.DatasetDef) -> str:
  """A hash of everything in a DatasetDef that decides the pipeline's output.

  The graph JSON (which carries each import-path UDF's code hash and each
  source's content identity) less the pipeline's `jaxfeed.Options` (all of
  them change how it runs, none its elements), the arrays, the pickled
  UDFs' bytes and the number of positions; not the signature, nor the
  `fingerprint` field a client may have set.
  """
  digest = hashlib.sha256(b"jaxfeed.DatasetDef/1")
  parts = [
    _computed_graph(dataset_def.graph_json),
    dataset_def.arrays,
    *dataset_def.pickled_udfs,
    str(dataset_def.num_positions).encode(),
  ]
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
      "same jaxfeed version on clients and workers."
    )
  if fingerprint_lib.digest(fn) != code:
    module = path.split(":", 1)[0]
    raise UDFImportError(
      f"UDF {path!r} on this worker is not the code the client sent: client "
      f"and worker run different versions of module {module!r} (or of a "
      "module, package or Python it uses, or module-level values it reads "
      "differ). Deploy the same code on clients and workers."
    )


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

  def __init__(
    self,
    dataset_def: service_pb2.DatasetDef,
    secret: bytes | None,
    rewrite: NodeRewrite | None,
    udf_modules: Sequence[str],
  ):
    check_signature(dataset_def, secret, check_expiry=False)
    self.udf_modules = udf_modules
    self.arrays = []
    if dataset_def.arrays:
      try:
        self.arrays = wire.decode(dataset_def.arrays)
      except wire.WireFormatError as e:
        raise SpecError(f"Pipeline spec's array table is not valid: {e}") from e
      _want(
        isinstance(self.arrays, list), "array table", type(self.arrays), "want a list of arrays"
      )
    self.pickled = list(dataset_def.pickled_udfs)
    self.rewrite = rewrite
    self._depth = 0

  def _enter(self) -> None:
    self._depth += 1
    if self._depth > MAX_SPEC_DEPTH:
      raise SpecError(f"Pipeline spec nests deeper than {MAX_SPEC_DEPTH} levels.")

  def node(self, spec: Any) -> base.Node:
    _want(
      isinstance(spec, dict)
      and isinstance(spec.get("class"), str)
      and isinstance(spec.get("params"), dict)
      and isinstance(spec.get("parents"), list),
      "op node",
      spec,
      "want {'class': str, 'params': dict, 'parents': list}",
    )
    self._enter()
    try:
      cls = resolve_path(_current_class_path(spec["class"]), self.udf_modules, is_class=True)
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
      raise SpecError(
        f"Cannot rebuild op {spec.get('op')!r:.80} ({spec['class']}) from its spec: {e}"
      ) from e

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
      # "content" (what identifies an object's data, for fingerprints) is
      # not needed to rebuild it.
      _want(
        set(enc) - {"content"} == {"__object__", "params"}
        and isinstance(enc["__object__"], str)
        and isinstance(enc["params"], dict),
        "object",
        enc,
        "want {'__object__': 'module:qualname', 'params': dict}",
      )
      cls = resolve_path(enc["__object__"], self.udf_modules, is_class=True)
      if not (isinstance(cls, type) and hasattr(cls, "spec_params")):
        raise SpecError(f"{enc['__object__']!r} is not a class with spec_params().")
      params = {k: self.value(v) for k, v in enc["params"].items()}
      try:
        return cls(**params)
      except Exception as e:
        raise SpecError(f"Cannot rebuild {enc['__object__']} from its spec: {e}") from e
    ((tag, body),) = enc.items()
    if tag in ("__array__", "__pickled__"):
      table = self.arrays if tag == "__array__" else self.pickled
      _want(
        isinstance(body, int) and not isinstance(body, bool) and 0 <= body < len(table),
        tag,
        enc,
        f"want an index into the {len(table)} entries sent",
      )
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
      _want(
        isinstance(body, list) and all(isinstance(kv, list) and len(kv) == 2 for kv in body),
        tag,
        enc,
        "want a list of [key, value] pairs",
      )
      items = [(self._key(self.value(k)), self.value(v)) for k, v in body]
      try:
        return dict(items)
      except TypeError as e:
        raise SpecError(f"Pipeline spec has a dict key that is not hashable: {e}") from e
    if tag == "__node__":
      return self.node(body)
    if tag == "__dataset__":
      return Dataset(self.node(body))
    if tag == "__callable__":
      path, code = (body.get("path"), body.get("code")) if isinstance(body, dict) else (body, None)
      fn = resolve_path(path, self.udf_modules)
      if not callable(fn):
        raise SpecError(f"Import path {path!r} names a {type(fn).__name__}, not a callable.")
      _check_code(path, code, fn)
      return fn
    raise SpecError(f"Unknown value tag in pipeline spec: {enc!r:.80}.")

  @staticmethod
  def _key(key: Any) -> Any:
    return key if not isinstance(key, list) else tuple(key)


def from_dataset_def(
  dataset_def: service_pb2.DatasetDef,
  udf_secret: bytes | None = None,
  rewrite: NodeRewrite | None = None,
  udf_modules: Sequence[str] = (),
) -> base.Node:
  """Rebuilds the graph of a DatasetDef (verifying paths and pickles first).

  Args:
    dataset_def: the encoded pipeline.
    udf_secret: the deployment's shared secret, or None to refuse pickled UDFs.
    rewrite: called as rewrite(node_class, params) -> (node_class, params)
      before each node is built (the service uses it to shard samplers).
    udf_modules: modules allowed beyond `import_paths.DEFAULT_UDF_MODULES`
      (see `import_paths.check_udf_modules`); every import path of the spec
      is checked before any module is imported.

  Returns:
    The root node.
  """
  try:
    graph = json.loads(dataset_def.graph_json)
  except (ValueError, RecursionError) as e:  # too deep a nesting recurses too far
    raise SpecError(f"Pipeline spec is not valid JSON: {e}") from e
  check_spec_paths(dataset_def, udf_modules)
  try:
    return _Decoder(dataset_def, udf_secret, rewrite, udf_modules).node(graph)
  except RecursionError as e:
    raise SpecError(f"Pipeline spec nests too deeply to rebuild: {e}") from e
