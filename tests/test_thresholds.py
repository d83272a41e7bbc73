"""Gradient dropping, Strom's threshold and Dryden's adaptive quantization, each against
a NumPy model of its paper's algorithm.

The models take the whole tensor as the sample, which the compressors do when it
is no larger than their sample (100000 entries for gradient dropping, 1024 for the
adaptive thresholds), so the comparison is exact. Real clusters run the same
models in ``tests/test_distributed.py`` (``--thresholds`` on the sweeps).
"""

import math

import numpy as np
import pytest
import tensorflow as tf

import tfgc
from tfgc.compressors import Adaptive, CompressContext, GradientDropping, Threshold
from tfgc.distribute import fusion
from test_fft import ef_fft_numpy


def ctx(step=0, rank=0, index=0):
    return CompressContext(rank=rank, num_workers=2, index=index,
                           step=tf.constant(step, tf.int64))


def _cap(order_by, passing, capacity):
    """The passing positions, the ``capacity`` largest ``order_by`` (ties to the lower
    position) when there are more."""
    passing = np.flatnonzero(passing)
    if passing.size <= capacity:
        return passing
    rank = sorted(passing, key=lambda i: (-order_by[i], i))
    return np.sort(np.array(rank[:capacity], dtype=np.int64))


def graddrop_numpy(v, drop_ratio=0.99, quantize="none"):
    """One worker's step on v = g + residual: (decoded, new residual)."""
    flat = v.reshape(-1).astype(np.float32)
    n = flat.size
    s = np.sort(np.abs(flat))
    t = s[max(0, int(math.floor(n * drop_ratio)) - 1)]
    k = min(n, max(1, math.ceil((1 - drop_ratio) * n - 1e-9)))
    sent = _cap(np.abs(flat), np.abs(flat) > t, k)
    decoded = np.zeros_like(flat)
    decoded[sent] = flat[sent]
    if quantize == "onebit":
        vals = flat[sent]
        pos = vals >= 0
        pos_mean = vals[pos].mean() if pos.any() else 0.0
        neg_mean = vals[~pos].mean() if (~pos).any() else 0.0
        decoded[sent] = np.where(pos, pos_mean, neg_mean)
    return decoded.reshape(v.shape), (flat - decoded).reshape(v.shape)


def threshold_numpy(v, tau, max_density):
    flat = v.reshape(-1).astype(np.float32)
    cap = min(flat.size, max(1, math.ceil(max_density * flat.size)))
    sent = _cap(np.abs(flat), (flat >= tau) | (flat <= -tau), cap)
    decoded = np.zeros_like(flat)
    decoded[sent] = np.where(flat[sent] >= tau, tau, -tau)
    return decoded.reshape(v.shape), (flat - decoded).reshape(v.shape)


def adaptive_numpy(v, proportion, max_excess):
    """Thresholds from the whole of v (n <= 1024), per-column means of what is sent."""
    rows_cols = v.reshape(-1, v.shape[-1]) if v.ndim > 1 else v.reshape(1, -1)
    cols = rows_cols.shape[1]
    flat = v.reshape(-1).astype(np.float32)
    n = flat.size
    pos = np.sort(flat[flat > 0])[::-1]
    neg = np.sort(-flat[flat < 0])[::-1]
    big = np.float32(3.4028234663852886e38)
    tau_p = pos[math.ceil(pos.size / proportion) - 1] if pos.size else big
    tau_n = -neg[math.ceil(neg.size / proportion) - 1] if neg.size else -big
    cap = min(n, max(1, math.ceil(max_excess * n / proportion)))
    sent = _cap(np.abs(flat), (flat >= tau_p) | (flat <= tau_n), cap)
    decoded = np.zeros_like(flat)
    column = sent % cols
    positive = flat[sent] >= tau_p
    recon = np.zeros((2, cols), np.float32)
    for c in range(cols):
        for side, want, fallback in ((0, True, tau_p), (1, False, tau_n)):
            here = flat[sent][(column == c) & (positive == want)]
            recon[side, c] = here.mean() if here.size else fallback
    decoded[sent] = np.where(positive, recon[0, column], recon[1, column])
    return decoded.reshape(v.shape), (flat - decoded).reshape(v.shape), recon


MODELS = {
    "graddrop": lambda v: graddrop_numpy(v),
    "graddrop:drop_ratio=0.9,quantize=onebit": lambda v: graddrop_numpy(v, 0.9, "onebit"),
    "threshold:tau=1.5,max_density=0.05": lambda v: threshold_numpy(v, 1.5, 0.05),
    "adaptive:proportion=20": lambda v: adaptive_numpy(v, 20, 2.0)[:2],
    # Not a threshold, but another all-gathered sparsifier with a NumPy model: the
    # cluster check runs it with these.
    "ef+fft": lambda v: ef_fft_numpy(v),
}


def model_for(spec):
    return MODELS[spec]


@pytest.mark.parametrize("spec", sorted(MODELS))
def test_steps_match_numpy_model_and_conserve_mass(spec):
    c = tfgc.get_compressor(spec)
    shape = (40, 25)
    state = c.init_state(tf.TensorShape(shape), tf.float32)
    rng = np.random.default_rng(1)
    residual = np.zeros(shape, np.float32)
    total_g, total_sent = np.zeros(shape, np.float64), np.zeros(shape, np.float64)
    for step in range(4):
        g = rng.normal(size=shape).astype(np.float32)
        payload, state = c.compress(tf.constant(g), state, ctx(step))
        got = c.decompress(payload, tf.TensorShape(shape), tf.float32, ctx(step)).numpy()
        want, residual = model_for(spec)(g + residual)
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(state["residual"].numpy(), residual, rtol=1e-5, atol=1e-5)
        total_g += g
        total_sent += got
    # Error feedback: everything sent plus what waits is everything computed.
    np.testing.assert_allclose(total_sent + state["residual"].numpy(), total_g, atol=1e-4)


def test_graddrop_sends_one_percent_largest_first():
    c = GradientDropping()
    x = tf.random.stateless_normal([200, 300], seed=[1, 2])
    payload, _, residual = c.compress_with_feedback(x, tf.zeros_like(x), {}, ctx())
    values, indices = payload
    assert values.shape == [600] and indices.shape == [600]
    sent = np.abs(values.numpy())
    # Every sent |v| is at least every |v| left behind (the sparsifier invariant).
    assert sent.min() >= np.abs(residual.numpy()).max()


def test_graddrop_sampled_threshold_keeps_about_one_percent():
    # 400k entries: the threshold comes from 100000 sampled ones, as in Marian.
    c = GradientDropping(drop_ratio=0.99)
    x = tf.random.stateless_normal([400, 1000], seed=[5, 6])
    t = float(c.threshold(x, tf.zeros_like(x), ctx()))
    passing = int(np.sum(np.abs(x.numpy()) > t))
    assert 0.9 * 4000 <= passing <= 1.1 * 4000, passing
    # Different workers draw different samples, the same worker the same one.
    assert t == float(c.threshold(x, tf.zeros_like(x), ctx()))
    assert t != float(c.threshold(x, tf.zeros_like(x), ctx(rank=1)))


def test_graddrop_pads_a_short_selection_with_nothing():
    c = GradientDropping(drop_ratio=0.9)
    x = np.zeros((10, 10), np.float32)
    x[3, 4] = 5.0  # one entry passes; the payload holds 10
    payload, _ = c.compress(tf.constant(x), {}, ctx())
    np.testing.assert_array_equal(
        c.decompress(payload, tf.TensorShape([10, 10]), tf.float32, ctx()).numpy(), x)
    onebit = GradientDropping(drop_ratio=0.9, quantize="onebit")
    payload, _ = onebit.compress(tf.constant(x), {}, ctx())
    np.testing.assert_array_equal(
        onebit.decompress(payload, tf.TensorShape([10, 10]), tf.float32, ctx()).numpy(), x)


def test_graddrop_onebit_sends_two_levels():
    c = GradientDropping(drop_ratio=0.9, quantize="onebit")
    x = tf.random.stateless_normal([50, 40], seed=[7, 8])
    payload, _ = c.compress(x, {}, ctx())
    decoded = c.decompress(payload, x.shape, tf.float32, ctx()).numpy()
    levels = np.unique(decoded[decoded != 0])
    assert levels.size == 2 and levels[0] < 0 < levels[1]
    # Indices, sign bits, two means and a count.
    k = 200
    assert [t.shape.as_list() for t in payload] == [[k], [math.ceil(k / 32)], [2], [1]]


def test_adaptive_sends_about_one_in_proportion_and_two_levels_per_column():
    c = Adaptive(proportion=50, max_excess=4.0)
    x = tf.random.stateless_normal([500, 100], seed=[9, 10])
    payload, _, residual = c.compress_with_feedback(x, tf.zeros_like(x), {}, ctx())
    words, recon, count = payload
    count = int(count.numpy()[0])
    assert 0.5 * 1000 <= count <= 2.0 * 1000, count  # n / pi = 1000, from 1024 samples
    decoded = c.decompress(payload, x.shape, tf.float32, ctx()).numpy()
    for col in range(0, 100, 7):
        levels = set(decoded[:, col][decoded[:, col] != 0])
        assert levels <= {recon.numpy()[0, col], recon.numpy()[1, col]}
    # The means minimise the squared error: each column's sent entries of one sign
    # leave residuals that sum to zero.
    v = x.numpy()
    sent = decoded != 0
    for col in range(0, 100, 11):
        for positive in (True, False):
            here = sent[:, col] & ((v[:, col] >= 0) == positive)
            if here.any():
                assert abs(residual.numpy()[here, col].sum()) < 1e-4


def test_adaptive_capacity_bounds_the_count_and_keeps_the_largest():
    c = Adaptive(proportion=4, max_excess=1.0)
    # Many ties at the threshold: half the entries are 1.0, so far more than n / 4 pass.
    x = np.where(np.arange(400).reshape(20, 20) % 2 == 0, 1.0, 0.1).astype(np.float32)
    x[0, 0] = 9.0
    payload, _, residual = c.compress_with_feedback(tf.constant(x), tf.zeros([20, 20]), {}, ctx())
    assert int(payload[2].numpy()[0]) == 100
    decoded = c.decompress(payload, tf.TensorShape([20, 20]), tf.float32, ctx()).numpy()
    assert decoded[0, 0] != 0  # the largest is always sent
    np.testing.assert_allclose(decoded + residual.numpy(), x, atol=1e-6)


def test_threshold_fixed_tau_and_capacity():
    c = Threshold(tau=0.5, max_density=0.1)
    x = np.array([[0.6, -0.7, 0.2, 0.1, 3.0]] * 4, np.float32)  # 12 pass, capacity 2
    payload, _, residual = c.compress_with_feedback(tf.constant(x), tf.zeros([4, 5]), {}, ctx())
    decoded = c.decompress(payload, tf.TensorShape([4, 5]), tf.float32, ctx()).numpy()
    assert set(np.unique(decoded)) <= {0.0, 0.5, -0.5}
    assert np.count_nonzero(decoded) == 2 and decoded[0, 4] == 0.5 and decoded[1, 4] == 0.5
    np.testing.assert_allclose(decoded + residual.numpy(), x, atol=1e-6)


def test_threshold_goes_dense_where_tau_does_not_fit_the_dtype():
    assert not Threshold(tau=1e-9).supports(tf.TensorShape([10, 10]), tf.float16)
    assert Threshold(tau=1e-9).supports(tf.TensorShape([10, 10]), tf.float32)


@pytest.mark.parametrize("spec", ["graddrop:quantize=onebit", "threshold", "adaptive"])
def test_malformed_payloads_fail_with_invalid_argument(spec):
    c = tfgc.get_compressor(spec)
    shape = tf.TensorShape([30, 30])
    payload, _ = c.compress(tf.random.stateless_normal(shape, seed=[1, 1]),
                            c.init_state(shape, tf.float32), ctx())
    payload = list(payload)
    count_at = len(payload) - 1
    bad_count = list(payload)
    bad_count[count_at] = tf.constant([10**6], tf.int32)
    with pytest.raises(tf.errors.InvalidArgumentError):
        c.decompress(tuple(bad_count), shape, tf.float32, ctx())
    bad_index = list(payload)
    first = bad_index[0].numpy().copy()
    first[0] = 2**30 if spec != "graddrop:quantize=onebit" else 10**6  # outside the tensor
    bad_index[0] = tf.constant(first)
    bad_index[count_at] = tf.constant([max(1, int(payload[count_at].numpy()[0]))], tf.int32)
    with pytest.raises(tf.errors.InvalidArgumentError):
        c.decompress(tuple(bad_index), shape, tf.float32, ctx())


@pytest.mark.parametrize("spec,arg", [
    ("graddrop:drop_ratio=1.0", "drop_ratio"), ("graddrop:drop_ratio=-0.1", "drop_ratio"),
    ("graddrop:scope=model", "scope"), ("graddrop:quantize=2bit", "quantize"),
    ("graddrop:sample_size=0", "sample_size"), ("threshold:tau=0", "tau"),
    ("threshold:tau=-1", "tau"), ("threshold:max_density=0", "max_density"),
    ("threshold:max_density=1.5", "max_density"), ("adaptive:proportion=0", "proportion"),
    ("adaptive:proportion=2.5", "proportion"), ("adaptive:max_excess=0.5", "max_excess"),
])
def test_bad_hyperparameters_name_the_argument(spec, arg):
    with pytest.raises(ValueError, match=arg):
        tfgc.get_compressor(spec)


@pytest.mark.parametrize("spec", ["graddrop", "threshold", "adaptive"])
def test_registry_wraps_in_error_feedback_and_round_trips(spec):
    c = tfgc.get_compressor(spec)
    assert c.name == "ef" and c.inner.name == spec
    assert tfgc.get_compressor(tfgc.compressors.serialize(c)) == c
    assert tfgc.get_compressor("ef+" + spec) == c
    assert not c.summable


def test_flags_choose_the_paths():
    assert tfgc.get_compressor("graddrop").sparse_entries is not None
    assert tfgc.get_compressor("graddrop:quantize=onebit").sparse_entries is None
    assert tfgc.get_compressor("graddrop:scope=global").fuses_gradients
    assert not tfgc.get_compressor("graddrop").fuses_gradients
    assert not tfgc.get_compressor("adaptive").fuses_gradients


def test_fusion_views_state_as_one_vector_and_splits_outputs_back():
    a, b, bias = tf.Variable(tf.ones([2, 3])), tf.Variable(tf.zeros([4])), tf.Variable([7.0])
    tensors = [tf.constant(np.arange(6, dtype=np.float32).reshape(2, 3)), tf.constant([9.0]),
               tf.constant([1.0, 2.0, 3.0, 4.0])]
    fused, variables, mask, unfuse = fusion.fuse(tensors, [a, bias, b], [True, False, True])
    assert mask == [False, True]
    np.testing.assert_array_equal(fused[1].numpy(), [0, 1, 2, 3, 4, 5, 1, 2, 3, 4])
    assert variables[0] is bias and isinstance(variables[1], fusion.FusedGroup)
    outs = unfuse([fused[0] * 2, fused[1] * 10])
    np.testing.assert_array_equal(outs[0].numpy(), tensors[0].numpy() * 10)
    np.testing.assert_array_equal(outs[1].numpy(), [18.0])
    np.testing.assert_array_equal(outs[2].numpy(), [10, 20, 30, 40])
    view = fusion.FusedVariable([a, b])
    np.testing.assert_array_equal(view.read_value().numpy(), [1] * 6 + [0] * 4)
    view.assign(tf.range(10, dtype=tf.float32))
    np.testing.assert_array_equal(a.numpy(), [[0, 1, 2], [3, 4, 5]])
    np.testing.assert_array_equal(b.numpy(), [6, 7, 8, 9])


def test_global_threshold_is_one_quantile_over_all_gradients():
    # Two gradients of very different scales: a per-layer threshold sends 1 % of
    # each, the global one sends almost only the large one's entries.
    rng = np.random.default_rng(3)
    big = rng.normal(size=(50, 40)).astype(np.float32) * 10
    small = rng.normal(size=(50, 40)).astype(np.float32)
    fused = tf.constant(np.concatenate([big.reshape(-1), small.reshape(-1)]))
    c = GradientDropping(scope="global")
    payload, _ = c.compress(fused, {}, ctx())
    decoded = c.decompress(payload, fused.shape, tf.float32, ctx()).numpy()
    want, _ = graddrop_numpy(fused.numpy())
    np.testing.assert_allclose(decoded, want)
    assert np.count_nonzero(decoded[:2000]) >= 35 and np.count_nonzero(decoded[2000:]) <= 5
