r"""Renders the benchmark results recorded in benchmarks/results/ into the
README's results table, docs/benchmarks.md (tables, and plots under
docs/images/benchmarks/) and the tables other docs pages quote
(`report_pages.PAGES`: the dispatcher at pod scale, W8 in the text guide,
W6's plans in coordinated reads), so that every published figure comes
from a recorded run.

  python -m benchmarks.report            # rewrite README.md, the docs pages, plots
  python -m benchmarks.report --check    # exit 1 when any of them differs
  python -m benchmarks.report --no-plots # tables only (no matplotlib needed)

The generated parts sit between `<!-- benchmarks.report: NAME -->` and
`<!-- end benchmarks.report: NAME -->`; the text around them is the page's own.
The output depends only on the results files (no dates, no machine state):
rendering twice gives the same bytes.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import pathlib
import re
import subprocess
import sys
from benchmarks import record
from benchmarks import report_pages
from benchmarks import report_plots
from benchmarks import report_rows
from benchmarks.report_rows import table

REPO = record.REPO
README = REPO / "README.md"
DOCS_PAGE = REPO / "docs" / "benchmarks.md"
PLOTS_DIR = REPO / "docs" / "images" / "benchmarks"
_BLOCK = re.compile(
  r"(<!-- benchmarks\.report: (?P<name>[\w-]+) -->\n)(.*?)"
  r"(<!-- end benchmarks\.report: (?P=name) -->)",
  re.S,
)


def replace_blocks(text: str, blocks: dict[str, str], where: str) -> str:
  """`text` with each generated block's content replaced by `blocks[name]`;
  every name must have its markers, and every marker a name."""
  found = [m.group("name") for m in _BLOCK.finditer(text)]
  missing = sorted(set(blocks) - set(found))
  unknown = sorted(set(found) - set(blocks))
  if missing or unknown:
    raise ValueError(
      f"{where}: generated blocks {missing} have no markers, blocks {unknown} are unknown; "
      f"mark each with '<!-- benchmarks.report: NAME -->' ... "
      f"'<!-- end benchmarks.report: NAME -->' (names: {sorted(blocks)})."
    )
  return _BLOCK.sub(lambda m: m.group(1) + blocks[m.group("name")] + m.group(4), text)


def readme_table(results: report_rows.Results) -> str:
  rows = [
    [h.workload, h.jaxfeed, h.peer, h.ratio, h.measured]
    for h in report_rows.headlines(results, readme=True)
  ]
  if not rows:
    return "No runs recorded yet: see [benchmarks](docs/benchmarks.md).\n"
  return table(["workload", "jaxfeed", "best peer", "ratio", "measured"], rows)


def _headline_docs(results: report_rows.Results) -> str:
  rows = [
    [h.workload, h.jaxfeed, h.peer, h.ratio, h.target, h.measured, h.commands]
    for h in report_rows.headlines(results, readme=False)
  ]
  missing = report_rows.not_recorded(results)
  text = table(["workload", "jaxfeed", "best peer", "ratio", "target", "measured", "rerun"], rows)
  if missing:
    text += (
      "\nNot recorded yet (run the command, then `python -m benchmarks.report`): "
      + "; ".join(f"{name}: `{command}`" for name, command in missing)
      + ".\n"
    )
  return text


def _runs_docs(results: report_rows.Results) -> str:
  """One section per benchmark: how each recorded run was made, and its rows."""
  out = []
  for benchmark in results.benchmarks():
    out.append(f"### {benchmark}\n")
    for context, rows in results.runs_of(benchmark):
      out.append(report_rows.describe_run(context) + "\n")
      out.append(report_rows.rows_table(rows))
    out.append(f"Every field of these rows: `benchmarks/results/{benchmark}.json`.\n")
  return "\n".join(out) if out else "No runs recorded yet.\n"


def _plots_docs(plots: dict[str, str]) -> str:
  if not plots:
    return "No runs recorded yet.\n"
  return "\n".join(f"![{title}](images/benchmarks/{name})\n" for name, title in plots.items())


def render(
  results: report_rows.Results, readme: str, docs: str, plot_titles: dict[str, str]
) -> tuple[str, str]:
  """The README and the docs page with their generated blocks filled in."""
  readme = replace_blocks(readme, {"results": readme_table(results)}, "README.md")
  docs = replace_blocks(
    docs,
    {
      "headline": _headline_docs(results),
      "plots": _plots_docs(plot_titles),
      "runs": _runs_docs(results),
    },
    "docs/benchmarks.md",
  )
  return readme, docs


def render_page(results: report_rows.Results, page: str, text: str) -> str:
  """`text`, the page `page` of `report_pages.PAGES`, with its generated
  tables filled in."""
  return replace_blocks(text, report_pages.PAGES[page](results), page)


@dataclasses.dataclass(frozen=True)
class Output:
  path: pathlib.Path
  content: bytes


def outputs(results: report_rows.Results, plots: bool = True) -> list[Output]:
  """Every file the report writes, with its content."""
  images: dict[str, bytes] = {}
  titles: dict[str, str] = {}
  if plots:
    for name, (title, svg) in report_plots.render(results).items():
      images[name], titles[name] = svg, title
  else:  # the page names the same plots
    titles = report_plots.titles(results)
  readme, docs = render(
    results, README.read_text(encoding="utf-8"), DOCS_PAGE.read_text(encoding="utf-8"), titles
  )
  found = [Output(README, readme.encode()), Output(DOCS_PAGE, docs.encode())]
  for page in report_pages.PAGES:
    text = render_page(results, page, (REPO / page).read_text(encoding="utf-8"))
    found.append(Output(REPO / page, text.encode()))
  found += [Output(PLOTS_DIR / name, svg) for name, svg in images.items()]
  return found


def leftovers(written: list[Output]) -> list[pathlib.Path]:
  """Plots of an earlier rendering that this one no longer draws."""
  kept = {output.path for output in written}
  return sorted(p for p in PLOTS_DIR.glob("*.svg") if p not in kept)


def _code(source: str) -> str:
  """A module's syntax tree without its docstrings: what runs, whatever the
  layout (the formatter's line breaks, a reworded docstring)."""
  try:
    tree = ast.parse(source)
  except SyntaxError:
    return source
  for node in ast.walk(tree):
    body = getattr(node, "body", None)
    if (
      isinstance(body, list)
      and body
      and isinstance(body[0], ast.Expr)
      and isinstance(body[0].value, ast.Constant)
      and isinstance(body[0].value.value, str)
    ):
      body[0] = ast.Pass()
  return ast.dump(tree)


def _same_code(commit: str, path: str) -> bool:
  """Whether `path` at `commit` runs the same code as at HEAD."""
  if not path.endswith(".py"):
    return False
  old, new = (
    subprocess.run(
      ["git", "show", f"{rev}:{path}"], cwd=REPO, capture_output=True, text=True, check=False
    )
    for rev in (commit, "HEAD")
  )
  return old.returncode == 0 and new.returncode == 0 and _code(old.stdout) == _code(new.stdout)


def stale(results: report_rows.Results) -> list[str]:
  """Runs whose commit's code (jaxfeed/, benchmarks/) differs from HEAD's:
  what they measured is no longer the code in the repository. The files that
  record and render results measure nothing and do not count, nor do changes
  of layout or docstrings alone (`_code`)."""
  notes = []
  for commit in sorted(results.commits()):
    changed = subprocess.run(
      [
        "git",
        "diff",
        "--name-only",
        commit,
        "HEAD",
        "--",
        "jaxfeed",
        "benchmarks",
        ":(exclude)benchmarks/results",
        ":(exclude)benchmarks/report*.py",
        ":(exclude)benchmarks/record.py",
      ],
      cwd=REPO,
      capture_output=True,
      text=True,
      check=False,
    ).stdout.split()
    changed = [path for path in changed if not _same_code(commit, path)]
    if changed:
      where = sorted({"/".join(path.split("/")[:2]) for path in changed})
      notes.append(
        f"runs at {commit[:7]}: {len(changed)} files changed since, in "
        f"{', '.join(where)}; rerun the runs that use them"
      )
  return notes


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument(
    "--check",
    action="store_true",
    help="write nothing; exit 1 when a file differs from what it renders",
  )
  parser.add_argument("--no-plots", action="store_true", help="tables only, no matplotlib")
  parser.add_argument(
    "--results",
    type=pathlib.Path,
    default=None,
    help="the results folder (default: $JAXFEED_BENCHMARK_RESULTS or benchmarks/results)",
  )
  args = parser.parse_args(argv)
  results = report_rows.Results.load(args.results)
  differ = []
  written = outputs(results, plots=not args.no_plots)
  if not args.no_plots:
    for path in leftovers(written):
      print(
        f"{path.relative_to(REPO)}: no longer drawn" + ("" if args.check else "; removed"),
        file=sys.stderr,
      )
      if args.check:
        differ.append(path.relative_to(REPO))
      else:
        path.unlink()
  for output in written:
    old = output.path.read_bytes() if output.path.exists() else None
    if old == output.content:
      continue
    differ.append(output.path.relative_to(REPO))
    if not args.check:
      output.path.parent.mkdir(parents=True, exist_ok=True)
      output.path.write_bytes(output.content)
  for note in stale(results):
    print(f"note: {note}", file=sys.stderr)
  if args.check:
    for path in differ:
      print(f"{path} differs from what `python -m benchmarks.report` renders", file=sys.stderr)
    return 1 if differ else 0
  for path in differ:
    print(f"wrote {path}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
