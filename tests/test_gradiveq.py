"""GradiVeQ: slices, the PCA learned from aggregated gradients, and its linearity, against
a NumPy model of the paper's algorithm.

The stages are driven here as the cross-device ops drive them (stage by step modulo
the cycle, the payloads of N workers summed, ``finish`` on the sum); real clusters
run the same model in ``tests/test_distributed.py`` (``--gradiveq`` on the sweeps).
"""

import math

import numpy as np
import pytest
import tensorflow as tf

import tfgc
from tfgc.compressors import CompressContext, GradiVeQ

SPEC = "gradiveq:slice_size=64,max_dim=8,learn_steps=6,compress_steps=3"


def gradiveq_numpy(steps_grads, shape, slice_len, max_dim, energy, learn_steps, compress_steps):
    """Outputs of every step for ``steps_grads[step][worker]`` gradients, and the d
    learned in each window."""
    n = int(np.prod(shape))
    slices = -(-n // slice_len)
    period = learn_steps + compress_steps
    samples, outputs, dims = [], [], []
    basis = mean = None
    for step, grads in enumerate(steps_grads):
        total = np.sum([g.astype(np.float64) for g in grads], axis=0).reshape(-1)
        pos = step % period
        if pos < learn_steps:
            if pos == 0:
                samples = []
            samples.append(np.pad(total, (0, slices * slice_len - n))[:slice_len])
            outputs.append(total.reshape(shape))
            if pos == learn_steps - 1:
                s = np.array(samples)
                mean = s.mean(0)
                cov = s.T @ s / len(s) - np.outer(mean, mean)
                values, vectors = np.linalg.eigh((cov + cov.T) / 2)
                values, vectors = np.maximum(values[::-1], 0), vectors[:, ::-1]
                held = np.cumsum(values) / values.sum()
                d = min(int(np.sum(held < 1 - energy)) + 1, max_dim)
                dims.append(d)
                basis = vectors[:, :d]
            continue
        rows = np.pad(total, (0, slices * slice_len - n)).reshape(slices, slice_len)
        rebuilt = (rows - mean) @ basis @ basis.T + mean
        outputs.append(rebuilt.reshape(-1)[:n].reshape(shape))
    return outputs, dims


def run_stages(compressor, steps_grads, shape):
    """The cross-device ops' loop, on one process: (outputs, final state, payload sizes)."""
    shape = tf.TensorShape(shape)
    stages = compressor.stages()
    period = compressor.stage_period
    state = compressor.init_state(shape, tf.float32)
    outputs, sizes = [], []
    for step, grads in enumerate(steps_grads):
        pos = step % period
        stage = [c for first, c in stages if first <= pos][-1]
        n = len(grads)
        ctxs = [CompressContext(rank=r, num_workers=n, step=tf.constant(step, tf.int64))
                for r in range(n)]
        payloads = [stage.compress(tf.constant(g), state, ctxs[r])[0][0]
                    for r, g in enumerate(grads)]
        sizes.append(int(payloads[0].shape[0]))
        out, state = stage.finish((tf.add_n(payloads),), shape, tf.float32, ctxs[0], state)
        outputs.append(out.numpy())
    return outputs, state, sizes


def low_rank_gradients(steps, workers, shape, rank=3, noise=0.01, seed=0):
    """Gradients whose slices lie near a rank-``rank`` subspace, as the paper observes."""
    rng = np.random.default_rng(seed)
    n = int(np.prod(shape))
    k = 64
    directions = rng.normal(size=(k, rank))
    out = []
    for _ in range(steps):
        grads = []
        for _ in range(workers):
            rows = (directions @ rng.normal(size=(rank, -(-n // k)))).T.reshape(-1)[:n]
            grads.append((rows.reshape(shape) + noise * rng.normal(size=shape)).astype(np.float32))
        out.append(grads)
    return out


@pytest.mark.parametrize("workers", [1, 3])
def test_stages_match_numpy_model(workers):
    c = tfgc.get_compressor(SPEC + ",dense_layers=true")
    shape = (40, 50)  # 2000 entries: 32 slices of 64, the last padded
    grads = low_rank_gradients(14, workers, shape)
    got, state, sizes = run_stages(c, grads, shape)
    want, dims = gradiveq_numpy(grads, shape, 64, 8, 0.01, 6, 3)
    for step, (g, w) in enumerate(zip(got, want)):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4, err_msg=f"step {step}")
    # Learning steps send the gradient, compressing steps 8 floats per slice.
    assert sizes == [2000] * 6 + [32 * 8] * 3 + [2000] * 5
    assert dims[0] == 3  # the lambda rule finds the subspace
    assert np.count_nonzero(np.abs(state["basis"].numpy()).sum(0)) == 3


def test_projections_add_up_exactly():
    c = GradiVeQ(slice_size=64, max_dim=8, learn_steps=4, dense_layers=True)
    shape = tf.TensorShape([40, 50])
    stage = c.stages()[1][1]
    rng = np.random.default_rng(1)
    basis, _ = np.linalg.qr(rng.normal(size=(64, 8)))
    mean = rng.normal(size=64)
    state = dict(c.init_state(shape, tf.float32), basis=tf.constant(basis, tf.float32),
                 mean=tf.constant(mean, tf.float32))
    grads = [rng.normal(size=shape).astype(np.float32) for _ in range(3)]
    ctx = CompressContext(num_workers=3)
    total = sum(stage.compress(tf.constant(g), state, ctx)[0][0].numpy() for g in grads)
    rows = np.pad(sum(grads).reshape(-1), (0, 48)).reshape(32, 64)
    np.testing.assert_allclose(total, ((rows - mean) @ basis).reshape(-1), rtol=1e-4,
                               atol=1e-4)


def test_learned_basis_holds_all_but_lambda_of_the_variance():
    c = GradiVeQ(slice_size=32, energy=0.05, max_dim=32)
    rng = np.random.default_rng(2)
    scales = np.geomspace(1, 1e-3, 32)
    samples = rng.normal(size=(200, 32)) * scales
    basis, mean, d = c.learn(tf.constant(samples.T @ samples, tf.float32),
                             tf.constant(samples.sum(0), tf.float32), tf.constant(200.0))
    centered = samples - mean.numpy()
    kept = centered @ basis.numpy() @ basis.numpy().T
    lost = np.sum((centered - kept) ** 2) / np.sum(centered ** 2)
    assert lost <= 0.05 + 1e-4 and 1 < int(d) < 32
    # One direction fewer would lose more than lambda: d is the smallest.
    fewer = basis.numpy()[:, :int(d) - 1]
    assert np.sum((centered - centered @ fewer @ fewer.T) ** 2) / np.sum(centered ** 2) > 0.05


def test_convolution_slices_are_whole_depth_filter_blocks():
    c = GradiVeQ()
    assert c.slice_length(tf.TensorShape([3, 3, 16, 16])) == 768  # 3 blocks of 16 x 16
    assert c.slice_length(tf.TensorShape([7, 7, 3, 64])) == 768  # 4 blocks of 3 x 64
    assert c.slice_length(tf.TensorShape([3, 3, 3, 1])) == 27  # every position, no more
    assert c.supports(tf.TensorShape([3, 3, 16, 16]), tf.float32)
    # Fully-connected layers stay uncompressed unless asked (the paper's choice).
    assert not c.supports(tf.TensorShape([784, 256]), tf.float32)
    assert GradiVeQ(dense_layers=True).supports(tf.TensorShape([784, 256]), tf.float32)
    assert not GradiVeQ(dense_layers=True).supports(tf.TensorShape([256]), tf.float32)


def test_stage_schedule_repeats():
    c = GradiVeQ(learn_steps=100, compress_steps=400)
    assert c.stage_period == 500 and [s for s, _ in c.stages()] == [0, 100]
    assert [st.phase for _, st in c.stages()] == ["learn", "compress"]
    assert all(st.stage_period == 0 and st.stages() == [] for _, st in c.stages())
    assert c.summable


@pytest.mark.parametrize("spec,arg", [
    ("gradiveq:slice_size=1", "slice_size"), ("gradiveq:energy=1.0", "energy"),
    ("gradiveq:energy=-0.1", "energy"), ("gradiveq:max_dim=0", "max_dim"),
    ("gradiveq:slice_size=16,max_dim=32", "max_dim"), ("gradiveq:learn_steps=1", "learn_steps"),
    ("gradiveq:compress_steps=0", "compress_steps"), ("gradiveq:dense_layers=1", "dense_layers"),
])
def test_bad_hyperparameters_name_the_argument(spec, arg):
    with pytest.raises(ValueError, match=arg):
        tfgc.get_compressor(spec)


def test_registry_and_no_error_feedback():
    c = tfgc.get_compressor("gradiveq:max_dim=48")
    assert isinstance(c, GradiVeQ) and tfgc.get_compressor(tfgc.compressors.serialize(c)) == c
    with pytest.raises(ValueError, match="without error feedback"):
        tfgc.get_compressor("ef+gradiveq")
    assert math.isclose(c.energy, 0.01)


# Kernel shapes of tf_keras.applications (ResNet50, MobileNetV2, VGG16, DenseNet121,
# EfficientNetB0) and odd ones: the stems, 1 x 1 bottlenecks, 3 x 3 and 7 x 7 convolutions,
# depthwise kernels (F = 1), and sides that divide into no power of two.
APPLICATION_KERNELS = [
    (7, 7, 3, 64), (1, 1, 64, 256), (3, 3, 512, 512), (1, 1, 2048, 512), (1, 1, 1024, 2048),
    (3, 3, 3, 32), (3, 3, 32, 1), (1, 1, 320, 1280), (3, 3, 960, 1), (3, 3, 512, 4096),
    (1, 1, 1024, 128), (5, 5, 672, 1), (3, 3, 17, 33), (2, 3, 700, 9), (1, 1, 5, 4000),
]


@pytest.mark.parametrize("shape", APPLICATION_KERNELS)
def test_slices_stay_near_slice_size_on_any_kernel_and_round_trip(shape):
    c = GradiVeQ()
    k, slices, d = c.dims(tf.TensorShape(shape))
    n = int(np.prod(shape))
    # K stays near the target whatever the width (a wide D x F block would make it
    # D F, and its K x K covariance the memory of many models), and small kernels
    # are never padded past their own size.
    assert min(n, c.slice_size // 2) <= k <= 2 * c.slice_size
    assert slices * k >= n and slices * k <= 1.25 * n + k
    state = c.init_state(tf.TensorShape(shape), tf.float32)
    assert state["samples"].shape == (c.learn_steps, k) and state["basis"].shape == (k, d)
    x = tf.random.stateless_normal(shape, seed=[1, 2])
    rows = c._slices(x)
    assert rows.shape == (slices, k)
    np.testing.assert_array_equal(c._unslice(rows, tf.TensorShape(shape), tf.float32), x)
    # A learning step takes its sample without building the other slices.
    np.testing.assert_array_equal(c._first_slice(x), rows[0])
    tiles = c.tiles(tf.TensorShape(shape))
    if tiles is not None:
        # A slice of a tiled kernel is one tile of t_D channels by t_F filters at c
        # collocated positions: the first slice is exactly that corner of x.
        cpos, t_d, t_f = tiles
        corner = tf.reshape(x, [-1, shape[2], shape[3]])[:cpos, :t_d, :t_f]
        np.testing.assert_array_equal(rows[0], tf.reshape(corner, [-1]))


def test_memory_is_a_small_multiple_of_resnet50_kernels():
    # Every conv kernel of ResNet-50 (counted from the architecture: the stem, then
    # per bottleneck 1x1, 3x3, 1x1, plus one projection per stage).
    c = GradiVeQ()
    shapes = [(7, 7, 3, 64)]
    for blocks, width, first in ((3, 64, 64), (4, 128, 256), (6, 256, 512), (3, 512, 1024)):
        for b in range(blocks):
            in_ch = first if b == 0 else 4 * width
            shapes += [(1, 1, in_ch, width), (3, 3, width, width), (1, 1, width, 4 * width)]
        shapes.append((1, 1, first, 4 * width))
    assert len(shapes) == 53
    model = sum(int(np.prod(s)) for s in shapes)
    state = sum(sum(int(np.prod(v.shape)) for v in c.init_state(tf.TensorShape(s), tf.float32)
                    .values()) for s in shapes)
    # Per layer: L_t = 100 samples of K entries, a K x d' basis and a K vector, K near
    # 768 (a K x K covariance instead would make it 1.3 x the model).
    assert state <= 0.5 * model, (state, model)
