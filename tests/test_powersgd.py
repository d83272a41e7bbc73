"""PowerSGD: the compressor alone, against a NumPy model of the paper's power iteration.

The multi-worker path (two all-reduces per step) is checked on real clusters in
``tests/test_sparse_paths.py``, which shares their launches.
"""

import numpy as np
import pytest
import tensorflow as tf

import tfgc
from tfgc.compressors import CompressContext, PowerSGD
from tfgc.compressors.powersgd import orthogonalize


def ctx(step=0, index=0, rank=0, num_workers=1):
    return CompressContext(rank=rank, num_workers=num_workers, index=index,
                           step=tf.constant(step, tf.int64))


def orthogonalize_numpy(p):
    p = p.astype(np.float64).copy()
    for j in range(p.shape[1]):
        p[:, j] /= np.linalg.norm(p[:, j]) + 1e-8
        for k in range(j + 1, p.shape[1]):
            p[:, k] -= np.dot(p[:, j], p[:, k]) * p[:, j]
    return p


def powersgd_numpy(ms, q):
    """One step of the paper's algorithm for workers' matrices ``ms`` and query ``q``:
    (the summed output, the next query, each worker's new residual)."""
    p = orthogonalize_numpy(sum(m @ q for m in ms))
    q_sum = sum(m.T @ p for m in ms)
    out = p @ q_sum.T
    return out, q_sum / len(ms), [m - out / len(ms) for m in ms]


def test_orthogonalize_gives_orthonormal_columns():
    p = tf.random.stateless_normal([50, 4], seed=[3, 4])
    got = orthogonalize(p).numpy()
    np.testing.assert_allclose(got.T @ got, np.eye(4), atol=1e-5)
    np.testing.assert_allclose(got, orthogonalize_numpy(p.numpy()), atol=1e-5)


def test_one_worker_matches_numpy_model_and_warm_starts():
    c = PowerSGD(rank=2)
    shape = tf.TensorShape([30, 20])
    state = c.init_state(shape, tf.float32)
    rng = np.random.default_rng(0)
    residual = np.zeros(shape, np.float32)
    query = None
    for step in range(4):
        g = rng.normal(size=shape).astype(np.float32)
        if query is None:
            # The first query is the shared N(0, 1) draw.
            query = c.query(tf.zeros([20, 2]), ctx(step)).numpy()
        payload, state = c.compress(tf.constant(g), state, ctx(step))
        out, query, (residual,) = powersgd_numpy([g + residual], query)
        decoded = c.decompress(payload, shape, tf.float32, ctx(step)).numpy()
        np.testing.assert_allclose(decoded, out, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(state["residual"].numpy(), residual, rtol=1e-4, atol=1e-4)
        # Warm start: the next step's query is this step's Q.
        np.testing.assert_allclose(state["query"].numpy(), query, rtol=1e-4, atol=1e-4)
        assert [tuple(t.shape) for t in payload] == [(30, 2), (20, 2)]


def test_workers_sum_equals_one_worker_on_the_sum():
    """Linearity: with the shared query, N workers' summed factors equal one worker's on
    sum(M_i): the all-reduced messages lose nothing to the split."""
    rng = np.random.default_rng(1)
    ms = [rng.normal(size=(12, 9)) for _ in range(3)]
    q = rng.normal(size=(9, 2))
    out, q_next, residuals = powersgd_numpy(ms, q)
    alone, q_alone, _ = powersgd_numpy([sum(ms)], q)
    np.testing.assert_allclose(out, alone, atol=1e-10)
    np.testing.assert_allclose(q_next * 3, q_alone, atol=1e-10)
    # Conservation: output plus every residual is the sum of the inputs.
    np.testing.assert_allclose(out + sum(residuals), sum(ms), atol=1e-10)


def test_low_rank_matrix_is_reconstructed_exactly():
    rng = np.random.default_rng(2)
    m = (rng.normal(size=(40, 2)) @ rng.normal(size=(2, 25))).astype(np.float32)
    c = PowerSGD(rank=2)
    shape = tf.TensorShape(m.shape)
    payload, state = c.compress(tf.constant(m), c.init_state(shape, tf.float32), ctx())
    np.testing.assert_allclose(c.decompress(payload, shape, tf.float32, ctx()).numpy(), m,
                               atol=1e-4)
    assert np.abs(state["residual"].numpy()).max() < 1e-4


def test_error_feedback_conserves_mass():
    c = tfgc.get_compressor("powersgd:rank=1")
    shape = tf.TensorShape([3, 3, 8, 16])  # a conv kernel: [72, 16] matrices
    state = c.init_state(shape, tf.float32)
    assert state["query"].shape == (16, 1)
    rng = np.random.default_rng(3)
    sent, total = np.zeros(shape), np.zeros(shape)
    for step in range(5):
        g = rng.normal(size=shape).astype(np.float32)
        payload, state = c.compress(tf.constant(g), state, ctx(step))
        sent += c.decompress(payload, shape, tf.float32, ctx(step)).numpy()
        total += g
    np.testing.assert_allclose(sent + state["residual"].numpy(), total, atol=1e-4)


def test_query_is_shared_and_drawn_again_without_warm_start():
    c, cold = PowerSGD(), PowerSGD(warm_start=False)
    stored = tf.ones([10, 2])
    a = c.query(tf.zeros([10, 2]), ctx(0, rank=0, num_workers=4)).numpy()
    b = c.query(tf.zeros([10, 2]), ctx(0, rank=3, num_workers=4)).numpy()
    np.testing.assert_array_equal(a, b)  # the same on every worker
    assert np.abs(a).sum() > 0
    np.testing.assert_array_equal(c.query(stored, ctx(1)).numpy(), stored.numpy())
    fresh = cold.query(stored, ctx(1)).numpy()
    assert not np.array_equal(fresh, stored.numpy())
    assert not np.array_equal(fresh, cold.query(stored, ctx(2)).numpy())


def test_supports_only_matrices_that_shrink():
    c = PowerSGD(rank=4)
    assert not c.supports(tf.TensorShape([1000]), tf.float32)  # vectors go dense
    assert not c.supports(tf.TensorShape([10, 10]), tf.float32)  # 100 < 2 * 4 * 20
    assert c.supports(tf.TensorShape([784, 128]), tf.float32)
    assert not c.supports(tf.TensorShape([784, 128]), tf.float64)
    assert PowerSGD(rank=4, min_compression_rate=1).supports(tf.TensorShape([20, 20]),
                                                             tf.float32)


def test_registry_round_trip_and_paths():
    from tfgc.distribute.paths import check_communication, choose_communication
    c = tfgc.get_compressor("powersgd:rank=4,warm_start=false")
    assert c == PowerSGD(rank=4, warm_start=False)
    assert tfgc.get_compressor(tfgc.serialize(c)) == c
    assert choose_communication(c, 4)[0] == "low_rank"
    assert check_communication("allgather", c) == "allgather"
    for path in ("allreduce", "reduce_scatter", "shared_index", "sparse_allreduce"):
        with pytest.raises(ValueError, match="`communication`"):
            check_communication(path, c)
    with pytest.raises(ValueError, match="low_rank"):
        check_communication("low_rank", tfgc.get_compressor("topk"))
    with pytest.raises(ValueError, match="own residual"):
        tfgc.get_compressor("ef+powersgd")


@pytest.mark.parametrize("build, argument", [
    (lambda: PowerSGD(rank=0), "rank"),
    (lambda: PowerSGD(rank=1.5), "rank"),
    (lambda: PowerSGD(warm_start="yes"), "warm_start"),
    (lambda: PowerSGD(min_compression_rate=0.5), "min_compression_rate"),
    (lambda: PowerSGD(min_compression_rate=float("inf")), "min_compression_rate"),
    (lambda: PowerSGD(seed=-1), "seed"),
    (lambda: tfgc.get_compressor("powersgd:rank=-2"), "rank"),
])
def test_invalid_hyperparameters_fail_at_construction(build, argument):
    with pytest.raises(ValueError, match=argument):
        build()
