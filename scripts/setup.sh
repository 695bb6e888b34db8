#!/usr/bin/env bash
# Idempotent set-up on a fresh machine: Debian zip/unzip (used by tests), a .venv with the pinned
# CPU torch and the dev dependencies, and tdz_numba installed in editable mode.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v zip >/dev/null || ! command -v unzip >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    (apt-get update -qq && apt-get install -y -qq zip unzip) >/dev/null
  else
    echo "note: install the 'zip' and 'unzip' tools for the interop tests" >&2
  fi
fi
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -r requirements-dev.txt
.venv/bin/python -m pip install -q --no-deps -e .
