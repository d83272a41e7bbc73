"""Variance-based compression and the MomentDense layer that feeds it, against NumPy.

The multi-worker path (model.fit with MomentDense layers, moment probes paired with
their kernels by the cross-device ops) runs on the 2-worker sweep of
``tests/test_distributed.py``.
"""

import math

import numpy as np
import pytest
import tensorflow as tf
import tf_keras as keras

import tfgc
from tfgc.compressors import CompressContext, Variance
from tfgc.keras import MomentDense


def ctx(moment):
    return CompressContext(second_moment=tf.constant(moment, tf.float32))


def variance_numpy(g, s, r, v, alpha=2.0, zeta=0.999, max_density=0.01):
    """One step for one worker: (decoded, new r, new v)."""
    r, v = r + g, v + s
    flat_r, flat_v = r.reshape(-1), v.reshape(-1)
    cap = min(flat_r.size, max(1, math.ceil(max_density * flat_r.size)))
    passing = np.flatnonzero((flat_r.astype(np.float32) ** 2 > alpha * flat_v) & (flat_r != 0))
    if passing.size > cap:
        score = np.where(flat_v[passing] > 0, flat_r[passing] ** 2
                         / np.where(flat_v[passing] > 0, flat_v[passing], 1), np.inf)
        passing = np.sort(passing[np.argsort(-score, kind="stable")[:cap]])
    values = flat_r[passing]
    scale = np.abs(values).max() if values.size else 0.0
    with np.errstate(divide="ignore"):
        k = np.clip(np.round(np.log(scale / np.abs(values)) / np.log(2.0)), 0, 7)
    decoded = np.zeros_like(flat_r)
    decoded[passing] = np.sign(values) * scale * 2.0 ** -k
    new_r = flat_r - decoded
    new_v = flat_v * np.float32(zeta)
    new_v[passing] = 0
    return decoded.reshape(g.shape), new_r.reshape(g.shape), new_v.reshape(g.shape)


def test_steps_match_numpy_model_and_conserve_mass():
    c = Variance(alpha=1.5, max_density=0.05)
    shape = (30, 40)
    state = c.init_state(tf.TensorShape(shape), tf.float32)
    rng = np.random.default_rng(0)
    r = v = np.zeros(shape, np.float32)
    total_g, total_sent = np.zeros(shape), np.zeros(shape)
    mean = rng.normal(size=shape).astype(np.float32) * 0.1
    for _ in range(6):
        g = mean + rng.normal(size=shape).astype(np.float32) * 0.3
        s = np.full(shape, 0.01, np.float32) * rng.uniform(0.5, 2, shape).astype(np.float32)
        payload, state = c.compress(tf.constant(g), state, ctx(s))
        got = c.decompress(payload, tf.TensorShape(shape), tf.float32, None).numpy()
        want, r, v = variance_numpy(g, s, r, v, alpha=1.5, max_density=0.05)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(state["r"].numpy(), r, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(state["v"].numpy(), v, rtol=1e-5, atol=1e-7)
        # The state counts what went out; the diagnostics report it as a rate.
        assert float(state["sent"]) == np.count_nonzero(want)
        rate = float(c.diagnostics(state)["send_rate"])
        assert rate == pytest.approx(np.count_nonzero(want) / want.size)
        assert 0 < float(state["sent"]) <= c.capacity(tf.TensorShape(shape))
        total_g += g
        total_sent += got
    np.testing.assert_allclose(total_sent + state["r"].numpy(), total_g, atol=1e-4)


def test_constant_gradient_without_variance_is_sent_every_step():
    c = Variance(max_density=1.0)
    g = np.zeros((10, 10), np.float32)
    g[2, 3] = 0.5
    state = c.init_state(tf.TensorShape([10, 10]), tf.float32)
    for _ in range(5):
        payload, state = c.compress(tf.constant(g), state, ctx(np.zeros((10, 10))))
        out = c.decompress(payload, tf.TensorShape([10, 10]), tf.float32, None).numpy()
        assert out[2, 3] == 0.5 and np.count_nonzero(out) == 1
        assert state["r"].numpy()[2, 3] == 0 and state["v"].numpy()[2, 3] == 0


@pytest.mark.parametrize("alphas", [(0.5, 4.0)])
def test_zero_mean_noise_is_sent_rarely_and_less_as_alpha_rises(alphas):
    rng = np.random.default_rng(1)
    n, steps = 2000, 30
    rates = []
    for alpha in alphas:
        c = Variance(alpha=alpha, zeta=1.0, max_density=1.0)
        state = c.init_state(tf.TensorShape([n]), tf.float32)
        sent = 0
        for _ in range(steps):
            # Per-sample gradients of mean 0 and variance 1, batch 16: the mean has
            # variance 1/16, which is what the moment reports.
            g = rng.normal(size=n).astype(np.float32) / 4.0
            payload, state = c.compress(tf.constant(g), state, ctx(np.full(n, 1 / 16)))
            sent += int(payload[2].numpy()[0])
        rates.append(sent / (n * steps))
    assert rates[0] < 0.5 and rates[1] < 0.1 and rates[1] < rates[0] / 3, rates


def test_four_bit_levels_and_wire_format():
    c = Variance(alpha=0.1, max_density=0.2)
    g = np.linspace(-1, 1, 100, dtype=np.float32).reshape(10, 10)
    payload, _ = c.compress(tf.constant(g), c.init_state(tf.TensorShape([10, 10]), tf.float32),
                            ctx(np.full((10, 10), 1e-3)))
    words, scale, count = payload
    assert [t.shape.as_list() for t in payload] == [[20], [1], [1]]
    assert int(count.numpy()[0]) == 20
    out = c.decompress(payload, tf.TensorShape([10, 10]), tf.float32, None).numpy()
    levels = np.abs(out[out != 0]) / float(scale.numpy()[0])
    assert set(np.round(np.log2(levels)).astype(int)) <= set(range(-7, 1))


def test_malformed_payloads_fail_with_invalid_argument():
    c = Variance()
    shape = tf.TensorShape([20, 20])
    payload = (tf.constant([5 << 4, 10**6 << 4, 0, 0], tf.int32), tf.constant([1.0]),
               tf.constant([2], tf.int32))
    with pytest.raises(tf.errors.InvalidArgumentError):
        c.decompress(payload, shape, tf.float32, None)
    with pytest.raises(tf.errors.InvalidArgumentError):
        c.decompress((payload[0], payload[1], tf.constant([99], tf.int32)), shape, tf.float32,
                     None)


def test_needs_moments():
    c = Variance()
    with pytest.raises(ValueError, match="MomentDense"):
        c.compress(tf.ones([10, 10]), c.init_state(tf.TensorShape([10, 10]), tf.float32),
                   CompressContext())


@pytest.mark.parametrize("spec,arg", [
    ("variance:alpha=0", "alpha"), ("variance:alpha=-1", "alpha"), ("variance:zeta=1.5", "zeta"),
    ("variance:zeta=-0.1", "zeta"), ("variance:max_density=0", "max_density"),
])
def test_bad_hyperparameters_name_the_argument(spec, arg):
    with pytest.raises(ValueError, match=arg):
        tfgc.get_compressor(spec)


def test_registry_round_trip():
    c = tfgc.get_compressor("variance:alpha=1.5")
    assert isinstance(c, Variance) and c.needs_second_moment and not c.summable
    assert tfgc.get_compressor(tfgc.compressors.serialize(c)) == c


def test_moment_dense_gives_mean_gradient_and_per_sample_second_moment():
    rng = np.random.default_rng(2)
    x = rng.normal(size=(8, 2, 5)).astype(np.float32)  # rank 3: rows over the leading axes
    y = rng.integers(0, 3, (8, 2))
    layer = MomentDense(3, activation="tanh")
    layer.build((None, 2, 5))

    def loss_of(xs, ys):
        out = layer(xs)
        return tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(ys, out, from_logits=True))

    with tf.GradientTape() as tape:
        loss = loss_of(x, y)
    kernel, bias, moment = tape.gradient(loss, [layer.kernel, layer.bias, layer.kernel_moment])
    per = []
    for z in range(8):
        for t in range(2):  # a "sample" is a row of the matmul: each (z, t) pair
            with tf.GradientTape() as t2:
                out = layer(x[z:z + 1, t:t + 1])
                lz = tf.reduce_mean(keras.losses.sparse_categorical_crossentropy(
                    y[z:z + 1, t:t + 1], out, from_logits=True))
            per.append(t2.gradient(lz, layer.kernel).numpy())
    per = np.array(per)
    np.testing.assert_allclose(kernel.numpy(), per.mean(0), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(moment.numpy(), (per ** 2).sum(0) / len(per) ** 2, rtol=1e-5,
                               atol=1e-9)
    # The forward pass and the other gradients are Dense's.
    dense = keras.layers.Dense(3, activation="tanh")
    dense.build((None, 2, 5))
    dense.set_weights(layer.get_weights()[:2])
    np.testing.assert_allclose(dense(x).numpy(), layer(x).numpy(), atol=1e-6)
    assert bias is not None and layer.get_config()["units"] == 3


def test_moment_dense_trains_in_model_fit():
    rng = np.random.default_rng(3)
    x = rng.normal(size=(256, 6)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int64)
    model = keras.Sequential([MomentDense(16, activation="relu"), MomentDense(2)])
    model.compile(keras.optimizers.SGD(0.1),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    history = model.fit(x, y, epochs=5, batch_size=32, verbose=0)
    assert history.history["loss"][-1] < 0.7 * history.history["loss"][0]
