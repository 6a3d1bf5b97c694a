#!/usr/bin/env bash
# One command for a machine with NVIDIA GPUs: every check CPU machines cannot run, a few
# minutes, one line per check (ok / n/s: not supported here / FAIL with the error).
# On a machine without a GPU it says so and exits 0. Run from a checkout after ./dev test
# (or with clusterwatch[all] and torch installed):   scripts/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
exec "$PY" scripts/gpu_check/main.py "$@"
