"""Content hashes of op parameters, user functions included.

A graph fingerprint must say what a pipeline computes: equal fingerprints mean
equal output, in any process. So parameters are hashed by content, never by
`id()` or a function's name:

- scalars, strings, bytes, containers, numpy arrays and dtypes by value;
- graph nodes by their fingerprint (op name, params, parents); sources,
  samplers and other objects with `spec_params()` by class path, those params
  and their `fingerprint_params()` (file sizes and modification times);
  other objects with a `fingerprint()` method (bucket plans) by its result;
- Python functions by their code (bytecode, constants and nested code, names,
  argument layout), defaults, keyword defaults, attributes, closure cells and
  the globals the code names, recursively (a helper called through a global
  is hashed too); bound methods and `functools.partial` by function and
  bound values; classes by their methods and attributes;
- installed code (the standard library and site-packages), C functions and
  modules by `module:qualname` plus the package's `__version__`: they are
  the environment, not the pipeline.

Values a function reads from module state (the globals of a module function;
the defaults, cells and attributes of a function importable by
`module:qualname` or reached through module state) may change while the
program runs (counters, caches) and are set up by the module's own code on
every host, so mutable ones (dicts, lists, arrays, objects) are identified by
their type, not their current contents; immutable ones (numbers, strings,
tuples, frozen dataclasses, functions, classes) by value.

Everything else that cannot be hashed by content (an object of a C type in a
closure, a generator, ...) gets a random nonce, the same for the same object
while it lives in this process: pipelines holding such objects never share a
fingerprint with another process's, which costs sharing but never returns
another pipeline's data. Such fingerprints say so (`Fingerprint.reproducible`),
so that nothing is cached under a key no one can compute again.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import os
import site
import struct
import sys
import sysconfig
import types
import weakref
from typing import Any, Callable, Iterable, Sequence

import numpy as np

__all__ = ["Fingerprint", "digest", "node_fingerprint"]

_PYTHON = f"{sys.implementation.name}{sys.version_info[0]}.{sys.version_info[1]}"
_HEAPTYPE = 1 << 9  # Py_TPFLAGS_HEAPTYPE: a class defined in Python code
# Class attributes that say nothing about behaviour, or that hold
# interpreter bookkeeping objects whose content cannot be hashed.
_SKIPPED_CLASS_ATTRS = frozenset(
  {
    "__dict__",
    "__weakref__",
    "__module__",
    "__qualname__",
    "__doc__",
    "__annotations__",
    "__dataclass_fields__",
    "__dataclass_params__",
    "__parameters__",
    "__orig_bases__",
    "__abstractmethods__",
    "_abc_impl",
  }
)


class Fingerprint(str):
  """A graph fingerprint (32 hex digits).

  Attributes:
    reproducible: False when a nonce went into it (see the module docstring):
      no other process, and no rebuilt copy of the graph, computes it again.
  """

  reproducible: bool = True


def digest(value: Any) -> str:
  """A hex SHA-256 of `value`'s content (see the module docstring)."""
  hasher = _Hasher()
  hasher.value(value, static=False)
  return hasher.hexdigest()


def node_fingerprint(op_name: str, params: dict, parent_fingerprints: Sequence[str]) -> Fingerprint:
  """The fingerprint of a graph node from its op, params and parents."""
  hasher = _Hasher()
  hasher.put(b"node", op_name.encode())
  hasher.value(params, static=False)
  for parent in parent_fingerprints:
    hasher.graph(parent)
  fingerprint = Fingerprint(hasher.hexdigest()[:32])
  fingerprint.reproducible = hasher.reproducible
  return fingerprint


class _Hasher:
  """Feeds a tagged, length-prefixed encoding of values into SHA-256."""

  def __init__(self):
    self._sha = hashlib.sha256()
    # Objects that can be reached twice (containers, functions, classes,
    # objects): their visit number, so that cycles end and a second visit is
    # a back reference. The objects are kept alive so ids stay unique.
    self._visited: dict[int, int] = {}
    self._alive: list[Any] = []
    self.reproducible = True  # no nonce went in

  def hexdigest(self) -> str:
    return self._sha.hexdigest()

  def put(self, tag: bytes, payload: bytes = b"") -> None:
    """One token: the tag (no NUL in it), NUL, payload length, payload."""
    self._sha.update(tag + b"\0" + struct.pack("<Q", len(payload)) + payload)

  def _first_visit(self, obj: Any) -> bool:
    """False (and a back reference written) if `obj` was hashed already."""
    seen = self._visited.get(id(obj))
    if seen is not None:
      self.put(b"ref", str(seen).encode())
      return False
    self._visited[id(obj)] = len(self._visited)
    self._alive.append(obj)
    return True

  def graph(self, fingerprint: str) -> None:
    """A graph node's fingerprint, as a parent or a parameter."""
    self.put(b"graph", fingerprint.encode())
    if not getattr(fingerprint, "reproducible", True):
      self.reproducible = False

  def _items(self, tag: bytes, items: Iterable[Any], static: bool) -> None:
    items = list(items)
    self.put(tag, str(len(items)).encode())
    for item in items:
      self.value(item, static)

  # -- values -----------------------------------------------------------------
  def value(self, v: Any, static: bool) -> None:
    """Hashes `v`; `static`: it is module state (see the module docstring)."""
    if v is None or v is Ellipsis or v is NotImplemented:
      self.put(b"const", repr(v).encode())
    elif isinstance(v, np.generic):  # before float: np.float64 is one
      self.put(b"scalar", repr(v.dtype).encode() + b"|" + v.tobytes())
    elif isinstance(v, bool):
      self.put(b"bool", b"1" if v else b"0")
    elif isinstance(v, int):
      self.put(b"int", str(int(v)).encode())
    elif isinstance(v, float):
      self.put(b"float", float.hex(v).encode())
    elif isinstance(v, complex):
      self.put(b"complex", f"{v.real.hex()},{v.imag.hex()}".encode())
    elif isinstance(v, str):
      self.put(b"str", v.encode("utf-8", "surrogatepass"))
    elif isinstance(v, bytes):
      self.put(b"bytes", v)
    elif isinstance(v, np.dtype):
      self.put(b"dtype", repr(v).encode())
    elif isinstance(v, tuple):
      self._items(b"tuple", v, static)
    elif isinstance(v, frozenset):
      self._set(b"frozenset", v, static)
    elif isinstance(v, types.CodeType):
      self._code(v)
    elif isinstance(v, (types.FunctionType, type, types.ModuleType, types.BuiltinFunctionType)):
      self._code_object(v, static)
    elif isinstance(v, _node_class):
      self.graph(v.fingerprint())
    elif isinstance(getattr(v, "node", None), _node_class):
      self.graph(v.node.fingerprint())
    elif hasattr(v, "spec_params"):
      self._spec_object(v)
    elif callable(getattr(v, "fingerprint", None)):  # e.g. a BucketPlan
      self.put(b"fingerprinted", str(v.fingerprint()).encode())
      self._class(type(v))
    elif isinstance(v, enum.Enum):
      self.put(b"enum", v.name.encode())
      self._class(type(v))
    elif isinstance(v, types.MethodType):
      self.put(b"method")
      self.value(v.__func__, static)
      self.value(v.__self__, static)
    elif isinstance(v, functools.partial):
      self.put(b"partial")
      self.value(v.func, static)
      self.value(v.args, static)
      self.value(v.keywords, static)
    elif isinstance(v, (staticmethod, classmethod)):
      self.put(b"wrapped-method", type(v).__name__.encode())
      self.value(v.__func__, static)
    elif isinstance(v, property):
      self._items(b"property", (v.fget, v.fset, v.fdel), static)
    elif isinstance(v, (range, slice)):
      self.put(type(v).__name__.encode())
      self._items(b"fields", (v.start, v.stop, v.step), static)
    elif _import_path(v) is not None:
      self._code_object(v, static)  # a callable object importable by name
    elif static and _is_frozen_dataclass(v):
      self.put(b"frozen")
      self._class(type(v))
      fields = _object_fields(v)
      self._items(b"fields", (x for kv in fields for x in kv), static=True)
    elif static:
      self._module_state(v)
    else:
      self._runtime_value(v)

  def _set(self, tag: bytes, items: Iterable[Any], static: bool) -> None:
    # Set order depends on hash randomization: sort the items' own digests.
    digests = []
    for item in items:
      sub = _Hasher()
      sub._visited, sub._alive = dict(self._visited), self._alive
      sub.value(item, static)
      digests.append(sub.hexdigest())
      self.reproducible &= sub.reproducible
    self.put(tag, ",".join(sorted(digests)).encode())

  def _array(self, array: np.ndarray) -> None:
    self.put(b"array", f"{array.dtype!r}|{array.shape}".encode())
    if array.dtype.hasobject:
      self._items(b"objects", array.ravel().tolist(), static=False)
    elif array.nbytes:
      raw = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
      self.put(b"data", hashlib.sha256(raw.data).digest())

  def _module_state(self, v: Any) -> None:
    """Mutable module state: identified by type, not by current content."""
    self.put(b"state")
    self._class(type(v))

  def _runtime_value(self, v: Any) -> None:
    """A value built at run time: by content, else a nonce."""
    if type(v) is np.ndarray:  # subclasses (masked arrays) hold more state
      self._array(v)
      return
    if isinstance(v, (bytearray, memoryview)):
      self.put(b"bytearray", bytes(v))
      return
    if isinstance(v, (list, dict, set)):
      if self._first_visit(v):
        if isinstance(v, list):
          self._items(b"list", v, static=False)
        elif isinstance(v, dict):
          self._items(b"dict", (x for kv in v.items() for x in kv), static=False)
        else:
          self._set(b"set", v, static=False)
      return
    fields = _object_fields(v)
    if fields is None:
      self.put(b"nonce", _nonce(v))
      self.reproducible = False
      return
    if self._first_visit(v):
      self.put(b"object")
      self._class(type(v))
      self._items(b"fields", (x for kv in fields for x in kv), static=False)

  def _spec_object(self, v: Any) -> None:
    # Like op nodes (by op name), and as in service specs, importable
    # classes of sources and samplers are named, not hashed.
    path = _import_path(type(v))
    if path is None:
      self.put(b"spec-object")
      self._class(type(v))
    else:
      self.put(b"spec-object", f"{path[0]}:{path[1]}".encode())
    self.value(v.spec_params(), static=False)
    content = getattr(v, "fingerprint_params", None)
    self.value(content() if callable(content) else None, static=False)

  # -- code ---------------------------------------------------------------------
  def _code_object(self, v: Any, static: bool) -> None:
    """Functions, classes, modules and other callables."""
    if isinstance(v, types.ModuleType):
      self.put(b"module", f"{v.__name__}=={_version(v.__name__)}".encode())
      return
    path = _import_path(v)
    if path is not None and (
      _is_installed(path[0]) or not isinstance(v, (types.FunctionType, type))
    ):
      self.put(b"named", f"{path[0]}:{path[1]}=={_version(path[0])}".encode())
      wrapped = getattr(v, "__wrapped__", None)  # e.g. a jitted function
      if wrapped is not None and not _is_installed(path[0]):
        self.value(wrapped, static=True)
      return
    if isinstance(v, types.FunctionType):
      self._function(v, module_state=static or path is not None)
    elif isinstance(v, type):
      self._class(v)
    elif v.__self__ is None or isinstance(v.__self__, types.ModuleType):
      self.put(b"builtin", repr(v).encode())  # unnamed C function: rare
    else:  # a C method bound to an object, e.g. `some_list.append`
      self.put(b"bound-builtin", v.__qualname__.encode())
      self.value(v.__self__, static)

  def _function(self, fn: types.FunctionType, module_state: bool) -> None:
    """`module_state`: `fn` is module state (importable by name, or reached
    through module state), and so are its defaults, cells and attributes."""
    if not self._first_visit(fn):
      return
    module = sys.modules.get(fn.__module__)
    globals_are_module_state = (
      module is not None and fn.__module__ != "__main__" and fn.__globals__ is vars(module)
    )
    state_is_module_state = module_state and fn.__module__ != "__main__"
    self.put(b"function")
    self._code(fn.__code__)
    # The containers of defaults and attributes are made by the `def`, so
    # they are walked even where their values are module state.
    self._items(b"defaults", fn.__defaults__ or (), state_is_module_state)
    kwdefaults = sorted((fn.__kwdefaults__ or {}).items())
    self._items(b"kwdefaults", (x for kv in kwdefaults for x in kv), state_is_module_state)
    cells = fn.__closure__ or ()
    self.put(b"cells", str(len(cells)).encode())
    for cell in cells:
      try:
        contents = cell.cell_contents
      except ValueError:  # not yet assigned
        self.put(b"empty-cell")
        continue
      self.value(contents, state_is_module_state)
    names = sorted(n for n in _global_names(fn.__code__) if n in fn.__globals__)
    for name in names:
      self.put(b"global", name.encode())
      self.value(fn.__globals__[name], globals_are_module_state)
    attrs = sorted(vars(fn).items())
    self._items(b"attrs", (x for kv in attrs for x in kv), state_is_module_state)

  def _code(self, code: types.CodeType) -> None:
    # File names and line numbers are left out: the same code installed in
    # another folder computes the same.
    self.put(b"code", _PYTHON.encode())
    self.put(
      b"layout",
      repr(
        (
          code.co_argcount,
          code.co_posonlyargcount,
          code.co_kwonlyargcount,
          code.co_nlocals,
          code.co_flags,
        )
      ).encode(),
    )
    self.put(b"bytecode", code.co_code)
    self.put(b"exceptions", getattr(code, "co_exceptiontable", b""))
    for names in (code.co_names, code.co_varnames, code.co_freevars, code.co_cellvars):
      self.put(b"names", "\0".join(names).encode())
    self._items(b"consts", code.co_consts, static=True)

  def _class(self, cls: type) -> None:
    path = _import_path(cls)
    if (path is not None and _is_installed(path[0])) or not (
      cls.__flags__ & _HEAPTYPE
    ):  # installed, or a C type
      self.put(
        b"class", f"{cls.__module__}:{cls.__qualname__}=={_version(cls.__module__)}".encode()
      )
      return
    if not self._first_visit(cls):
      return
    self.put(b"class", cls.__qualname__.encode())
    self._items(b"bases", cls.__bases__, static=True)
    # Class attributes are state set up by the class's code, like globals.
    members = sorted((k, v) for k, v in vars(cls).items() if k not in _SKIPPED_CLASS_ATTRS)
    self._items(b"members", (x for kv in members for x in kv), static=True)


class _NoNodeYet:
  """Stands for the graph node class until `jaxfeed.ops.base` registers it
  (no node exists before that)."""


# base imports this module, so base registers its node class here.
_node_class: type = _NoNodeYet


def register_node_class(node_class: type) -> None:
  """Called once by `jaxfeed.ops.base`: the class of graph nodes, hashed by
  their own fingerprint."""
  global _node_class
  _node_class = node_class


def _global_names(code: types.CodeType) -> set[str]:
  """Names the code (and the code nested in it) may read as globals."""
  names = set(code.co_names)
  for const in code.co_consts:
    if isinstance(const, types.CodeType):
      names |= _global_names(const)
  return names


def _import_path(obj: Any) -> tuple[str, str] | None:
  """(module, qualname) if they name `obj` in an already imported module."""
  module_name = getattr(obj, "__module__", None)
  qualname = getattr(obj, "__qualname__", None)
  if not isinstance(module_name, str) or not isinstance(qualname, str):
    return None
  if module_name == "__main__" or "<" in qualname:
    return None
  found = sys.modules.get(module_name)
  for part in qualname.split("."):
    found = getattr(found, part, None)
  return (module_name, qualname) if found is obj else None


@functools.cache
def _installed_roots() -> tuple[str, ...]:
  paths = sysconfig.get_paths()
  roots = {paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib") if k in paths}
  roots.update(getattr(site, "getsitepackages", list)())
  if site.ENABLE_USER_SITE:
    roots.add(site.getusersitepackages())
  return tuple(os.path.join(os.path.realpath(r), "") for r in roots)


@functools.lru_cache(maxsize=4096)
def _is_installed(module_name: str) -> bool:
  """True for the standard library, site-packages and built-in modules."""
  if module_name == "__main__":
    return False
  module = sys.modules.get(module_name)
  if module is None:
    return False
  filename = getattr(module, "__file__", None)
  if not filename:  # built into the interpreter, or made at run time
    origin = getattr(getattr(module, "__spec__", None), "origin", None)
    return module_name in sys.builtin_module_names or origin in ("built-in", "frozen")
  return os.path.realpath(filename).startswith(_installed_roots())


def _version(module_name: str) -> str:
  top = sys.modules.get(module_name.partition(".")[0])
  version = getattr(top, "__version__", "")
  return version if isinstance(version, str) else ""


def _is_frozen_dataclass(obj: Any) -> bool:
  params = getattr(type(obj), "__dataclass_params__", None)
  return bool(getattr(params, "frozen", False))


def _object_fields(obj: Any) -> list[tuple[str, Any]] | None:
  """The fields of a dataclass or a plain Python object, else None.

  Plain: every class of the object is defined in Python (no C state) and
  keeps its fields in `__dict__` (no `__slots__`).
  """
  cls = type(obj)
  if dataclasses.is_dataclass(cls):
    return [(f.name, getattr(obj, f.name)) for f in dataclasses.fields(cls)]
  for klass in cls.__mro__[:-1]:
    if not klass.__flags__ & _HEAPTYPE or "__slots__" in vars(klass):
      return None
  state = getattr(obj, "__dict__", None)
  return sorted(state.items()) if isinstance(state, dict) else None


_nonces: dict[int, tuple[Callable[[], Any], bytes]] = {}


def _nonce(obj: Any) -> bytes:
  """Random bytes, the same for `obj` while it lives (where weakrefs allow)."""
  key = id(obj)
  entry = _nonces.get(key)
  if entry is not None and entry[0]() is obj:
    return entry[1]
  try:
    ref = weakref.ref(obj, lambda _, key=key: _nonces.pop(key, None))
  except TypeError:
    return os.urandom(16)
  entry = (ref, os.urandom(16))
  _nonces[key] = entry
  return entry[1]
