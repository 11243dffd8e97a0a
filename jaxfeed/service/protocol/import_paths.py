"""Import paths in pipeline specs: which modules they may name, and importing them.

A spec names its ops, sources and samplers by class path and its UDFs by
import path (`module:qualname`). Where a spec is rebuilt (workers) or
registered (the dispatcher), every import path must lie in an allowed module
(`DEFAULT_UDF_MODULES`, jaxfeed's classes and the deployment's
`--udf_modules`); modules that run code, touch files or processes are never
allowed, and a path is checked before its module is imported.
"""

from __future__ import annotations

import importlib
import json
import types
from typing import Any, Sequence

from jaxfeed.service.protocol.protos import service_pb2


class SpecError(ValueError):
  """A pipeline cannot be encoded for, or rebuilt on, a service worker."""


class UDFImportError(SpecError):
  """A UDF's import path does not resolve where the pipeline is rebuilt."""


def object_path(obj: Any) -> str:
  return f"{obj.__module__}:{obj.__qualname__}"


class UDFNotAllowedError(SpecError):
  """An import path is outside the modules the deployment allows."""


# Callables workers may import when the deployment lists nothing more: pure
# numeric modules and jaxfeed's own op helpers. An entry ending in "." allows
# a package and everything under it; any other entry allows exactly that
# module (so "numpy" does not let in numpy.ctypeslib or numpy.f2py).
DEFAULT_UDF_MODULES = (
  "numpy",
  "numpy.fft",
  "numpy.linalg",
  "math",
  "jaxfeed.ops.",
  "jaxfeed.coord.",
  "jaxfeed.sampler",
  "jaxfeed.seeding",
)
# Class paths (op nodes, sources, samplers) may also name any jaxfeed class;
# they are only used after checking that they are such classes.
_CLASS_MODULES = ("jaxfeed.",)
# Modules that run code, touch files or processes, or reach the network:
# never allowed, whatever the deployment lists.
NEVER_ALLOWED_MODULES = frozenset(
  {
    "builtins",
    "os",
    "posix",
    "nt",
    "subprocess",
    "_posixsubprocess",
    "importlib",
    "pickle",
    "_pickle",
    "cloudpickle",
    "dill",
    "marshal",
    "shelve",
    "shutil",
    "sys",
    "ctypes",
    "socket",
    "runpy",
    "code",
    "codeop",
    "pty",
    "multiprocessing",
    "signal",
    "io",
    "_io",
    "tempfile",
    "pathlib",
    "glob",
    "pkgutil",
    "zipimport",
    "types",
    "inspect",
    "gc",
    "threading",
    "asyncio",
    "webbrowser",
    "urllib",
    "http",
    "ftplib",
    "smtplib",
    "__main__",
    "functools",
    "operator",
  }
)
# Never a UDF's module either: the service's own functions (they import
# modules by name, start processes); its classes may appear as class paths.
_NEVER_UDF_MODULES = NEVER_ALLOWED_MODULES | {"jaxfeed.service"}
# Callables of allowed modules that read or write files.
_NEVER_ALLOWED_PATHS = frozenset(
  f"numpy:{name}"
  for name in (
    "load",
    "save",
    "savez",
    "savez_compressed",
    "loadtxt",
    "savetxt",
    "genfromtxt",
    "fromfile",
    "fromregex",
    "memmap",
    "DataSource",
  )
)
UDF_MODULES_FLAG = "--udf_modules"


def _module_matches(module: str, entries: Sequence[str]) -> bool:
  for entry in entries:
    if entry.endswith("."):
      if module == entry[:-1] or module.startswith(entry):
        return True
    elif module == entry:
      return True
  return False


def check_udf_modules(entries: Sequence[str]) -> tuple[str, ...]:
  """Validates a deployment's extra UDF module entries; returns them as a tuple.

  Args:
    entries: module names ("mypkg.udfs": that module only) or package
      prefixes ending in "." ("mypkg.": the package and its submodules).

  Returns:
    The entries, in order.
  """
  if isinstance(entries, str):
    raise ValueError(
      f"udf_modules must be a sequence of module names, got the "
      f"string {entries!r} (split it at commas)."
    )
  checked = []
  for entry in entries:
    name = entry[:-1] if isinstance(entry, str) and entry.endswith(".") else entry
    if not isinstance(name, str) or not all(part.isidentifier() for part in name.split(".")):
      raise ValueError(
        f"udf_modules entry {entry!r} is not a module name or a package "
        "prefix ending in '.' (e.g. 'mypkg.udfs' or 'mypkg.')."
      )
    unsafe = sorted(
      m
      for m in _NEVER_UDF_MODULES
      if _module_matches(m, [entry]) or m.startswith(name + ".") or name.startswith(m + ".")
    )
    if unsafe:
      raise ValueError(
        f"udf_modules entry {entry!r} would let pipelines run {unsafe[0]!r}, "
        "a module that runs code, touches files or processes; it is never "
        "allowed. List only the modules of your own UDFs."
      )
    checked.append(entry)
  return tuple(checked)


def parse_udf_modules(flag_value: str) -> tuple[str, ...]:
  """The entries of a comma-separated --udf_modules flag, validated."""
  return check_udf_modules([e.strip() for e in flag_value.split(",") if e.strip()])


def _split_path(path: Any) -> tuple[str, str]:
  if not isinstance(path, str) or ":" not in path:
    raise UDFImportError(f"Import path {path!r} is not of the form 'module:qualname'.")
  module_name, qualname = path.split(":", 1)
  return module_name, qualname


def _refuse(path: str, what: str, udf_modules: Sequence[str]) -> UDFNotAllowedError:
  return UDFNotAllowedError(
    f"Import path {path!r} is not allowed on this deployment: {what}. UDFs "
    "and classes in a pipeline are imported only from jaxfeed's own modules, "
    f"{', '.join(DEFAULT_UDF_MODULES[:4])} and the modules the dispatcher "
    f"and workers list in {UDF_MODULES_FLAG} (now: "
    f"{','.join(udf_modules) or 'none'}); add your UDFs' module there, e.g. "
    f"{UDF_MODULES_FLAG}=mypkg. on both."
  )


def check_path_allowed(path: str, udf_modules: Sequence[str], is_class: bool = False) -> None:
  """Raises UDFNotAllowedError unless `path` may be imported (without importing)."""
  module_name, qualname = _split_path(path)
  allowed = (*(_CLASS_MODULES if is_class else DEFAULT_UDF_MODULES), *udf_modules)
  never = NEVER_ALLOWED_MODULES if is_class else _NEVER_UDF_MODULES
  if any(module_name == m or module_name.startswith(m + ".") for m in never):
    raise _refuse(
      path,
      f"module {module_name!r} runs code, touches files or "
      "processes (or is the service itself) and is never allowed",
      udf_modules,
    )
  if not _module_matches(module_name, allowed):
    raise _refuse(path, f"module {module_name!r} is not allowlisted", udf_modules)
  if path in _NEVER_ALLOWED_PATHS:
    raise _refuse(path, "it reads or writes files", udf_modules)
  if any(not part.isidentifier() or part.startswith("_") for part in qualname.split(".")):
    raise _refuse(path, f"qualname {qualname!r} names a private attribute", udf_modules)


def resolve_path(
  path: str, udf_modules: Sequence[str] | None = None, is_class: bool = False
) -> Any:
  """Imports `module:qualname` and returns the object.

  Args:
    path: the import path.
    udf_modules: None imports anything (the client checking its own
      functions); otherwise the deployment's extra allowed modules: paths
      outside them are refused before their module is imported.
    is_class: the path names an op, source or sampler class.

  Returns:
    The object.
  """
  module_name, qualname = _split_path(path)
  if udf_modules is not None:
    check_path_allowed(path, udf_modules, is_class)
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
        f"Module {module_name!r} has no attribute {qualname!r} (import path {path!r}) on this host."
      ) from e
    if udf_modules is not None and isinstance(value, types.ModuleType):
      raise _refuse(path, f"{part!r} is a module imported by {module_name!r}", udf_modules)
  if udf_modules is not None:
    # An allowed module may import a function from elsewhere
    # (`from os import system`): the object's own module must be allowed too.
    home = getattr(value, "__module__", None)
    if not isinstance(home, str):
      raise _refuse(path, "the object names no module of its own", udf_modules)
    if home != module_name:
      check_path_allowed(
        f"{home}:{getattr(value, '__qualname__', qualname)}", udf_modules, is_class
      )
  return value


def graph_paths(dataset_def: service_pb2.DatasetDef) -> list[tuple[str, bool]]:
  """Every import path in a spec's graph, with whether it names a class."""
  try:
    graph = json.loads(dataset_def.graph_json)
  except (ValueError, RecursionError) as e:  # too deep a nesting recurses too far
    raise SpecError(f"Pipeline spec is not valid JSON: {e}") from e
  found: list[tuple[str, bool]] = []
  pending = [graph]
  while pending:
    item = pending.pop()
    if isinstance(item, list):
      pending.extend(item)
    elif isinstance(item, dict):
      for key, value in item.items():
        if key in ("class", "__object__") and isinstance(value, str):
          found.append((value, True))
        elif key == "__callable__":
          # {"path": ..., "code": ...}; a bare path from older clients.
          found.append((value.get("path") if isinstance(value, dict) else value, False))
        else:
          pending.append(value)
  return found


def check_spec_paths(dataset_def: service_pb2.DatasetDef, udf_modules: Sequence[str]) -> None:
  """Raises UDFNotAllowedError if any import path of the spec is not allowed."""
  for path, is_class in graph_paths(dataset_def):
    check_path_allowed(path, udf_modules, is_class)
