"""Tests for tfgc.ops.sparsify: compiled kernels vs pure-TF references vs NumPy.

Every test taking the ``mode`` fixture runs with the compiled kernels
("custom") and with TFGC_DISABLE_CUSTOM_OPS=1 ("reference"). Exact and
threshold selections are compared bit for bit with a NumPy oracle (and, in
custom mode, with the references); the sampled (DGC) mode is approximate by
design, so it is checked through its guarantees: the count window, the
threshold property (every sent |v| >= every kept one) and mass conservation.
"""

import math

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tfgc.ops import sparsify as sp

DTYPES = [tf.float32, tf.float16, tf.bfloat16]
DTYPE_IDS = ["float32", "float16", "bfloat16"]


# ---------------------------------------------------------------------------
# NumPy oracle.

def np_dtype(dtype):
    return tf.as_dtype(dtype).as_numpy_dtype


def f32(t):
    return np.asarray(tf.cast(t, tf.float32)) if tf.is_tensor(t) else np.asarray(t, np.float32)


def np_v(x, r):
    """x + r the way TensorFlow computes it: float32 add, one rounding."""
    x = np.asarray(x)
    with np.errstate(over="ignore", invalid="ignore"):
        return (x.astype(np.float32) + np.asarray(r).astype(np.float32)).astype(x.dtype).ravel()


def np_keys(v):
    vf = np.asarray(v).astype(np.float32)
    return np.where(np.isnan(vf), -1.0, np.abs(vf))


def np_topk_indices(v, k):
    keys = np_keys(v)
    order = np.lexsort((np.arange(keys.size), -keys))  # largest first, then lowest index
    return np.sort(order[:min(k, keys.size)]).astype(np.int32)


def np_threshold_indices(v, pos, neg):
    vf = np.asarray(v).astype(np.float32)
    with np.errstate(invalid="ignore"):
        return np.flatnonzero((vf >= pos) | (vf <= neg)).astype(np.int32)


def bits(a):
    a = np.asarray(a)
    return a.view(np.uint16 if a.dtype.itemsize == 2 else np.uint32)


def check_selection(x, r, out, expected_idx=None, with_mask=False):
    """Structural checks common to all modes; returns (v, indices)."""
    x = np.asarray(x)
    v = np_v(x, r)
    n = v.size
    values, idx, new_res = out.values.numpy(), out.indices.numpy(), out.new_residual.numpy()
    assert out.values.dtype == tf.as_dtype(x.dtype) and out.indices.dtype == tf.int32
    assert out.new_residual.shape == x.shape and out.new_residual.dtype == tf.as_dtype(x.dtype)
    assert values.shape == idx.shape
    assert np.all(np.diff(idx.astype(np.int64)) > 0), "indices must be strictly ascending"
    assert idx.size == 0 or (idx[0] >= 0 and idx[-1] < n)
    if expected_idx is not None:
        np.testing.assert_array_equal(idx, expected_idx)
    # Values are v at the indices, bit for bit; the residual is v elsewhere
    # and +0.0 at the indices.
    np.testing.assert_array_equal(bits(values), bits(v[idx]))
    flat_res = new_res.ravel()
    expected_res = v.copy()
    expected_res[idx] = 0
    np.testing.assert_array_equal(bits(flat_res), bits(expected_res))
    # Conservation: scatter(values) + new_residual == x + residual exactly.
    rebuilt = flat_res.copy()
    rebuilt[idx] = values
    np.testing.assert_array_equal(bits(rebuilt), bits(v))
    if with_mask:
        mask = out.mask.numpy()
        assert mask.dtype == bool and mask.shape == (n,)
        np.testing.assert_array_equal(np.flatnonzero(mask), idx)
    else:
        assert out.mask.shape == [0]
    return v, idx


def assert_threshold_property(v, idx):
    """Every sent |v| >= every unsent |v| (NaN ranks lowest)."""
    keys = np_keys(v)
    sent = np.zeros(keys.size, bool)
    sent[idx] = True
    if sent.any() and (~sent).any():
        assert keys[sent].min() >= keys[~sent].max()


def random_inputs(n, dtype, seed, dist="normal", shape=None):
    rng = np.random.default_rng(seed)
    if dist == "normal":
        x = rng.standard_normal(n)
    elif dist == "heavy":
        x = rng.standard_cauchy(n)
    elif dist == "ties":
        x = rng.integers(-3, 4, n).astype(np.float64)
    elif dist == "zeros":
        x = np.zeros(n)
    elif dist == "sparse":  # embedding-like: 99% exact zeros
        x = rng.standard_normal(n) * (rng.random(n) < 0.01)
    elif dist == "layers":  # blocks with very different scales
        x = rng.standard_normal(n) * np.repeat(10.0 ** rng.integers(-3, 3, 8), -(-n // 8))[:n]
    else:
        raise ValueError(dist)
    r = rng.standard_normal(n) * 0.1 if dist not in ("ties", "zeros", "sparse") else np.zeros(n)
    shape = shape or (n,)
    cast = np_dtype(dtype)
    with np.errstate(over="ignore"):  # Cauchy tails overflow float16 to inf: fine
        x, r = x.astype(np.float32).astype(cast), r.astype(np.float32).astype(cast)
    return x.reshape(shape), r.reshape(shape)


# ---------------------------------------------------------------------------
# Dispatch.

def test_dispatch_uses_the_expected_implementation(mode):
    @tf.function
    def f(x, r):
        return sp.sparsify_with_residual(x, r, 3)

    spec = tf.TensorSpec([None], tf.float32)
    graph = f.get_concrete_function(spec, spec).graph
    op_types = {op.type for op in graph.get_operations()}
    assert ("TfgcSparsifyWithResidual" in op_types) == (mode == "custom")


# ---------------------------------------------------------------------------
# Exact mode.

EXACT_CASES = [(1, 0), (1, 1), (1, 5), (2, 1), (17, 3), (17, 16), (17, 17), (17, 40),
               (1000, 0), (1000, 1), (1000, 10), (1000, 999), (100003, 100), (100003, 5000),
               (300007, 300)]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("n,k", EXACT_CASES, ids=str)
def test_exact_matches_oracle(mode, dtype, n, k):
    x, r = random_inputs(n, dtype, seed=n + k)
    out = sp.sparsify_with_residual(x, r, k, exact=True, with_mask=True, seed=k)
    v, idx = check_selection(x, r, out, np_topk_indices(np_v(x, r), k), with_mask=True)
    assert idx.size == min(k, n)
    assert_threshold_property(v, idx)
    if mode == "custom":
        ref = sp.sparsify_with_residual_reference(x, r, k, exact=True, with_mask=True)
        np.testing.assert_array_equal(out.indices.numpy(), ref.indices.numpy())
        np.testing.assert_array_equal(bits(out.new_residual.numpy()), bits(ref.new_residual.numpy()))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("dist", ["ties", "zeros", "sparse", "heavy", "layers"])
def test_exact_ties_and_distributions(mode, dtype, dist):
    n = 50021
    x, r = random_inputs(n, dtype, seed=7, dist=dist)
    for k in (1, 37, 2500, 5000):
        out = sp.sparsify_with_residual(x, r, k, exact=True)
        check_selection(x, r, out, np_topk_indices(np_v(x, r), k))


def test_exact_multidimensional_is_row_major(mode):
    x, r = random_inputs(105, tf.float32, seed=3, shape=(3, 5, 7))
    out = sp.sparsify_with_residual(x, r, 10, exact=True)
    assert out.new_residual.shape == (3, 5, 7)
    check_selection(x, r, out, np_topk_indices(np_v(x, r), 10))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("exact", [True, False], ids=["exact", "sampled"])
def test_nan_and_inf_are_pinned(mode, dtype, exact):
    nan, inf = np.nan, np.inf
    x = np.array([1.0, nan, -inf, 2.0, nan, 0.0, -0.0, inf, -3.0], np.float32).astype(np_dtype(dtype))
    r = np.zeros_like(x)
    # Infinities first (both signs), then by magnitude; zeros tie (lower index
    # first); NaN only once every number has been taken.
    expected = {0: [], 1: [2], 2: [2, 7], 3: [2, 7, 8], 4: [2, 3, 7, 8], 5: [0, 2, 3, 7, 8],
                6: [0, 2, 3, 5, 7, 8], 7: [0, 2, 3, 5, 6, 7, 8], 8: [0, 1, 2, 3, 5, 6, 7, 8],
                9: list(range(9)), 20: list(range(9))}
    for k, idx in expected.items():
        out = sp.sparsify_with_residual(x, r, k, exact=exact, with_mask=True)
        if exact:
            check_selection(x, r, out, np.array(idx, np.int32), with_mask=True)
            continue
        # Sampled mode may send a few more than k (ties at the threshold), but
        # the ranking is the same: NaN only once every number is sent.
        v, got = check_selection(x, r, out, with_mask=True)
        lo, hi = count_bounds(k, x.size)
        assert lo <= got.size <= hi
        assert_threshold_property(v, got)
        if k <= 7:
            assert not np.isin([1, 4], got).any()


@pytest.mark.parametrize("shape", [(0,), (3, 0), (0, 4, 2)], ids=str)
@pytest.mark.parametrize("exact", [True, False], ids=["exact", "sampled"])
def test_empty_inputs(mode, shape, exact):
    x = np.zeros(shape, np.float32)
    for k in (0, 5):
        out = sp.sparsify_with_residual(x, x, k, exact=exact, with_mask=True)
        assert out.values.shape == [0] and out.indices.shape == [0] and out.mask.shape == [0]
        assert out.new_residual.shape == shape
    out = sp.sparsify_by_threshold(x, x, 1.0, -1.0, with_mask=True)
    assert out.values.shape == [0] and out.new_residual.shape == shape


# ---------------------------------------------------------------------------
# Sampled (DGC) mode.

def count_bounds(k, n):
    k = min(k, n)
    return max(math.ceil(0.8 * k), 1 if k else 0), max(k, math.floor(1.3 * k))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("dist", ["normal", "heavy", "ties", "zeros", "sparse", "layers"])
def test_sampled_count_window_and_threshold(mode, dtype, dist):
    n = 200003 if dtype == tf.float32 else 60013
    x, r = random_inputs(n, dtype, seed=11, dist=dist)
    v = np_v(x, r)
    for k in (1, 7, n // 1000, n // 100, n // 10):
        for seed in range(3):
            out = sp.sparsify_with_residual(x, r, k, seed=seed, with_mask=(seed == 0))
            _, idx = check_selection(x, r, out, with_mask=(seed == 0))
            lo, hi = count_bounds(k, n)
            assert lo <= idx.size <= hi, (k, seed, idx.size)
            assert_threshold_property(v, idx)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_large_samples_and_candidate_sets(mode, dtype):
    # Samples and candidate sets of more than 65536 keys take the kernel's
    # radix-select path instead of partitioning, and float32 inputs of this
    # size (4.4 MB) its streaming-store path.
    n, k = 1100003, 60000
    x, r = random_inputs(n, dtype, seed=5)
    v = np_v(x, r)
    exact = sp.sparsify_with_residual(x, r, k, exact=True, sample_ratio=0.5)
    check_selection(x, r, exact, np_topk_indices(v, k))
    sampled = sp.sparsify_with_residual(x, r, k, sample_ratio=0.5)
    _, idx = check_selection(x, r, sampled)
    lo, hi = count_bounds(k, n)
    assert lo <= idx.size <= hi
    assert_threshold_property(v, idx)


def test_sampled_deterministic_given_seed(mode):
    x, r = random_inputs(100003, tf.float32, seed=5, dist="heavy")
    a = sp.sparsify_with_residual(x, r, 500, seed=42)
    b = sp.sparsify_with_residual(x, r, 500, seed=42)
    np.testing.assert_array_equal(a.indices.numpy(), b.indices.numpy())


def test_sampled_lowering_and_fallback_paths(mode):
    # k * sample / n ~ 2: the sampled threshold is very noisy, so the count
    # often starts outside the window and has to be lowered or refined.
    n = 100000
    for seed in range(12):
        x, r = random_inputs(n, tf.float32, seed=seed)
        out = sp.sparsify_with_residual(x, r, 200, seed=seed)
        v, idx = check_selection(x, r, out)
        lo, hi = count_bounds(200, n)
        assert lo <= idx.size <= hi
        assert_threshold_property(v, idx)
    # 700 huge entries, the rest tiny: when the sample's threshold lands among
    # the huge ones, lowering by 0.8^10 cannot reach 0.8k and the op falls back
    # to exact selection (exactly k).
    rng = np.random.default_rng(0)
    for seed in range(12):
        x = (rng.standard_normal(n) * 1e-6).astype(np.float32)
        x[rng.choice(n, 700, replace=False)] = 1e6
        r = np.zeros_like(x)
        out = sp.sparsify_with_residual(x, r, 1000, seed=seed)
        v, idx = check_selection(x, r, out)
        assert 800 <= idx.size <= 1300
        assert_threshold_property(v, idx)


@pytest.mark.parametrize("n", [1, 2, 100, 257, 1000], ids=str)
def test_sampled_small_inputs(mode, n):
    x, r = random_inputs(n, tf.float32, seed=n)
    for k in range(0, min(n, 12) + 2):
        out = sp.sparsify_with_residual(x, r, k, seed=k)
        v, idx = check_selection(x, r, out)
        lo, hi = count_bounds(k, n)
        assert lo <= idx.size <= hi
        assert_threshold_property(v, idx)
    out = sp.sparsify_with_residual(x, r, n + 3)
    check_selection(x, r, out, np.arange(n, dtype=np.int32))


def test_sampled_inside_tf_function(mode):
    @tf.function(input_signature=[tf.TensorSpec([None], tf.float32)] * 2 + [tf.TensorSpec([], tf.int64)])
    def f(x, r, k):
        return sp.sparsify_with_residual(x, r, k, seed=1)

    x, r = random_inputs(10007, tf.float32, seed=1)
    out = f(x, r, np.int64(100))
    v, idx = check_selection(x, r, sp.Sparsified(*out))
    assert 80 <= idx.size <= 130
    with pytest.raises(tf.errors.InvalidArgumentError):
        f(x, r[:-1], np.int64(100))


# ---------------------------------------------------------------------------
# Threshold mode.

@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("n", [1, 31, 1000, 100003], ids=str)
def test_threshold_matches_oracle(mode, dtype, n):
    x, r = random_inputs(n, dtype, seed=n)
    for pos, neg in [(2.0, -2.0), (1.0, -3.0), (0.0, 0.0), (0.0, -1.0), (np.inf, -np.inf), (1e30, -0.5)]:
        out = sp.sparsify_by_threshold(x, r, pos, neg, with_mask=True)
        check_selection(x, r, out, np_threshold_indices(np_v(x, r), pos, neg), with_mask=True)
        if mode == "custom":
            ref = sp.sparsify_by_threshold_reference(x, r, pos, neg)
            np.testing.assert_array_equal(out.indices.numpy(), ref.indices.numpy())


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_threshold_special_values(mode, dtype):
    x = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 1.0, -1.0, 0.5], np.float32).astype(np_dtype(dtype))
    r = np.zeros_like(x)
    out = sp.sparsify_by_threshold(x, r, 1.0, -1.0)
    check_selection(x, r, out, np.array([1, 2, 5, 6], np.int32))
    # Zero thresholds take every number, -0.0 included, but never NaN.
    out = sp.sparsify_by_threshold(x, r, 0.0, 0.0)
    check_selection(x, r, out, np.arange(1, 8, dtype=np.int32))


@pytest.mark.parametrize("pos,neg", [(-1.0, -2.0), (1.0, 0.5), (np.nan, -1.0), (1.0, np.nan)])
def test_threshold_rejects_bad_thresholds(mode, pos, neg):
    x = np.ones(4, np.float32)
    with pytest.raises(tf.errors.InvalidArgumentError):
        sp.sparsify_by_threshold(x, x, pos, neg).values.numpy()


# ---------------------------------------------------------------------------
# Argument validation of the selection ops.

@pytest.mark.parametrize("case", ["shape", "dtype", "negative_k", "ratio0", "ratio2", "k_vector"])
def test_selection_rejects_bad_arguments(mode, case):
    x = np.ones(8, np.float32)
    args = dict(x=x, residual=x, k=2)
    kwargs = {}
    if case == "shape":
        args["residual"] = np.ones(9, np.float32)
    elif case == "dtype":
        args["residual"] = np.ones(8, np.float16)
    elif case == "negative_k":
        args["k"] = -1
    elif case == "ratio0":
        kwargs["sample_ratio"] = 0.0
    elif case == "ratio2":
        kwargs["sample_ratio"] = 2.0
    elif case == "k_vector":
        args["k"] = [2]
    with pytest.raises(tf.errors.InvalidArgumentError):
        sp.sparsify_with_residual(args["x"], args["residual"], args["k"], **kwargs).values.numpy()


# ---------------------------------------------------------------------------
# scatter_add_payloads.

def np_scatter_add(values, indices, n):
    acc = np.zeros(n, np.float32)
    np.add.at(acc, np.asarray(indices, np.int64), np.asarray(values).astype(np.float32))
    return acc


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("n,m", [(1, 0), (1, 1), (10, 30), (1000, 500), (100003, 20000)], ids=str)
def test_scatter_add_matches_oracle(mode, dtype, n, m):
    rng = np.random.default_rng(n + m)
    values = rng.standard_normal(m).astype(np.float32).astype(np_dtype(dtype))
    indices = rng.integers(0, n, m).astype(np.int32)  # with duplicates
    dense = sp.scatter_add_payloads(values, indices, n)
    assert dense.dtype == dtype and dense.shape == [n]
    expected = np_scatter_add(values, indices, n).astype(np_dtype(dtype))
    np.testing.assert_array_equal(bits(dense.numpy()), bits(expected))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_round_trip(mode, dtype):
    x, r = random_inputs(30011, dtype, seed=2, shape=(1, 30011))
    for out in (sp.sparsify_with_residual(x, r, 300), sp.sparsify_with_residual(x, r, 300, exact=True),
                sp.sparsify_by_threshold(x, r, 2.0, -2.0)):
        dense = sp.scatter_add_payloads(out.values, out.indices, x.size)
        rebuilt = tf.reshape(dense, x.shape) + out.new_residual
        np.testing.assert_array_equal(f32(rebuilt), f32(x + r))


def test_scatter_add_empty(mode):
    assert sp.scatter_add_payloads(np.zeros(0, np.float32), np.zeros(0, np.int32), 0).shape == [0]
    np.testing.assert_array_equal(
        sp.scatter_add_payloads(np.zeros(0, np.float32), np.zeros(0, np.int32), 5).numpy(), np.zeros(5))


FUZZ = settings(max_examples=250, derandomize=True, deadline=None, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@st.composite
def payloads(draw):
    n = draw(st.one_of(st.integers(0, 300), st.integers(-3, 3),
                       st.sampled_from([-2**63, -1, 2**31 + 1, 2**40, 2**63 - 1])))
    m = draw(st.integers(0, 40))
    m_idx = draw(st.one_of(st.just(m), st.just(m), st.just(m), st.integers(0, 40)))
    hi = max(n, 1) if 0 <= n <= 300 else 300
    idx = draw(st.lists(st.one_of(st.integers(0, hi - 1), st.integers(-5, hi + 5),
                                  st.sampled_from([-2**31, 2**31 - 1])),
                        min_size=m_idx, max_size=m_idx))
    values = np.random.default_rng(draw(st.integers(0, 2**32 - 1))).standard_normal(m)
    dtype = draw(st.sampled_from(DTYPES))
    shape_kind = draw(st.sampled_from(["ok", "ok", "ok", "matrix_values", "scalar_n"]))
    values = values.astype(np.float32).astype(np_dtype(dtype))
    indices = np.array(idx, np.int32)
    n_arg = n
    if shape_kind == "matrix_values":
        values = values.reshape(1, -1)
    elif shape_kind == "scalar_n":
        n_arg = [n]
    return values, indices, n_arg


@FUZZ
@given(payload=payloads())
def test_fuzz_scatter_add(mode, payload):
    values, indices, n = payload
    try:
        dense = sp.scatter_add_payloads(values, indices, n)
    except tf.errors.InvalidArgumentError:
        event("rejected")
        valid = (values.ndim == 1 and np.ndim(n) == 0 and values.size == indices.size
                 and 0 <= n <= 2**31 and np.all((indices >= 0) & (indices < n)))
        assert not valid
        return
    event("decoded")
    expected = np_scatter_add(values, indices, n).astype(values.dtype)
    np.testing.assert_array_equal(bits(dense.numpy()), bits(expected))
