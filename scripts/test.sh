#!/usr/bin/env bash
# Install dflash with its test extras into ./.venv-test (its own environment, editable, once; the
# README's .venv stays as you made it) and run the whole test suite on the CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
if [ ! -x .venv-test/bin/python ]; then
  "$PYTHON" -m venv .venv-test
fi
.venv-test/bin/python -m pip install --quiet --upgrade pip
.venv-test/bin/python -m pip install --quiet -e ".[test]"
# The real agent CLIs that tests/test_agent_clis.py drives (npm, pinned in tests/agent_clis.py;
# about 1 GB in .agent-clis/, installed once per version set).
if command -v npm >/dev/null 2>&1; then
  clis="$(.venv-test/bin/python -c 'import sys; sys.path.insert(0, "tests"); from agent_clis import VERSIONS; print(*VERSIONS.values())')"
  if [ "$(cat .agent-clis/installed 2>/dev/null)" != "$clis" ]; then
    # shellcheck disable=SC2086  # one argument per package
    npm install --prefix .agent-clis --no-audit --no-fund --loglevel=error $clis >/dev/null
    echo "$clis" > .agent-clis/installed
  fi
fi
.venv-test/bin/ruff check .
# Every test, the slow ones too (plain `pytest` leaves them out: pyproject.toml).
exec .venv-test/bin/python -m pytest -m "slow or not slow" "$@"
