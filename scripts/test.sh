#!/usr/bin/env bash
# Runs the whole test suite, after setting up a fresh machine if needed (scripts/setup.sh:
# the project's virtual environment .venv, see there for TFGC_VENV and PYTHON).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
source scripts/python_env.sh
exec "$TFGC_PY" -m pytest -q --durations=15 tests "$@"
