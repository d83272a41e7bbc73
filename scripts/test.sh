#!/usr/bin/env bash
# Runs the whole test suite (after setting up a fresh machine if needed).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec "${PYTHON:-python3}" -m pytest -q --durations=15 tests "$@"
