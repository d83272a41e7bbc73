"""Tests for tfgc.ops.sign_bits: compiled kernels vs pure-TF references vs NumPy.

Every test that takes the ``mode`` fixture runs twice: once through the
compiled kernels ("custom") and once with TFGC_DISABLE_CUSTOM_OPS=1
("reference"). Results are checked against an independent NumPy oracle and,
in custom mode, against the references directly.
"""

import os

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tfgc.ops import _loader
from tfgc.ops import sign_bits as sb

DTYPES = [tf.float32, tf.float16, tf.bfloat16]
DTYPE_IDS = ["float32", "float16", "bfloat16"]
INT64_MAX = np.iinfo(np.int64).max




# ---------------------------------------------------------------------------
# NumPy oracle.

def np_dtype(dtype):
    return tf.as_dtype(dtype).as_numpy_dtype


def np_pack(x):
    bits = np.asarray(x).astype(np.float32).ravel() >= 0  # NaN -> False
    bits = np.concatenate([bits, np.zeros((-bits.size) % 32, bool)])
    return np.packbits(bits, bitorder="little").view("<u4").astype(np.uint32).view(np.int32)


def np_bits(words, n):
    words = np.asarray(words, dtype="<i4")
    return np.unpackbits(words.view(np.uint8), bitorder="little")[:n].astype(bool)


def np_unpack(words, n, dtype=np.float32):
    return np.where(np_bits(words, n), 1.0, -1.0).astype(dtype)


def np_quantize(x):
    """Float64 statistics; means float32; residual against means rounded to x.dtype."""
    x = np.asarray(x)
    xf = x.astype(np.float32)
    x64 = xf.astype(np.float64)
    pos = xf >= 0
    rows = x.shape[0]
    with np.errstate(invalid="ignore"):
        pos_sum = np.where(pos, x64, 0.0).sum(axis=0)
        neg_sum = np.where(pos, 0.0, x64).sum(axis=0)
    pos_cnt = pos.sum(axis=0)
    pos_mean = (pos_sum / np.maximum(pos_cnt, 1)).astype(np.float32)
    neg_mean = (neg_sum / np.maximum(rows - pos_cnt, 1)).astype(np.float32)
    return np_pack(x), pos_mean, neg_mean


def np_residual(x, pos_mean, neg_mean):
    x = np.asarray(x)
    decoded = np.where(x.astype(np.float32) >= 0, pos_mean, neg_mean)
    decoded = decoded.astype(x.dtype).astype(np.float32)
    with np.errstate(invalid="ignore"):
        return (x.astype(np.float32) - decoded).astype(x.dtype)


def np_dequantize(words, pos_mean, neg_mean, rows, dtype=np.float32):
    cols = len(pos_mean)
    bits = np_bits(words, rows * cols).reshape(rows, cols)
    with np.errstate(over="ignore", invalid="ignore"):  # float32 -> half may overflow to inf
        return np.where(bits, pos_mean, neg_mean).astype(dtype)


def machine_eps(dtype):
    return {tf.float32: 2.0**-23, tf.float16: 2.0**-10, tf.bfloat16: 2.0**-7}[tf.as_dtype(dtype)]


def f32(t):
    return np.asarray(tf.cast(t, tf.float32))


def random_matrix(rows, cols, dtype, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, cols)).astype(np.float32)
    # Per-column offsets and scales make the two class means of a column
    # asymmetric and different from column to column.
    x = x * rng.uniform(0.1, 4.0, cols).astype(np.float32) + rng.uniform(-1, 1, cols).astype(np.float32)
    return x.astype(np_dtype(dtype))


# ---------------------------------------------------------------------------
# Loader and dispatch.

def test_env_var_is_read_at_each_call(monkeypatch):
    monkeypatch.setenv(_loader.DISABLE_ENV_VAR, "1")
    assert sb._loader.load_library() is None
    monkeypatch.setenv(_loader.DISABLE_ENV_VAR, "0")
    if os.path.exists(_loader.library_path()):
        assert _loader.load_library() is not None
    monkeypatch.setenv(_loader.DISABLE_ENV_VAR, "1")
    assert not _loader.custom_ops_available()


def test_dispatch_uses_the_expected_implementation(mode):
    @tf.function
    def f(x):
        return sb.pack_sign_bits(x)

    graph = f.get_concrete_function(tf.TensorSpec([None], tf.float32)).graph
    op_types = {op.type for op in graph.get_operations()}
    assert ("TfgcPackSignBits" in op_types) == (mode == "custom")


# ---------------------------------------------------------------------------
# pack / unpack.

SIZES = [0, 1, 31, 32, 33, 64, 1000, 1000003]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("n", SIZES)
def test_pack_unpack_match_oracle(mode, dtype, n):
    if n > 10000 and dtype != tf.float32:
        n = 100003  # keep the half-precision cases quick
    rng = np.random.default_rng(n)
    x = rng.standard_normal(n).astype(np.float32).astype(np_dtype(dtype))
    words = sb.pack_sign_bits(tf.constant(x))
    assert words.dtype == tf.int32 and words.shape == [-(-n // 32)]
    np.testing.assert_array_equal(words.numpy(), np_pack(x))
    if mode == "custom":
        np.testing.assert_array_equal(words.numpy(), sb.pack_sign_bits_reference(x).numpy())

    values = sb.unpack_sign_bits(words, n, dtype=dtype)
    assert values.dtype == dtype and values.shape == [n]
    expected = np.where(x.astype(np.float32) >= 0, 1.0, -1.0)
    np.testing.assert_array_equal(f32(values), expected)
    if mode == "custom":
        ref = sb.unpack_sign_bits_reference(words, n, dtype=dtype)
        np.testing.assert_array_equal(f32(values), f32(ref))


def test_pack_multidimensional_is_row_major(mode):
    x = np.random.default_rng(3).standard_normal((3, 5, 7)).astype(np.float32)
    np.testing.assert_array_equal(sb.pack_sign_bits(x).numpy(), np_pack(x))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_pack_special_values_are_pinned(mode, dtype):
    nan = np.float32(np.nan)
    values = [nan, -nan, np.inf, -np.inf, 0.0, -0.0, 1.0, -1.0,
              np.float32(1e-30), np.float32(-1e-30)]
    x = np.array(values, np.float32).astype(np_dtype(dtype))
    # NaN of either sign -> 0, +inf -> 1, -inf -> 0, +0 and -0 -> 1, tiny
    # values (subnormal or flushed to +-0 in half precision) keep their sign.
    expected_bits = [0, 0, 1, 0, 1, 1, 1, 0, 1, 0]
    if dtype != tf.float32:
        expected_bits[9] = int(np.float32(x[9]) >= 0)  # -1e-30 rounds to -0.0 -> 1
    expected = sum(b << i for i, b in enumerate(expected_bits))
    assert sb.pack_sign_bits(x).numpy().tolist() == [expected]


def test_pack_all_bits_set_and_clear(mode):
    assert sb.pack_sign_bits(np.ones(64, np.float32)).numpy().tolist() == [-1, -1]
    assert sb.pack_sign_bits(-np.ones(64, np.float32)).numpy().tolist() == [0, 0]
    # Padding bits of a partial word are zero.
    assert sb.pack_sign_bits(np.ones(33, np.float32)).numpy().tolist() == [-1, 1]


@pytest.mark.parametrize("args", [
    (np.zeros([2], np.int32), 65),       # too few words
    (np.zeros([3], np.int32), 64),       # too many words
    (np.zeros([1], np.int32), 0),        # n = 0 needs zero words
    (np.zeros([0], np.int32), 1),
    (np.zeros([1], np.int32), -1),       # negative size
    (np.zeros([1], np.int32), -32),
    (np.zeros([1, 1], np.int32), 32),    # words not 1-D
    (np.int32(0), 32),                   # scalar words
    (np.zeros([1], np.int32), [32]),     # num_elements not a scalar
    (np.zeros([1], np.int32), INT64_MAX),
    (np.zeros([1], np.float32), 32),     # wrong payload dtype
    (np.zeros([1], np.int64), 32),
])
def test_unpack_rejects_malformed_payloads(mode, args):
    with pytest.raises(tf.errors.InvalidArgumentError):
        sb.unpack_sign_bits(*args).numpy()


# ---------------------------------------------------------------------------
# 1-bit quantize / dequantize.

# Shapes chosen to reach every kernel path: short and wide (column blocks),
# tall and narrow (rows folded into wider lanes, with a ragged tail), long
# columns with row shards, and a single tile that stores its means directly.
SHAPES = [(1, 1), (1, 5), (5, 1), (37, 29), (1, 100003), (3, 1000), (128, 600),
          (129, 600), (1000, 100), (1000003, 1), (33335, 3), (130, 20000)]


def check_quantized(x, q, dtype):
    rows, cols = x.shape
    words, pos_mean, neg_mean, residual = (t.numpy() for t in q)
    assert q.words.dtype == tf.int32 and q.words.shape == [-(-rows * cols // 32)]
    assert q.pos_mean.dtype == tf.float32 and q.pos_mean.shape == [cols]
    assert q.neg_mean.dtype == tf.float32 and q.neg_mean.shape == [cols]
    assert q.residual.dtype == dtype and q.residual.shape == [rows, cols]

    oracle_words, oracle_pos, oracle_neg = np_quantize(x)
    np.testing.assert_array_equal(words, oracle_words)
    # Summation order differs from the float64 oracle (the kernels sum short
    # runs in float32), hence a small relative tolerance on the means.
    scale = np.abs(x.astype(np.float32)).max(axis=0, initial=0.0)
    np.testing.assert_allclose(pos_mean, oracle_pos, rtol=1e-5, atol=1e-6 * scale.max(initial=0))
    np.testing.assert_allclose(neg_mean, oracle_neg, rtol=1e-5, atol=1e-6 * scale.max(initial=0))
    # Given the returned means the residual is exact.
    np.testing.assert_array_equal(f32(residual), np_residual(x, pos_mean, neg_mean).astype(np.float32))


@pytest.mark.parametrize("dtype,shape", [
    pytest.param(dtype, shape, id=f"{name}-{shape}")
    for dtype, name in zip(DTYPES, DTYPE_IDS) for shape in SHAPES
    # Large shapes only in float32, to keep the file fast.
    if dtype == tf.float32 or shape[0] * shape[1] <= 200000
])
def test_quantize_matches_oracle_and_reference(mode, dtype, shape):
    x = random_matrix(*shape, dtype, seed=shape[0] * 7 + shape[1])
    q = sb.onebit_quantize(x)
    check_quantized(x, q, dtype)
    if mode == "custom":
        ref = sb.onebit_quantize_reference(x)
        np.testing.assert_array_equal(q.words.numpy(), ref.words.numpy())
        np.testing.assert_allclose(q.pos_mean.numpy(), ref.pos_mean.numpy(), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(q.neg_mean.numpy(), ref.neg_mean.numpy(), rtol=1e-5, atol=1e-6)
        eps = machine_eps(dtype)
        np.testing.assert_allclose(f32(q.residual), f32(ref.residual), rtol=0,
                                   atol=4 * eps * float(np.abs(f32(x)).max()))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", [(1, 1), (37, 29), (1, 100003), (1000, 100), (100003, 3)], ids=str)
def test_quantize_round_trip(mode, dtype, shape):
    x = random_matrix(*shape, dtype, seed=11)
    rows, cols = shape
    q = sb.onebit_quantize(x)
    decoded = sb.onebit_dequantize(q.words, q.pos_mean, q.neg_mean, rows, dtype=dtype)
    assert decoded.dtype == dtype and decoded.shape == [rows, cols]
    dec = f32(decoded).astype(np.float64)
    xf = f32(x).astype(np.float64)
    eps = machine_eps(dtype)

    # decoded + residual reconstructs x up to the rounding of the residual.
    np.testing.assert_allclose(dec + f32(q.residual), xf, rtol=0, atol=2 * eps * np.abs(xf).max())

    # Exactly the two class means per column.
    pos_levels = q.pos_mean.numpy().astype(np_dtype(dtype)).astype(np.float32)
    neg_levels = q.neg_mean.numpy().astype(np_dtype(dtype)).astype(np.float32)
    for j in range(min(cols, 50)):
        levels = set(dec[:, j].tolist())
        pos = xf[:, j] >= 0
        expected = set()
        if pos.any():
            expected.add(float(pos_levels[j]))
        if (~pos).any():
            expected.add(float(neg_levels[j]))
        assert levels == expected
        if pos.any() and (~pos).any():
            assert len(levels) == 2

    # The means preserve column sums, so residual columns sum to ~0.
    if dtype == tf.float32:
        tol = 1e-5 * np.abs(xf).sum(axis=0) + 1e-6
        assert np.all(np.abs(dec.sum(axis=0) - xf.sum(axis=0)) <= tol)
        assert np.all(np.abs(f32(q.residual).astype(np.float64).sum(axis=0)) <= tol)


def test_quantize_all_positive_and_all_negative_columns(mode):
    x = np.array([[1.0, -1.0, 2.0],
                  [3.0, -5.0, -2.0],
                  [0.0, -0.5, 4.0],
                  [-0.0, -1.5, -6.0]], np.float32)
    q = sb.onebit_quantize(x)
    # Column 0 has no negatives (0.0 and -0.0 count as >= 0): neg_mean = 0.
    # Column 1 has no non-negatives: pos_mean = 0.
    np.testing.assert_allclose(q.pos_mean.numpy(), [1.0, 0.0, 3.0])
    np.testing.assert_allclose(q.neg_mean.numpy(), [0.0, -2.0, -4.0])
    decoded = sb.onebit_dequantize(q.words, q.pos_mean, q.neg_mean, 4).numpy()
    np.testing.assert_allclose(decoded, [[1, -2, 3], [1, -2, -4], [1, -2, 3], [1, -2, -4]])
    np.testing.assert_allclose(q.residual.numpy(), x - decoded)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_quantize_nan_and_inf_are_pinned(mode, dtype):
    nan, inf = np.nan, np.inf
    x = np.array([[1.0, 1.0, 2.0],
                  [nan, inf, -2.0],
                  [-3.0, -1.0, -inf],
                  [3.0, 3.0, 4.0]], np.float32).astype(np_dtype(dtype))
    q = sb.onebit_quantize(x)
    pos_mean, neg_mean, residual = q.pos_mean.numpy(), q.neg_mean.numpy(), f32(q.residual)
    # NaN goes to the negative class: its bit is 0 ...
    bits = np_bits(q.words.numpy(), 12).reshape(4, 3)
    np.testing.assert_array_equal(bits, f32(x) >= 0)
    assert not bits[1, 0]
    # ... it poisons that column's neg_mean and the negative-class residuals,
    # while pos_mean and the positive-class residuals stay finite.
    assert pos_mean[0] == 2.0 and np.isnan(neg_mean[0])
    assert np.isnan(residual[1, 0]) and np.isnan(residual[2, 0])
    np.testing.assert_array_equal(residual[[0, 3], 0], [-1.0, 1.0])
    # +inf makes its class mean +inf; inf - inf = NaN, finite - inf = -inf.
    assert pos_mean[1] == inf and neg_mean[1] == -1.0
    assert np.isnan(residual[1, 1]) and residual[0, 1] == -inf and residual[3, 1] == -inf
    assert residual[2, 1] == 0.0
    # -inf likewise for the negative class.
    assert pos_mean[2] == 3.0 and neg_mean[2] == -inf
    assert np.isnan(residual[2, 2]) and residual[1, 2] == inf
    # Dequantize reproduces the non-finite means as they are.
    decoded = f32(sb.onebit_dequantize(q.words, q.pos_mean, q.neg_mean, 4, dtype=dtype))
    np.testing.assert_array_equal(decoded, np_dequantize(q.words.numpy(), pos_mean, neg_mean, 4))


@pytest.mark.parametrize("shape", [(0, 0), (0, 5), (5, 0)], ids=str)
def test_quantize_empty(mode, shape):
    q = sb.onebit_quantize(np.zeros(shape, np.float32))
    assert q.words.shape == [0]
    np.testing.assert_array_equal(q.pos_mean.numpy(), np.zeros(shape[1], np.float32))
    np.testing.assert_array_equal(q.neg_mean.numpy(), np.zeros(shape[1], np.float32))
    assert q.residual.shape == shape
    decoded = sb.onebit_dequantize(q.words, q.pos_mean, q.neg_mean, shape[0])
    assert decoded.shape == shape


@pytest.mark.parametrize("shape", [(), (4,), (2, 3, 4)], ids=str)
def test_quantize_rejects_non_matrices(mode, shape):
    with pytest.raises(tf.errors.InvalidArgumentError):
        sb.onebit_quantize(np.ones(shape, np.float32))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (1, 100), (5, 1000), (31, 33), (1000, 37), (7, 1)], ids=str)
def test_dequantize_matches_oracle(mode, dtype, shape):
    rows, cols = shape
    rng = np.random.default_rng(rows * 100 + cols)
    words = rng.integers(-2**31, 2**31, -(-rows * cols // 32), dtype=np.int64).astype(np.int32)
    # Random padding bits must be ignored.
    pos_mean = rng.standard_normal(cols).astype(np.float32)
    neg_mean = rng.standard_normal(cols).astype(np.float32)
    out = sb.onebit_dequantize(words, pos_mean, neg_mean, rows, dtype=dtype)
    expected = np_dequantize(words, pos_mean, neg_mean, rows, np_dtype(dtype))
    np.testing.assert_array_equal(f32(out), expected.astype(np.float32))
    if mode == "custom":
        ref = sb.onebit_dequantize_reference(words, pos_mean, neg_mean, rows, dtype=dtype)
        np.testing.assert_array_equal(f32(out), f32(ref))


@pytest.mark.parametrize("args", [
    (np.zeros([1], np.int32), np.zeros([3], np.float32), np.zeros([3], np.float32), 11),   # 33 bits need 2 words
    (np.zeros([2], np.int32), np.zeros([3], np.float32), np.zeros([3], np.float32), 10),   # 30 bits need 1 word
    (np.zeros([1], np.int32), np.zeros([3], np.float32), np.zeros([2], np.float32), 10),   # mean lengths differ
    (np.zeros([1], np.int32), np.zeros([3], np.float32), np.zeros([3], np.float32), -1),   # negative rows
    (np.zeros([0], np.int32), np.zeros([3], np.float32), np.zeros([3], np.float32), -1),
    (np.zeros([1], np.int32), np.zeros([4], np.float32), np.zeros([4], np.float32), INT64_MAX),  # overflow
    (np.zeros([1], np.int32), np.zeros([2], np.float32), np.zeros([2], np.float32), 2**62),       # overflow
    (np.zeros([1], np.int32), np.zeros([1], np.float32), np.zeros([1], np.float32), 2**40),       # huge, short payload
    (np.zeros([1, 1], np.int32), np.zeros([1], np.float32), np.zeros([1], np.float32), 1),   # words not 1-D
    (np.zeros([1], np.int32), np.zeros([1, 1], np.float32), np.zeros([1, 1], np.float32), 1),  # means not 1-D
    (np.zeros([1], np.int32), np.float32(0), np.float32(0), 1),
    (np.zeros([1], np.int32), np.zeros([1], np.float32), np.zeros([1], np.float32), [1]),  # rows not scalar
    (np.zeros([1], np.int64), np.zeros([1], np.float32), np.zeros([1], np.float32), 1),    # wrong dtypes
    (np.zeros([1], np.int32), np.zeros([1], np.float64), np.zeros([1], np.float64), 1),
])
def test_dequantize_rejects_malformed_payloads(mode, args):
    with pytest.raises(tf.errors.InvalidArgumentError):
        sb.onebit_dequantize(*args).numpy()


def test_dequantize_huge_rows_with_no_columns(mode):
    # rows * 0 = 0 elements: valid, needs zero words, allocates nothing.
    out = sb.onebit_dequantize(np.zeros([0], np.int32), np.zeros([0], np.float32),
                               np.zeros([0], np.float32), 2**62)
    assert out.shape == [2**62, 0]


def test_validation_inside_tf_function(mode):
    @tf.function(input_signature=[tf.TensorSpec([None], tf.int32), tf.TensorSpec([None], tf.float32),
                                  tf.TensorSpec([None], tf.float32), tf.TensorSpec([], tf.int64)])
    def decode(words, pos, neg, rows):
        return sb.onebit_dequantize(words, pos, neg, rows)

    out = decode(np.array([5], np.int32), np.ones(3, np.float32), -np.ones(3, np.float32), np.int64(2))
    np.testing.assert_array_equal(out.numpy(), [[1, -1, 1], [-1, -1, -1]])
    with pytest.raises(tf.errors.InvalidArgumentError):
        decode(np.array([5, 6], np.int32), np.ones(3, np.float32), -np.ones(3, np.float32), np.int64(2))

    @tf.function(input_signature=[tf.TensorSpec([None], tf.int32), tf.TensorSpec([], tf.int64)])
    def unpack(words, n):
        return sb.unpack_sign_bits(words, n)

    assert unpack(np.array([1], np.int32), np.int64(3)).numpy().tolist() == [1, -1, -1]
    with pytest.raises(tf.errors.InvalidArgumentError):
        unpack(np.array([1], np.int32), np.int64(33))


# ---------------------------------------------------------------------------
# Fuzzing of the payload-facing ops: any input must give a correct result or
# InvalidArgumentError, never a crash or another exception type.

FUZZ = settings(max_examples=300, derandomize=True, deadline=None, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow])

def random_words(seed, count):
    # Drawn from NumPy: payloads can be thousands of words, more than
    # Hypothesis should generate element by element.
    return np.random.default_rng(seed).integers(-2**31, 2**31, count).astype(np.int32)


# Mostly small valid sizes (so that many payloads decode), plus negative,
# huge and extreme ones.
sizes = st.one_of(st.integers(0, 200), st.integers(0, 3000), st.integers(-3, 200),
                  st.integers(-2**63, 2**63 - 1),
                  st.sampled_from([2**31, 2**32 + 1, 2**62, INT64_MAX, -2**63]))


def word_counts(expected):
    """Mostly the right count, otherwise off by one or arbitrary."""
    return st.one_of(st.just(expected), st.just(expected), st.just(expected),
                     st.integers(0, 12), st.just(max(expected - 1, 0)), st.just(expected + 1))


@st.composite
def unpack_payloads(draw):
    n = draw(sizes)
    expected = -(-n // 32) if 0 <= n < 10**4 else 0
    num_words = draw(word_counts(expected))
    words = random_words(draw(st.integers(0, 2**32 - 1)), num_words)
    shape_kind = draw(st.sampled_from(["vector", "vector", "vector", "matrix", "scalar_n"]))
    if shape_kind == "matrix":
        words = words.reshape(1, -1)
    n_arg = [n] if shape_kind == "scalar_n" else n
    return words, n_arg, draw(st.sampled_from(DTYPES))


@FUZZ
@given(payload=unpack_payloads())
def test_fuzz_unpack(mode, payload):
    words, n, dtype = payload
    try:
        out = sb.unpack_sign_bits(words, n, dtype=dtype)
    except tf.errors.InvalidArgumentError:
        event("rejected")
        valid = (words.ndim == 1 and np.ndim(n) == 0 and 0 <= n
                 and words.size == -(-n // 32))
        assert not valid
        return
    event("decoded")
    np.testing.assert_array_equal(f32(out), np_unpack(words, n))


@st.composite
def dequantize_payloads(draw):
    rows = draw(sizes)
    cols = draw(st.integers(0, 40))
    neg_cols = draw(st.one_of(st.just(cols), st.just(cols), st.integers(0, 40)))
    if 0 <= rows and rows * cols < 10**4:
        expected = -(-rows * cols // 32)
    else:
        expected = 0
    num_words = draw(word_counts(expected))
    words = random_words(draw(st.integers(0, 2**32 - 1)), num_words)
    floats = st.floats(width=32, allow_nan=True, allow_infinity=True)
    pos = np.array(draw(st.lists(floats, min_size=cols, max_size=cols)), np.float32)
    neg = np.array(draw(st.lists(floats, min_size=neg_cols, max_size=neg_cols)), np.float32)
    return words, pos, neg, rows, draw(st.sampled_from(DTYPES))


@FUZZ
@given(payload=dequantize_payloads())
def test_fuzz_dequantize(mode, payload):
    words, pos, neg, rows, dtype = payload
    try:
        out = sb.onebit_dequantize(words, pos, neg, rows, dtype=dtype)
    except tf.errors.InvalidArgumentError:
        event("rejected")
        cols = pos.size
        valid = (pos.size == neg.size and rows >= 0
                 and (cols == 0 or rows <= INT64_MAX // cols)
                 and words.size == -(-rows * cols // 32))
        assert not valid
        return
    event("decoded")
    assert out.shape == [rows, pos.size]
    if 0 < out.shape.num_elements() < 10**6:
        expected = np_dequantize(words, pos, neg, rows, np_dtype(dtype)).astype(np.float32)
        np.testing.assert_array_equal(f32(out), expected)


# ---------------------------------------------------------------------------
# Half-precision conversions. The kernels convert float16/bfloat16 <-> float32
# with their own branch-free code; check it against NumPy on every 16-bit
# pattern and on the rounding-sensitive float32 values.

@pytest.mark.parametrize("dtype", [tf.float16, tf.bfloat16], ids=["float16", "bfloat16"])
def test_half_to_float_all_bit_patterns(mode, dtype):
    x = np.arange(2**16, dtype=np.uint16).view(np_dtype(dtype))
    # bfloat16 subnormals are float32 subnormals, which TensorFlow's
    # flush-to-zero mode zeroes in any kernel (custom or not); leave them out.
    xf = x.astype(np.float32)
    x = x[~((xf != 0) & (np.abs(xf) < np.finfo(np.float32).tiny))].reshape(1, -1)
    q = sb.onebit_quantize(x)
    # With a single row each column's mean is its only value (converted to
    # float32); the other class is empty, mean 0.
    expected = x.astype(np.float32)[0]
    pos = expected >= 0
    np.testing.assert_array_equal(q.pos_mean.numpy(), np.where(pos, expected, 0))
    np.testing.assert_array_equal(q.neg_mean.numpy(), np.where(pos, 0, expected))


@pytest.mark.parametrize("dtype", [tf.float16, tf.bfloat16], ids=["float16", "bfloat16"])
def test_float_to_half_rounding(mode, dtype):
    halves = np.arange(2**16, dtype=np.uint16).view(np_dtype(dtype)).astype(np.float32)
    finite = np.sort(halves[np.isfinite(halves)])
    mids = (finite[:-1].astype(np.float64) + finite[1:]) / 2  # ties: round to even
    tiny = np.finfo(np.float32).tiny
    values = np.concatenate([
        halves, mids.astype(np.float32), np.nextafter(mids.astype(np.float32), np.float32(np.inf)),
        np.nextafter(mids.astype(np.float32), np.float32(-np.inf)),
        np.random.default_rng(5).standard_normal(10000).astype(np.float32) * 1000,
        np.float32([65504, 65519.996, 65520, 1e10, -1e10, 3.4e38, -3.4e38, np.inf, -np.inf, np.nan]),
    ]).astype(np.float32)
    # Float32 subnormals are left out: TensorFlow runs kernels with denormals
    # flushed, so the reference cast would see zeros.
    values = values[~((values != 0) & (np.abs(values) < tiny))]
    words = np.full(-(-values.size // 32), -1, np.int32)
    out = sb.onebit_dequantize(words, values, values, 1, dtype=dtype).numpy()[0]
    with np.errstate(over="ignore", invalid="ignore"):
        expected = values.astype(np_dtype(dtype))
    np.testing.assert_array_equal(np.isnan(out.astype(np.float32)), np.isnan(values))
    finite_mask = ~np.isnan(values)
    np.testing.assert_array_equal(out[finite_mask].view(np.uint16), expected[finite_mask].view(np.uint16))
