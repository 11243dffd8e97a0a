"""The API reference builds without warnings, every public name and
Dataset method says what it does, and every snippet in the docs runs.

The snippets' convention (README.md and docs/*.md):
- A ```python block is runnable: the test runs it as a script of its own, in
  a new process in an empty temporary folder, and it must exit 0. It makes
  its own (tiny, generated) data; nothing is downloaded.
- `<!-- continues -->` on the line before a block: it runs after the
  runnable blocks before it in the same file (back to the last one without
  this line), as one script.
- `<!-- not-runnable: REASON -->` on the line before a block: not run, for
  REASON (required). Every other code block (```bash, ...) carries one too.
- A block without a language (```) is output, not code.
"""

import dataclasses
import inspect
import os
import pathlib
import re
import subprocess
import sys
import warnings

import pdoc
import pytest

import jaxfeed

REPO = pathlib.Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
_FENCE = re.compile(r"^( *)```(\w*)\n(.*?)^\1```[ \t]*$", re.S | re.M)
_NOT_RUNNABLE = re.compile(r"<!-- not-runnable: (\S.*?) -->")
_CONTINUES = "<!-- continues -->"


@dataclasses.dataclass(frozen=True)
class Snippet:
  """A fenced code block of a document, and what the line before it says."""

  where: str        # "docs/images.md:30"
  language: str     # "python", "bash", "" (output)
  code: str
  marker: str       # the line before the fence, stripped


def snippets_of(path: pathlib.Path) -> list[Snippet]:
  text = path.read_text()
  found = []
  for match in _FENCE.finditer(text):
    before = text[:match.start()].rstrip("\n").rpartition("\n")[2].strip()
    line = text.count("\n", 0, match.start()) + 1
    indent = match.group(1)
    code = "".join(l[len(indent):] if l.startswith(indent) else l
                   for l in match.group(3).splitlines(keepends=True))
    found.append(Snippet(f"{path.relative_to(REPO)}:{line}", match.group(2), code, before))
  return found


def runnable_scripts() -> list[tuple[str, str]]:
  """(where, script) of every runnable snippet, with what it continues."""
  scripts = []
  for path in DOCS:
    chain: list[str] = []
    for snippet in snippets_of(path):
      if snippet.language != "python" or _NOT_RUNNABLE.fullmatch(snippet.marker):
        continue
      chain = [*chain, snippet.code] if snippet.marker == _CONTINUES else [snippet.code]
      scripts.append((snippet.where, "\n".join(chain)))
  return scripts


def test_every_code_snippet_runs_or_says_why_not():
  unexplained, dangling = [], []
  for path in DOCS:
    seen_runnable = False
    for snippet in snippets_of(path):
      marked = _NOT_RUNNABLE.fullmatch(snippet.marker)
      if snippet.language and snippet.language != "python" and not marked:
        unexplained.append(snippet.where)
      if "not-runnable" in snippet.marker and not marked:
        unexplained.append(f"{snippet.where} (a marker without a reason)")
      if snippet.marker == _CONTINUES and not seen_runnable:
        dangling.append(snippet.where)
      seen_runnable |= snippet.language == "python" and not marked
  assert not unexplained, f"code blocks neither run nor saying why: {unexplained}"
  assert not dangling, f"'continues' with no runnable snippet before it: {dangling}"
  assert len(runnable_scripts()) >= 8


@pytest.mark.parametrize("where,script", runnable_scripts(),
                         ids=[where for where, _ in runnable_scripts()])
def test_a_docs_snippet_runs(tmp_path, where, script):
  (tmp_path / "snippet.py").write_text(script)
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO))
  done = subprocess.run([sys.executable, "snippet.py"], cwd=tmp_path, env=env,
                        capture_output=True, text=True, timeout=180, check=False)
  assert done.returncode == 0, f"{where}:\n{done.stderr[-3000:]}"


def test_every_public_name_and_dataset_method_has_a_docstring():
  missing = [name for name in jaxfeed.__all__
             if not isinstance(getattr(jaxfeed, name), (int, float, str))
             and not inspect.getdoc(getattr(jaxfeed, name))]
  assert not missing, missing
  undocumented = [name for name, member in inspect.getmembers(jaxfeed.Dataset)
                  if not name.startswith("_") and callable(member)
                  and not inspect.getdoc(member)]
  assert not undocumented, undocumented


def test_every_listed_submodule_is_reachable_as_an_attribute():
  import types
  for name in jaxfeed.__all__:
    value = getattr(jaxfeed, name)
    if isinstance(value, types.ModuleType):
      assert inspect.getdoc(value), name
  assert jaxfeed.example.parse_example and jaxfeed.image.decode_jpeg


def test_dataset_docstrings_say_what_users_ask_about():
  assert "drop_remainder" in inspect.getdoc(jaxfeed.Dataset.batch)
  map_doc = inspect.getdoc(jaxfeed.Dataset.map)
  assert '"process"' in map_doc and "unpacked into arguments" in map_doc
  for method in ("shuffle", "unbatch", "padded_batch", "interleave", "repeat",
                 "cache"):
    assert len(inspect.getdoc(getattr(jaxfeed.Dataset, method))) > 80, method


def test_the_api_reference_builds_without_warnings(tmp_path):
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    pdoc.pdoc("jaxfeed", output_directory=tmp_path)
  messages = [str(w.message) for w in caught
              if "pdoc" in (w.filename or "") or issubclass(w.category, UserWarning)]
  assert not messages, messages[:10]
  page = (tmp_path / "jaxfeed.html").read_text()
  assert 'id="Dataset.batch"' in page and "drop_remainder" in page
