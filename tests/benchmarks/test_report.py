"""The README's results table, the benchmark page's tables and the
dispatcher-scale page's tables are what `python -m benchmarks.report`
renders from benchmarks/results/, byte for byte; benchmark runs record
their rows with their context.

No benchmark runs here: the recorded files are read, and the record module
is exercised with rows made up for the purpose.
"""

import copy
import json
import re
import subprocess
import sys

import pytest

from benchmarks import record
from benchmarks import report
from benchmarks import report_dispatcher
from benchmarks import report_pages
from benchmarks import report_plots
from benchmarks import report_rows


def _recorded() -> report_rows.Results:
  # Not $JAXFEED_BENCHMARK_RESULTS: the tests point that at a temporary folder.
  return report_rows.Results.load(record.RESULTS_DIR)


def _rendered() -> tuple[str, str]:
  return report.render(
    _recorded(),
    report.README.read_text(encoding="utf-8"),
    report.DOCS_PAGE.read_text(encoding="utf-8"),
    report_plots.titles(_recorded()),
  )


def test_readme_table_is_rendered_from_the_recorded_runs():
  readme, _ = _rendered()
  assert report.README.read_text(encoding="utf-8") == readme, (
    "README.md's results table differs from the recorded runs: edit "
    "benchmarks/results/ (rerun the benchmark), then `python -m benchmarks.report`."
  )


def test_benchmark_page_tables_are_rendered_from_the_recorded_runs():
  _, docs = _rendered()
  assert report.DOCS_PAGE.read_text(encoding="utf-8") == docs, (
    "docs/benchmarks.md differs from the recorded runs: `python -m benchmarks.report`."
  )


@pytest.mark.parametrize("page", sorted(report_pages.PAGES))
def test_docs_pages_tables_are_rendered_from_the_recorded_runs(page):
  text = (record.REPO / page).read_text(encoding="utf-8")
  assert report.render_page(_recorded(), page, text) == text, (
    f"{page} differs from the recorded runs: `python -m benchmarks.report`."
  )


def test_every_rendered_page_counts_as_an_output_of_the_report():
  """A checkout that differs only in what the report writes still runs its commit's code."""
  assert set(report_pages.PAGES) <= set(record.OUTPUTS)


def test_a_hand_edited_dispatcher_figure_is_put_back():
  page = "docs/dispatcher_scale.md"
  text = (record.REPO / page).read_text(encoding="utf-8")
  row = next(line for line in text.splitlines() if line.startswith("| 1,024 / 2,048 | 60 s |"))
  edited = text.replace(row, "| 1,024 / 2,048 | 60 s | 9999 | 0.1 | 0.01 ms | 0 |")
  assert edited != text
  assert report.render_page(_recorded(), page, edited) == text


def test_a_missed_dispatcher_target_is_marked(tmp_path, monkeypatch):
  monkeypatch.setenv(record.ENV_DIR, str(tmp_path))
  line, context = max(
    _recorded().rows("dispatcher_scale", "dispatcher scale"), key=lambda rc: rc[0]["workers"]
  )
  slow = copy.deepcopy(line)
  slow["latency_ms"]["GetSplits"]["p99"] = 150.0
  slow["failed_rpcs"] = 3
  record.save("dispatcher_scale", {"context": context, "rows": [slow]})
  text = report_dispatcher.targets(report_rows.Results.load(tmp_path))
  assert "| every RPC kind's callers' p99 <= 100 ms | 150 ms (GetSplits) | **no** |" in text
  assert "| no failed RPC | 3 | **no** |" in text
  assert "| restart replay <= 5 s |" in text and "s | yes |" in text


def test_the_projection_paces_heartbeats_as_the_dispatcher_does():
  calls = report_dispatcher.modelled_rpcs(1024)
  # Both caps bind: workers every 10 / 3 s, clients every 60 / 10 s; splits
  # of 256 x 1024 / 32 positions, 2 a call, 1,000 positions a second per task.
  assert calls["WorkerHeartbeat"] == pytest.approx(1024 / (10 / 3))
  assert calls["ClientHeartbeat"] == pytest.approx(2048 / 6)
  assert calls["GetSplits"] == pytest.approx(2 * 1024 * 1000 / (2 * 256 * 32))
  # A few workers keep their own intervals (0.5 s; clients 0.1 s).
  assert report_dispatcher.modelled_rpcs(16)["WorkerHeartbeat"] == pytest.approx(32)
  assert report_dispatcher.largest_within(0.6, 0.5) > report_dispatcher.largest_within(0.6, 1.0)


def test_readme_has_recorded_headline_rows():
  table = report.readme_table(_recorded())
  assert "| W2 elements/s" in table and "(earlier)" not in table


def test_a_hand_edited_figure_is_put_back():
  readme = report.README.read_text(encoding="utf-8")
  row = next(line for line in readme.splitlines() if line.startswith("| W2 elements/s"))
  edited = readme.replace(row, "| W2 elements/s, `map` per element | 99.9M | Grain 1k | 99x | |")
  assert edited != readme
  rendered, _ = report.render(_recorded(), edited, report.DOCS_PAGE.read_text(encoding="utf-8"), {})
  assert rendered == readme


def test_missing_markers_are_named():
  with pytest.raises(
    ValueError, match=r"README.md: generated blocks \['results'\] have no markers"
  ):
    report.replace_blocks("# no table here\n", {"results": "x\n"}, "README.md")


def test_a_run_records_its_rows_and_context(tmp_path, monkeypatch):
  monkeypatch.setenv(record.ENV_DIR, str(tmp_path))
  with record.run("made_up"):
    record.row({"workload": "W0", "system": "jaxfeed", "rate": 1.0})
    record.row({"workload": "W0", "system": "peer", "rate": 2.0}, echo=False)
  (entry,) = json.loads((tmp_path / "made_up.json").read_text())["runs"]
  context = entry["context"]
  assert {
    "commit",
    "dirty",
    "machine",
    "load_average_start",
    "load_average_end",
    "date",
    "versions",
    "command",
  } <= set(context)
  assert context["machine"]["cores"] >= 1 and context["machine"]["cpu_model"]
  assert context["versions"]["python"] and "jax" in context["versions"]
  assert [r["system"] for r in entry["rows"]] == ["jaxfeed", "peer"]


def test_a_failed_run_records_nothing(tmp_path, monkeypatch):
  monkeypatch.setenv(record.ENV_DIR, str(tmp_path))
  with pytest.raises(RuntimeError):
    with record.run("made_up"):
      record.row({"workload": "W0", "system": "jaxfeed", "rate": 1.0})
      raise RuntimeError("the benchmark failed half way")
  assert not (tmp_path / "made_up.json").exists()


def test_a_rerun_replaces_the_rows_it_measured_and_keeps_the_others(tmp_path, monkeypatch):
  monkeypatch.setenv(record.ENV_DIR, str(tmp_path))
  context = {"commit": "a" * 40}
  record.save(
    "made_up",
    {
      "context": context,
      "rows": [
        {"workload": "W2", "system": "jaxfeed", "rate": 1.0},
        {"workload": "W3", "system": "jaxfeed", "rate": 3.0},
      ],
    },
  )
  record.save(
    "made_up",
    {
      "context": {"commit": "b" * 40},
      "rows": [{"workload": "W2", "system": "jaxfeed", "rate": 2.0}],
    },
  )
  text = (tmp_path / "made_up.json").read_text()
  runs = json.loads(text)["runs"]
  assert [(r["context"]["commit"][0], [x["rate"] for x in r["rows"]]) for r in runs] == [
    ("a", [3.0]),
    ("b", [2.0]),
  ]
  assert '    {"workload": "W2", "system": "jaxfeed", "rate": 2.0}' in text.splitlines()


def _w1_rows() -> list[dict]:
  """W1's rows as `benchmarks.w1_per_element` writes them."""
  made = [
    ("jaxfeed AUTOTUNE", 9000.0),
    ("jaxfeed no parallelism", 4000.0),
    ("tf.data (tf.image ops)", 3000.0),
    ("grain (multiprocessing)", 2000.0),
    ("bare single-thread loop", 5000.0),
  ]
  return [
    {
      "workload": "W1 per-element",
      "system": name,
      "unit": "images/s",
      "rate": rate,
      "main_row": True,
      **(
        {"picked": {"op": "from_source+random_map+batch", "backend": "process", "num_workers": 2}}
        if name == "jaxfeed AUTOTUNE"
        else {}
      ),
    }
    for name, rate in made
  ]


def test_w1_rows_appear_once_recorded(tmp_path, monkeypatch):
  monkeypatch.setenv(record.ENV_DIR, str(tmp_path))
  assert report_rows.w1(report_rows.Results.load(tmp_path)) is None
  record.save(
    "w1_per_element",
    {
      "context": {
        "commit": "c" * 40,
        "dirty": False,
        "machine": {"cores": 2},
        "load_average_start": [1.0, 1, 1],
        "load_average_end": [2.0, 1, 1],
      },
      "rows": _w1_rows(),
    },
  )
  table = report.readme_table(report_rows.Results.load(tmp_path))
  assert (
    "| W1 images/s, a per-element function as users write it, AUTOTUNE | 9000 (on process) "
    "| tf.data (tf.image ops) 3000 | 3.00x | `ccccccc`, 2 cores, load 1.0-2.0 |"
  ) in table


def test_check_exits_nonzero_when_the_readme_differs(tmp_path):
  """`--check` over other results than the README's: it must say so."""
  (tmp_path / "run.json").write_text(record.dumps({"benchmark": "run", "runs": []}))
  done = subprocess.run(
    [
      sys.executable,
      "-m",
      "benchmarks.report",
      "--check",
      "--no-plots",
      "--results",
      str(tmp_path),
    ],
    cwd=record.REPO,
    capture_output=True,
    text=True,
    timeout=60,
    check=False,
  )
  assert done.returncode == 1, done.stderr
  assert "README.md differs from what `python -m benchmarks.report` renders" in done.stderr
  assert (
    "docs/dispatcher_scale.md differs from what `python -m benchmarks.report` renders"
    in done.stderr
  )


# A rate (MB/s, images/s, RPC/s, ...), a ratio (2.5x) or a tail latency
# (p99 ... 12 ms): what a benchmark measures.
_MEASURED = re.compile(
  r"\d[\d.,]*\s*[kMG]?\s*(?:MB/s|GB/s|KB/s|MiB/s|GiB/s|img/s|images/s|tokens/s|elements/s"
  r"|sequences/s|seq/s|RPC/s|calls/s|changes/s)"
  r"|\b\d+(?:\.\d+)?x\b(?! *\d)"
  r"|\bp(?:50|90|99)\b[^.|\n]{0,12}?\d+(?:\.\d+)? ?ms",
  re.I,
)
_GENERATED = re.compile(
  r"<!-- benchmarks\.report: ([\w-]+) -->.*?"
  r"<!-- end benchmarks\.report: \1 -->",
  re.S,
)


def _measured_figures_typed_by_hand(text: str) -> list[str]:
  return [m.group(0) for m in _MEASURED.finditer(_GENERATED.sub("", text))]


def test_no_measured_figure_is_typed_by_hand_in_the_docs():
  pages = [record.REPO / "README.md", *sorted((record.REPO / "docs").rglob("*.md"))]
  typed = {
    str(page.relative_to(record.REPO)): found
    for page in pages
    if (found := _measured_figures_typed_by_hand(page.read_text(encoding="utf-8")))
  }
  assert not typed, (
    f"measured figures typed by hand: {typed}; render them from benchmarks/results/ "
    "(a block of benchmarks/report_pages.py) or say it without the number."
  )


def test_hand_typed_figures_are_found_and_rendered_ones_are_not():
  assert _measured_figures_typed_by_hand(
    "ran 5.8 MB/s against 3.9 (1.5x); 13.4k images/s; p99 of 25 ms; a 64x64 image"
  ) == ["5.8 MB/s", "1.5x", "13.4k images/s", "p99 of 25 ms"]
  assert (
    _measured_figures_typed_by_hand(
      "<!-- benchmarks.report: w8 -->\n| 48.5M tokens/s | 6.39x |\n"
      "<!-- end benchmarks.report: w8 -->\n"
    )
    == []
  )


def test_a_run_goes_stale_when_the_code_changes_not_its_layout(tmp_path, monkeypatch):
  # The formatter's line breaks and a reworded docstring leave a run's
  # figures standing; a changed expression does not.
  repo = tmp_path / "repo"
  (repo / "jaxfeed").mkdir(parents=True)
  module = repo / "jaxfeed" / "op.py"

  def commit(text: str) -> str:
    module.write_text(text, encoding="utf-8")
    subprocess.run(["git", "add", "-A"], cwd=repo, check=True)
    subprocess.run(
      ["git", "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "c"],
      cwd=repo,
      check=True,
    )
    return subprocess.run(
      ["git", "rev-parse", "HEAD"], cwd=repo, check=True, capture_output=True, text=True
    ).stdout.strip()

  subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
  measured = commit('"""Op."""\n\ndef f(a, b):\n  return g(a,\n           b)\n')

  class Results:
    def commits(self):
      return {measured}

  monkeypatch.setattr(report, "REPO", repo)
  commit('"""The op, reworded."""\n\n\ndef f(a, b):\n  return g(\n    a,\n    b,\n  )\n')
  assert report.stale(Results()) == []
  commit('"""Op."""\n\ndef f(a, b):\n  return g(b, a)\n')
  assert report.stale(Results()) == [
    f"runs at {measured[:7]}: 1 files changed since, in jaxfeed/op.py; rerun the runs that use them"
  ]
