#!/usr/bin/env python3
"""Standalone correctness harness for tfgc's CUDA kernels (no TensorFlow).

Loads libtfgc_cuda.so (built by build.sh from the TensorFlow-free part of
custom_ops/cc/kernels/*.cu.cc) through ctypes, runs every kernel on random
inputs with injected special values (NaN, +-Inf, -0.0, ragged sizes) and
compares the results with NumPy oracles that restate the CPU ops' semantics:

  pack_sign_bits / unpack_sign_bits   bit = (x >= 0), LSB first
  onebit_quantize / onebit_dequantize per-column class means (Seide et al.)
  threshold_encode / threshold_decode Strom 2015 / Dryden et al. 2016 words
  quantize_bucketed / dequantize_*    QSGD / TernGrad codes, Philox uniforms
  sparsify_topk / sparsify_sampled    top-k of |x + residual| (exact radix
                                      select; DGC mode's contract)
  sparsify_by_threshold               v >= pos or v <= neg selection
  scatter_add_payloads                sparse (value, index) decode
  block_hadamard                      randomized block Hadamard rotation

Prints PASS / FAIL per kernel and dtype; exits 1 if anything failed, 2 if no
CUDA device could be used.

    python custom_ops/cuda_harness/harness.py [--lib PATH]

``--backend tf`` runs the same checks against tfgc's compiled TensorFlow CPU
ops instead (needs TensorFlow and tfgc, no GPU): it validates the oracles and
the harness itself on a machine without a GPU.
"""

import argparse
import ctypes
import os
import sys

import numpy as np

DTYPES = ["float32", "float16", "bfloat16"]
DTYPE_CODE = {"float32": 0, "float16": 1, "bfloat16": 2}
HERE = os.path.dirname(os.path.abspath(__file__))


# ---------------------------------------------------------------------------
# Raw storage: float32 arrays, or uint16 bit patterns for float16 / bfloat16
# (NumPy has no bfloat16; conversions below round to nearest even like CUDA's
# intrinsics and Eigen).

def raw_dtype(dt):
    return np.float32 if dt == "float32" else np.uint16


def to_f32(raw, dt):
    raw = np.asarray(raw)
    if dt == "float32":
        return raw.astype(np.float32)
    if dt == "float16":
        return raw.view(np.float16).astype(np.float32)
    return (raw.astype(np.uint32) << 16).view(np.float32)


def from_f32(f, dt):
    f = np.asarray(f, np.float32)
    if dt == "float32":
        return f.copy()
    if dt == "float16":
        with np.errstate(over="ignore", invalid="ignore"):
            return f.astype(np.float16).view(np.uint16)
    u = f.view(np.uint32).astype(np.uint64)
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    return np.where(nan, ((u >> 16) & 0x8000) | 0x7FC0, rounded).astype(np.uint16)


def round_to(value, dt):
    return np.float32(to_f32(from_f32(np.float32([value]), dt), dt)[0])


def same_values(a, b, dt):
    """Bit-exact equality of raw arrays, except that all NaNs are equal."""
    fa, fb = to_f32(a, dt), to_f32(b, dt)
    if fa.shape != fb.shape:
        return False
    na, nb = np.isnan(fa), np.isnan(fb)
    if not np.array_equal(na, nb):
        return False
    return np.array_equal(np.asarray(a)[~na], np.asarray(b)[~nb])


def random_raw(n, dt, rng, scale=1.0, specials=True):
    x = (rng.standard_normal(n) * scale).astype(np.float32)
    if specials and n >= 8:
        k = rng.choice(n, size=min(8, n), replace=False)
        x[k] = np.float32([np.nan, -np.nan, np.inf, -np.inf, 0.0, -0.0, 1.0, -1.0])[:k.size]
    return from_f32(x, dt)


# ---------------------------------------------------------------------------
# NumPy oracles.

def np_pack(x_f32):
    bits = np.asarray(x_f32).ravel() >= 0  # NaN -> False
    bits = np.concatenate([bits, np.zeros((-bits.size) % 32, bool)])
    return np.packbits(bits, bitorder="little").view("<u4").astype(np.uint32).view(np.int32)


def np_bits(words, n):
    words = np.asarray(words, dtype="<i4")
    return np.unpackbits(words.view(np.uint8), bitorder="little")[:n].astype(bool)


def np_means(x_f32):
    x64 = x_f32.astype(np.float64)
    pos = x_f32 >= 0
    rows = x_f32.shape[0]
    with np.errstate(invalid="ignore"):
        ps = np.where(pos, x64, 0.0).sum(axis=0)
        ns = np.where(pos, 0.0, x64).sum(axis=0)
    pc = pos.sum(axis=0)
    return ((ps / np.maximum(pc, 1)).astype(np.float32),
            (ns / np.maximum(rows - pc, 1)).astype(np.float32))


def np_quantize_residual(x_raw, pos_mean, neg_mean, dt):
    xf = to_f32(x_raw, dt)
    mean = np.where(xf >= 0, pos_mean, neg_mean).astype(np.float32)
    mean = to_f32(from_f32(mean, dt), dt)
    with np.errstate(invalid="ignore", over="ignore"):
        return from_f32(xf - mean, dt)


def np_encode(x_raw, r_raw, pt, nt, dt):
    # float32 arithmetic flushes subnormals, as TensorFlow's CPU threads do
    # (see flush_subnormals).
    with np.errstate(invalid="ignore", over="ignore"):
        total = flush_subnormals(to_f32(x_raw, dt)) + flush_subnormals(to_f32(r_raw, dt))
        v = to_f32(from_f32(flush_subnormals(total), dt), dt)
        pos, neg = v >= pt, v <= nt
        diff = np.where(pos, v - pt, np.where(neg, v - nt, v)).astype(np.float32)
        res = from_f32(flush_subnormals(diff), dt)
    index = np.flatnonzero(pos | neg).astype(np.int64)
    return (index * 2 + pos[index]).astype(np.int32), res


def np_decode(words, pv, nv, n, dt):
    words = np.asarray(words, np.int64)
    index = words >> 1
    cp = np.bincount(index[words & 1 == 1], minlength=n)[:n]
    cn = np.bincount(index[words & 1 == 0], minlength=n)[:n]
    with np.errstate(invalid="ignore", over="ignore"):
        p = cp.astype(np.float32) * np.float32(pv)
        q = cn.astype(np.float32) * np.float32(nv)
        out = np.where(cp > 0, np.where(cn > 0, p + q, p), np.where(cn > 0, q, np.float32(0)))
    return from_f32(out.astype(np.float32), dt)


# Philox-4x32-10 and TensorFlow's stateless seed scrambling, as the CPU op
# and quantize_gpu.cu.cc implement them: element i of
# tf.random.stateless_uniform([N], seed) is output i % 4 of counter
# (lo64 = i // 4, hi64 = counter_hi) under the scrambled key.
PHILOX_MASK = np.uint64(0xFFFFFFFF)


def np_philox(c0, c1, c2, c3, k0, k1):
    c0, c1, c2, c3 = (np.asarray(c, np.uint64) & PHILOX_MASK for c in (c0, c1, c2, c3))
    k0, k1 = np.uint64(k0), np.uint64(k1)
    for _ in range(10):
        p0 = np.uint64(0xD2511F53) * c0
        p1 = np.uint64(0xCD9E8D57) * c2
        c0, c1, c2, c3 = ((p1 >> np.uint64(32)) ^ c1 ^ k0, p1 & PHILOX_MASK,
                          (p0 >> np.uint64(32)) ^ c3 ^ k1, p0 & PHILOX_MASK)
        k0 = (k0 + np.uint64(0x9E3779B9)) & PHILOX_MASK
        k1 = (k1 + np.uint64(0xBB67AE85)) & PHILOX_MASK
    return c0, c1, c2, c3


def np_philox_stream(seed):
    s0, s1 = (int(v) & 0xFFFFFFFFFFFFFFFF for v in seed)
    out = np_philox([s0 & 0xFFFFFFFF], [s0 >> 32], [s1 & 0xFFFFFFFF], [s1 >> 32],
                    0x3EC8F720, 0x02461E29)
    return [int(o[0]) for o in out]  # key0, key1, counter_hi0, counter_hi1


def np_uniform_bits(n, seed):
    k0, k1, h0, h1 = np_philox_stream(seed)
    g = np.arange(-(-n // 4), dtype=np.uint64)
    outs = np_philox(g & PHILOX_MASK, g >> np.uint64(32), np.full_like(g, h0),
                     np.full_like(g, h1), k0, k1)
    return np.stack(outs, axis=1).ravel()[:n].astype(np.uint32)


def np_bucket_scales(x_f32, d, max_norm):
    n = x_f32.size
    nb = max(1, -(-n // d))
    xp = np.concatenate([x_f32, np.zeros(nb * d - n, np.float32)]).reshape(nb, d)
    if max_norm:
        return (xp.view(np.uint32) & np.uint32(0x7FFFFFFF)).max(axis=1).view(np.float32)
    x64 = xp.astype(np.float64)
    return np.sqrt((x64 * x64).sum(axis=1)).astype(np.float32)


def np_pack_codes(codes, bits):
    k = 32 // bits
    codes = np.concatenate([codes.astype(np.uint64), np.zeros((-codes.size) % k, np.uint64)])
    shifts = (np.arange(k, dtype=np.uint64) * np.uint64(bits))
    return (codes.reshape(-1, k) << shifts).sum(axis=1).astype(np.uint32).view(np.int32)


def np_quantize_codes(x_f32, scales, seed, levels, d, bits):
    """Words of the CPU op given the per-bucket scales (float32 arithmetic)."""
    n = x_f32.size
    if n == 0:
        return np.zeros(0, np.int32)
    sf = np.float32(levels)
    sc = np.asarray(scales, np.float32)[np.arange(n) // d]
    vb = x_f32.view(np.uint32)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        a = ((sf * (vb & np.uint32(0x7FFFFFFF)).view(np.float32)) / sc).view(np.uint32)
    a = np.where((sc.view(np.uint32) == 0) | (a > 0x7F800000), np.uint32(0), a)
    a = np.minimum(a, sf.view(np.uint32)).astype(np.uint32)
    af = a.view(np.float32)
    lv = af.astype(np.int32)
    frac = af - lv.astype(np.float32)
    u = (np.uint32(0x3F800000) | (np_uniform_bits(n, seed) & np.uint32(0x7FFFFF))).view(
        np.float32) - np.float32(1)
    level = lv.astype(np.int64) + (u.view(np.uint32) < frac.view(np.uint32))
    codes = levels + np.where(vb >> np.uint32(31) == 1, -level, level)
    return np_pack_codes(codes, bits)


def np_unpack_codes(words, n, bits):
    k = 32 // bits
    w = np.asarray(words, np.int32).view(np.uint32).astype(np.uint64)
    shifts = np.arange(k, dtype=np.uint64) * np.uint64(bits)
    codes = (w[:, None] >> shifts) & np.uint64((1 << bits) - 1)
    return codes.ravel()[:n].astype(np.int64)


def np_dequantize(scales, words, n, levels, d, bits):
    """float32 values, or None if a used code exceeds 2 * levels."""
    codes = np_unpack_codes(words, n, bits)
    if codes.size and codes.max() > 2 * levels:
        return None
    so = np.asarray(scales, np.float32) / np.float32(levels)
    with np.errstate(invalid="ignore", over="ignore"):
        return (codes - levels).astype(np.float32) * so[np.arange(n) // d]


# Sparsification (sparsify.h): v = x + residual in float32, rounded once to
# the dtype; ranking key = |v|'s bit pattern + 1, 0 for NaN. The addition
# flushes float32 subnormals (inputs and result) to signed zero, as the CPU op
# does (TensorFlow's threads run with FTZ / DAZ) and the GPU kernel does
# explicitly (add.ftz).
KEY_ABS_MASK = {"float32": 0x7FFFFFFF, "float16": 0x7FFF, "bfloat16": 0x7FFF}
KEY_POS_INF = {"float32": 0x7F800000, "float16": 0x7C00, "bfloat16": 0x7F80}


def flush_subnormals(f):
    f = np.array(f, np.float32)
    bits = f.view(np.uint32)
    subnormal = ((bits & np.uint32(0x7F800000)) == 0) & ((bits & np.uint32(0x7FFFFF)) != 0)
    bits[subnormal] &= np.uint32(0x80000000)
    return f


def np_sparsify_v(x_raw, r_raw, dt):
    with np.errstate(invalid="ignore", over="ignore"):
        total = flush_subnormals(to_f32(x_raw, dt)) + flush_subnormals(to_f32(r_raw, dt))
        return from_f32(flush_subnormals(total), dt)


def np_keys(v_raw, dt):
    bits = np.asarray(v_raw).view(np.uint32 if dt == "float32" else np.uint16).astype(np.int64)
    a = bits & KEY_ABS_MASK[dt]
    return np.where(a <= KEY_POS_INF[dt], a + 1, 0)


def np_selection(v_raw, idx, with_mask):
    """(values, indices, new_residual, mask) of selecting ascending idx from v."""
    idx = np.asarray(idx, np.int64)
    res = v_raw.copy()
    res[idx] = 0  # +0.0 in every dtype
    mask = np.zeros(v_raw.size if with_mask else 0, bool)
    if with_mask:
        mask[idx] = True
    return v_raw[idx], idx.astype(np.int32), res, mask


def np_topk(x_raw, r_raw, k, dt, with_mask):
    v = np_sparsify_v(x_raw, r_raw, dt)
    n = v.size
    # Largest key first, ties to the lower index; then ascending indices.
    order = np.lexsort((np.arange(n), -np_keys(v, dt)))
    return np_selection(v, np.sort(order[:min(k, n)]), with_mask)


def np_sparsify_by_threshold(x_raw, r_raw, pos, neg, dt, with_mask):
    v = np_sparsify_v(x_raw, r_raw, dt)
    vf = to_f32(v, dt)
    with np.errstate(invalid="ignore"):
        selected = (vf >= np.float32(pos)) | (vf <= np.float32(neg))  # NaN: neither
    return np_selection(v, np.flatnonzero(selected), with_mask)


# ---------------------------------------------------------------------------
# Backends: the CUDA library through ctypes, or tfgc's TensorFlow CPU ops.

def np_block_hadamard(x, signs, block, inverse):
    """The rotation's butterflies in float32, each operation flushing subnormals
    on input and output as TensorFlow's CPU threads do (see flush_subnormals)."""
    x = np.asarray(x, np.float32)
    n = x.size
    tail = n % block
    out = []
    with np.errstate(invalid="ignore", over="ignore"):
        for part, m in ((x[:n - tail], block), (x[n - tail:], tail)):
            if part.size == 0:
                continue
            s = np.asarray(signs[:m], np.float32)
            y = part.reshape(-1, m)
            if not inverse:
                y = flush_subnormals(flush_subnormals(y) * s)
            h = 1
            while h < m:
                y = flush_subnormals(y).reshape(-1, m // (2 * h), 2, h)
                a, b = y[:, :, 0], y[:, :, 1]
                y = flush_subnormals(np.stack([a + b, a - b], 2)).reshape(-1, m)
                h *= 2
            scale = np.float32(1.0) / np.sqrt(np.float32(m))
            y = flush_subnormals(flush_subnormals(y) * scale)
            if inverse:
                y = flush_subnormals(y * s)
            out.append(y.reshape(-1))
    return np.concatenate(out) if out else np.zeros(0, np.float32)


class CudaError(RuntimeError):
    pass


class CudaBackend:
    name = "cuda"

    def __init__(self, path):
        self.lib = ctypes.CDLL(path)
        L = self.lib
        vp, i64, i32p, f32p = ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p
        L.tfgc_harness_malloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]
        L.tfgc_harness_free.argtypes = [vp]
        L.tfgc_harness_to_device.argtypes = [vp, vp, ctypes.c_size_t]
        L.tfgc_harness_to_host.argtypes = [vp, vp, ctypes.c_size_t]
        L.tfgc_harness_error_string.restype = ctypes.c_char_p
        L.tfgc_harness_device_name.argtypes = [ctypes.c_char_p, ctypes.c_int]
        L.tfgc_cuda_pack_sign_bits.argtypes = [ctypes.c_int, vp, i64, i32p, vp]
        L.tfgc_cuda_unpack_sign_bits.argtypes = [ctypes.c_int, i32p, i64, vp, vp]
        L.tfgc_cuda_onebit_quantize_scratch_bytes.argtypes = [i64, i64]
        L.tfgc_cuda_onebit_quantize_scratch_bytes.restype = i64
        L.tfgc_cuda_onebit_quantize.argtypes = [ctypes.c_int, vp, i64, i64, i32p, f32p, f32p, vp,
                                                vp, vp]
        L.tfgc_cuda_onebit_dequantize.argtypes = [ctypes.c_int, i32p, f32p, f32p, i64, i64, vp,
                                                  vp]
        L.tfgc_cuda_threshold_encode_scratch_bytes.argtypes = [i64]
        L.tfgc_cuda_threshold_encode_scratch_bytes.restype = i64
        L.tfgc_cuda_threshold_encode_count.argtypes = [
            ctypes.c_int, vp, vp, i64, ctypes.c_float, ctypes.c_float, vp, vp,
            ctypes.POINTER(ctypes.c_int64), vp]
        L.tfgc_cuda_threshold_encode_emit.argtypes = [vp, i64, i32p, vp]
        L.tfgc_cuda_threshold_decode_validate.argtypes = [i32p, i64, i64, vp,
                                                          ctypes.POINTER(ctypes.c_int), vp]
        L.tfgc_cuda_threshold_decode.argtypes = [ctypes.c_int, i32p, i64, ctypes.c_float,
                                                 ctypes.c_float, i64, ctypes.c_int, vp, vp, vp]
        ip = ctypes.POINTER(ctypes.c_int)
        L.tfgc_cuda_quantize_bucketed_scratch_bytes.argtypes = [i64, i64]
        L.tfgc_cuda_quantize_bucketed_scratch_bytes.restype = i64
        L.tfgc_cuda_quantize_bucketed.argtypes = [
            ctypes.c_int, vp, i64, i64, ctypes.c_int, ctypes.c_int, ctypes.c_int, i64, i64, vp,
            f32p, i32p, vp]
        L.tfgc_cuda_dequantize_bucketed.argtypes = [ctypes.c_int, f32p, i32p, i64, i64,
                                                    ctypes.c_int, ctypes.c_int, vp, vp, ip, vp]
        L.tfgc_cuda_dequantize_bucketed_sum.argtypes = [f32p, i32p, i64, i64, i64, ctypes.c_int,
                                                        ctypes.c_int, f32p, vp, ip, vp]
        f32 = ctypes.c_float
        L.tfgc_cuda_sparsify_scratch_bytes.argtypes = [i64]
        L.tfgc_cuda_sparsify_scratch_bytes.restype = i64
        L.tfgc_cuda_sparsify_topk.argtypes = [ctypes.c_int, vp, vp, i64, i64, vp, vp, vp, i32p,
                                              vp, vp]
        L.tfgc_cuda_sparsify_by_threshold_count.argtypes = [
            ctypes.c_int, vp, vp, i64, f32, f32, vp, vp, ctypes.POINTER(ctypes.c_int64), vp]
        L.tfgc_cuda_sparsify_by_threshold_emit.argtypes = [ctypes.c_int, i64, f32, f32, vp, i64,
                                                           vp, vp, i32p, vp, vp]
        L.tfgc_cuda_scatter_add_scratch_bytes.argtypes = [ctypes.c_int, i64]
        L.tfgc_cuda_scatter_add_scratch_bytes.restype = i64
        L.tfgc_cuda_scatter_add_validate.argtypes = [i32p, i64, i64, vp, ip, vp]
        L.tfgc_cuda_scatter_add.argtypes = [ctypes.c_int, vp, i32p, i64, i64, vp, vp, vp]
        L.tfgc_cuda_block_hadamard_validate_signs.argtypes = [f32p, i64, vp, ip, vp]
        L.tfgc_cuda_block_hadamard.argtypes = [f32p, f32p, i64, i64, ctypes.c_int, f32p, vp]
        self._live = []
        buf = ctypes.create_string_buffer(256)
        self.check(L.tfgc_harness_device_name(buf, 256), "cudaGetDeviceProperties")
        self.device = buf.value.decode()

    def check(self, err, what):
        if err != 0:
            raise CudaError(f"{what}: {self.lib.tfgc_harness_error_string(err).decode()}")

    def alloc(self, nbytes):
        p = ctypes.c_void_p()
        self.check(self.lib.tfgc_harness_malloc(ctypes.byref(p), int(nbytes)), "cudaMalloc")
        self._live.append(p.value)
        return p.value

    def put(self, a):
        a = np.ascontiguousarray(a)
        p = self.alloc(a.nbytes)
        self.check(self.lib.tfgc_harness_to_device(p, a.ctypes.data, a.nbytes), "to_device")
        return p

    def get(self, p, shape, dtype):
        out = np.empty(shape, dtype)
        self.check(self.lib.tfgc_harness_to_host(out.ctypes.data, p, out.nbytes), "to_host")
        return out

    def release(self):
        for p in self._live:
            self.lib.tfgc_harness_free(p)
        self._live = []

    def sync(self, err, what):
        self.check(err, what)
        self.check(self.lib.tfgc_harness_synchronize(), what + " (sync)")

    # Kernels ---------------------------------------------------------------
    def pack(self, x_raw, dt):
        n = x_raw.size
        w = self.alloc(4 * (-(-n // 32)))
        self.sync(self.lib.tfgc_cuda_pack_sign_bits(DTYPE_CODE[dt], self.put(x_raw), n, w, None),
                  "pack")
        return self.get(w, [-(-n // 32)], np.int32)

    def unpack(self, words, n, dt):
        out = self.alloc(n * np.dtype(raw_dtype(dt)).itemsize)
        self.sync(self.lib.tfgc_cuda_unpack_sign_bits(DTYPE_CODE[dt], self.put(words), n, out,
                                                      None), "unpack")
        return self.get(out, [n], raw_dtype(dt))

    def quantize(self, x_raw, dt):
        rows, cols = x_raw.shape
        n = rows * cols
        nw = -(-n // 32)
        w, pm, nm = self.alloc(4 * nw), self.alloc(4 * cols), self.alloc(4 * cols)
        res = self.alloc(x_raw.nbytes)
        scratch = self.alloc(self.lib.tfgc_cuda_onebit_quantize_scratch_bytes(rows, cols))
        self.sync(self.lib.tfgc_cuda_onebit_quantize(DTYPE_CODE[dt], self.put(x_raw), rows, cols,
                                                     w, pm, nm, res, scratch, None), "quantize")
        return (self.get(w, [nw], np.int32), self.get(pm, [cols], np.float32),
                self.get(nm, [cols], np.float32), self.get(res, x_raw.shape, x_raw.dtype))

    def dequantize(self, words, pos_mean, neg_mean, rows, dt):
        cols = pos_mean.size
        out = self.alloc(rows * cols * np.dtype(raw_dtype(dt)).itemsize)
        self.sync(self.lib.tfgc_cuda_onebit_dequantize(
            DTYPE_CODE[dt], self.put(words), self.put(pos_mean), self.put(neg_mean), rows, cols,
            out, None), "dequantize")
        return self.get(out, [rows, cols], raw_dtype(dt))

    def encode(self, x_raw, r_raw, pt, nt, dt):
        n = x_raw.size
        # The launcher takes thresholds already rounded to the dtype, as the
        # OpKernel passes them.
        pt, nt = round_to(pt, dt), round_to(nt, dt)
        res = self.alloc(x_raw.nbytes)
        scratch = self.alloc(self.lib.tfgc_cuda_threshold_encode_scratch_bytes(n))
        m = ctypes.c_int64()
        self.check(self.lib.tfgc_cuda_threshold_encode_count(
            DTYPE_CODE[dt], self.put(x_raw), self.put(r_raw), n, pt, nt, res, scratch,
            ctypes.byref(m), None), "encode_count")
        words = self.alloc(4 * m.value)
        self.sync(self.lib.tfgc_cuda_threshold_encode_emit(scratch, n, words, None), "encode_emit")
        return self.get(words, [m.value], np.int32), self.get(res, x_raw.shape, x_raw.dtype)

    def decode(self, words, pv, nv, n, dt):
        m = words.size
        wd = self.put(words)
        flags_dev = self.alloc(4)
        flags = ctypes.c_int()
        self.check(self.lib.tfgc_cuda_threshold_decode_validate(wd, m, n, flags_dev,
                                                                ctypes.byref(flags), None),
                   "decode_validate")
        if flags.value & 1:
            return None  # rejected payload
        unsorted = 1 if flags.value & 2 else 0
        counts = self.alloc(8 * n) if unsorted else None
        out = self.alloc(n * np.dtype(raw_dtype(dt)).itemsize)
        self.sync(self.lib.tfgc_cuda_threshold_decode(DTYPE_CODE[dt], wd, m, pv, nv, n, unsorted,
                                                      counts, out, None), "decode")
        return self.get(out, [n], raw_dtype(dt))

    def qb_quantize(self, x_raw, dt, seed, levels, d, bits, norm):
        n = x_raw.size
        nb, nw = max(1, -(-n // d)), -(-n // (32 // bits))
        scales, words = self.alloc(4 * nb), self.alloc(4 * max(nw, 1))
        scratch = self.alloc(max(8, self.lib.tfgc_cuda_quantize_bucketed_scratch_bytes(n, d)))
        x = self.put(x_raw) if n else self.alloc(8)
        self.sync(self.lib.tfgc_cuda_quantize_bucketed(
            DTYPE_CODE[dt], x, n, d, levels, bits, 1 if norm == "max" else 0, int(seed[0]),
            int(seed[1]), scratch, scales, words, None), "quantize_bucketed")
        return self.get(scales, [nb], np.float32), self.get(words, [nw], np.int32)

    def qb_dequantize(self, scales, words, n, levels, d, bits, dt):
        out = self.alloc(max(8, n * np.dtype(raw_dtype(dt)).itemsize))
        bad = ctypes.c_int()
        wd = self.put(words) if words.size else self.alloc(8)
        self.check(self.lib.tfgc_cuda_dequantize_bucketed(
            DTYPE_CODE[dt], self.put(scales), wd, n, d, levels, bits, out, self.alloc(4),
            ctypes.byref(bad), None), "dequantize_bucketed")
        return None if bad.value else self.get(out, [n], raw_dtype(dt))

    def qb_dequantize_sum(self, scales, words, n, levels, d, bits):
        out = self.alloc(max(8, 4 * n))
        bad = ctypes.c_int()
        wd = self.put(words) if words.size else self.alloc(8)
        self.check(self.lib.tfgc_cuda_dequantize_bucketed_sum(
            self.put(scales), wd, scales.shape[0], n, d, levels, bits, out, self.alloc(4),
            ctypes.byref(bad), None), "dequantize_bucketed_sum")
        return None if bad.value else self.get(out, [n], np.float32)

    def _poisoned(self, nbytes):
        # Outputs and scratch of the selection / decode launchers start as
        # 0x5A bytes (finite values in every dtype, an out-of-range index,
        # an invalid bool), not as whatever cudaMalloc hands back: fresh or
        # recycled memory is often zero or an earlier case's result, which
        # would hide an element the kernels forget to write and a scratch
        # word they read before initialising it.
        return self.put(np.full(max(1, int(nbytes)), 0x5A, np.uint8))

    def _selection(self, vals, idx, res, mask, m, n, dt):
        mask_out = np.zeros(0, bool)
        if mask:
            raw_mask = self.get(mask, [n], np.uint8)
            if np.any(raw_mask > 1):  # still poisoned: never written
                raise CudaError(f"{np.count_nonzero(raw_mask > 1)} mask entries not written")
            mask_out = raw_mask.astype(bool)
        return (self.get(vals, [m], raw_dtype(dt)), self.get(idx, [m], np.int32),
                self.get(res, [n], raw_dtype(dt)), mask_out)

    def sparsify_topk(self, x_raw, r_raw, k, dt, with_mask, exact=True, seed=0):
        # The GPU always selects exactly: `exact` and `seed` have no launcher
        # arguments (the sampled mode's contract holds for the exact result).
        n, size = x_raw.size, np.dtype(raw_dtype(dt)).itemsize
        m = min(k, n)
        res, vals, idx = (self._poisoned(n * size), self._poisoned(m * size),
                          self._poisoned(4 * m))
        mask = self._poisoned(n) if with_mask else None
        scratch = self._poisoned(max(8, self.lib.tfgc_cuda_sparsify_scratch_bytes(n)))
        self.sync(self.lib.tfgc_cuda_sparsify_topk(DTYPE_CODE[dt], self.put(x_raw),
                                                   self.put(r_raw), n, k, scratch, res, vals,
                                                   idx, mask, None), "sparsify_topk")
        return self._selection(vals, idx, res, mask, m, n, dt)

    def sparsify_by_threshold(self, x_raw, r_raw, pos, neg, dt, with_mask):
        n, size = x_raw.size, np.dtype(raw_dtype(dt)).itemsize
        res = self._poisoned(n * size)
        mask = self._poisoned(n) if with_mask else None
        scratch = self._poisoned(max(8, self.lib.tfgc_cuda_sparsify_scratch_bytes(n)))
        count = ctypes.c_int64(-1)
        self.check(self.lib.tfgc_cuda_sparsify_by_threshold_count(
            DTYPE_CODE[dt], self.put(x_raw), self.put(r_raw), n, pos, neg, res, scratch,
            ctypes.byref(count), None), "sparsify_by_threshold_count")
        m = count.value
        if not 0 <= m <= n:
            raise CudaError(f"sparsify_by_threshold_count returned {m} for n = {n}")
        vals, idx = self._poisoned(m * size), self._poisoned(4 * m)
        self.sync(self.lib.tfgc_cuda_sparsify_by_threshold_emit(
            DTYPE_CODE[dt], n, pos, neg, scratch, m, res, vals, idx, mask, None),
            "sparsify_by_threshold_emit")
        return self._selection(vals, idx, res, mask, m, n, dt)

    def scatter_add(self, values_raw, indices, n, dt):
        m = indices.size
        ind = self.put(indices) if m else self.alloc(8)
        vals = self.put(values_raw) if m else self.alloc(8)
        bad = ctypes.c_int()
        self.check(self.lib.tfgc_cuda_scatter_add_validate(ind, m, n, self._poisoned(4),
                                                           ctypes.byref(bad), None),
                   "scatter_add_validate")
        if bad.value:
            return None
        scratch = self._poisoned(max(8, self.lib.tfgc_cuda_scatter_add_scratch_bytes(DTYPE_CODE[dt], n)))
        out = self._poisoned(n * np.dtype(raw_dtype(dt)).itemsize)
        self.sync(self.lib.tfgc_cuda_scatter_add(DTYPE_CODE[dt], vals, ind, m, n, scratch, out,
                                                 None), "scatter_add")
        return self.get(out, [n], raw_dtype(dt))

    def block_hadamard(self, x, signs, block, inverse, in_place=False):
        """The rotation of x, or None where the signs are not all +1 or -1."""
        x = np.asarray(x, np.float32)
        sg = self.put(np.asarray(signs, np.float32))
        bad = ctypes.c_int()
        self.check(self.lib.tfgc_cuda_block_hadamard_validate_signs(
            sg, len(signs), self._poisoned(4), ctypes.byref(bad), None), "validate_signs")
        if bad.value:
            return None
        xd = self.put(x) if x.size else self.alloc(8)
        out = xd if in_place else self._poisoned(4 * x.size)
        self.sync(self.lib.tfgc_cuda_block_hadamard(xd, sg, x.size, block, int(inverse), out,
                                                    None), "block_hadamard")
        return self.get(out, [x.size], np.float32)

    def block_hadamard_rejects(self, n, block):
        """Whether the launcher refuses n elements in blocks of block."""
        buf = self.alloc(4 * max(n, block))
        return self.lib.tfgc_cuda_block_hadamard(buf, buf, n, block, 0, buf, None) != 0


class TfBackend:
    """tfgc's TensorFlow CPU ops behind the same interface (oracle self-test)."""

    name = "tf"

    def __init__(self):
        # The tfgc of this checkout, not whichever one is installed.
        sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))
        import tensorflow as tf

        import tfgc.ops.quantize as qb
        import tfgc.ops.rotation as rot
        import tfgc.ops.sign_bits as sb
        import tfgc.ops.sparsify as sp
        import tfgc.ops.threshold as th
        from tfgc.ops import _loader
        if not _loader.custom_ops_available():
            raise RuntimeError("tfgc's compiled op library is not available")
        self.tf, self.sb, self.th, self.qb, self.sp = tf, sb, th, qb, sp
        self.rot = rot
        self.device = "TensorFlow CPU ops"

    def _in(self, raw, dt):
        tf = self.tf
        if dt == "float32":
            return tf.constant(raw)
        t = tf.constant(raw.view(np.int16))
        return tf.bitcast(t, tf.float16 if dt == "float16" else tf.bfloat16)

    def _out(self, t, dt):
        if dt == "float32":
            return t.numpy()
        return self.tf.bitcast(t, self.tf.int16).numpy().view(np.uint16)

    def release(self):
        pass

    def pack(self, x_raw, dt):
        return self.sb.pack_sign_bits(self._in(x_raw, dt)).numpy()

    def unpack(self, words, n, dt):
        return self._out(self.sb.unpack_sign_bits(words, n, dtype=dt), dt)

    def quantize(self, x_raw, dt):
        q = self.sb.onebit_quantize(self._in(x_raw, dt))
        return q.words.numpy(), q.pos_mean.numpy(), q.neg_mean.numpy(), self._out(q.residual, dt)

    def dequantize(self, words, pos_mean, neg_mean, rows, dt):
        return self._out(self.sb.onebit_dequantize(words, pos_mean, neg_mean, rows, dtype=dt), dt)

    def encode(self, x_raw, r_raw, pt, nt, dt):
        words, res = self.th.threshold_encode(self._in(x_raw, dt), self._in(r_raw, dt), pt, nt)
        return words.numpy(), self._out(res, dt)

    def decode(self, words, pv, nv, n, dt):
        try:
            return self._out(self.th.threshold_decode(words, pv, nv, n, dtype=dt), dt)
        except self.tf.errors.InvalidArgumentError:
            return None

    def qb_quantize(self, x_raw, dt, seed, levels, d, bits, norm):
        q = self.qb.quantize_bucketed(self._in(x_raw, dt), np.asarray(seed, np.int64),
                                      levels=levels, bucket_size=d, bits=bits, norm=norm)
        return q.scales.numpy(), q.words.numpy()

    def qb_dequantize(self, scales, words, n, levels, d, bits, dt):
        try:
            return self._out(self.qb.dequantize_bucketed(scales, words, n, levels=levels,
                                                         bucket_size=d, bits=bits, dtype=dt), dt)
        except self.tf.errors.InvalidArgumentError:
            return None

    def qb_dequantize_sum(self, scales, words, n, levels, d, bits):
        try:
            return self.qb.dequantize_bucketed_sum(scales, words, n, levels=levels, bucket_size=d,
                                                   bits=bits).numpy()
        except self.tf.errors.InvalidArgumentError:
            return None

    def _selection(self, sel, dt):
        return (self._out(sel.values, dt), sel.indices.numpy(), self._out(sel.new_residual, dt),
                sel.mask.numpy())

    def sparsify_topk(self, x_raw, r_raw, k, dt, with_mask, exact=True, seed=0):
        return self._selection(self.sp.sparsify_with_residual(
            self._in(x_raw, dt), self._in(r_raw, dt), k, exact=exact, seed=seed,
            with_mask=with_mask), dt)

    def sparsify_by_threshold(self, x_raw, r_raw, pos, neg, dt, with_mask):
        return self._selection(self.sp.sparsify_by_threshold(
            self._in(x_raw, dt), self._in(r_raw, dt), pos, neg, with_mask=with_mask), dt)

    def scatter_add(self, values_raw, indices, n, dt):
        try:
            return self._out(self.sp.scatter_add_payloads(self._in(values_raw, dt), indices, n), dt)
        except self.tf.errors.InvalidArgumentError:
            return None

    def block_hadamard(self, x, signs, block, inverse, in_place=False):
        try:
            return self.rot.block_hadamard(np.asarray(x, np.float32),
                                           np.asarray(signs, np.float32), block,
                                           inverse=inverse).numpy()
        except self.tf.errors.InvalidArgumentError:
            return None

    def block_hadamard_rejects(self, n, block):
        try:
            self.rot.block_hadamard(np.zeros(n, np.float32), np.ones(block, np.float32), block)
        except self.tf.errors.InvalidArgumentError:
            return True
        return False


# ---------------------------------------------------------------------------
# Checks. Each returns None on success or a failure message.

def check_pack_unpack(b, dt, rng):
    for n in [1, 31, 32, 33, 1000, 1000003]:
        x = random_raw(n, dt, rng)
        words = b.pack(x, dt)
        if not np.array_equal(words, np_pack(to_f32(x, dt))):
            return f"pack n={n}: words differ"
        out = b.unpack(words, n, dt)
        expected = from_f32(np.where(np_bits(words, n), 1.0, -1.0).astype(np.float32), dt)
        if not same_values(out, expected, dt):
            return f"unpack n={n}: values differ"
        b.release()
    return None


def check_quantize(b, dt, rng):
    shapes = [(1, 1), (5, 1), (37, 29), (1, 100003), (1000, 100), (100003, 3), (130, 20000),
              (3000, 1)]
    for shape in shapes:
        x = random_raw(shape[0] * shape[1], dt, rng, specials=False).reshape(shape)
        xf = to_f32(x, dt)
        words, pm, nm, res = b.quantize(x, dt)
        if not np.array_equal(words, np_pack(xf)):
            return f"quantize {shape}: words differ"
        opm, onm = np_means(xf)
        # Summation order differs from the float64 oracle.
        if not (np.allclose(pm, opm, rtol=1e-5, atol=1e-6) and np.allclose(nm, onm, rtol=1e-5, atol=1e-6)):
            return f"quantize {shape}: means differ (max err {np.abs(pm - opm).max():.3g})"
        if not same_values(res, np_quantize_residual(x, pm, nm, dt), dt):
            return f"quantize {shape}: residual not exact given the returned means"
        b.release()
    # Special values: NaN -> negative class, Inf propagates (compared with
    # NaN-aware equality, the means are exact here: one value per class).
    x = from_f32(np.float32([[1.0, np.inf, -np.inf, np.nan, -0.0, 0.0]]), dt)
    words, pm, nm, res = b.quantize(x, dt)
    opm, onm = np_means(to_f32(x, dt))
    if not (same_values(pm, opm, "float32") and same_values(nm, onm, "float32")):
        return "quantize specials: means differ"
    if not same_values(res, np_quantize_residual(x, pm, nm, dt), dt):
        return "quantize specials: residual differs"
    b.release()
    return None


def check_dequantize(b, dt, rng):
    for rows, cols in [(1, 1), (3, 7), (1, 100), (5, 1000), (31, 33), (1000, 37), (7, 1)]:
        n = rows * cols
        words = rng.integers(-2**31, 2**31, -(-n // 32)).astype(np.int32)
        pm = rng.standard_normal(cols).astype(np.float32)
        nm = rng.standard_normal(cols).astype(np.float32)
        out = b.dequantize(words, pm, nm, rows, dt)
        expected = from_f32(np.where(np_bits(words, n).reshape(rows, cols), pm, nm), dt)
        if not same_values(out, expected, dt):
            return f"dequantize {rows}x{cols}: values differ"
        b.release()
    return None


def check_encode(b, dt, rng):
    for n in [1, 33, 1000, 8191, 8192, 8193, 100003, 1000003]:
        for pt, nt in [(1.0, -0.75), (0.1, -0.1), (100.0, -100.0), (1e-3, -1e-3)]:
            x = random_raw(n, dt, rng)
            r = random_raw(n, dt, rng, scale=0.3, specials=False)
            if n >= 16:  # float32 subnormals (flushed) and half subnormals (kept)
                x[8:12] = from_f32(np.float32([1e-40, -3e-39, 3e-6, -5e-7]), dt)
                r[8:12] = 0
            words, res = b.encode(x, r, pt, nt, dt)
            ew, er = np_encode(x, r, round_to(pt, dt), round_to(nt, dt), dt)
            if not np.array_equal(words, ew):
                return f"encode n={n} thresholds=({pt}, {nt}): words differ ({words.size} vs {ew.size})"
            if not same_values(res, er, dt):
                return f"encode n={n} thresholds=({pt}, {nt}): residual differs"
            b.release()
    return None


def check_decode(b, dt, rng):
    for n in [1, 5, 1000, 100003]:
        sorted_words = (np.sort(rng.choice(n, size=max(1, n // 3), replace=False)) * 2
                        + rng.integers(0, 2, max(1, n // 3))).astype(np.int32)
        repeated = (rng.integers(0, n, n // 3 + 7) * 2 + rng.integers(0, 2, n // 3 + 7)).astype(np.int32)
        for words in (sorted_words, repeated, np.zeros(0, np.int32)):
            for pv, nv in [(0.3, -0.7), (np.inf, np.nan), (1e6, -0.0)]:
                out = b.decode(words, pv, nv, n, dt)
                if out is None:
                    return f"decode n={n}: valid payload rejected"
                if not same_values(out, np_decode(words, pv, nv, n, dt), dt):
                    return f"decode n={n} m={words.size} values=({pv}, {nv}): values differ"
                b.release()
        for bad in ([-1], [2 * n], [0, 2 * n + 1], [-2**31]):
            if b.decode(np.array(bad, np.int32), 1.0, -1.0, n, dt) is not None:
                return f"decode n={n}: malformed words {bad} accepted"
            b.release()
    return None


QB_CONFIGS = [(1, 2), (7, 4), (127, 8), (32767, 16), (1, 16)]  # (levels, bits)


def check_quantize_bucketed(b, dt, rng):
    cases = [(0, 5), (1, 1), (5, 2), (63, 64), (65, 64), (1000, 7), (1000, 128), (4099, 4099),
             (10007, 300), (100003, 100003), (100003, 128)]
    for k, (n, d) in enumerate(cases):
        levels, bits = QB_CONFIGS[k % len(QB_CONFIGS)]
        for norm in ("l2", "max"):
            seed = [int(rng.integers(-2**63, 2**63)), int(rng.integers(-2**63, 2**63))]
            # Specials only in ragged multi-bucket cases, so other buckets stay finite.
            x = random_raw(n, dt, rng, specials=(k % 3 == 1))
            xf = to_f32(x, dt)
            scales, words = b.qb_quantize(x, dt, seed, levels, d, bits, norm)
            oracle = np_bucket_scales(xf, d, norm == "max")
            if norm == "max":
                ok = same_values(scales, oracle, "float32")
            else:  # float64 sums in another order: at most the last float32 bit
                fin = np.isfinite(oracle)
                ok = (np.array_equal(np.isnan(scales), np.isnan(oracle))
                      and np.allclose(scales[fin], oracle[fin], rtol=2.5e-7, atol=0)
                      and np.array_equal(scales[~fin & ~np.isnan(oracle)],
                                         oracle[~fin & ~np.isnan(oracle)]))
            if not ok:
                return f"quantize_bucketed n={n} d={d} {norm}: scales differ"
            # Codes bit-exact given the returned scales (Philox stream included).
            if not np.array_equal(words, np_quantize_codes(xf, scales, seed, levels, d, bits)):
                return f"quantize_bucketed n={n} d={d} s={levels} bits={bits} {norm}: words differ"
            b.release()
    return None


def check_dequantize_bucketed(b, dt, rng):
    for k, (n, d) in enumerate([(1, 1), (5, 2), (64, 64), (1000, 7), (100003, 1000)]):
        levels, bits = QB_CONFIGS[k % len(QB_CONFIGS)]
        nb, k_per = max(1, -(-n // d)), 32 // bits
        scales = (rng.standard_normal(nb) ** 2).astype(np.float32)
        scales[0] = 0.0
        if nb > 2:
            scales[1], scales[2] = np.inf, np.nan
        codes = rng.integers(0, 2 * levels + 1, n)
        words = np_pack_codes(codes, bits)
        out = b.qb_dequantize(scales, words, n, levels, d, bits, dt)
        expected = from_f32(np_dequantize(scales, words, n, levels, d, bits), dt)
        if out is None or not same_values(out, expected, dt):
            return f"dequantize_bucketed n={n} d={d}: values differ"
        # Sums over workers, in worker order from +0.
        for workers in (1, 3):
            sc = (rng.standard_normal((workers, nb)) ** 2).astype(np.float32)
            ws = np.stack([np_pack_codes(rng.integers(0, 2 * levels + 1, n), bits)
                           for _ in range(workers)])
            acc = np.zeros(n, np.float32)
            for w in range(workers):
                acc = acc + np_dequantize(sc[w], ws[w], n, levels, d, bits)
            out = b.qb_dequantize_sum(sc, ws, n, levels, d, bits)
            if out is None or not same_values(out, acc, "float32"):
                return f"dequantize_bucketed_sum n={n} workers={workers}: values differ"
            if 2 * levels + 1 < (1 << bits):  # a code above 2s exists: must be rejected
                bad = ws.copy()
                j = int(rng.integers(0, n))
                field = (bad[-1, j // k_per].view(np.uint32)
                         | np.uint32(((1 << bits) - 1) << (bits * (j % k_per))))
                bad[-1, j // k_per] = np.uint32(field).view(np.int32)
                if b.qb_dequantize_sum(sc, bad, n, levels, d, bits) is not None:
                    return f"dequantize_bucketed_sum n={n}: code > 2s accepted"
                if b.qb_dequantize(sc[-1], bad[-1], n, levels, d, bits, dt) is not None:
                    return f"dequantize_bucketed n={n}: code > 2s accepted"
        # Padding fields are not codes: junk there is ignored.
        if n % k_per:
            junk = words.copy()
            junk[-1] = np.int32(-1)  # all ones, used fields included...
            used = n % k_per
            keep = np.uint32((1 << (bits * used)) - 1)
            junk[-1] = np.uint32((words[-1].view(np.uint32) & keep)
                                 | (np.uint32(0xFFFFFFFF) & ~keep)).view(np.int32)
            out = b.qb_dequantize(scales, junk, n, levels, d, bits, dt)
            if out is None or not same_values(out, expected, dt):
                return f"dequantize_bucketed n={n}: padding junk not ignored"
        b.release()
    return None


def check_scatter_add(b, dt, rng):
    for n in [1, 5, 1000, 100003]:
        m = max(1, n // 3)
        unique = rng.choice(n, size=m, replace=False).astype(np.int32)
        values = random_raw(m, dt, rng)
        # Each index once: exact (+0 + v), whatever the summation order.
        expected = np.zeros(n, np.float32)
        expected[unique] = expected[unique] + to_f32(values, dt)
        out = b.scatter_add(values, unique, n, dt)
        if out is None or not same_values(out, from_f32(expected, dt), dt):
            return f"scatter_add n={n} unique: values differ"
        # Repeated indices: the GPU adds in any order, so compare against a
        # float64 sum with the float32 accumulation error bound, plus one
        # rounding to the dtype.
        rep = rng.integers(0, n, 3 * m + 7).astype(np.int32)
        values = random_raw(rep.size, dt, rng, specials=False)
        v64 = to_f32(values, dt).astype(np.float64)
        exact = np.zeros(n)
        np.add.at(exact, rep, v64)
        mag, count = np.zeros(n), np.zeros(n)
        np.add.at(mag, rep, np.abs(v64))
        np.add.at(count, rep, 1.0)
        out = b.scatter_add(values, rep, n, dt)
        if out is None:
            return f"scatter_add n={n}: valid payload rejected"
        ulp = {"float32": 2.0**-23, "float16": 2.0**-10, "bfloat16": 2.0**-7}[dt]
        tol = count * 2.0**-23 * mag + ulp * np.abs(exact) + 1e-30
        if not np.all(np.abs(to_f32(out, dt).astype(np.float64) - exact) <= tol):
            return f"scatter_add n={n} repeated: sums off by more than rounding"
        if b.scatter_add(np.zeros(0, raw_dtype(dt)), np.zeros(0, np.int32), n, dt) is None:
            return f"scatter_add n={n}: empty payload rejected"
        for bad in ([-1], [n], [0, n], [-2**31], [2**31 - 1]):
            bad = np.array(bad, np.int32)
            if b.scatter_add(from_f32(np.ones(bad.size, np.float32), dt), bad, n, dt) is not None:
                return f"scatter_add n={n}: malformed indices {bad.tolist()} accepted"
        b.release()
    return None


ONE_RAW = {"float32": 0x3F800000, "float16": 0x3C00, "bfloat16": 0x3F80}


def sparsify_inputs(n, kind, dt, rng):
    """(x, residual) raw arrays of one of the selection tests' distributions."""
    zeros = from_f32(np.zeros(n, np.float32), dt)
    if kind == "normal":  # specials included: NaN, +-Inf, +-0.0
        return random_raw(n, dt, rng), random_raw(n, dt, rng, scale=0.3, specials=False)
    if kind == "ties":  # few magnitudes, both signs, many +-0.0 (x + r keeps -0.0 only for -0 + -0)
        x = rng.integers(-3, 4, n).astype(np.float32) * np.float32(0.5)
        x[(x == 0) & (rng.random(n) < 0.5)] = -0.0
        r = np.where(rng.random(n) < 0.3, np.float32(-0.0), np.float32(0.0)).astype(np.float32)
        return from_f32(x, dt), from_f32(r, dt)
    if kind == "zeros":  # one key everywhere: ties broken by index alone
        return zeros, zeros
    if kind == "nan":  # mostly NaN: k often exceeds the non-NaN count
        x = (rng.standard_normal(n) * 10).astype(np.float32)
        x[rng.random(n) < 0.6] = np.nan
        x[rng.random(n) < 0.01] = np.inf
        return from_f32(x, dt), zeros
    if kind == "close":  # keys differing only in their lowest bits (the last radix digits)
        bits = ONE_RAW[dt] + rng.integers(0, 64, n)
        bits |= np.where(rng.random(n) < 0.5, 0x80000000 if dt == "float32" else 0x8000, 0)
        if dt == "float32":
            return bits.astype(np.uint32).view(np.float32), zeros
        return bits.astype(np.uint16), zeros
    if kind == "tiny":  # subnormals (float32, bfloat16) around zero thresholds
        pool = np.float32([0.0, -0.0, 1e-45, -1e-45, 3e-45, 1e-40, -1e-40, 1e-38, -1e-38, np.nan,
                           1.0, -np.inf])
        return from_f32(pool[rng.integers(0, pool.size, n)], dt), zeros
    raise ValueError(kind)


def selection_differs(got, want, dt):
    """None if two (values, indices, new_residual, mask) agree bit for bit."""
    vals, idx, res, mask = got
    evals, eidx, eres, emask = want
    if not np.array_equal(idx, eidx):
        return f"indices differ ({idx.size} vs {eidx.size} selected)"
    if not same_values(vals, evals, dt):
        return "values differ"
    if not same_values(res, eres, dt):
        return "new_residual differs"
    if not np.array_equal(mask, emask):
        return "mask differs"
    return None


MANY_TILES = 257 * 8192 + 4099


def check_sparsify_topk(b, dt, rng):
    case = 0
    # MANY_TILES: more compaction tiles (8192 elements) than the scan block
    # has threads, so that tiles, their tie ranks and slots are spread over
    # several per thread; ties ("zeros") then cross those thread boundaries.
    for n in [1, 2, 31, 33, 1000, 8191, 8192, 8193, 100003, 1000003, MANY_TILES]:
        kinds = (["normal", "ties", "zeros", "nan", "close", "tiny"] if n < 10**6
                 else ["normal", "ties"] if n < MANY_TILES else ["zeros", "ties"])
        ks = [0, 1, 2, 7, n // 100, n // 3, n - 1, n, n + 3]
        if n >= 10**6:
            ks = [n // 100, n - 1] if n < MANY_TILES else [5, n // 3, n - 1]
        for kind in kinds:
            x, r = sparsify_inputs(n, kind, dt, rng)
            for k in sorted(set(k for k in ks if k >= 0)):
                with_mask = case % 2 == 0
                case += 1
                got = b.sparsify_topk(x, r, k, dt, with_mask)
                msg = selection_differs(got, np_topk(x, r, k, dt, with_mask), dt)
                if msg:
                    return f"sparsify_topk n={n} k={k} {kind}: {msg}"
                b.release()
    return None


def check_sparsify_sampled(b, dt, rng):
    # DGC mode may keep any count in [ceil(0.8k), max(k, floor(1.3k))] as
    # long as no unsent key beats a sent one (the GPU keeps exactly k).
    case = 0
    for n in [1000, 8193, 100003, 1000003]:
        for kind in ["normal", "ties", "nan"]:
            x, r = sparsify_inputs(n, kind, dt, rng)
            v = np_sparsify_v(x, r, dt)
            keys = np_keys(v, dt)
            for k in [1, 7, n // 100, n // 3]:
                with_mask = case % 2 == 0
                case += 1
                got = b.sparsify_topk(x, r, k, dt, with_mask, exact=False, seed=case)
                idx = got[1].astype(np.int64)
                lo, hi = max(1, int(np.ceil(0.8 * k))), max(k, int(np.floor(1.3 * k)))
                where = f"sparsify_sampled n={n} k={k} {kind}"
                if not lo <= idx.size <= hi:
                    return f"{where}: {idx.size} selected, outside [{lo}, {hi}]"
                if np.any(np.diff(idx) <= 0) or idx.min() < 0 or idx.max() >= n:
                    return f"{where}: indices not ascending in [0, n)"
                sel = np.zeros(n, bool)
                sel[idx] = True
                if sel.all() or keys[sel].min() < keys[~sel].max():
                    return f"{where}: an unsent entry outranks a sent one"
                msg = selection_differs(got, np_selection(v, idx, with_mask), dt)
                if msg:
                    return f"{where}: {msg}"
                b.release()
    return None


def check_sparsify_by_threshold(b, dt, rng):
    thresholds = [(1.0, -0.75), (0.1, -0.1), (0.0, -0.0), (0.0, -1.0), (np.inf, -np.inf),
                  (0.5, -np.inf), (100.0, -100.0), (1e-45, -1e-45), (1e-40, -0.0)]
    case = 0
    for n in [1, 33, 1000, 8191, 8192, 8193, 100003, 1000003, MANY_TILES]:
        for kind in ["normal", "tiny"] if n < 10**6 else ["normal"]:
            x, r = sparsify_inputs(n, kind, dt, rng)
            for pos, neg in thresholds if n < 10**6 else thresholds[:2]:
                with_mask = case % 2 == 0
                case += 1
                got = b.sparsify_by_threshold(x, r, pos, neg, dt, with_mask)
                want = np_sparsify_by_threshold(x, r, pos, neg, dt, with_mask)
                msg = selection_differs(got, want, dt)
                if msg:
                    return f"sparsify_by_threshold n={n} ({pos}, {neg}) {kind}: {msg}"
                b.release()
    return None


def check_block_hadamard(b, dt, rng):
    # Block sizes on both sides of the GPU's shuffle (32), register (512) and
    # tile (4096) passes, and past the tile (global radix-2 and radix-4 ends).
    cases = [(1, 5), (2, 6), (4, 4), (4, 12), (8, 24), (32, 32 * 3 + 16), (64, 64),
             (128, 128 * 37 + 64), (512, 512 * 9 + 1), (512, 4096 * 3 + 512 + 256),
             (1024, 1024 * 5), (2048, 2048 * 2 + 2), (4096, 4096 * 3 + 2048),
             (8192, 8192 * 2 + 4096), (16384, 16384 + 8), (32768, 32768 * 2),
             (1 << 20, (1 << 21) + (1 << 19))]
    for block, n in cases:
        x = rng.standard_normal(n).astype(np.float32)
        if n >= 16:
            k = rng.choice(n, size=8, replace=False)
            x[k] = np.float32([np.nan, np.inf, -np.inf, -0.0, 1e-40, -1e-40, 3e38, -3e38])
        signs = np.where(rng.random(block) < 0.5, -1.0, 1.0).astype(np.float32)
        for inverse in (False, True):
            got = b.block_hadamard(x, signs, block, inverse)
            if got is None or not same_values(got, np_block_hadamard(x, signs, block, inverse),
                                              "float32"):
                return f"block {block}, n {n}, inverse {inverse}: values differ"
            b.release()
        # The inverse undoes the forward rotation (finite inputs).
        fx = rng.standard_normal(n).astype(np.float32)
        back = b.block_hadamard(b.block_hadamard(fx, signs, block, False), signs, block, True)
        if not np.allclose(back, fx, rtol=0, atol=1e-5 * max(1.0, np.log2(block))):
            return f"block {block}, n {n}: inverse(forward(x)) differs from x"
        in_place = b.block_hadamard(fx, signs, block, False, in_place=True)
        if not same_values(in_place, np_block_hadamard(fx, signs, block, False), "float32"):
            return f"block {block}, n {n}: in place differs"
        b.release()
    signs = np.ones(64, np.float32)
    for bad in (0.0, 2.0, np.nan, -0.5):
        signs[17] = bad
        if b.block_hadamard(np.ones(128, np.float32), signs, 64, False) is not None:
            return f"a sign of {bad} was accepted"
        b.release()
    for n, block in ((112, 64), (3, 4), (100, 512)):
        if not b.block_hadamard_rejects(n, block):
            return f"{n} elements in blocks of {block} (a last block of {n % block}) accepted"
        b.release()
    return None


CHECKS = [("pack/unpack_sign_bits", check_pack_unpack), ("onebit_quantize", check_quantize),
          ("onebit_dequantize", check_dequantize), ("threshold_encode", check_encode),
          ("threshold_decode", check_decode), ("quantize_bucketed", check_quantize_bucketed),
          ("dequantize_bucketed", check_dequantize_bucketed),
          ("sparsify_topk", check_sparsify_topk), ("sparsify_sampled", check_sparsify_sampled),
          ("sparsify_by_threshold", check_sparsify_by_threshold),
          ("scatter_add_payloads", check_scatter_add),
          ("block_hadamard", check_block_hadamard, ["float32"])]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lib", default=os.path.join(os.path.dirname(os.path.dirname(HERE)),
                                                      "build", "cuda_harness", "libtfgc_cuda.so"))
    parser.add_argument("--backend", choices=["cuda", "tf"], default="cuda")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", nargs="+", default=None, metavar="CHECK",
                        help="run only these checks (names as printed)")
    args = parser.parse_args(argv)
    names = [c[0] for c in CHECKS]
    unknown = set(args.only or ()) - set(names)
    if unknown:
        parser.error(f"unknown check(s) {sorted(unknown)}; the checks are {names}")

    try:
        backend = CudaBackend(args.lib) if args.backend == "cuda" else TfBackend()
    except (OSError, CudaError, RuntimeError, ImportError) as exc:
        print(f"harness: cannot use the {args.backend} backend: {exc}", file=sys.stderr)
        return 2
    print(f"harness: {backend.name} backend on {backend.device}")
    failures = 0
    for name, check, *dtypes in CHECKS:
        if args.only and name not in args.only:
            continue
        for dt in (dtypes[0] if dtypes else DTYPES):
            rng = np.random.default_rng([args.seed, DTYPES.index(dt)])
            try:
                message = check(backend, dt, rng)
            except CudaError as exc:
                message = f"CUDA error: {exc}"
            finally:
                backend.release()
            status = "PASS" if message is None else "FAIL"
            failures += message is not None
            print(f"{status}  {name:24s} {dt:9s}" + ("" if message is None else f"  {message}"),
                  flush=True)
    print(f"harness: {failures} failure(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
