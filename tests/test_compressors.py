"""Invariants of every compressor, checked on one process (no cluster).

Every test runs twice (the ``mode`` fixture): through the compiled kernels and through
the pure-TF references.
"""

import math

import numpy as np
import pytest
import tensorflow as tf

import tfgc
from tfgc.compressors import (BF16, FP16, QSGD, CompressContext, ErrorFeedback, Identity, OneBit,
                              RandomK, ScaledSign, SignSGD, TernGrad, TopK)
from tfgc.ops import packing

pytestmark = pytest.mark.usefixtures("mode")

ALL_SPECS = ["none", "fp16", "bf16", "topk:ratio=0.05", "ef+topk:ratio=0.05", "randomk:ratio=0.1",
             "onebit", "signsgd", "efsignsgd", "qsgd", "qsgd:levels=7,bucket_size=128", "terngrad",
             "qsgd:levels=7,bucket_size=128,norm=max,rotate=true"]


def ctx(step=0, rank=0, index=0, num_workers=2):
    return CompressContext(rank=rank, num_workers=num_workers, index=index,
                           step=tf.constant(step, tf.int64))


def roundtrip(compressor, x, state=None, c=None):
    c = c or ctx()
    state = compressor.init_state(x.shape, x.dtype) if state is None else state
    payload, new_state = compressor.compress(x, state, c)
    return payload, new_state, compressor.decompress(payload, x.shape, x.dtype, c)


def assert_unbiased(draws, target, variance):
    """Monte-Carlo check of E[draw] = target, given each coordinate's exact variance."""
    mean = draws.mean(axis=0)
    exact = variance < 1e-12
    np.testing.assert_allclose(mean[exact], target[exact], rtol=1e-5, atol=1e-6)
    z = (mean - target)[~exact] / np.sqrt(variance[~exact] / len(draws))
    assert np.mean(np.abs(z) < 4.0) > 0.99
    assert 0.6 < np.mean(z ** 2) < 1.4  # chi-square per degree of freedom


# -- registry and configuration -------------------------------------------------------


@pytest.mark.parametrize("spec", ALL_SPECS)
def test_string_and_config_round_trip(spec):
    c = tfgc.get_compressor(spec)
    assert tfgc.get_compressor(tfgc.serialize(c)) == c
    config = tfgc.compressors.serialize_config(c)
    assert tfgc.get_compressor(config) == c
    # get_config returns exactly the constructor's arguments.
    assert type(c)(**c.get_config()) == c


def test_registry_builds_what_the_string_says():
    c = tfgc.get_compressor("qsgd:levels=7,bucket_size=128,norm=max")
    assert isinstance(c, QSGD) and (c.levels, c.bucket_size, c.norm) == (7, 128, "max")
    ef = tfgc.get_compressor("ef+topk:ratio=0.001")
    assert isinstance(ef, ErrorFeedback) and isinstance(ef.inner, TopK) and ef.inner.ratio == 0.001
    # Error feedback is part of 1-bit SGD and EF-signSGD, so their names include it.
    assert isinstance(tfgc.get_compressor("onebit").inner, OneBit)
    assert isinstance(tfgc.get_compressor("efsignsgd").inner, ScaledSign)
    assert tfgc.get_compressor("ef+onebit") == tfgc.get_compressor("onebit")
    assert isinstance(tfgc.get_compressor(None), Identity)
    assert isinstance(tfgc.get_compressor({"name": "fp16"}), FP16)
    assert isinstance(tfgc.get_compressor("bf16"), BF16)
    inst = TopK(ratio=0.5)
    assert tfgc.get_compressor(inst) is inst


def test_instances_get_error_feedback_like_their_names():
    """compressor=OneBit() and compressor="onebit" build the same thing."""
    get = tfgc.compressors.get
    assert get(OneBit()) == get("onebit") == ErrorFeedback(OneBit())
    assert get(ScaledSign()) == get("efsignsgd") == ErrorFeedback(ScaledSign())
    inner = OneBit()
    assert get(inner).inner is inner
    # An explicit opt-out still returns the bare quantizer.
    assert get(inner, wrap_error_feedback=False) is inner
    # Already wrapped, or not in need of feedback: returned unchanged.
    wrapped = ErrorFeedback(OneBit())
    assert isinstance(wrapped.inner, OneBit)  # not ErrorFeedback(ErrorFeedback(...))
    assert get(wrapped) is wrapped
    assert get(ErrorFeedback(inner)).inner is inner
    for plain in (TopK(ratio=0.1), SignSGD(), QSGD(levels=7), Identity(), FP16()):
        assert get(plain) is plain
    with pytest.raises(ValueError, match="already wrapped"):
        ErrorFeedback(ErrorFeedback(OneBit()))
    # A per-tensor plan is no encoding to wrap: refused when built, not at the first step.
    for spec in ("ef+auto", "ef+auto:link_gbps=0.1"):
        with pytest.raises(ValueError, match=r"'auto' plans each gradient.*without `ef\+`"):
            get(spec)


@pytest.mark.parametrize("build, argument", [
    (lambda: TopK(ratio=0), "ratio"),
    (lambda: TopK(ratio=1.5), "ratio"),
    (lambda: TopK(ratio="a"), "ratio"),
    (lambda: TopK(k=-1), "k"),
    (lambda: RandomK(ratio=-0.1), "ratio"),
    (lambda: RandomK(seed=-3), "seed"),
    (lambda: RandomK(unbiased="yes"), "unbiased"),
    (lambda: QSGD(levels=0), "levels"),
    (lambda: QSGD(levels=1 << 20), "levels"),
    (lambda: QSGD(bucket_size=0), "bucket_size"),
    (lambda: QSGD(norm="l3"), "norm"),
    (lambda: TernGrad(clip=-1.0), "clip"),
    (lambda: TernGrad(clip=float("nan")), "clip"),
    (lambda: tfgc.get_compressor("topk:ratio=2"), "ratio"),
    (lambda: tfgc.get_compressor("topk:bogus=1"), "bogus"),
    (lambda: tfgc.get_compressor("qsgd:levels"), "levels"),
    (lambda: tfgc.get_compressor("qsgd:levels=127, levels=7"), "`levels` given twice"),
    (lambda: tfgc.get_compressor("auto:error=0.05,error=0.1"), "`error` given twice"),
    (lambda: tfgc.get_compressor("nosuch"), "nosuch"),
    (lambda: tfgc.get_compressor("zz+topk"), "zz"),
    (lambda: tfgc.CompressionPolicy(min_elements=-1), "min_elements"),
    (lambda: tfgc.CompressedMultiWorkerMirroredStrategy(compressor="topk", communication="allreduce"),
     "allreduce"),
    (lambda: tfgc.CompressedMultiWorkerMirroredStrategy(compressor="topk", communication="ring"),
     "communication"),
    (lambda: tfgc.CompressedMultiWorkerMirroredStrategy(compressor="topk:ratio=0"), "ratio"),
    (lambda: tfgc.CompressedMultiWorkerMirroredStrategy(bucket_bytes=0), "bucket_bytes"),
    (lambda: tfgc.CompressedMultiWorkerMirroredStrategy(policy="dense"), "policy"),
])
def test_invalid_hyperparameters_fail_at_construction(build, argument):
    with pytest.raises(ValueError, match=argument):
        build()


# -- error feedback -------------------------------------------------------------------


@pytest.mark.parametrize("inner", ["topk:ratio=0.05", "randomk:ratio=0.1", "onebit", "scaledsign",
                                   "qsgd:levels=3", "terngrad", "signsgd"])
def test_error_feedback_conserves_mass(inner):
    """sum_t decoded_t + e_T == sum_t g_t."""
    ef = tfgc.get_compressor("ef+" + inner)
    rng = np.random.default_rng(0)
    shape = (40, 30)
    state = ef.init_state(tf.TensorShape(shape), tf.float32)
    sent_total = np.zeros(shape)
    grad_total = np.zeros(shape)
    for step in range(6):
        g = rng.normal(size=shape).astype(np.float32)
        c = ctx(step=step)
        payload, state = ef.compress(tf.constant(g), state, c)
        sent_total += ef.decompress(payload, tf.TensorShape(shape), tf.float32, c).numpy()
        grad_total += g
    np.testing.assert_allclose(sent_total + state["residual"].numpy(), grad_total,
                               rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("nesterov", [False, True])
@pytest.mark.parametrize("inner", ["onebit", "scaledsign", "qsgd:levels=3", "topk:ratio=0.05"])
def test_error_feedback_momentum_correction(inner, nesterov):
    """With momentum m the worker compresses u + e, u <- m u + g (Nesterov: u <- m (u + g),
    sending u + g), and error feedback conserves the velocities:
    sum_t decoded_t + e_T == sum_t what was added."""
    m = 0.9
    ef = tfgc.get_compressor(f"ef+{inner},momentum={m},nesterov={nesterov}"
                             if ":" in inner else
                             f"ef+{inner}:momentum={m},nesterov={nesterov}")
    assert ef.applied_momentum == m and ef.nesterov is nesterov
    plain = tfgc.get_compressor("ef+" + inner)
    rng = np.random.default_rng(1)
    shape = (24, 20)
    state = ef.init_state(tf.TensorShape(shape), tf.float32)
    ref_state = plain.init_state(tf.TensorShape(shape), tf.float32)
    u = np.zeros(shape, np.float32)
    sent_total = np.zeros(shape)
    added_total = np.zeros(shape)
    for step in range(6):
        g = rng.normal(size=shape).astype(np.float32)
        if nesterov:
            u = np.float32(m) * (u + g)
            added = u + g
        else:
            u = np.float32(m) * u + g
            added = u
        c = ctx(step=step)
        payload, state = ef.compress(tf.constant(g), state, c)
        # The same compressor without momentum, fed the velocity, sends the same bits.
        ref_payload, ref_state = plain.compress(tf.constant(added), ref_state, c)
        for a, b in zip(payload, ref_payload):
            np.testing.assert_array_equal(a.numpy(), b.numpy())
        np.testing.assert_allclose(state["momentum"].numpy(), u, rtol=1e-6, atol=1e-6)
        sent_total += ef.decompress(payload, tf.TensorShape(shape), tf.float32, c).numpy()
        added_total += added
    np.testing.assert_allclose(sent_total + state["residual"].numpy(), added_total,
                               rtol=1e-5, atol=1e-4)


def test_error_feedback_momentum_in_strings_and_errors():
    get = tfgc.get_compressor
    c = get("onebit:momentum=0.9")
    assert isinstance(c, ErrorFeedback) and c.momentum == 0.9 and isinstance(c.inner, OneBit)
    assert get(tfgc.serialize(c)) == c == ErrorFeedback(OneBit(), momentum=0.9)
    assert get("efsignsgd:momentum=0.5").applied_momentum == 0.5
    # Without momentum the config (and so the state's key) is what it always was.
    assert get("onebit").get_config() == {"compressor": {"name": "onebit", "config": {}}}
    assert "momentum" not in get("onebit").init_state(tf.TensorShape([3]), tf.float32)
    with pytest.raises(ValueError, match="`momentum`.*ef\\+topk"):
        get("topk:ratio=0.1,momentum=0.9")
    for bad in ("onebit:momentum=1.0", "onebit:momentum=-0.1", "onebit:momentum=true"):
        with pytest.raises(ValueError, match="`momentum`"):
            get(bad)
    with pytest.raises(ValueError, match="`nesterov`"):
        get("onebit:nesterov=true")
    with pytest.raises(ValueError, match="`nesterov`"):
        ErrorFeedback(OneBit(), momentum=0.9, nesterov="yes")


# -- sparsifiers ------------------------------------------------------------------------


def test_topk_keeps_exactly_the_k_largest():
    x = tf.random.stateless_normal([1000], seed=[1, 2])
    c = TopK(ratio=0.013)
    (values, indices), _, decoded = roundtrip(c, x)
    k = math.ceil(0.013 * 1000)
    assert values.shape == [k] and len(set(indices.numpy())) == k
    mags = np.abs(x.numpy())
    kept = np.zeros(1000, bool)
    kept[indices.numpy()] = True
    assert mags[kept].min() >= mags[~kept].max()
    np.testing.assert_array_equal(decoded.numpy()[kept], x.numpy()[kept])
    assert not decoded.numpy()[~kept].any()


def test_topk_aggregate_sums_overlapping_entries():
    c = TopK(k=2)
    a = tf.constant([5.0, 0, 0, -4, 0, 0])
    b = tf.constant([3.0, 0, 7, 0, 0, 0])
    pa, _ = c.compress(a, {}, ctx())
    pb, _ = c.compress(b, {}, ctx())
    out = c.aggregate([pa, pb], a.shape, tf.float32, ctx())
    np.testing.assert_array_equal(out.numpy(), [8, 0, 7, -4, 0, 0])


@pytest.mark.parametrize("shared", [True, False])
def test_a_context_seed_folds_seed_index_rank_and_step_eagerly_and_traced(shared):
    # The parts known when traced are folded once, as a constant; the numbers must be
    # those of the fold-ins made in the graph, or a checkpoint's run would draw anew.
    def folded(base, index, rank, step):
        seed = tf.constant([base & 0x7FFFFFFF, 0x5EED], tf.int64)
        seed = tf.random.experimental.stateless_fold_in(seed, index)
        if not shared:
            seed = tf.random.experimental.stateless_fold_in(seed, rank + 1)
        return tf.random.experimental.stateless_fold_in(seed, tf.constant(step, tf.int64))

    seen = set()
    for base, index, rank, step in [(0, 0, 0, 0), (11, 3, 1, 7), (2**31 + 5, 40, 2, 2**40),
                                    (-3, 1, 0, 1)]:
        def seed(now, base=base, index=index, rank=rank):
            return CompressContext(rank=rank, num_workers=4, index=index,
                                   step=now).seed(base, shared)

        want = folded(base, index, rank, step).numpy()
        now = tf.constant(step, tf.int64)
        np.testing.assert_array_equal(seed(now).numpy(), want)
        np.testing.assert_array_equal(tf.function(seed)(now).numpy(), want)
        seen.add(tuple(want))
    assert len(seen) == 4
    # A rank given as a tensor (not known when traced) folds in the graph, alike.
    ctx = CompressContext(rank=tf.constant(1), num_workers=4, index=3,
                          step=tf.constant(7, tf.int64))
    np.testing.assert_array_equal(ctx.seed(11, shared).numpy(), folded(11, 3, 1, 7).numpy())


def test_randomk_indices_shared_across_workers_and_fresh_each_step():
    c = RandomK(ratio=0.05, seed=3)
    shape = tf.TensorShape([400])
    idx = lambda **kw: set(c._indices(shape, ctx(**kw)).numpy())  # noqa: E731
    assert idx(step=4, rank=0) == idx(step=4, rank=1)
    assert idx(step=4, rank=0) != idx(step=5, rank=0)
    assert idx(step=4, index=0) != idx(step=4, index=1)
    assert len(idx(step=4)) == 20
    # Summable: decoding the sum of payloads equals the sum of decodings.
    x0, x1 = tf.random.normal([400]), tf.random.normal([400])
    p0, _ = c.compress(x0, {}, ctx(step=2, rank=0))
    p1, _ = c.compress(x1, {}, ctx(step=2, rank=1))
    summed = c.decompress((p0[0] + p1[0],), shape, tf.float32, ctx(step=2))
    separate = c.decompress(p0, shape, tf.float32, ctx(step=2)) + \
        c.decompress(p1, shape, tf.float32, ctx(step=2))
    np.testing.assert_allclose(summed.numpy(), separate.numpy(), atol=1e-6)


@pytest.mark.parametrize("ratio", [0.05, 0.5])  # the O(k) draw, and the O(n) ranking
def test_randomk_picks_uniform_subsets_of_exactly_k(ratio):
    n, steps = 200, 400
    c = RandomK(ratio=ratio, seed=11)
    k = int(round(ratio * n))
    counts = np.zeros(n)
    for step in range(steps):
        idx = c._indices(tf.TensorShape([n]), ctx(step=step)).numpy()
        assert len(idx) == k and len(set(idx.tolist())) == k
        assert idx.min() >= 0 and idx.max() < n
        counts[idx] += 1
    # In a graph the payload keeps its static size (the byte counters need it).
    graph_idx = tf.function(lambda: c._indices(tf.TensorShape([n]), ctx(step=0)))()
    assert graph_idx.shape == [k]
    payload = tf.function(lambda x: c.compress(x, {}, ctx(step=0))[0][0]).get_concrete_function(
        tf.TensorSpec([n], tf.float32)).structured_outputs
    assert payload.shape == [k]
    # Every coordinate is kept with probability k / n: a chi-square test on the
    # per-coordinate counts (n - 1 degrees of freedom; 300 is beyond p = 1e-4).
    expected = steps * k / n
    chi2 = float(np.sum((counts - expected) ** 2 / expected) * (1 - k / n) ** -1)
    assert chi2 < 300, chi2


# -- quantizers -------------------------------------------------------------------------


def test_onebit_decodes_to_per_column_means():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(64, 7)).astype(np.float32)
    x[:, 3] = np.abs(x[:, 3])  # a column with no negative entry
    payload, _, decoded = roundtrip(OneBit(), tf.constant(x))
    d = decoded.numpy()
    for j in range(7):
        col, dec = x[:, j], d[:, j]
        pos = col >= 0
        np.testing.assert_allclose(dec[pos], col[pos].mean(), rtol=1e-5)
        if (~pos).any():
            np.testing.assert_allclose(dec[~pos], col[~pos].mean(), rtol=1e-5)
        assert len(np.unique(dec)) <= 2
        # The means preserve each column's sum, so the residual sums to zero.
        np.testing.assert_allclose(dec.sum(), col.sum(), rtol=1e-4, atol=1e-4)
    assert [int(t.shape.num_elements()) for t in payload] == [math.ceil(64 * 7 / 32), 7, 7]


def test_signsgd_majority_vote():
    c = SignSGD()
    xs = [tf.constant([1.0, -2, 3, -1]), tf.constant([2.0, -1, -3, 1]), tf.constant([-1.0, -1, 5, 2])]
    payloads = [c.compress(x, {}, ctx())[0] for x in xs]
    out = c.aggregate(payloads, xs[0].shape, tf.float32, ctx(num_workers=3))
    expected = np.sign(np.sum([np.sign(x.numpy()) for x in xs], axis=0))
    np.testing.assert_array_equal(out.numpy(), expected)


def signsgd_vote(grads):
    """The reference: sign(sum_m sign(g_m)) with sign(0) = 0."""
    return np.sign(np.sum([np.sign(g) for g in grads], axis=0))


def test_signsgd_zero_gradient_decodes_to_zero():
    c = SignSGD()
    x = tf.constant([0.0, 2.0, -0.0, -3.0, 0.0, 1e-3, -1e-30, 0.0] * 5)  # 40: two words
    payload, _, decoded = roundtrip(c, x)
    expected = np.sign(x.numpy())
    np.testing.assert_array_equal(decoded.numpy(), expected)
    assert not np.signbit(decoded.numpy()[expected == 0]).any()  # +0, also for -0.0
    # One worker's vote is its own sign, zeros included.
    out = c.aggregate([payload], x.shape, tf.float32, ctx(num_workers=1))
    np.testing.assert_array_equal(out.numpy(), expected)
    # An all-zero gradient sends no vote at all.
    z = tf.zeros([7, 5])
    _, _, dz = roundtrip(c, z)
    np.testing.assert_array_equal(dz.numpy(), np.zeros([7, 5]))


def test_signsgd_coordinate_zero_on_every_worker_gets_zero():
    """Dead units (e.g. weights of an always-0 input pixel) must not drift."""
    c = SignSGD()
    rng = np.random.default_rng(3)
    xs = [rng.normal(size=(20, 6)).astype(np.float32) for _ in range(3)]
    for x in xs:
        x[4, :] = 0.0   # a dead input row: 0 on every worker
        x[:, 2] = -0.0  # a dead column, as negative zeros
    payloads = [c.compress(tf.constant(x), {}, ctx(rank=r, num_workers=3))[0]
                for r, x in enumerate(xs)]
    out = c.aggregate(payloads, tf.TensorShape([20, 6]), tf.float32, ctx(num_workers=3)).numpy()
    assert not out[4, :].any() and not out[:, 2].any()
    np.testing.assert_array_equal(out, signsgd_vote(xs))
    assert np.all(np.abs(np.delete(np.delete(out, 4, axis=0), 2, axis=1)) == 1)  # odd votes


def test_signsgd_majority_vote_with_zero_votes():
    c = SignSGD()
    xs = [tf.constant([1.0, 1.0, 1.0, 1.0, -2.0, 0.0, 3.0, -1.0]),
          tf.constant([0.0, -1.0, 1.0, -0.0, -1.0, 0.0, -5.0, -1.0]),
          tf.constant([0.0, 0.0, -1.0, -1.0, 4.0, 0.0, 0.0, 0.0])]
    payloads = [c.compress(x, {}, ctx(rank=r, num_workers=3))[0] for r, x in enumerate(xs)]
    for dtype in (tf.float32, tf.float16, tf.bfloat16):
        out = c.aggregate(payloads, xs[0].shape, dtype, ctx(num_workers=3))
        assert out.dtype == dtype
        np.testing.assert_array_equal(tf.cast(out, tf.float32).numpy(),
                                      [1, 0, 1, 0, -1, 0, 0, -1])
    np.testing.assert_array_equal(
        c.aggregate(payloads, xs[0].shape, tf.float32, ctx(num_workers=3)).numpy(),
        signsgd_vote([x.numpy() for x in xs]))


@pytest.mark.parametrize("n", [1, 31, 32, 33, 1000])
def test_signsgd_wire_size_is_two_bits_per_element(n):
    """Two bit-vectors of ceil(n / 32) int32 words: 8 * ceil(n / 32) bytes per tensor."""
    x = tf.random.stateless_normal([n], seed=[9, n])
    payload, _, _ = roundtrip(SignSGD(), x)
    assert [(t.dtype, t.shape.as_list()) for t in payload] == [(tf.int32, [math.ceil(n / 32)])] * 2
    assert sum(4 * packing.num_words(int(t.shape.num_elements()), t.dtype)
               for t in payload) == 8 * math.ceil(n / 32)


def test_scaled_sign_preserves_l1_norm():
    x = tf.random.stateless_normal([333], seed=[4, 5])
    _, _, decoded = roundtrip(ScaledSign(), x)
    np.testing.assert_allclose(np.abs(decoded.numpy()).sum(), np.abs(x.numpy()).sum(), rtol=1e-5)
    np.testing.assert_array_equal(np.sign(decoded.numpy()), np.where(x.numpy() >= 0, 1, -1))


@pytest.mark.parametrize("levels, bucket, norm", [(1, 64, "l2"), (4, 100, "l2"), (7, 128, "max")])
def test_qsgd_unbiased_and_within_variance_bound(levels, bucket, norm):
    rng = np.random.default_rng(2)
    v = rng.normal(size=300).astype(np.float32)
    v[::7] = 0.0
    c = QSGD(levels=levels, bucket_size=bucket, norm=norm, seed=11)
    draws = np.stack([
        roundtrip(c, tf.constant(v), c=ctx(step=t))[2].numpy() for t in range(400)])
    # Exact per-coordinate variance: norm/s * (l + Bernoulli(p)).
    chunks = np.array_split(v, range(bucket, len(v), bucket))
    norms = np.concatenate([np.full(len(ch), np.linalg.norm(ch) if norm == "l2"
                                    else np.abs(ch).max()) for ch in chunks])
    scaled = levels * np.abs(v) / norms
    p = scaled - np.floor(scaled)
    variance = (norms / levels) ** 2 * p * (1 - p)
    assert_unbiased(draws, v, variance)
    # Outputs lie on the levels {±norm * l / s} of their bucket; zeros stay zero.
    assert np.all(draws[:, ::7] == 0)
    if norm == "l2":
        d = bucket
        mse = np.mean(np.sum((draws - v) ** 2, axis=1))
        bound = sum(min(d / levels ** 2, math.sqrt(d) / levels) * np.sum(chunk ** 2)
                    for chunk in np.array_split(v, range(bucket, len(v), bucket)))
        assert mse <= bound * 1.05


def test_qsgd_wire_size():
    c = QSGD(levels=7, bucket_size=128)
    payload, _, _ = roundtrip(c, tf.random.normal([1000]))
    norms, words = payload
    assert c.bits == 4 and norms.shape == [8] and words.shape == [math.ceil(1000 * 4 / 32)]
    assert QSGD(levels=127).bits == 8 and QSGD(levels=1).bits == 2


def test_terngrad_values_are_ternary_and_unbiased():
    g = tf.random.stateless_normal([2000], seed=[7, 8])
    c = TernGrad(seed=5)
    clipped = np.clip(g.numpy(), -2.5 * g.numpy().std(), 2.5 * g.numpy().std())
    s = np.abs(clipped).max()
    draws = np.stack([roundtrip(c, g, c=ctx(step=t))[2].numpy() for t in range(300)])
    assert set(np.unique(draws)) <= {-s, 0.0, s} or np.allclose(
        np.unique(np.abs(draws)), [0.0, s], rtol=1e-6)
    p = np.abs(clipped) / s
    assert_unbiased(draws, clipped, s ** 2 * p * (1 - p))


def test_stochastic_compressors_differ_across_workers_and_steps():
    x = tf.random.normal([50, 40])
    c = QSGD(levels=2)
    a = roundtrip(c, x, c=ctx(step=1, rank=0))[2].numpy()
    assert np.array_equal(a, roundtrip(c, x, c=ctx(step=1, rank=0))[2].numpy())
    assert not np.array_equal(a, roundtrip(c, x, c=ctx(step=1, rank=1))[2].numpy())
    assert not np.array_equal(a, roundtrip(c, x, c=ctx(step=2, rank=0))[2].numpy())


@pytest.mark.parametrize("spec", ALL_SPECS)
@pytest.mark.parametrize("dtype", [tf.float32, tf.float16, tf.bfloat16])
def test_every_compressor_handles_half_precision_and_odd_sizes(spec, dtype):
    c = tfgc.get_compressor(spec)
    x = tf.cast(tf.random.stateless_normal([37, 3], seed=[1, 1]), dtype)
    payload, _, decoded = roundtrip(c, x)
    assert decoded.shape == x.shape and decoded.dtype == dtype
    assert np.all(np.isfinite(tf.cast(decoded, tf.float32).numpy()))
    agg = c.aggregate([payload, payload], x.shape, dtype, ctx())
    assert agg.shape == x.shape and agg.dtype == dtype


def ring_sum(compressor, per_worker, num_workers):
    """Simulates the summable path: each worker's payload, added in the wire dtype, decoded."""
    x = tf.constant([per_worker, -per_worker, 1.0])
    payloads = [compressor.compress(x, {}, ctx(rank=r, num_workers=num_workers))[0][0]
                for r in range(num_workers)]
    total = payloads[0]
    for p in payloads[1:]:
        total = total + p  # one hop: the partial sum is rounded to the wire dtype
    assert total.dtype == compressor.wire_dtype
    return compressor.decompress((total,), x.shape, tf.float32, ctx(num_workers=num_workers))


def test_fp16_allreduce_sum_overflows_past_65504_and_bf16_does_not():
    """fp16 accumulates in fp16: the sum over workers, not each value, must fit."""
    np.testing.assert_array_equal(ring_sum(FP16(), 30000.0, 2).numpy(), [60000, -60000, 2])
    over = ring_sum(FP16(), 40000.0, 2).numpy()
    assert over[0] == np.inf and over[1] == -np.inf and over[2] == 2
    # Each 40000 fits in fp16 on its own; only the sum overflows.
    _, _, alone = roundtrip(FP16(), tf.constant([40000.0]))
    assert alone.numpy()[0] == 40000
    # bf16 has float32's exponent range: the same sum stays finite (8-bit mantissa).
    bf = ring_sum(BF16(), 40000.0, 2).numpy()
    assert np.all(np.isfinite(bf))
    np.testing.assert_allclose(bf, [80000, -80000, 2], rtol=1 / 128)
    # The small end: fp16 loses magnitudes below 2**-24 (about 6e-8).
    _, _, tiny = roundtrip(FP16(), tf.constant([1e-8, 2.0 ** -24, 1e-8]))
    np.testing.assert_array_equal(tiny.numpy(), [0, 2.0 ** -24, 0])


def test_casts_declare_that_they_pass_non_finite_values():
    for c in (Identity(), FP16(), BF16()):
        assert getattr(c, "passes_non_finite", None) is True
        _, _, decoded = roundtrip(c, tf.constant([np.inf, -np.inf, np.nan, 1.0]))
        d = decoded.numpy()
        assert d[0] == np.inf and d[1] == -np.inf and np.isnan(d[2]) and d[3] == 1


def test_policy_keeps_small_and_vector_gradients_dense():
    policy = tfgc.CompressionPolicy(min_elements=100)
    topk = TopK()
    assert policy.should_compress(tf.zeros([20, 10]), topk)
    assert not policy.should_compress(tf.zeros([9, 10]), topk)
    assert not policy.should_compress(tf.zeros([1000]), topk)
    assert not policy.should_compress(tf.zeros([20, 10], tf.int32), topk)
    assert tfgc.CompressionPolicy(min_elements=100, compress_vectors=True).should_compress(
        tf.zeros([1000]), topk)


# -- importance-weighted pruning ---------------------------------------------------------


def test_importance_selects_by_gradient_over_weight_and_keeps_the_rest():
    """The k largest |v| / (|w| + eps), not the largest |v|; error feedback is implied,
    and what was not sent stays in the residual (mass conserved)."""
    from tfgc.compressors import Importance
    c = tfgc.get_compressor("importance:k=3")
    assert isinstance(c, ErrorFeedback) and isinstance(c.inner, Importance)
    assert c.needs_weights and c.index_selection.shares_indices
    rng = np.random.default_rng(4)
    shape = (8, 12)
    w = rng.normal(size=shape).astype(np.float32)
    w[0, 0] = 0.0  # guarded: ranks first among its peers, no division by zero
    state = c.init_state(tf.TensorShape(shape), tf.float32)
    residual = np.zeros(shape, np.float32)
    sent_total, grad_total = np.zeros(shape), np.zeros(shape)
    for step in range(4):
        g = rng.normal(size=shape).astype(np.float32)
        v = (g + residual).ravel()
        scores = np.abs(v) / (np.abs(w.ravel()) + np.float32(1e-6))
        want = np.sort(np.argsort(-scores, kind="stable")[:3])
        cc = CompressContext(rank=0, num_workers=2, step=tf.constant(step, tf.int64),
                             weight=tf.constant(w))
        (values, indices), state = c.compress(tf.constant(g), state, cc)
        np.testing.assert_array_equal(indices.numpy(), want)
        np.testing.assert_allclose(values.numpy(), v[want], rtol=1e-6)
        if step == 0:
            assert 0 in want
            assert set(want) != set(np.argsort(-np.abs(v))[:3])  # not plain top-k
        residual = v.copy()
        residual[want] = 0
        residual = residual.reshape(shape)
        np.testing.assert_allclose(state["residual"].numpy(), residual, rtol=1e-6)
        sent_total += c.decompress((values, indices), tf.TensorShape(shape), tf.float32,
                                   cc).numpy()
        grad_total += g
    np.testing.assert_allclose(sent_total + state["residual"].numpy(), grad_total, atol=1e-5)


def test_importance_needs_weights_and_checks_eps():
    from tfgc.distribute.paths import choose_communication
    c = tfgc.get_compressor("importance")
    assert choose_communication(c, 4)[0] == "shared_index"
    assert tfgc.get_compressor(tfgc.serialize(c)) == c
    with pytest.raises(ValueError, match="variables' values"):
        c.compress(tf.ones([4, 4]), c.init_state(tf.TensorShape([4, 4]), tf.float32), ctx())
    for bad in ("importance:eps=0", "importance:eps=-1", "importance:ratio=0"):
        with pytest.raises(ValueError, match="`eps`|`ratio`"):
            tfgc.get_compressor(bad)
