# Sourced by setup.sh, test.sh and demo.sh: names the Python that tfgc is installed in.
#
#   TFGC_VENV unset    .venv in the repository (created by setup.sh from $PYTHON or python3)
#   TFGC_VENV=DIR      the virtual environment DIR (created if missing)
#   TFGC_VENV=0        $PYTHON (default python3) itself, no virtual environment
#
# Sets TFGC_PY (the interpreter), TFGC_PY_MODE (venv or system) and TFGC_VENV_DIR.
case "${TFGC_VENV:-}" in
  0|no|false|off)
    TFGC_PY_MODE=system
    TFGC_VENV_DIR=""
    TFGC_PY=$(command -v "${PYTHON:-python3}" || echo "${PYTHON:-python3}")
    ;;
  *)
    TFGC_PY_MODE=venv
    TFGC_VENV_DIR=${TFGC_VENV:-$(pwd)/.venv}
    TFGC_PY=$TFGC_VENV_DIR/bin/python
    ;;
esac
