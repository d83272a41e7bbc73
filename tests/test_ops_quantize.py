"""Tests for tfgc.ops.quantize: compiled kernels vs pure-TF references vs NumPy.

Tests taking the ``mode`` fixture run through the compiled kernels ("custom")
and through the references ("reference"). Both draw element i's uniform from
tf.random.stateless_uniform([N], seed)[i], so the NumPy oracle below can use
the same draws and check every code exactly, not only in distribution.
"""

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tfgc.compressors.quantizers import QSGD
from tfgc.ops import packing
from tfgc.ops import quantize as qz

DTYPES = [tf.float32, tf.float16, tf.bfloat16]
DTYPE_IDS = ["float32", "float16", "bfloat16"]
INT64_MAX = np.iinfo(np.int64).max


# ---------------------------------------------------------------------------
# NumPy oracle.

def np_dtype(dtype):
    return tf.as_dtype(dtype).as_numpy_dtype


def f32(t):
    return np.asarray(tf.cast(t, tf.float32))


def np_buckets(n, d):
    return max(1, -(-n // d))


def np_scales(v, d, norm):
    """v: float32 [n]. l2 in float64 rounded once; max |v| with NaN propagating."""
    nb = np_buckets(v.size, d)
    d = min(d, max(v.size, 1))  # a bucket larger than the tensor is the tensor
    padded = np.zeros(nb * d, np.float32)
    padded[:v.size] = v
    b = padded.reshape(nb, d)
    with np.errstate(over="ignore", invalid="ignore"):
        if norm == "l2":
            return np.sqrt((b.astype(np.float64) ** 2).sum(axis=1)).astype(np.float32)
        return np.abs(b).max(axis=1)


def np_a(v, scales, d, levels):
    """a = min(s |v| / scale, s) in float32; 0 for a zero scale or NaN quotient."""
    scale = scales[np.arange(v.size) // d]
    s = np.float32(levels)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        a = (s * np.abs(v)) / scale
    a = np.where((scale == 0) | np.isnan(a), np.float32(0), a)
    return np.minimum(a, s).astype(np.float32)


def np_uniforms(n, seed):
    return tf.random.stateless_uniform([max(n, 1)], seed=seed).numpy()[:n]


def np_codes(v, scales, d, levels, seed):
    a = np_a(v, scales, d, levels)
    low = np.floor(a)
    level = low + (np_uniforms(v.size, seed) < a - low)
    return (np.where(v < 0, -level, level) + levels).astype(np.int64)


def np_pack(codes, bits):
    per_word = 32 // bits
    nw = -(-codes.size // per_word)
    padded = np.zeros(nw * per_word, np.uint64)
    padded[:codes.size] = codes
    fields = padded.reshape(nw, per_word) << (bits * np.arange(per_word, dtype=np.uint64))
    return fields.sum(axis=1).astype(np.uint32).view(np.int32)


def np_unpack(words, n, bits):
    per_word = 32 // bits
    w = np.asarray(words, np.int32).view(np.uint32).astype(np.uint64)
    fields = (w[:, None] >> (bits * np.arange(per_word, dtype=np.uint64))) & ((1 << bits) - 1)
    return fields.reshape(-1)[:n].astype(np.int64)


def np_dequantize(scales, words, n, levels, d, bits, dtype=np.float32):
    codes = np_unpack(words, n, bits)
    factor = (np.asarray(scales, np.float32) / np.float32(levels))[np.arange(n) // d]
    with np.errstate(over="ignore", invalid="ignore"):
        return ((codes - levels).astype(np.float32) * factor).astype(dtype)


def bits_for(levels):
    return next(b for b in (2, 4, 8, 16) if 2 * levels + 1 <= (1 << b))


def random_vector(n, dtype, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(n).astype(np.float32) * rng.uniform(0.1, 10.0)
    x[rng.random(n) < 0.05] = 0.0  # exact zeros must stay exact
    return x.astype(np_dtype(dtype))


SEED = np.array([12345, 678], np.int64)


# ---------------------------------------------------------------------------
# Dispatch.

def test_dispatch_uses_the_expected_implementation(mode):
    @tf.function
    def f(x):
        return qz.quantize_bucketed(x, SEED, levels=7, bucket_size=16, bits=4)

    graph = f.get_concrete_function(tf.TensorSpec([None], tf.float32)).graph
    op_types = {op.type for op in graph.get_operations()}
    assert ("TfgcQuantizeBucketed" in op_types) == (mode == "custom")


# ---------------------------------------------------------------------------
# Quantize vs the exact oracle.

CONFIGS = [  # n, bucket_size, levels, bits, norm
    (1, 1, 1, 2, "max"),
    (5, 512, 127, 8, "l2"),
    (1000, 64, 127, 8, "l2"),
    (1001, 100, 7, 4, "max"),
    (4099, 33, 1, 2, "l2"),
    (777, 10**12, 1, 2, "max"),        # TernGrad: one bucket, larger than n
    (3000, 7, 32767, 16, "l2"),
    (2500, 50, 3, 16, "max"),          # more bits than needed
    (200003, 70001, 5, 4, "l2"),       # huge buckets: two-pass kernel path
    (300000, 512, 127, 8, "max"),      # many parallel shards
]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("n,d,levels,bits,norm", CONFIGS, ids=str)
def test_quantize_matches_oracle(mode, dtype, n, d, levels, bits, norm):
    if n > 5000 and dtype != tf.float32:
        pytest.skip("large sizes only in float32, to keep the file fast")
    x = random_vector(n, dtype, seed=n + levels)
    q = qz.quantize_bucketed(x, SEED, levels=levels, bucket_size=d, bits=bits, norm=norm)
    nb = np_buckets(n, d)
    assert q.scales.dtype == tf.float32 and q.scales.shape == [nb]
    assert q.words.dtype == tf.int32 and q.words.shape == [-(-n * bits // 32)]

    v = x.astype(np.float32)
    scales = q.scales.numpy()
    expected_scales = np_scales(v, d, norm)
    if norm == "max":
        np.testing.assert_array_equal(scales, expected_scales)
    else:  # float64 sums in another order: at most the last bit differs
        np.testing.assert_allclose(scales, expected_scales, rtol=2**-23, atol=0)

    codes = np_unpack(q.words.numpy(), n, bits)
    # The same layout as tfgc.ops.packing, and zero padding fields.
    np.testing.assert_array_equal(packing.unpack_codes(q.words, n, bits).numpy(), codes)
    per_word = 32 // bits
    all_fields = np_unpack(q.words.numpy(), q.words.shape[0] * per_word, bits)
    assert not all_fields[n:].any()

    # Within one level of a, exact where a is integral, and exactly the
    # oracle's draw everywhere.
    a = np_a(v, scales, d, levels)
    q_signed = codes - levels
    level = np.abs(q_signed)
    assert np.all((level == np.floor(a)) | (level == np.ceil(a)))
    integral = a == np.floor(a)
    np.testing.assert_array_equal(level[integral], a[integral])
    assert np.all(q_signed[v < 0] <= 0) and np.all(q_signed[v > 0] >= 0)
    np.testing.assert_array_equal(codes, np_codes(v, scales, d, levels, SEED))

    if mode == "custom":
        ref = qz.quantize_bucketed_reference(x, SEED, levels=levels, bucket_size=d, bits=bits, norm=norm)
        np.testing.assert_array_equal(q.scales.numpy(), ref.scales.numpy())
        np.testing.assert_array_equal(q.words.numpy(), ref.words.numpy())


def test_quantize_multidimensional_is_row_major(mode):
    x = random_vector(3 * 5 * 7, tf.float32, seed=3)
    q3 = qz.quantize_bucketed(x.reshape(3, 5, 7), SEED, levels=7, bucket_size=10, bits=4)
    q1 = qz.quantize_bucketed(x, SEED, levels=7, bucket_size=10, bits=4)
    np.testing.assert_array_equal(q3.words.numpy(), q1.words.numpy())
    np.testing.assert_array_equal(q3.scales.numpy(), q1.scales.numpy())


def test_terngrad_special_case(mode):
    # s = 1, max norm, one bucket: code = 1 + sign(g) [u < |g| / max|g|].
    g = random_vector(1000, tf.float32, seed=9)
    q = qz.quantize_bucketed(g, SEED, levels=1, bucket_size=len(g), bits=2, norm="max")
    scale = np.abs(g).max()
    assert q.scales.numpy().tolist() == [scale]
    keep = np_uniforms(len(g), SEED) < np.abs(g) / scale
    expected = 1 + keep * np.where(g < 0, -1, 1)
    np.testing.assert_array_equal(packing.unpack_codes(q.words, len(g), 2).numpy(), expected)


# ---------------------------------------------------------------------------
# Determinism and randomness.

def test_determinism_and_seed_dependence(mode):
    x = random_vector(10000, tf.float32, seed=1)
    kw = dict(levels=3, bucket_size=128, bits=4)
    a = qz.quantize_bucketed(x, SEED, **kw)
    b = qz.quantize_bucketed(x, SEED, **kw)
    np.testing.assert_array_equal(a.words.numpy(), b.words.numpy())
    c = qz.quantize_bucketed(x, SEED + [0, 1], **kw)
    np.testing.assert_array_equal(a.scales.numpy(), c.scales.numpy())
    assert np.mean(a.words.numpy() != c.words.numpy()) > 0.5
    # int32 seeds are accepted and mean the same.
    d = qz.quantize_bucketed(x, SEED.astype(np.int32), **kw)
    np.testing.assert_array_equal(a.words.numpy(), d.words.numpy())


def test_draws_depend_only_on_the_element_index(mode):
    # A prefix covering whole buckets is quantized identically however long
    # the tensor (and hence however the work is sharded) is.
    x = random_vector(300000, tf.float32, seed=2)
    kw = dict(levels=127, bucket_size=500, bits=8)
    full = qz.quantize_bucketed(x, SEED, **kw)
    for m in (500, 64000, 150000):
        part = qz.quantize_bucketed(x[:m], SEED, **kw)
        np.testing.assert_array_equal(part.scales.numpy(), full.scales.numpy()[:m // 500])
        np.testing.assert_array_equal(np_unpack(part.words.numpy(), m, 8),
                                      np_unpack(full.words.numpy(), m, 8))


@pytest.mark.parametrize("norm", ["l2", "max"])
def test_unbiased(mode, norm):
    n, d, levels = 200, 50, 3
    x = random_vector(n, tf.float32, seed=4)
    draws = []
    for i in range(300):
        q = qz.quantize_bucketed(x, [i, 77], levels=levels, bucket_size=d, bits=4, norm=norm)
        draws.append(qz.dequantize_bucketed(q.scales, q.words, n, levels=levels, bucket_size=d,
                                            bits=4).numpy())
    draws = np.array(draws, np.float64)
    scales = np_scales(x, d, norm)
    a = np_a(x, scales, d, levels).astype(np.float64)
    p = a - np.floor(a)
    variance = (scales[np.arange(n) // d].astype(np.float64) / levels) ** 2 * p * (1 - p)
    mean = draws.mean(axis=0)
    exact = variance < 1e-12
    np.testing.assert_allclose(mean[exact], x[exact], rtol=1e-5, atol=1e-6)
    z = (mean - x)[~exact] / np.sqrt(variance[~exact] / len(draws))
    assert np.mean(np.abs(z) < 4.0) > 0.99
    assert 0.6 < np.mean(z ** 2) < 1.4  # chi-square per degree of freedom


# ---------------------------------------------------------------------------
# Edge cases.

@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_empty(mode, dtype):
    q = qz.quantize_bucketed(np.zeros([0], np_dtype(dtype)), SEED, levels=7, bucket_size=4, bits=4)
    assert q.scales.numpy().tolist() == [0.0] and q.words.shape == [0]
    out = qz.dequantize_bucketed(q.scales, q.words, 0, levels=7, bucket_size=4, bits=4, dtype=dtype)
    assert out.shape == [0] and out.dtype == dtype


@pytest.mark.parametrize("norm", ["l2", "max"])
def test_all_zeros(mode, norm):
    q = qz.quantize_bucketed(np.zeros(100, np.float32), SEED, levels=7, bucket_size=30, bits=4, norm=norm)
    np.testing.assert_array_equal(q.scales.numpy(), np.zeros(4, np.float32))
    np.testing.assert_array_equal(np_unpack(q.words.numpy(), 100, 4), np.full(100, 7))
    out = qz.dequantize_bucketed(q.scales, q.words, 100, levels=7, bucket_size=30, bits=4)
    np.testing.assert_array_equal(out.numpy(), np.zeros(100, np.float32))


def test_extreme_magnitudes_stay_in_range(mode):
    # |v| = scale with s * |v| overflowing float32: a is capped at s.
    x = np.array([3e38, -3e38, 1e38, 0.0], np.float32)
    q = qz.quantize_bucketed(x, SEED, levels=127, bucket_size=4, bits=8, norm="max")
    codes = np_unpack(q.words.numpy(), 4, 8)
    assert codes[0] == 254 and codes[1] == 0 and codes[3] == 127
    assert np.all((codes >= 0) & (codes <= 254))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("norm", ["l2", "max"])
def test_nan_and_inf_are_pinned(mode, dtype, norm):
    nan, inf = np.nan, np.inf
    x = np.array([1.0, nan, -2.0, 3.0,      # bucket 0: NaN
                  1.0, -inf, 2.0, 0.5,      # bucket 1: -inf
                  -1.0, 0.25, 2.0, -0.0,    # bucket 2: finite
                  inf, inf, -1.0], np.float32).astype(np_dtype(dtype))
    q = qz.quantize_bucketed(x, SEED, levels=7, bucket_size=4, bits=4, norm=norm)
    scales = q.scales.numpy()
    assert np.isnan(scales[0]) and scales[1] == inf and scales[3] == inf
    assert np.isfinite(scales[2])
    codes = np_unpack(q.words.numpy(), x.size, 4)
    # Non-finite scale: every element of the bucket gets level 0 (code s).
    np.testing.assert_array_equal(codes[[0, 1, 2, 3, 4, 5, 6, 7, 12, 13, 14]], 7)
    np.testing.assert_array_equal(codes, np_codes(f32(x), scales, 4, 7, SEED))
    assert np.all(codes <= 14)
    out = f32(qz.dequantize_bucketed(q.scales, q.words, x.size, levels=7, bucket_size=4, bits=4,
                                     dtype=dtype))
    # ... and decodes to 0 * scale = NaN; the finite bucket is unaffected.
    assert np.all(np.isnan(out[[0, 1, 2, 3, 4, 5, 6, 7, 12, 13, 14]]))
    assert np.all(np.isfinite(out[8:12]))


# ---------------------------------------------------------------------------
# Dequantize.

@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("n,d,levels,bits", [(1, 1, 1, 2), (37, 5, 1, 2), (1000, 64, 7, 4),
                                             (1001, 100, 127, 8), (333, 1000, 32767, 16),
                                             (100003, 512, 100, 8)], ids=str)
def test_dequantize_matches_oracle(mode, dtype, n, d, levels, bits):
    rng = np.random.default_rng(n)
    codes = rng.integers(0, 2 * levels + 1, n)
    words = np_pack(codes, bits)
    # Random padding fields must be ignored.
    per_word = 32 // bits
    if n % per_word:
        words[-1] |= np.int32(-(1 << (bits * (n % per_word))))
    scales = rng.uniform(0, 10, np_buckets(n, d)).astype(np.float32)
    out = qz.dequantize_bucketed(scales, words, n, levels=levels, bucket_size=d, bits=bits, dtype=dtype)
    assert out.dtype == dtype and out.shape == [n]
    expected = np_dequantize(scales, words, n, levels, d, bits, np_dtype(dtype)).astype(np.float32)
    np.testing.assert_array_equal(f32(out), expected)
    if mode == "custom":
        ref = qz.dequantize_bucketed_reference(scales, words, n, levels=levels, bucket_size=d, bits=bits,
                                               dtype=dtype)
        np.testing.assert_array_equal(f32(out), f32(ref))


@pytest.mark.parametrize("levels,d", [(127, 512), (7, 100), (1, 10000)])
def test_wire_format_matches_the_qsgd_compressor(mode, levels, d):
    x = random_vector(3000, tf.float32, seed=6)
    bits = bits_for(levels)
    q = qz.quantize_bucketed(x, SEED, levels=levels, bucket_size=d, bits=bits)
    decoded = QSGD(levels=levels, bucket_size=d).decompress((q.scales, q.words), tf.TensorShape([3000]), tf.float32, None)
    ours = qz.dequantize_bucketed(q.scales, q.words, 3000, levels=levels, bucket_size=d, bits=bits)
    np.testing.assert_array_equal(decoded.numpy(), ours.numpy())


def test_round_trip_error_is_bounded(mode):
    x = random_vector(5000, tf.float32, seed=8)
    q = qz.quantize_bucketed(x, SEED, levels=127, bucket_size=256, bits=8, norm="max")
    out = qz.dequantize_bucketed(q.scales, q.words, 5000, levels=127, bucket_size=256, bits=8).numpy()
    step = (q.scales.numpy() / 127)[np.arange(5000) // 256]
    assert np.all(np.abs(out - x) <= step * (1 + 1e-6))


@pytest.mark.parametrize("args,kw", [
    ((np.zeros([1], np.float32), np.zeros([2], np.int32), 33), {}),     # 33 2-bit codes need 3 words
    ((np.zeros([1], np.float32), np.zeros([4], np.int32), 33), {}),
    ((np.zeros([2], np.float32), np.zeros([3], np.int32), 33), {}),     # 33 <= bucket_size: one scale
    ((np.zeros([0], np.float32), np.zeros([0], np.int32), 0), {}),      # n = 0 still sends one scale
    ((np.zeros([1], np.float32), np.zeros([1], np.int32), 0), {}),      # n = 0 needs no words
    ((np.zeros([1], np.float32), np.zeros([1], np.int32), -1), {}),     # negative size
    ((np.zeros([1], np.float32), np.zeros([1], np.int32), -2**63), {}),
    ((np.zeros([1], np.float32), np.zeros([1], np.int32), INT64_MAX), {}),
    ((np.zeros([1], np.float32), np.array([3], np.int32), 1), {}),      # code 3 > 2s = 2
    ((np.zeros([1], np.float32), np.array([0, -(1 << 30)], np.int32), 32), {}),
    ((np.zeros([1, 1], np.float32), np.zeros([1], np.int32), 1), {}),   # ranks
    ((np.zeros([1], np.float32), np.zeros([1, 1], np.int32), 1), {}),
    ((np.zeros([1], np.float32), np.zeros([1], np.int32), [1]), {}),
    ((np.zeros([1], np.float64), np.zeros([1], np.int32), 1), {}),      # dtypes
    ((np.zeros([1], np.float32), np.zeros([1], np.int64), 1), {}),
    ((np.zeros([1], np.float32), np.zeros([1], np.int32), 1.5), {}),
    ((np.zeros([1], np.float32), np.zeros([1], np.int32), 1), {"levels": 2}),  # 5 codes in 2 bits
    ((np.zeros([1], np.float32), np.zeros([1], np.int32), 1), {"levels": 0}),
    ((np.zeros([1], np.float32), np.zeros([1], np.int32), 1), {"bits": 3}),
    ((np.zeros([1], np.float32), np.zeros([1], np.int32), 1), {"bucket_size": 0}),
])
def test_dequantize_rejects_malformed_payloads(mode, args, kw):
    kw = {"levels": 1, "bucket_size": 64, "bits": 2, **kw}
    with pytest.raises(tf.errors.InvalidArgumentError):
        qz.dequantize_bucketed(*args, **kw).numpy()


@pytest.mark.parametrize("kw", [
    {"levels": 0}, {"levels": 32768}, {"levels": 8, "bits": 4}, {"bits": 32}, {"bits": 1},
    {"bucket_size": 0}, {"bucket_size": -5}, {"norm": "l1"}, {"levels": 1.5},
])
def test_quantize_rejects_bad_attributes(mode, kw):
    kw = {"levels": 1, "bucket_size": 64, "bits": 2, "norm": "l2", **kw}
    with pytest.raises(tf.errors.InvalidArgumentError):
        qz.quantize_bucketed(np.ones(10, np.float32), SEED, **kw)


@pytest.mark.parametrize("seed", [np.array([1, 2, 3], np.int64), np.array([[1, 2]], np.int64),
                                  np.array([1.0, 2.0], np.float32)], ids=str)
def test_quantize_rejects_bad_seeds(mode, seed):
    with pytest.raises(tf.errors.InvalidArgumentError):
        qz.quantize_bucketed(np.ones(10, np.float32), seed, levels=1, bucket_size=4, bits=2)


def test_validation_inside_tf_function(mode):
    @tf.function(input_signature=[tf.TensorSpec([None], tf.float32), tf.TensorSpec([None], tf.int32),
                                  tf.TensorSpec([], tf.int64)])
    def decode(scales, words, n):
        return qz.dequantize_bucketed(scales, words, n, levels=1, bucket_size=2, bits=2)

    out = decode(np.array([2.0, 4.0], np.float32), np.array([0b10_01_00_10], np.int32), np.int64(4))
    np.testing.assert_array_equal(out.numpy(), [2.0, -2.0, 0.0, 4.0])
    with pytest.raises(tf.errors.InvalidArgumentError):
        decode(np.array([2.0], np.float32), np.array([0], np.int32), np.int64(4))
    with pytest.raises(tf.errors.InvalidArgumentError):
        decode(np.array([2.0, 4.0], np.float32), np.array([0b11], np.int32), np.int64(4))


def test_graph_mode_matches_the_oracle(mode):
    # Inside tf.function Grappler may rewrite the references' arithmetic (a
    # division by the constant s became a reciprocal multiply); the results
    # must stay bit-identical to eager mode and to the oracle.
    @tf.function(input_signature=[tf.TensorSpec([None], tf.float32), tf.TensorSpec([2], tf.int64)],
                 autograph=False)
    def round_trip(x, seed):
        q = qz.quantize_bucketed(x, seed, levels=7, bucket_size=10, bits=4)
        n = tf.size(x, out_type=tf.int64)
        return q, qz.dequantize_bucketed(q.scales, q.words, n, levels=7, bucket_size=10, bits=4)

    x = random_vector(1000, tf.float32, seed=12)
    (scales, words), out = round_trip(x, SEED)
    np.testing.assert_array_equal(np_codes(x, scales.numpy(), 10, 7, SEED), np_unpack(words.numpy(), 1000, 4))
    np.testing.assert_array_equal(out.numpy(), np_dequantize(scales.numpy(), words.numpy(), 1000, 7, 10, 4))


# ---------------------------------------------------------------------------
# Fused sum of several workers' payloads.

@pytest.mark.parametrize("workers", [0, 1, 3])
@pytest.mark.parametrize("n,d,levels,bits", [(1, 1, 1, 2), (1001, 100, 7, 4), (70000, 512, 127, 8)], ids=str)
def test_dequantize_sum_matches_sequential_sum(mode, workers, n, d, levels, bits):
    xs = [random_vector(n, tf.float32, seed=k) for k in range(workers)]
    qs = [qz.quantize_bucketed(x, [k, 5], levels=levels, bucket_size=d, bits=bits) for k, x in enumerate(xs)]
    nb, nw = np_buckets(n, d), -(-n * bits // 32)
    scales = np.stack([q.scales.numpy() for q in qs]) if qs else np.zeros([0, nb], np.float32)
    words = np.stack([q.words.numpy() for q in qs]) if qs else np.zeros([0, nw], np.int32)
    out = qz.dequantize_bucketed_sum(scales, words, n, levels=levels, bucket_size=d, bits=bits)
    assert out.dtype == tf.float32 and out.shape == [n]
    expected = np.zeros(n, np.float32)
    for k in range(workers):
        expected = expected + np_dequantize(scales[k], words[k], n, levels, d, bits)
    np.testing.assert_array_equal(out.numpy(), expected)
    if mode == "custom" and workers:
        ref = qz.dequantize_bucketed_sum_reference(scales, words, n, levels=levels, bucket_size=d, bits=bits)
        np.testing.assert_array_equal(out.numpy(), ref.numpy())


@pytest.mark.parametrize("args", [
    (np.zeros([2, 1], np.float32), np.zeros([3, 3], np.int32), 33),    # worker counts differ
    (np.zeros([2, 2], np.float32), np.zeros([2, 3], np.int32), 33),    # buckets per worker
    (np.zeros([2, 1], np.float32), np.zeros([2, 2], np.int32), 33),    # words per worker
    (np.zeros([2, 1], np.float32), np.zeros([2, 1], np.int32), -1),
    (np.zeros([1], np.float32), np.zeros([1], np.int32), 1),           # not 2-D
    (np.zeros([1, 1], np.float32), np.array([[3]], np.int32), 1),      # code 3 > 2s
    (np.zeros([2, 1], np.float32), np.array([[0], [3 << 16]], np.int32), 10),  # in worker 1
])
def test_dequantize_sum_rejects_malformed_payloads(mode, args):
    with pytest.raises(tf.errors.InvalidArgumentError):
        qz.dequantize_bucketed_sum(*args, levels=1, bucket_size=64, bits=2).numpy()


# ---------------------------------------------------------------------------
# Fuzzing of the payload-facing op: a correct result or InvalidArgumentError,
# never a crash or another exception type.

FUZZ = settings(max_examples=300, derandomize=True, deadline=None, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

sizes = st.one_of(st.integers(0, 300), st.integers(0, 3000), st.integers(-3, 100),
                  st.integers(-2**63, 2**63 - 1),
                  st.sampled_from([2**31, 2**32 + 1, 2**62, INT64_MAX, -2**63]))


@st.composite
def dequantize_payloads(draw):
    levels = draw(st.sampled_from([1, 2, 7, 8, 127, 128, 32767]))
    bits = draw(st.sampled_from([b for b in (2, 4, 8, 16) if 2 * levels + 1 <= (1 << b)]))
    d = draw(st.one_of(st.integers(1, 70), st.sampled_from([512, 2**62])))
    n = draw(sizes)
    ok = 0 <= n < 10**4
    exp_words = -(-n * bits // 32) if ok else 0
    exp_scales = np_buckets(n, d) if ok else 1
    # Mostly the right counts, otherwise off by one or arbitrary.
    num_words = draw(st.sampled_from([exp_words] * 6 + [max(exp_words - 1, 0), exp_words + 1])
                     | st.integers(0, 12))
    num_scales = draw(st.sampled_from([exp_scales] * 6 + [exp_scales + 1, max(exp_scales - 1, 0)]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    if draw(st.sampled_from([True, True, True, False])) and ok:  # mostly valid codes
        codes = rng.integers(0, 2 * levels + 1, num_words * (32 // bits))
        words = np_pack(codes, bits)
    else:
        words = rng.integers(-2**31, 2**31, num_words).astype(np.int32)
    scales = rng.standard_normal(num_scales).astype(np.float32)
    return scales, words, n, levels, d, bits, draw(st.sampled_from(DTYPES))


@FUZZ
@given(payload=dequantize_payloads())
def test_fuzz_dequantize(mode, payload):
    scales, words, n, levels, d, bits, dtype = payload
    try:
        out = qz.dequantize_bucketed(scales, words, n, levels=levels, bucket_size=d, bits=bits, dtype=dtype)
    except tf.errors.InvalidArgumentError:
        event("rejected")
        valid = (n >= 0 and scales.size == np_buckets(n, d) and words.size == -(-n * bits // 32)
                 and np_unpack(words, n, bits).max(initial=0) <= 2 * levels)
        assert not valid
        return
    event("decoded")
    assert out.shape == [n]
    expected = np_dequantize(scales, words, n, levels, d, bits, np_dtype(dtype)).astype(np.float32)
    np.testing.assert_array_equal(f32(out), expected)
