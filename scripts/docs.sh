#!/usr/bin/env bash
# Builds the manual (Sphinx + MyST, API reference from the docstrings) into
# docs/_build/html; extra arguments go to sphinx-build (e.g. -W --keep-going).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e '.[docs]'
rm -rf docs/reference/generated   # stubs of names no longer exported would warn
.venv/bin/python -m sphinx -b html docs docs/_build/html "$@"
echo "The manual: docs/_build/html/index.html"
