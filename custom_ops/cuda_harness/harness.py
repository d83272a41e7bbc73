#!/usr/bin/env python3
"""Standalone correctness harness for tfgc's CUDA kernels (no TensorFlow).

Loads libtfgc_cuda.so (built by build.sh from the TensorFlow-free part of
custom_ops/cc/kernels/*.cu.cc) through ctypes, runs every kernel on random
inputs with injected special values (NaN, +-Inf, -0.0, ragged sizes) and
compares the results with NumPy oracles that restate the CPU ops' semantics:

  pack_sign_bits / unpack_sign_bits   bit = (x >= 0), LSB first
  onebit_quantize / onebit_dequantize per-column class means (Seide et al.)
  threshold_encode / threshold_decode Strom 2015 / Dryden et al. 2016 words

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
    with np.errstate(invalid="ignore", over="ignore"):
        v = to_f32(from_f32(to_f32(x_raw, dt) + to_f32(r_raw, dt), dt), dt)
        pos, neg = v >= pt, v <= nt
        res = from_f32(np.where(pos, v - pt, np.where(neg, v - nt, v)).astype(np.float32), dt)
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


# ---------------------------------------------------------------------------
# Backends: the CUDA library through ctypes, or tfgc's TensorFlow CPU ops.

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


class TfBackend:
    """tfgc's TensorFlow CPU ops behind the same interface (oracle self-test)."""

    name = "tf"

    def __init__(self):
        # The tfgc of this checkout, not whichever one is installed.
        sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))
        import tensorflow as tf
        import tfgc.ops.sign_bits as sb
        import tfgc.ops.threshold as th
        from tfgc.ops import _loader
        if not _loader.custom_ops_available():
            raise RuntimeError("tfgc's compiled op library is not available")
        self.tf, self.sb, self.th = tf, sb, th
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


CHECKS = [("pack/unpack_sign_bits", check_pack_unpack), ("onebit_quantize", check_quantize),
          ("onebit_dequantize", check_dequantize), ("threshold_encode", check_encode),
          ("threshold_decode", check_decode)]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lib", default=os.path.join(os.path.dirname(os.path.dirname(HERE)),
                                                      "build", "cuda_harness", "libtfgc_cuda.so"))
    parser.add_argument("--backend", choices=["cuda", "tf"], default="cuda")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    try:
        backend = CudaBackend(args.lib) if args.backend == "cuda" else TfBackend()
    except (OSError, CudaError, RuntimeError, ImportError) as exc:
        print(f"harness: cannot use the {args.backend} backend: {exc}", file=sys.stderr)
        return 2
    print(f"harness: {backend.name} backend on {backend.device}")
    failures = 0
    for name, check in CHECKS:
        for dt in DTYPES:
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
