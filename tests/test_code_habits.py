"""What keeps the code easy to read and to check: small modules, typed
exports, explicit imports."""

from __future__ import annotations

import ast
import pathlib

import jaxfeed

PACKAGE_DIR = pathlib.Path(jaxfeed.__file__).parent
REPO = PACKAGE_DIR.parent

# A module holds one idea; past this many lines it holds several.
MAX_LINES = 550

# Known exceptions, each to be split along its seams (then removed here);
# none at present. Generated gRPC modules are not edited.
LONG_MODULES: set[str] = set()
GENERATED = ("_pb2.py", "_pb2_grpc.py")


def test_no_module_in_jaxfeed_grows_past_the_line_limit():
  too_long = {}
  for path in sorted(PACKAGE_DIR.rglob("*.py")):
    name = path.relative_to(PACKAGE_DIR).as_posix()
    if name in LONG_MODULES or name.endswith(GENERATED):
      continue
    lines = len(path.read_text().splitlines())
    if lines > MAX_LINES:
      too_long[name] = lines
  assert not too_long, f"modules over {MAX_LINES} lines; split them along their seams: {too_long}"


def test_the_known_long_modules_are_still_long():
  # A split module leaves this list: its entry would hide a new long file.
  stale = [
    name
    for name in LONG_MODULES
    if not (PACKAGE_DIR / name).exists()
    or len((PACKAGE_DIR / name).read_text().splitlines()) <= MAX_LINES
  ]
  assert not stale, f"remove from LONG_MODULES (gone, or within the limit): {stale}"


def _lazy_exports_and_typed_imports(path: pathlib.Path) -> tuple[set[str], set[str]]:
  tree = ast.parse(path.read_text())
  exports: set[str] = set()
  typed: set[str] = set()
  for node in tree.body:
    if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "_EXPORTS":
      exports = set(ast.literal_eval(node.value))
    if (
      isinstance(node, ast.If)
      and isinstance(node.test, ast.Name)
      and node.test.id == "TYPE_CHECKING"
    ):
      for statement in node.body:
        assert isinstance(statement, ast.ImportFrom), ast.dump(statement)
        for alias in statement.names:
          assert alias.asname == alias.name, f"re-export {alias.name} as itself"
          typed.add(alias.name)
  return exports, typed


def test_type_checkers_see_every_lazy_export():
  for init in (PACKAGE_DIR / "__init__.py", PACKAGE_DIR / "service" / "__init__.py"):
    exports, typed = _lazy_exports_and_typed_imports(init)
    assert exports, init
    assert exports == typed, (
      f"{init}: _EXPORTS and the TYPE_CHECKING imports differ: only exported "
      f"{sorted(exports - typed)}, only imported {sorted(typed - exports)}"
    )


def test_the_package_ships_its_type_hints():
  assert (PACKAGE_DIR / "py.typed").is_file()
  assert '"jaxfeed" = ["py.typed"]' in (REPO / "pyproject.toml").read_text()


def test_the_dataset_facade_names_the_op_modules_it_imports():
  # `from jaxfeed.ops import batch`, which readers, IDEs and type checkers
  # follow, not a module name in a string.
  for name in ("dataset.py", "dataset_batching.py", "dataset_sources.py"):
    source = (PACKAGE_DIR / name).read_text()
    assert "import_module" not in source and "importlib" not in source, name
