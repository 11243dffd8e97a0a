#!/usr/bin/env bash
# Generates the API reference (HTML, from the docstrings) into docs/api.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e '.[docs]'
.venv/bin/python -m pdoc jaxfeed -o docs/api "$@"
echo "API reference in docs/api/index.html"
