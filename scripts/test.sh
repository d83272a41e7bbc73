#!/usr/bin/env bash
# Runs the whole test suite, after setting up a fresh machine if needed (scripts/setup.sh:
# the project's virtual environment .venv, see there for TFGC_VENV and PYTHON).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
source scripts/python_env.sh
# Two pytest-xdist workers (TFGC_TEST_WORKERS; 1: a single process), each given a whole
# test module at a time, so a module's clusters serve all of its tests; tests/conftest.py
# hands out the longest modules first. On 2 cores the suite's clusters leave a core idle
# about a third of the time in one process; two took 1274-1283 s instead of 1516 s.
workers=${TFGC_TEST_WORKERS:-2}
parallel=()
if [ "$workers" -gt 1 ]; then
  parallel=(-n "$workers" --dist loadfile --no-loadscope-reorder)
fi
exec "$TFGC_PY" -m pytest -q --durations=15 "${parallel[@]}" tests "$@"
