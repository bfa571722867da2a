#!/usr/bin/env bash
# Install dflash with its test extras into ./.venv (once) and run the whole test suite on the CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet -e ".[test,demo]"
exec .venv/bin/python -m pytest "$@"
