"""The CUDA kernels must keep compiling, even on CI machines without a GPU.

Runs scripts/check_cuda.sh (nvcc on the TensorFlow-free part of every
custom_ops/cc/kernels/*.cu.cc). Skipped when nvcc is not installed. Set
TFGC_CHECK_CUDA_WITH_TF=1 to also compile the GOOGLE_CUDA parts against the
installed TensorFlow's headers (about a minute).
"""

import ctypes
import os
import re
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "check_cuda.sh")
NVCC = os.environ.get("NVCC", "nvcc")

pytestmark = pytest.mark.skipif(shutil.which(NVCC) is None, reason="nvcc is not installed")


def run(script, *args, cwd=ROOT):
    return subprocess.run(["bash", script, *args], cwd=cwd, capture_output=True, text=True,
                          timeout=600)


def test_cuda_sources_compile():
    args = ["--with-tf"] if os.environ.get("TFGC_CHECK_CUDA_WITH_TF") == "1" else []
    proc = run(SCRIPT, *args)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "all" in proc.stdout and "CUDA sources compile" in proc.stdout


def test_check_cuda_fails_on_a_broken_kernel(tmp_path):
    # Same script in a scratch tree with one good and one broken kernel file.
    (tmp_path / "scripts").mkdir()
    shutil.copy(SCRIPT, tmp_path / "scripts" / "check_cuda.sh")
    kernels = tmp_path / "custom_ops" / "cc" / "kernels"
    kernels.mkdir(parents=True)
    (kernels / "good_gpu.cu.cc").write_text("__global__ void k(int* p) { *p = 1; }\n")
    (kernels / "bad_gpu.cu.cc").write_text("__global__ void k(int* p) { *p = undefined_name; }\n")
    proc = run(str(tmp_path / "scripts" / "check_cuda.sh"), cwd=tmp_path)
    assert proc.returncode != 0
    assert "FAILED" in proc.stderr and "undefined_name" in proc.stderr
    assert "ok      custom_ops/cc/kernels/good_gpu.cu.cc" in proc.stdout


def test_harness_library_links(tmp_path):
    # The standalone harness library must link (it cannot run without a GPU):
    # every extern "C" launcher the harness calls has to be exported.
    out = tmp_path / "libtfgc_cuda.so"
    proc = subprocess.run(["bash", os.path.join(ROOT, "custom_ops", "cuda_harness", "build.sh"),
                           str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lib = ctypes.CDLL(str(out))  # static CUDA runtime: loads without a driver
    with open(os.path.join(ROOT, "custom_ops", "cuda_harness", "harness.py")) as f:
        called = set(re.findall(r"\b(tfgc_(?:cuda|harness)_\w+)", f.read()))
    # Every kernel family is reached through the harness.
    for family in ("sign_bits", "onebit", "threshold", "quantize", "scatter_add", "sparsify",
                   "block_hadamard"):
        assert any(family in name for name in called), family
    missing = sorted(name for name in called if not hasattr(lib, name))
    assert not missing, missing
