"""Deep Gradient Compression against a NumPy model of the paper's algorithm.

The distributed checks (DGC at density 1 trains as dense momentum SGD, the refusal
of an optimizer that applies momentum again, the warm-up on a real cluster) run in
``test_distributed.py``'s 2-worker sweep.
"""

import math

import numpy as np
import pytest
import tensorflow as tf

from tfgc import compressors
from tfgc.compressors import DGC, CompressContext


def ctx(step=0, num_workers=2, rank=0):
    return CompressContext(rank=rank, num_workers=num_workers, index=0,
                           step=tf.constant(step, tf.int64))


def run(compressor, grads, num_workers=2):
    """Compresses ``grads`` in turn; returns payloads and states, as NumPy."""
    state = compressor.init_state(tf.TensorShape(grads[0].shape), tf.float32)
    out = []
    for step, g in enumerate(grads):
        payload, state = compressor.compress(tf.constant(g), state, ctx(step, num_workers))
        out.append(([np.asarray(p) for p in payload],
                    {k: np.asarray(v) for k, v in state.items()}))
    return out


def numpy_dgc(grads, k, m, nesterov=False, masking=True):
    """The paper's steps 2-4 with exact top-k (ties to the lower index)."""
    u = np.zeros_like(grads[0]).ravel()
    v = np.zeros_like(grads[0]).ravel()
    out = []
    for g in grads:
        g = g.ravel()
        if nesterov:
            u = (u + g) * np.float32(m)
            v = (u + g) + v
        else:
            u = u * np.float32(m) + g
            v = u + v
        order = np.lexsort((np.arange(v.size), -np.abs(v)))[:k]
        sent = np.sort(order)
        values = v[sent].copy()
        v[sent] = 0
        if masking:
            u[sent] = 0
        out.append((values, sent, u.copy(), v.copy()))
    return out


@pytest.fixture
def grads():
    rng = np.random.default_rng(7)
    return [rng.normal(size=(40, 25)).astype(np.float32) for _ in range(6)]


@pytest.mark.parametrize("nesterov", [False, True])
def test_momentum_correction_and_masking_match_numpy(grads, nesterov):
    k = 20
    c = DGC(ratio=k / 1000, momentum=0.9, nesterov=nesterov, sample_ratio=1.0)
    for (payload, state), (values, sent, u, v) in zip(run(c, grads),
                                                      numpy_dgc(grads, k, 0.9, nesterov)):
        np.testing.assert_array_equal(payload[1], sent)
        np.testing.assert_allclose(payload[0], values, rtol=1e-6)
        np.testing.assert_allclose(state["momentum"].ravel(), u, rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(state["residual"].ravel(), v, rtol=1e-6, atol=1e-7)
        # u and v are zeroed exactly at the sent indices.
        assert np.all(state["momentum"].ravel()[sent] == 0)
        assert np.all(state["residual"].ravel()[sent] == 0)


def test_without_masking_momentum_survives_sending(grads):
    c = DGC(ratio=0.02, momentum=0.9, momentum_masking=False, sample_ratio=1.0)
    for (payload, state), (_, sent, u, v) in zip(run(c, grads),
                                                 numpy_dgc(grads, 20, 0.9, masking=False)):
        np.testing.assert_array_equal(payload[1], sent)
        np.testing.assert_allclose(state["momentum"].ravel(), u, rtol=1e-6, atol=1e-7)
        assert np.any(state["momentum"].ravel()[sent] != 0)


def test_velocities_are_conserved(grads):
    """Sum of what was sent plus the final v equals the sum of the velocities added."""
    c = DGC(ratio=0.01, momentum=0.9)
    out = run(c, grads)
    sent = np.zeros(1000, np.float64)
    for payload, _ in out:
        np.add.at(sent, payload[1], payload[0])
    velocities = np.zeros(1000, np.float64)
    u = np.zeros(1000, np.float64)
    prev_state = {"momentum": np.zeros(1000)}
    for g, (_, state) in zip(grads, out):
        # u after step 2 is m * (masked u of the step before) + g.
        u = 0.9 * prev_state["momentum"].ravel().astype(np.float64) + g.ravel()
        velocities += u
        prev_state = state
    np.testing.assert_allclose(sent + out[-1][1]["residual"].ravel(), velocities, atol=1e-4)


def test_sampled_threshold_sends_exactly_k_of_the_largest():
    rng = np.random.default_rng(3)
    g = rng.normal(size=(200, 100)).astype(np.float32)
    c = DGC(ratio=0.01, momentum=0.0)  # sampled threshold (sample_ratio 0.01)
    (values, indices), state = c.compress(tf.constant(g), c.init_state(g.shape, tf.float32),
                                          ctx())
    assert values.shape == indices.shape == (200,)
    real = np.asarray(values) != 0
    sent = np.asarray(indices)[real]
    assert len(set(sent)) == len(sent) >= math.ceil(0.8 * 200)
    residual = np.asarray(state["residual"]).ravel()
    np.testing.assert_array_equal(residual[sent], 0)
    # Every sent |v| is at least every kept one.
    assert np.min(np.abs(g.ravel()[sent])) >= np.max(np.abs(residual))
    # Nothing is lost.
    decoded = np.zeros(g.size, np.float32)
    np.add.at(decoded, np.asarray(indices), np.asarray(values))
    np.testing.assert_allclose(decoded + residual, g.ravel(), rtol=0, atol=0)


def test_local_clipping_scales_with_workers():
    g = np.full((50, 40), 3.0, np.float32)  # norm 134
    c = DGC(ratio=1.0, momentum=0.0, clip_norm=2.0)
    for n in (1, 4, 16):
        (values, _), _ = c.compress(tf.constant(g), c.init_state(g.shape, tf.float32),
                                    ctx(num_workers=n))
        assert np.linalg.norm(values) == pytest.approx(2.0 / math.sqrt(n), rel=1e-5)


def test_full_density_is_momentum_without_masking(grads):
    c = DGC(ratio=1.0, momentum=0.9)
    u = np.zeros(1000, np.float32)
    for (payload, state), g in zip(run(c, grads), grads):
        u = u * np.float32(0.9) + g.ravel()
        np.testing.assert_allclose(payload[0], u, rtol=1e-6)
        np.testing.assert_array_equal(payload[1], np.arange(1000))
        np.testing.assert_array_equal(state["residual"], 0)


def test_warmup_densities_follow_the_paper():
    c = compressors.get("dgc:ratio=0.001,warmup_steps=5")
    assert c.warmup_densities() == [0.25, 0.0625, 0.015625, 0.00390625]
    stages = c.stages()
    assert [s for s, _ in stages] == [0, 5, 10, 15, 20]
    assert [x.ratio for _, x in stages] == [0.25, 0.0625, 0.015625, 0.00390625, 0.001]
    assert all(x.stages() == [] and x.momentum == c.momentum for _, x in stages)
    assert [c.density_at(s) for s in (0, 4, 5, 19, 20, 10**6)] == \
        [0.25, 0.25, 0.0625, 0.00390625, 0.001, 0.001]
    assert DGC(ratio=0.3, warmup_steps=5).stages() == []
    assert DGC(ratio=0.001).stages() == []


def test_registry_round_trip():
    c = compressors.get("dgc:ratio=0.01,nesterov=true,clip_norm=5,warmup_steps=100")
    assert compressors.get(compressors.serialize(c)) == c
    assert compressors.get(compressors.serialize_config(c)) == c
    assert c.applied_momentum == 0.9 and c.nesterov


@pytest.mark.parametrize("spec, argument", [
    ("dgc:ratio=0", "ratio"), ("dgc:ratio=1.5", "ratio"), ("dgc:momentum=1.0", "momentum"),
    ("dgc:momentum=-0.1", "momentum"), ("dgc:momentum=true", "momentum"),
    ("dgc:momentum=0,nesterov=true", "nesterov"), ("dgc:nesterov=1", "nesterov"),
    ("dgc:clip_norm=-1", "clip_norm"), ("dgc:clip_norm=inf", "clip_norm"),
    ("dgc:momentum_masking=0", "momentum_masking"), ("dgc:sample_ratio=0", "sample_ratio"),
    ("dgc:warmup_steps=-1", "warmup_steps"), ("dgc:warmup_steps=1.5", "warmup_steps"),
    ("ef+dgc", "own residual"), ("dgc:k=5", "no hyperparameter `k`"),
])
def test_bad_hyperparameters_name_the_argument(spec, argument):
    with pytest.raises(ValueError, match=argument):
        compressors.get(spec)
