"""meProp (MePropDense): forward equals Dense, gradients against NumPy models of both modes.

The upstream gradient is fixed by a loss ``sum(y * G)`` with a random ``G``, so the
gradient with respect to the layer's pre-activation output is ``G`` (times the
activation's derivative where there is one) and the references can be written
directly in NumPy.
"""

import numpy as np
import pytest
import tensorflow as tf
import tf_keras as keras

from tfgc.keras import MePropDense
from tfgc.keras.meprop import meprop_matmul, per_example_backward, unified_backward

MODES = ["unified", "per_example"]


def data(b, n, m, seed=0, dtype=np.float32):
    rng = np.random.default_rng(seed)
    return (rng.normal(size=(b, n)).astype(dtype), rng.normal(size=(b, m)).astype(dtype))


def layer_pair(n, m, k, mode, seed=0, activation=None, dtype="float32"):
    """A MePropDense and a keras Dense with the same (random, nonzero-bias) weights."""
    rng = np.random.default_rng(seed + 100)
    kernel = rng.normal(size=(n, m)).astype(dtype)
    bias = rng.normal(size=(m,)).astype(dtype)
    mp = MePropDense(m, k, mode=mode, activation=activation, dtype=dtype)
    dense = keras.layers.Dense(m, activation=activation, dtype=dtype)
    mp.build((None, n))
    dense.build((None, n))
    mp.set_weights([kernel, bias])
    dense.set_weights([kernel, bias])
    return mp, dense


def grads(layer, x, g):
    """(y, dx, dkernel, dbias) for the loss sum(layer(x) * g)."""
    x = tf.constant(x)
    with tf.GradientTape() as tape:
        tape.watch(x)
        y = layer(x)
        loss = tf.reduce_sum(y * g)
    dx, dw, db = tape.gradient(loss, [x, layer.kernel, layer.bias])
    return y.numpy(), dx.numpy(), dw.numpy(), db.numpy()


def unified_numpy(x, w, dy, k):
    """(dx, dW, inds) of unified meProp; ties, absent from random data, go to the lower index."""
    inds = np.argsort(-np.abs(dy).sum(0), kind="stable")[:k]
    dw = np.zeros_like(w)
    dw[:, inds] = x.T @ dy[:, inds]
    return dy[:, inds] @ w[:, inds].T, dw, np.sort(inds)


def per_example_numpy(x, w, dy, k):
    """(dx, dW) of per-example meProp: every row of dy keeps its own k largest |dy|."""
    dy_k = np.zeros_like(dy)
    for b in range(dy.shape[0]):
        keep = np.argsort(-np.abs(dy[b]), kind="stable")[:k]
        dy_k[b, keep] = dy[b, keep]
    return dy_k @ w.T, x.T @ dy_k


# ---------------------------------------------------------------------- forward


@pytest.mark.parametrize("mode", MODES)
def test_forward_equals_dense(mode):
    mp, dense = layer_pair(12, 9, 3, mode, activation="relu")
    x, _ = data(5, 12, 9)
    np.testing.assert_array_equal(mp(x).numpy(), dense(x).numpy())
    # Rank 3: leading dimensions are flattened into rows, as Dense does.
    x3 = np.random.default_rng(1).normal(size=(2, 4, 12)).astype(np.float32)
    np.testing.assert_allclose(mp(x3).numpy(), dense(x3).numpy(), rtol=1e-6, atol=1e-6)
    assert mp(x3).shape == (2, 4, 9)


# ------------------------------------------------------------------ k = m: dense


@pytest.mark.parametrize("mode", MODES)
def test_k_equal_units_reproduces_dense_gradients(mode):
    mp, dense = layer_pair(16, 10, 10, mode, activation="tanh")
    x, g = data(6, 16, 10)
    got, want = grads(mp, x, g), grads(dense, x, g)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("backward", [unified_backward, per_example_backward])
def test_selection_path_with_all_columns_is_dense(backward):
    """k = m turns the selection off in the layer; the selecting code itself, run with
    every column kept, must also give the dense gradients (up to summation order)."""
    x, dy = data(7, 11, 8, seed=3)
    w = np.random.default_rng(4).normal(size=(11, 8)).astype(np.float32)
    dx, dw = backward(tf.constant(x), tf.constant(w), tf.constant(dy), 8)
    np.testing.assert_allclose(dx.numpy(), dy @ w.T, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dw.numpy(), x.T @ dy, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------- k < m: models


def test_unified_matches_numpy_and_touches_only_selected_columns():
    n, m, k = 20, 15, 4
    mp, _ = layer_pair(n, m, k, "unified")
    x, g = data(9, n, m, seed=5)
    _, dx, dw, db = grads(mp, x, g)
    w = mp.kernel.numpy()
    want_dx, want_dw, inds = unified_numpy(x, w, g, k)
    nonzero_cols = np.flatnonzero(np.abs(dw).sum(0))
    np.testing.assert_array_equal(nonzero_cols, inds)
    np.testing.assert_allclose(dw[:, inds], x.T @ g[:, inds], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dw, want_dw, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dx, want_dx, rtol=1e-5, atol=1e-5)
    # The bias gradient uses the full dy, as the authors' code does.
    np.testing.assert_allclose(db, g.sum(0), rtol=1e-5, atol=1e-5)


def test_per_example_matches_numpy():
    n, m, k = 18, 12, 3
    mp, _ = layer_pair(n, m, k, "per_example")
    x, g = data(8, n, m, seed=6)
    _, dx, dw, db = grads(mp, x, g)
    want_dx, want_dw = per_example_numpy(x, mp.kernel.numpy(), g, k)
    np.testing.assert_allclose(dx, want_dx, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dw, want_dw, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(db, g.sum(0), rtol=1e-5, atol=1e-5)
    # Different rows keep different columns, so more than k columns of dW move.
    assert np.count_nonzero(np.abs(dw).sum(0)) > k


@pytest.mark.parametrize("mode", MODES)
def test_dy_is_the_pre_activation_gradient(mode):
    """With an activation, the selection sees dL/d(xW + b), not dL/d(activation)."""
    n, m, k = 10, 8, 2
    mp, _ = layer_pair(n, m, k, mode, activation="tanh")
    x, g = data(5, n, m, seed=7)
    _, dx, dw, _ = grads(mp, x, g)
    w, b = mp.kernel.numpy(), mp.bias.numpy()
    dz = g * (1.0 - np.tanh(x @ w + b) ** 2)
    model = unified_numpy if mode == "unified" else per_example_numpy
    want_dx, want_dw = model(x, w, dz, k)[:2]
    np.testing.assert_allclose(dx, want_dx, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(dw, want_dw, rtol=1e-4, atol=1e-5)


def test_rank3_inputs_are_rows():
    """Leading dimensions are flattened: unified mode shares one index set across all rows."""
    n, m, k = 6, 9, 3
    mp, _ = layer_pair(n, m, k, "unified")
    rng = np.random.default_rng(8)
    x = rng.normal(size=(2, 5, n)).astype(np.float32)
    g = rng.normal(size=(2, 5, m)).astype(np.float32)
    _, dx, dw, _ = grads(mp, x, g)
    want_dx, want_dw, _ = unified_numpy(x.reshape(-1, n), mp.kernel.numpy(), g.reshape(-1, m), k)
    np.testing.assert_allclose(dx, want_dx.reshape(2, 5, n), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(dw, want_dw, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", MODES)
def test_graph_mode_matches_eager(mode):
    mp, _ = layer_pair(14, 10, 3, mode)
    x, g = data(6, 14, 10, seed=9)

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            loss = tf.reduce_sum(mp(x) * g)
        return tape.gradient(loss, [x, mp.kernel, mp.bias])

    for a, b in zip(step(tf.constant(x)), grads(mp, x, g)[1:]):
        np.testing.assert_allclose(a.numpy(), b, rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------ finite differences


def test_finite_differences_on_selected_coordinates():
    """On the selected columns, unified meProp's dW is the true gradient (and db always
    is): a central difference of a nonlinear loss in float64 agrees."""
    n, m, k = 7, 10, 3
    mp, _ = layer_pair(n, m, k, "unified", activation="tanh", dtype="float64")
    x, g = data(4, n, m, seed=10, dtype=np.float64)

    def loss_of(kernel, bias):
        z = np.tanh(x @ kernel + bias)
        return float(np.sum(np.sin(z) * g))

    xt = tf.constant(x)
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(tf.sin(mp(xt)) * g)
    dw, db = (t.numpy() for t in tape.gradient(loss, [mp.kernel, mp.bias]))
    w, b = mp.kernel.numpy(), mp.bias.numpy()
    selected = np.flatnonzero(np.abs(dw).sum(0))
    assert len(selected) == k
    eps = 1e-6
    for j in selected:
        for i in range(n):
            wp, wm = w.copy(), w.copy()
            wp[i, j] += eps
            wm[i, j] -= eps
            fd = (loss_of(wp, b) - loss_of(wm, b)) / (2 * eps)
            assert abs(dw[i, j] - fd) < 1e-7 * max(1.0, abs(fd)), (i, j, dw[i, j], fd)
    for j in range(m):
        bp, bm = b.copy(), b.copy()
        bp[j] += eps
        bm[j] -= eps
        fd = (loss_of(w, bp) - loss_of(w, bm)) / (2 * eps)
        assert abs(db[j] - fd) < 1e-7 * max(1.0, abs(fd)), (j, db[j], fd)


# ------------------------------------------------------------------ validation


@pytest.mark.parametrize("kwargs, name", [
    (dict(units=0, k=1), "units"),
    (dict(units=4.0, k=1), "units"),
    (dict(units=4, k=0), "k"),
    (dict(units=4, k=-2), "k"),
    (dict(units=4, k=2.5), "k"),
    (dict(units=4, k=True), "k"),
    (dict(units=4, k="2"), "k"),
    (dict(units=4, k=2, mode="percolumn"), "mode"),
])
def test_bad_hyperparameters_raise(kwargs, name):
    with pytest.raises(ValueError, match=f"`{name}`"):
        MePropDense(**kwargs)


def test_k_above_units_names_both():
    with pytest.raises(ValueError, match=r"`k` \(5\).*`units` \(4\)"):
        MePropDense(4, 5)


def test_numpy_integers_are_accepted():
    layer = MePropDense(np.int64(6), np.int32(2))
    assert (layer.units, layer.k) == (6, 2)
    assert type(layer.get_config()["k"]) is int


def test_meprop_matmul_checks_k():
    x, w = tf.zeros([2, 3]), tf.zeros([3, 4])
    with pytest.raises(ValueError, match="`k`"):
        meprop_matmul(x, w, 5)
    with pytest.raises(ValueError, match="`mode`"):
        meprop_matmul(x, w, 2, mode="rows")


def test_unknown_last_dimension_fails_at_build():
    with pytest.raises(ValueError, match="last dimension"):
        MePropDense(4, 2).build((None, None))


# ---------------------------------------------------------------------- config


def test_config_round_trip():
    layer = MePropDense(7, 3, mode="per_example", activation="relu", use_bias=False,
                        kernel_initializer="he_normal", bias_initializer="ones", name="mp")
    config = layer.get_config()
    clone = MePropDense.from_config(config)
    assert clone.get_config() == config
    assert (clone.units, clone.k, clone.mode, clone.use_bias) == (7, 3, "per_example", False)
    assert clone.activation is keras.activations.relu
    # Through a whole model's JSON, which needs the registered name.
    model = keras.Sequential([keras.Input((5,)), MePropDense(4, 2, activation="tanh")])
    rebuilt = keras.models.model_from_json(model.to_json())
    assert isinstance(rebuilt.layers[0], MePropDense)
    assert rebuilt.layers[0].get_config()["k"] == 2
    rebuilt.set_weights(model.get_weights())
    x = np.ones((3, 5), np.float32)
    np.testing.assert_array_equal(rebuilt(x).numpy(), model(x).numpy())


# --------------------------------------------------------------------- training


@pytest.mark.parametrize("mode", MODES)
def test_trains_in_model_fit(mode):
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(256, 20)).astype(np.float32)
    y = (x[:, :3].sum(1) > 0).astype(np.int32) + (x[:, 3] > 1).astype(np.int32)
    model = keras.Sequential([
        keras.Input((20,)),
        MePropDense(32, k=4, mode=mode, activation="relu"),
        keras.layers.Dense(3),
    ])
    model.compile(optimizer=keras.optimizers.Adam(0.01),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    history = model.fit(x, y, batch_size=32, epochs=5, verbose=0)
    losses = history.history["loss"]
    assert losses[-1] < 0.7 * losses[0], losses


def test_mixed_precision_runs():
    layer = MePropDense(8, 3, dtype=keras.mixed_precision.Policy("mixed_float16"))
    x = tf.random.stateless_normal([4, 6], seed=[1, 2])
    with tf.GradientTape() as tape:
        y = layer(x)
        loss = tf.reduce_sum(tf.cast(y, tf.float32))
    dw = tape.gradient(loss, layer.kernel)
    assert y.dtype == tf.float16 and layer.kernel.dtype == tf.float32
    assert dw.dtype == tf.float32
    assert np.count_nonzero(np.abs(dw.numpy()).sum(0)) == 3
