#!/usr/bin/env bash
# Sets up .venv (if needed), checks the layout and lints (ruff format, ruff
# check), type-checks (mypy, its cache in .mypy_cache) and runs the test
# suite; any failing step fails the run.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e '.[test]'
.venv/bin/ruff format --check .
.venv/bin/ruff check .
.venv/bin/mypy
exec .venv/bin/python -m pytest -n 2 -q "$@"
