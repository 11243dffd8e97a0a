"""jaxfeed's modules import one another one way: no import cycles.

Every import counts, at the top of a module or inside a function: an import
moved into a function still makes a cycle, it only defers it. A package's
own `__init__` is not counted as a target of its submodules' imports (Python
imports it first anyway, and it lists the submodules it exports).
"""

from __future__ import annotations

import ast
import pathlib

import jaxfeed

PACKAGE_DIR = pathlib.Path(jaxfeed.__file__).parent


def _module_names(root: pathlib.Path, package: str) -> dict[str, tuple[pathlib.Path, bool]]:
  """Dotted module name -> (file, whether it is a package's __init__)."""
  modules = {}
  for path in sorted(root.rglob("*.py")):
    parts = [package, *path.relative_to(root).with_suffix("").parts]
    is_package = parts[-1] == "__init__"
    if is_package:
      parts = parts[:-1]
    modules[".".join(parts)] = (path, is_package)
  return modules


def import_graph(root: pathlib.Path, package: str) -> dict[str, set[str]]:
  """Module -> the modules of `package` it imports anywhere in its code."""
  modules = _module_names(root, package)
  graph = {}
  for name, (path, is_package) in modules.items():
    imported = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
      if isinstance(node, ast.Import):
        imported.update(alias.name for alias in node.names)
      elif isinstance(node, ast.ImportFrom):
        origin = node.module or ""
        if node.level:  # relative: from the module's own package upwards
          base = name.split(".")[: len(name.split(".")) - node.level + is_package]
          origin = ".".join(base + ([origin] if origin else []))
        for alias in node.names:
          submodule = f"{origin}.{alias.name}"
          imported.add(submodule if submodule in modules else origin)
    graph[name] = {m for m in imported if m in modules and m != name}
  return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
  """The strongly connected groups of more than one module (Tarjan)."""
  index: dict[str, int] = {}
  low: dict[str, int] = {}
  stack: list[str] = []
  on_stack: set[str] = set()
  cycles = []

  def visit(module: str) -> None:
    index[module] = low[module] = len(index)
    stack.append(module)
    on_stack.add(module)
    for target in sorted(graph[module]):
      if target not in index:
        visit(target)
        low[module] = min(low[module], low[target])
      elif target in on_stack:
        low[module] = min(low[module], index[target])
    if low[module] == index[module]:
      group = []
      while True:
        member = stack.pop()
        on_stack.discard(member)
        group.append(member)
        if member == module:
          break
      if len(group) > 1:
        cycles.append(sorted(group))

  for module in sorted(graph):
    if module not in index:
      visit(module)
  return cycles


def test_jaxfeed_has_no_import_cycles():
  cycles = import_cycles(import_graph(PACKAGE_DIR, "jaxfeed"))
  assert not cycles, (
    "jaxfeed modules import each other in a cycle (imports inside functions "
    f"count too); move the shared code to the layer on the left: {cycles}"
  )


# DESIGN.md's data path, left to right; the Dataset facade belongs to the op
# graph. A module imports only from its own layer and the layers to its left.
_LAYERS = {
  "sources": 0,
  "seeding": 0,
  "sampler": 1,
  "sampler_replacement": 1,
  "resharded_sampler": 1,
  "ops": 2,
  "dataset": 2,
  "dataset_batching": 2,
  "dataset_sources": 2,
  "service": 3,
  "device": 4,
}


def _layer(module: str) -> int | None:
  parts = module.split(".")
  return _LAYERS.get(parts[1]) if len(parts) > 1 else None


def test_layers_import_only_from_their_left():
  graph = import_graph(PACKAGE_DIR, "jaxfeed")
  rightward = sorted(
    (module, target)
    for module, targets in graph.items()
    for target in targets
    if _layer(module) is not None and _layer(target) is not None and _layer(target) > _layer(module)
  )
  assert not rightward, f"imports from a layer to the right (module, target): {rightward}"


# The service's parts, left to right: what every party shares (the
# protocol); the dispatcher's storage, the pools its workers run in and the
# metrics; then the worker, the dispatcher and the client (in the trainer).
# A module imports only from its own part and the parts at lower levels.
_SERVICE_PARTS = {
  "protocol": 0,
  "storage": 1,
  "pools": 1,
  "metrics": 1,
  "worker": 2,
  "dispatcher": 3,
  "client": 4,
}


def _service_part(module: str) -> str | None:
  parts = module.split(".")
  return parts[2] if parts[:2] == ["jaxfeed", "service"] and len(parts) > 2 else None


def test_every_service_module_belongs_to_a_part():
  graph = import_graph(PACKAGE_DIR, "jaxfeed")
  unplaced = sorted(m for m in graph if _service_part(m) not in (None, *_SERVICE_PARTS))
  assert not unplaced, f"place these in _SERVICE_PARTS (a folder of the service): {unplaced}"


def test_service_parts_import_only_from_their_left():
  graph = import_graph(PACKAGE_DIR, "jaxfeed")
  wrong = sorted(
    (module, target)
    for module, targets in graph.items()
    for target in targets
    if _service_part(module) in _SERVICE_PARTS
    and _service_part(target) in _SERVICE_PARTS
    and _service_part(target) != _service_part(module)
    and _SERVICE_PARTS[_service_part(target)] >= _SERVICE_PARTS[_service_part(module)]
  )
  assert not wrong, f"service parts importing a part not to their left (module, target): {wrong}"


def test_the_benchmarks_have_no_import_cycles():
  benchmarks = PACKAGE_DIR.parent / "benchmarks"
  cycles = import_cycles(import_graph(benchmarks, "benchmarks"))
  assert not cycles, f"benchmark modules import each other in a cycle: {cycles}"


def test_the_dataset_facade_does_not_import_the_service():
  graph = import_graph(PACKAGE_DIR, "jaxfeed")
  assert not {m for m in graph["jaxfeed.dataset"] if m.startswith("jaxfeed.service")}


def test_a_cycle_through_an_import_inside_a_function_is_found(tmp_path):
  package = tmp_path / "pkg"
  (package / "sub").mkdir(parents=True)
  (package / "__init__.py").write_text("")
  (package / "sub" / "__init__.py").write_text("from pkg.sub import low\n")
  (package / "top.py").write_text("from pkg.sub import low\n")
  (package / "sub" / "low.py").write_text(
    "import os\n\ndef late():\n  from .. import top\n  return top\n"
  )
  (package / "alone.py").write_text("from pkg import sub\n")
  graph = import_graph(package, "pkg")
  assert graph["pkg.sub.low"] == {"pkg.top"}
  assert graph["pkg.alone"] == {"pkg.sub"}
  assert import_cycles(graph) == [["pkg.sub.low", "pkg.top"]]
