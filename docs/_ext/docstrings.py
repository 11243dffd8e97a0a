"""jaxfeed's docstrings as reStructuredText.

The docstrings are Google style (napoleon reads their sections) written as
plain text with Markdown's inline code: `name`, `*args`, "`jax.Array`s",
and hanging indents for a list's items. In reStructuredText a single
backtick is interpreted text, a lone `*` starts emphasis and an indented
line after a paragraph is an error, so before napoleon runs this
- turns every `code` span into a literal (a cross-reference when it names a
  public jaxfeed object the reference documents) and escapes stars outside
  them;
- outside napoleon's sections, joins a hanging indent's lines into its
  first line, and sets an indented list (or the block after a line ending
  in ":") apart with blank lines;
- leaves literal blocks (after `::`, or `>>>`) alone.
"""

from __future__ import annotations

import importlib
import re
from typing import Any

_SECTION = re.compile(
  r"\s*(Args|Arguments|Attributes|Example|Examples|Keyword Args|Methods|Note|"
  r"Notes|Other Parameters|Raises|References|Returns|See Also|Usage|Warning|"
  r"Warns|Yields):\s*$"
)
_BULLET = re.compile(r"\s*([*-]|\d+\.) ")
_SPAN = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")
_PUBLIC = re.compile(r"jaxfeed(\.service)?\.[A-Z_a-z]\w*(\.[a-z_]\w*)?")


def _public_object(name: str) -> bool:
  """Whether `name` is a public jaxfeed object the API reference documents."""
  if not _PUBLIC.fullmatch(name):
    return False
  parts = name.split(".")
  module = "jaxfeed.service" if parts[1] == "service" else "jaxfeed"
  rest = parts[2:] if parts[1] == "service" else parts[1:]
  value: Any = importlib.import_module(module)
  if rest[0] not in value.__all__:
    return False
  for part in rest:
    if not hasattr(value, part):
      return False
    value = getattr(value, part)
    if isinstance(value, type(importlib)):
      return False  # a submodule's names: the reference lists some only
  return bool(getattr(value, "__doc__", None))


def _inline(text: str) -> str:
  out, end = [], 0
  for match in _SPAN.finditer(text):
    out.append(_escape_stars(text[end : match.start()]))
    code = match.group(1)
    if _public_object(code):
      out.append(f":py:obj:`{code}`")
    else:
      out.append("``" + code + "``")
    end = match.end()
    if end < len(text) and (text[end].isalnum() or text[end] == "_"):
      out.append("\\ ")  # "`jax.Array`s": end the literal, then the word
  out.append(_escape_stars(text[end:]))
  return "".join(out)


def _escape_stars(text: str) -> str:
  bullet = _BULLET.match(text)
  start = bullet.end() if bullet else 0
  return text[:start] + re.sub(r"(?<![\\*])\*(?!\*)", r"\\*", text[start:])


def _indent(line: str) -> int:
  return len(line) - len(line.lstrip())


def set_hanging_indents_apart(lines: list[str]) -> list[str]:
  """The lines with hanging indents joined and indented lists set apart."""
  out: list[str] = []
  skip_indent = None  # inside a napoleon section or a literal block
  i = 0
  while i < len(lines):
    line = lines[i]
    i += 1
    if skip_indent is not None:
      if not line.strip() or _indent(line) > skip_indent:
        out.append(line)
        continue
      skip_indent = None
    if _SECTION.fullmatch(line) or line.rstrip().endswith("::"):
      skip_indent = _indent(line)
      out.append(line)
      continue
    deeper = (
      i < len(lines) and lines[i].strip() and _indent(lines[i]) > _indent(line) and line.strip()
    )
    if not deeper:
      out.append(line)
      continue
    if _BULLET.match(line):
      out.append(line)  # an item's own continuation lines
      continue
    if _BULLET.match(lines[i]) or line.rstrip().endswith(":"):
      out += [line, ""]
      block_indent = _indent(line)
      while i < len(lines) and (not lines[i].strip() or _indent(lines[i]) > block_indent):
        out.append(lines[i])
        i += 1
      out.append("")
      continue
    joined = line.rstrip()
    while i < len(lines) and lines[i].strip() and _indent(lines[i]) > _indent(line):
      joined += " " + lines[i].strip()
      i += 1
    if out and out[-1].strip():
      out.append("")
    out += [joined, ""]
  return out


def markdown_code_to_rst(lines: list[str]) -> None:
  """Rewrites a docstring's lines in place (see the module docstring)."""
  lines[:] = set_hanging_indents_apart(lines)
  in_raises = None
  for i, line in enumerate(lines):
    if line.strip() == "Raises:":
      in_raises = _indent(line)
    elif line.strip() and in_raises is not None and _indent(line) <= in_raises:
      in_raises = None
    elif in_raises is not None:
      # "PipelineStateError (a ValueError): ..." names one exception.
      lines[i] = re.sub(r"^(\s*)(\w+) \(([^)]*)\):", r"\1\2: (\3)", line)
  literal_indent = None
  for i, line in enumerate(lines):
    indent = len(line) - len(line.lstrip())
    if literal_indent is not None:
      if not line.strip() or indent > literal_indent:
        continue
      literal_indent = None
    if line.lstrip().startswith(">>>"):
      continue
    lines[i] = _inline(line)
    if line.rstrip().endswith("::"):
      literal_indent = indent


def _process(app: Any, what: str, name: str, obj: Any, options: Any, lines: list[str]) -> None:
  del app, what, name, obj, options
  markdown_code_to_rst(lines)


def setup(app: Any) -> dict[str, Any]:
  # Before napoleon (priority 500), which reads the sections.
  app.connect("autodoc-process-docstring", _process, priority=400)
  return {"parallel_read_safe": True, "parallel_write_safe": True}
