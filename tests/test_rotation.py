"""The randomized block Hadamard rotation (``tfgc.ops.rotation``) and QSGD with
``rotate=True``.

* the kernel and the reference agree bit for bit, on every block length and tail;
* the rotation is orthogonal: it keeps norms and sums, its inverse undoes it, and the
  unsigned transform is its own inverse;
* the signs depend on the seed alone, so every worker draws the same;
* bad blocks, signs and tails fail with InvalidArgumentError in both implementations;
* rotated QSGD is unbiased, stays within the bound the planner uses on adversarial
  gradients (where unrotated max-normed levels do not come close), sums payloads
  before one inverse rotation, and refuses settings it cannot honour.
"""

import numpy as np
import pytest
import tensorflow as tf

import tfgc
from tfgc.compressors import CompressContext
from tfgc.compressors.quantizers import rotated_bound
from tfgc.ops import rotation

IMPLEMENTATIONS = [rotation.block_hadamard, rotation.block_hadamard_reference]


def signs(block, seed=(3, 4)):
    return rotation.random_signs(tf.constant(seed, tf.int64), block)


def hadamard(m):
    h = np.ones((1, 1))
    while h.shape[0] < m:
        h = np.block([[h, h], [h, -h]])
    return h


def needs_kernel():
    if not tfgc.ops.custom_ops_available():
        pytest.skip("no op library (scripts/setup.sh builds it)")


@pytest.mark.parametrize("n, block", [(0, 8), (1, 8), (2, 1), (4096, 128), (1000, 128),
                                      (130, 128), (5 * 512 + 256, 512), (64, 64), (3, 4)])
@pytest.mark.parametrize("inverse", [False, True])
def test_the_kernel_and_the_reference_agree_bit_for_bit(n, block, inverse):
    needs_kernel()
    rng = np.random.default_rng(n)
    padded = rotation.padded_length(n, block)
    x = tf.constant(rng.standard_t(2, padded).astype(np.float32))
    s = signs(block)
    got = rotation.block_hadamard(x, s, block, inverse)
    want = rotation.block_hadamard_reference(x, s, block, inverse)
    np.testing.assert_array_equal(got.numpy(), want.numpy())


@pytest.mark.parametrize("block", [1, 2, 16, 128])
def test_each_block_is_the_signed_hadamard_matrix_over_its_root(block):
    rng = np.random.default_rng(block)
    n = 3 * block + (block // 2 or 0)
    x = rng.normal(size=rotation.padded_length(n, block)).astype(np.float32)
    s = signs(block).numpy()
    y = rotation.block_hadamard_reference(tf.constant(x), tf.constant(s), block).numpy()
    start = 0
    while start < x.size:
        m = min(block, x.size - start)
        want = hadamard(m) @ (s[:m] * x[start:start + m]) / np.sqrt(m)
        np.testing.assert_allclose(y[start:start + m], want, rtol=1e-5, atol=1e-5)
        start += m


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_the_unsigned_rotation_is_its_own_inverse(implementation):
    x = tf.constant(np.random.default_rng(0).normal(size=1024 + 64).astype(np.float32))
    ones = tf.ones([256])
    twice = implementation(implementation(x, ones, 256), ones, 256)
    np.testing.assert_allclose(twice.numpy(), x.numpy(), rtol=0, atol=1e-6)
    # The forward map with all signs +1 is its own inverse map too.
    np.testing.assert_array_equal(implementation(x, ones, 256, inverse=True).numpy(),
                                  implementation(x, ones, 256).numpy())


@pytest.mark.parametrize("n", [1, 127, 128, 1000, 1 << 16])
def test_rotation_keeps_norms_and_sums_and_comes_back(n):
    rng = np.random.default_rng(n)
    a = tf.constant(rng.normal(size=n).astype(np.float32))
    b = tf.constant(rng.normal(size=n).astype(np.float32))
    s = signs(128)
    ra, rb = rotation.rotate(a, s, 128), rotation.rotate(b, s, 128)
    assert ra.shape[0] == rotation.padded_length(n, 128)
    np.testing.assert_allclose(float(tf.norm(ra)), float(tf.norm(a)), rtol=1e-5)
    # Linear: the rotated sum is the sum of the rotations, so workers may add first.
    np.testing.assert_allclose(rotation.unrotate(ra + rb, s, 128, n).numpy(),
                               (a + b).numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(rotation.unrotate(ra, s, 128, n).numpy(), a.numpy(),
                               rtol=1e-5, atol=1e-6)


def test_padding_is_whole_blocks_and_a_power_of_two_tail():
    assert rotation.padded_length(0, 128) == 0
    assert rotation.padded_length(128, 128) == 128
    assert rotation.padded_length(129, 128) == 129
    assert rotation.padded_length(130, 128) == 130
    assert rotation.padded_length(131, 128) == 132
    assert rotation.padded_length(1000, 128) == 896 + 128
    assert rotation.padded_length(1000, 512) == 512 + 512
    assert rotation.padded_length(10, 512) == 16
    for n in range(1, 300):
        p = rotation.padded_length(n, 64)
        assert n <= p < n + max(n % 64, 1)


def test_the_signs_are_the_seeds_alone():
    a, b = signs(512, (1, 2)), signs(512, (1, 2))
    np.testing.assert_array_equal(a.numpy(), b.numpy())
    assert set(np.unique(a.numpy())) == {-1.0, 1.0}
    assert not np.array_equal(a.numpy(), signs(512, (1, 3)).numpy())
    # Balanced: 512 fair signs sum to within 5 standard deviations of 0.
    assert abs(float(tf.reduce_sum(a))) <= 5 * np.sqrt(512)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_bad_inputs_fail_with_invalid_argument(implementation):
    x = tf.zeros([128])
    cases = [
        (lambda: implementation(x, tf.ones([100]), 100), "block"),
        (lambda: implementation(x, tf.ones([64]), 128), "signs"),
        (lambda: implementation(tf.zeros([131]), tf.ones([128]), 128), "power-of-two"),
        (lambda: implementation(tf.zeros([2, 64]), tf.ones([128]), 128), "vector"),
        (lambda: implementation(x, tf.fill([128], 0.5), 128), "signs"),
    ]
    for call, message in cases:
        with pytest.raises(tf.errors.InvalidArgumentError, match=message):
            call()
    with pytest.raises(TypeError, match="float32"):
        implementation(tf.zeros([128], tf.float64), tf.ones([128], tf.float64), 128)


def test_a_bad_tail_fails_at_run_time_inside_a_function_too():
    @tf.function(input_signature=[tf.TensorSpec([None], tf.float32)])
    def run(x):
        return rotation.block_hadamard(x, tf.ones([8]), 8)

    needs_kernel()  # the reference needs static lengths
    assert run(tf.zeros([12])).shape == [12]
    with pytest.raises(tf.errors.InvalidArgumentError, match="power-of-two"):
        run(tf.zeros([11]))


# -- QSGD with rotate=True -------------------------------------------------------------

ROTATED = "qsgd:levels=7,bucket_size=128,norm=max,rotate=true"


def _round_trip(compressor, x, step, rank=0):
    ctx = CompressContext(rank=rank, num_workers=2, index=0, step=tf.constant(step, tf.int64))
    payload, _ = compressor.compress(x, {}, ctx)
    return payload, compressor.decompress(payload, x.shape, x.dtype, ctx)


def test_rotated_qsgd_is_unbiased():
    c = tfgc.get_compressor(ROTATED)
    rng = np.random.default_rng(1)
    x = tf.constant(rng.standard_t(2, size=(30, 11)).astype(np.float32))
    outs = np.stack([_round_trip(c, x, step)[1].numpy() for step in range(400)])
    # Per element, the mean of 400 draws within 5 standard errors of the input.
    mean, err = outs.mean(0), outs.std(0) / np.sqrt(len(outs))
    assert np.all(np.abs(mean - x.numpy()) <= 5 * err + 1e-6)


@pytest.mark.parametrize("kind", ["spike", "spikes", "equal", "heavy", "gauss"])
def test_rotated_levels_stay_within_their_bound_on_any_gradient(kind):
    rng = np.random.default_rng(2)
    n = 128 * 40
    if kind == "spike":
        v = np.zeros(n)
        v[5] = 1.0
    elif kind == "spikes":
        v = rng.normal(size=n) * 0.1
        v[::128] = 1.0
    elif kind == "equal":
        v = np.ones(n)
    elif kind == "heavy":
        v = rng.standard_t(1.5, size=n)
    else:
        v = rng.normal(size=n)
    x = tf.constant(v.astype(np.float32))
    rotated = tfgc.get_compressor(ROTATED)
    plain = tfgc.get_compressor("qsgd:levels=7,bucket_size=128,norm=max")
    errs = {}
    for name, c in (("rotated", rotated), ("plain", plain)):
        e = [float(tf.reduce_sum((_round_trip(c, x, s)[1] - x) ** 2) / tf.reduce_sum(x ** 2))
             for s in range(30)]
        errs[name] = np.mean(e)
    assert errs["rotated"] <= rotated.variance_bound(n) == pytest.approx(rotated_bound(128, 7))
    if kind in ("spikes", "heavy"):
        # A spike per bucket leaves the plain levels too coarse for the rest.
        assert errs["plain"] > 5 * errs["rotated"], errs


def test_the_bound_is_the_minimum_over_its_free_parameter():
    for d, s in ((128, 7), (512, 127), (2, 1)):
        b = rotated_bound(d, s)
        for t in (0.3, 0.6, 0.9, 0.99):
            assert b <= (np.log(d) - 0.5 * np.log(1 - t)) / (2 * t * s * s) + 1e-12
    # Larger buckets: a larger largest element relative to the norm, so a larger bound.
    assert rotated_bound(64, 7) < rotated_bound(128, 7) < rotated_bound(256, 7)


def test_rotated_payloads_add_before_one_inverse_rotation():
    c = tfgc.get_compressor(ROTATED)
    rng = np.random.default_rng(3)
    shape = tf.TensorShape([1000])
    xs = [tf.constant(rng.normal(size=1000).astype(np.float32)) for _ in range(3)]
    payloads, decoded = [], []
    for rank, x in enumerate(xs):
        p, d = _round_trip(c, x, step=7, rank=rank)
        payloads.append(p)
        decoded.append(d)
    ctx = CompressContext(rank=0, num_workers=3, index=5, step=tf.constant(7, tf.int64))
    total = c.aggregate(payloads, shape, tf.float32, ctx)
    np.testing.assert_allclose(total.numpy(), sum(decoded).numpy(), rtol=1e-5, atol=1e-5)
    # The payload covers the padded length: 7 whole buckets and a tail of 128.
    scales, words = payloads[0]
    assert scales.shape == [8] and words.shape == [1024 * 4 // 32]


def test_a_traced_step_draws_its_signs_once_for_every_gradient():
    # The signs depend on the seed and the step alone, so a traced step of many rotated
    # gradients draws them once (one uniform draw in the graph), and every gradient's
    # round trip is the one it makes alone, eagerly.
    c = tfgc.get_compressor(ROTATED)
    rng = np.random.default_rng(5)
    xs = [tf.constant(rng.normal(size=n).astype(np.float32)) for n in (1000, 300, 128)]
    step = tf.Variable(7, dtype=tf.int64)

    @tf.function
    def round_trips():
        now = step.read_value()
        outs = []
        for index, x in enumerate(xs):
            ctx = CompressContext(rank=1, num_workers=2, index=index, step=now)
            payload, _ = c.compress(x, {}, ctx)
            outs.append(c.aggregate([payload], x.shape, tf.float32, ctx))
        return outs

    graph = round_trips.get_concrete_function().graph
    draws = [op for op in graph.get_operations() if op.type.startswith("StatelessRandomUniform")]
    # One for the signs; QSGD's stochastic rounding draws once per gradient besides
    # (the custom kernel draws inside itself: no op of its own).
    assert len([op for op in draws if op.outputs[0].shape == [128]]) == 1, draws
    for index, (x, out) in enumerate(zip(xs, round_trips())):
        ctx = CompressContext(rank=1, num_workers=2, index=index,
                              step=tf.constant(7, tf.int64))
        payload, _ = c.compress(x, {}, ctx)
        alone = c.aggregate([payload], x.shape, tf.float32, ctx)
        np.testing.assert_array_equal(out.numpy(), alone.numpy())


@pytest.mark.parametrize("dtype", [tf.float16, tf.bfloat16])
def test_rotated_qsgd_returns_the_gradients_dtype(dtype):
    c = tfgc.get_compressor(ROTATED)
    x = tf.cast(tf.random.stateless_normal([40, 9], seed=[1, 2]), dtype)
    _, out = _round_trip(c, x, 0)
    assert out.dtype == dtype and out.shape == x.shape
    rel = float(tf.norm(tf.cast(out - x, tf.float32)) / tf.norm(tf.cast(x, tf.float32)))
    assert rel <= 3 * np.sqrt(rotated_bound(128, 7))


@pytest.mark.parametrize("spec, argument", [
    ("qsgd:rotate=true", "norm"),  # l2 norm
    ("qsgd:norm=max,rotate=true,bucket_size=100", "bucket_size"),
    ("qsgd:norm=max,rotate=1", "rotate"),
])
def test_settings_rotation_cannot_honour_fail_at_construction(spec, argument):
    with pytest.raises(ValueError, match=f"`{argument}"):
        tfgc.get_compressor(spec)


def test_the_cuda_harness_oracle_restates_the_cpu_kernel():
    # The GPU kernel is checked against the harness's NumPy oracle on a GPU machine
    # (custom_ops/cuda_harness); here the same check runs against the CPU op, so an
    # oracle that drifted from the CPU kernel's bits fails on every machine.
    needs_kernel()
    import importlib.util
    import os
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        "custom_ops", "cuda_harness", "harness.py")
    spec = importlib.util.spec_from_file_location("tfgc_cuda_harness", path)
    harness = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(harness)
    backend = harness.TfBackend()
    assert harness.check_block_hadamard(backend, "float32", np.random.default_rng(3)) is None
    # And the oracle tells a wrong rotation apart: signs applied after, not before.
    x = np.arange(1, 9, dtype=np.float32)
    signs = np.float32([1, -1, 1, 1, -1, 1, 1, 1])
    assert not np.array_equal(harness.np_block_hadamard(x, signs, 8, False),
                              harness.np_block_hadamard(x, signs, 8, True))
