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
sources=("$root"/custom_ops/cc/kernels/*.cu.cc "$here/harness_util.cu")
# One object per source, compiled side by side (as many at once as there are cores),
# then linked: no kernel calls across files, so no relocatable device code is needed.
objs="$(mktemp -d)"
trap 'rm -rf "$objs"' EXIT
jobs_max=$(nproc 2>/dev/null || echo 1)
pids=()
for i in "${!sources[@]}"; do
  while [ "$(jobs -rp | wc -l)" -ge "$jobs_max" ]; do wait -n || true; done
  (set -x; "$NVCC" -std=c++17 -O3 -Xcompiler -fPIC "${arch[@]}" -I"$root" \
     -x cu -c "${sources[$i]}" -o "$objs/$i.o") &
  pids+=($!)
done
for pid in "${pids[@]}"; do wait "$pid"; done
set -x
"$NVCC" -shared "${arch[@]}" "$objs"/*.o -o "$out"
