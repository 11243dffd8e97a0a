"""The manual builds without warnings or broken links, every public name
and Dataset method says what it does, and every snippet in the docs runs.

The snippets' convention (README.md and every docs/**/*.md page):
- A ```python block is runnable: the test runs it as a script of its own, in
  a new process in an empty temporary folder, and it must exit 0. It makes
  its own (tiny, generated) data; nothing is downloaded.
- `<!-- continues -->` on the line before a block: it runs after the
  runnable blocks before it in the same file (back to the last one without
  this line), as one script.
- `<!-- not-runnable: REASON -->` on the line before a block: not run, for
  REASON (required). Every other code block (```bash, ...) carries one too.
- A block without a language (```) is output, not code.
The markers are HTML comments: the site shows neither (a test checks).
"""

import dataclasses
import html.parser
import inspect
import os
import pathlib
import posixpath
import re
import shutil
import subprocess
import sys
import urllib.parse

import pytest

import jaxfeed

REPO = pathlib.Path(__file__).resolve().parents[1]
# What the site builds from, and never the build's own outputs.
_BUILT = ("_build", "generated")
DOCS = [
  REPO / "README.md",
  *sorted(
    path
    for path in (REPO / "docs").rglob("*.md")
    if not set(path.relative_to(REPO / "docs").parts) & set(_BUILT)
  ),
]
_FENCE = re.compile(r"^( *)```(\w*)\n(.*?)^\1```[ \t]*$", re.S | re.M)
_NOT_RUNNABLE = re.compile(r"<!-- not-runnable: (\S.*?) -->")
_CONTINUES = "<!-- continues -->"


@dataclasses.dataclass(frozen=True)
class Snippet:
  """A fenced code block of a document, and what the line before it says."""

  where: str  # "docs/images.md:30"
  language: str  # "python", "bash", "" (output)
  code: str
  marker: str  # the line before the fence, stripped


def snippets_of(path: pathlib.Path) -> list[Snippet]:
  text = path.read_text()
  found = []
  for match in _FENCE.finditer(text):
    before = text[: match.start()].rstrip("\n").rpartition("\n")[2].strip()
    line = text.count("\n", 0, match.start()) + 1
    indent = match.group(1)
    code = "".join(
      l[len(indent) :] if l.startswith(indent) else l
      for l in match.group(3).splitlines(keepends=True)
    )
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


@pytest.mark.parametrize(
  "where,script", runnable_scripts(), ids=[where for where, _ in runnable_scripts()]
)
def test_a_docs_snippet_runs(tmp_path, where, script):
  (tmp_path / "snippet.py").write_text(script)
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(REPO))
  done = subprocess.run(
    [sys.executable, "snippet.py"],
    cwd=tmp_path,
    env=env,
    capture_output=True,
    text=True,
    timeout=180,
    check=False,
  )
  assert done.returncode == 0, f"{where}:\n{done.stderr[-3000:]}"


def test_every_public_name_and_dataset_method_has_a_docstring():
  missing = [
    name
    for name in jaxfeed.__all__
    if not isinstance(getattr(jaxfeed, name), (int, float, str))
    and not inspect.getdoc(getattr(jaxfeed, name))
  ]
  assert not missing, missing
  undocumented = [
    name
    for name, member in inspect.getmembers(jaxfeed.Dataset)
    if not name.startswith("_") and callable(member) and not inspect.getdoc(member)
  ]
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
  for method in ("shuffle", "unbatch", "padded_batch", "interleave", "repeat", "cache"):
    assert len(inspect.getdoc(getattr(jaxfeed.Dataset, method))) > 80, method


class _Page(html.parser.HTMLParser):
  """The ids and the relative links of one built HTML page."""

  def __init__(self):
    super().__init__()
    self.ids: set[str] = set()
    self.links: list[str] = []

  def handle_starttag(self, tag, attrs):
    attrs = dict(attrs)
    if attrs.get("id"):
      self.ids.add(attrs["id"])
    if tag == "a" and attrs.get("name"):
      self.ids.add(attrs["name"])
    target = attrs.get("href") if tag in ("a", "link") else attrs.get("src")
    if target and not urllib.parse.urlsplit(target).scheme and not target.startswith("//"):
      self.links.append(target)


def broken_links(site: pathlib.Path) -> list[str]:
  """'page -> link' for every relative href/src of the site whose file or
  anchor does not exist."""
  pages = {}
  for path in site.rglob("*.html"):
    if path.relative_to(site).parts[0] in ("_static", "_sources"):
      continue  # the theme's template fragments, not pages
    page = _Page()
    page.feed(path.read_text())
    pages[path.relative_to(site).as_posix()] = page
  broken = []
  for name, page in sorted(pages.items()):
    for link in page.links:
      parts = urllib.parse.urlsplit(link)
      target = (
        posixpath.normpath(
          posixpath.join(posixpath.dirname(name), urllib.parse.unquote(parts.path))
        )
        if parts.path
        else name
      )
      if target.endswith("/") or (site / target).is_dir():
        target = posixpath.join(target, "index.html")
      if not (site / target).is_file():
        broken.append(f"{name} -> {link} (no file)")
      elif parts.fragment and target in pages and parts.fragment not in pages[target].ids:
        broken.append(f"{name} -> {link} (no anchor)")
  return broken


def test_the_readme_links_to_files_that_exist():
  links = re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", (REPO / "README.md").read_text())
  assert len(links) > 10
  missing = [link for link in links if not (REPO / link).is_file()]
  assert not missing, missing


def test_broken_links_finds_a_missing_page_and_a_missing_anchor(tmp_path):
  (tmp_path / "a.html").write_text(
    '<h1 id="top">A</h1><a href="b.html#gone">b</a>'
    '<a href="#top">top</a><a href="c.html">c</a>'
    '<a href="https://example.org/x.html">out</a>'
  )
  (tmp_path / "b.html").write_text('<p id="here"><a href="a.html#top">a</a></p>')
  assert broken_links(tmp_path) == [
    "a.html -> b.html#gone (no anchor)",
    "a.html -> c.html (no file)",
  ]


def build_site(root: pathlib.Path) -> subprocess.CompletedProcess:
  """Builds the manual from a copy of docs/ into root/html, with warnings as
  errors (and nitpicky: docs/conf.py)."""
  shutil.copytree(
    REPO / "docs", root / "src", ignore=lambda folder, names: [n for n in names if n in _BUILT]
  )
  return subprocess.run(
    [
      sys.executable,
      "-m",
      "sphinx",
      "-b",
      "html",
      "-W",
      "--keep-going",
      "-q",
      "-d",
      str(root / "doctrees"),
      str(root / "src"),
      str(root / "html"),
    ],
    capture_output=True,
    text=True,
    timeout=600,
    check=False,
    env=dict(os.environ, JAX_PLATFORMS="cpu"),
  )


# One test, so that the build (the slow part) runs once however pytest-xdist
# spreads the tests.
def test_the_manual_builds_without_warnings_or_broken_links(tmp_path):
  pytest.importorskip("sphinx", reason="the docs extra is not installed")
  pytest.importorskip("myst_parser", reason="the docs extra is not installed")
  done = build_site(tmp_path)
  assert done.returncode == 0 and not done.stderr.strip(), done.stderr[-5000:]
  site = tmp_path / "html"

  for path in DOCS[1:]:  # every docs page is a page of the site
    page = path.relative_to(REPO / "docs").with_suffix(".html")
    assert (site / page).is_file(), page

  broken = broken_links(site)
  assert not broken, broken[:20]

  # The API reference documents every public name.
  generated = site / "reference" / "generated"
  index = (site / "reference" / "index.html").read_text()
  for name in jaxfeed.__all__:
    if isinstance(getattr(jaxfeed, name), int):
      assert f'id="jaxfeed.{name}"' in index, name  # a constant: on the index
    elif name not in jaxfeed._SUBMODULES or name == "image":
      assert (generated / f"jaxfeed.{name}.html").is_file(), name
  for name in jaxfeed.service.__all__:
    if isinstance(getattr(jaxfeed.service, name), int):
      assert f'id="jaxfeed.service.{name}"' in index, name  # a constant: on the index
    else:
      assert (generated / f"jaxfeed.service.{name}.html").is_file(), name
  batch = (generated / "jaxfeed.Dataset.html").read_text()
  assert 'id="jaxfeed.Dataset.batch"' in batch and "drop_remainder" in batch

  # The snippet markers are HTML comments: in the page, never shown.
  pages = [page for page in site.rglob("*.html") if page.relative_to(site).parts[0] != "_static"]
  for page in pages:
    visible = re.sub(r"<!--.*?-->", "", page.read_text(), flags=re.S)
    assert "not-runnable" not in visible and "continues --" not in visible, page


def test_the_reference_page_lists_every_public_name():
  """A quick check of what the manual's build checks too, without Sphinx."""
  text = (REPO / "docs" / "reference" / "index.md").read_text()
  listed = set(re.findall(r"^\s+([A-Za-z_]\w*)$", text, re.MULTILINE))
  listed |= set(re.findall(r"py:data:: (\w+)", text))
  missing = [
    name for name in jaxfeed.__all__ if name not in jaxfeed._SUBMODULES and name not in listed
  ]
  missing += [f"jaxfeed.service.{name}" for name in jaxfeed.service.__all__ if name not in listed]
  assert not missing, f"docs/reference/index.md does not list {missing}"
