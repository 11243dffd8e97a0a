#!/usr/bin/env bash
# Sets up .venv (if needed) and runs the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e '.[test]'
exec .venv/bin/python -m pytest -n 2 -q "$@"
