#!/usr/bin/env bash
# Sets up .venv (if needed) and runs the main job: a Flax NNX transformer fed by
# jaxfeed.Loader on text that ships with Python (its standard library's source
# and help topics, mixed 70/30 and packed), on an 8-device CPU mesh.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e '.[examples]'
export XLA_FLAGS="${XLA_FLAGS:---xla_force_host_platform_device_count=8}"
exec .venv/bin/python -m examples.train_lm --flagfile=configs/lm.flags "$@"
