#!/usr/bin/env bash
# Builds build/cuda_harness/libtfgc_cuda.so (git-ignored): the TensorFlow-free part of
# every custom_ops/cc/kernels/*.cu.cc (kernels + extern "C" launchers) plus the
# harness' memory helpers. Needs nvcc only (no TensorFlow, no GPU to build).
#
#   custom_ops/cuda_harness/build.sh [OUTPUT]
#
# CUDA_ARCH selects the target (nvcc -arch value). Default: "native" when a
# GPU is visible to nvidia-smi, else nvcc's default target, whose embedded PTX
# is JIT-compiled for newer GPUs at load time.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
out="${1:-$root/build/cuda_harness/libtfgc_cuda.so}"
mkdir -p "$(dirname "$out")"
NVCC="${NVCC:-nvcc}"

arch=()
if [ -n "${CUDA_ARCH:-}" ]; then
  arch=("-arch=$CUDA_ARCH")
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  arch=("-arch=native")
fi

shopt -s nullglob
sources=("$root"/custom_ops/cc/kernels/*.cu.cc)
set -x
"$NVCC" -std=c++17 -O3 -shared -Xcompiler -fPIC "${arch[@]}" -I"$root" \
  -x cu "${sources[@]}" "$here/harness_util.cu" -o "$out"
