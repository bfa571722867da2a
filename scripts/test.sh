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
# Debian's Chromium for tests/test_web_page.py (a real browser; Playwright cannot download its own
# here). Skipped where there is no apt-get; the test then skips, except in CI where it fails.
if ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
  sudo=""
  if [ "$(id -u)" -ne 0 ] && command -v sudo >/dev/null 2>&1; then sudo="sudo"; fi
  $sudo apt-get update -q >/dev/null && $sudo apt-get install -y -q chromium >/dev/null
fi
.venv-test/bin/ruff check .
# Every test, the slow ones too (plain `pytest` leaves them out: pyproject.toml), on two workers
# (pytest-xdist), a test file's tests on one worker (its module fixtures are then made once); then
# the tests that bound a wall time, alone, so that the other worker's load does not decide them.
# Exit status 5 is pytest's "no test selected" (a pass that a path given here leaves empty).
# The processes that load MKL (a `dflash serve`, training children) keep it to one thread there: the
# two workers hold the two cores, and MKL's threads, spinning between products, took CPU from the
# other worker (training under load: 36 s, 28 with one thread). Each test compares outputs made in
# one process, so the thread count decides no outcome.
status=0
MKL_NUM_THREADS=1 .venv-test/bin/python -m pytest -m "(slow or not slow) and not timed" -n 2 --dist loadfile "$@" || status=$?
[ "$status" -eq 5 ] && status=0
timed=0
.venv-test/bin/python -m pytest -m timed "$@" || timed=$?
[ "$timed" -eq 5 ] && timed=0
[ "$status" -ne 0 ] && exit "$status"
exit "$timed"
