#!/usr/bin/env bash
# Compile check of the CUDA kernels, without a GPU and without TensorFlow.
#
# Compiles every custom_ops/cc/kernels/*.cu.cc with `nvcc -std=c++17 -c -x cu`
# and GOOGLE_CUDA undefined, i.e. the TensorFlow-free part of each file (the
# __global__ kernels and their extern "C" launchers), into a temporary
# directory. Any compiler error fails the script. Exits 0 with a message when
# nvcc is not installed, so CPU-only machines can run it unconditionally.
#
#   scripts/check_cuda.sh            # TF-free part only (a few seconds per file)
#   scripts/check_cuda.sh --with-tf  # also the GOOGLE_CUDA part against the
#                                    # headers of the importable TensorFlow
#                                    # (CPU wheels ship them too; ~15 s per file)
#
# Environment: NVCC (default: nvcc on PATH), PYTHON (for --with-tf),
# NVCC_FLAGS (extra flags, e.g. -arch=sm_90).
set -euo pipefail
cd "$(dirname "$0")/.."

NVCC="${NVCC:-nvcc}"
if ! command -v "$NVCC" >/dev/null 2>&1; then
  echo "check_cuda: $NVCC not found; skipping the CUDA compile check."
  exit 0
fi

with_tf=0
for arg in "$@"; do
  case "$arg" in
    --with-tf) with_tf=1 ;;
    *) echo "check_cuda: unknown argument $arg" >&2; exit 2 ;;
  esac
done

shopt -s nullglob
sources=(custom_ops/cc/kernels/*.cu.cc)
if [ ${#sources[@]} -eq 0 ]; then
  echo "check_cuda: no *.cu.cc files found"
  exit 0
fi

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

tf_flags=()
if [ "$with_tf" = 1 ]; then
  read -r -a tf_flags <<<"$("${PYTHON:-python3}" -c \
    'import tensorflow as tf; print(" ".join(tf.sysconfig.get_compile_flags()))' 2>/dev/null)"
fi

# Each compile runs in the background (as many at once as there are cores) and leaves
# its verdict in $tmp/<name>.<label>.status; they are reported in the sources' order.
compile() {  # compile LABEL FLAGS... SRC
  local label="$1"; shift
  local src="${*: -1}"
  local base="$tmp/$(basename "$src" .cu.cc).$label"
  set -- "${@:1:$#-1}"
  if "$NVCC" -std=c++17 -x cu -I. ${NVCC_FLAGS:-} "$@" -c "$src" -o "$base.o" \
      >"$base.log" 2>&1; then
    echo ok >"$base.status"
  else
    echo FAILED >"$base.status"
  fi
}
jobs_max=$(nproc 2>/dev/null || echo 1)
spawn() {
  while [ "$(jobs -rp | wc -l)" -ge "$jobs_max" ]; do wait -n || true; done
  compile "$@" &
}

"$NVCC" --version | tail -n 1
labels=(plain)
[ "$with_tf" = 1 ] && labels+=(tf)
for src in "${sources[@]}"; do
  spawn plain "$src"
  if [ "$with_tf" = 1 ]; then
    spawn tf -DGOOGLE_CUDA=1 --expt-relaxed-constexpr -w "${tf_flags[@]}" "$src"
  fi
done
wait

failed=0
for src in "${sources[@]}"; do
  for label in "${labels[@]}"; do
    base="$tmp/$(basename "$src" .cu.cc).$label"
    if [ "$(cat "$base.status" 2>/dev/null)" = ok ]; then
      echo "check_cuda: ok      $src ($label)"
    else
      echo "check_cuda: FAILED  $src ($label)" >&2
      cat "$base.log" >&2
      failed=1
    fi
  done
done

if [ "$failed" != 0 ]; then
  echo "check_cuda: CUDA compilation FAILED (see above)" >&2
  exit 1
fi
echo "check_cuda: all ${#sources[@]} CUDA sources compile"
