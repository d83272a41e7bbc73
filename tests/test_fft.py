"""FFT sparsification with range-based floats, against a NumPy model.

The model mirrors the range-based float on the exact float32 bits, so codes and
decoded values compare exactly; the spectrum is TensorFlow's own (its FFT and
NumPy's differ in the last bits, and a kept set could then differ at a near-tie).
The multi-worker path is checked on real clusters with the threshold sparsifiers'
fixed gradients (``tests/test_distributed.py``).
"""

import math

import numpy as np
import pytest
import tensorflow as tf

import tfgc
from tfgc.compressors import FFT, CompressContext
from tfgc.compressors.fft import range_float_decode, range_float_encode


def range_float_numpy(x, bits, exponent_bits):
    """(codes, top, decoded) of float32 ``x`` as range-based floats."""
    m = bits - 1 - exponent_bits
    raw = np.asarray(x, np.float32).view(np.int32).astype(np.int64)
    sign = (raw < 0).astype(np.int64)
    biased = (raw >> 23) & 0xFF
    frac = raw & ((1 << 23) - 1)
    nonzero = biased > 0
    exponent = biased - 127
    top = int(exponent[nonzero].max()) if nonzero.any() else -160
    lowest = top - (2 ** exponent_bits - 2)
    q = (frac + (1 << (22 - m))) >> (23 - m)
    carry = q >= (1 << m)
    exponent = np.where(carry, exponent + 1, exponent)
    q = np.where(carry, 0, q)
    over = exponent > top
    exponent = np.where(over, top, exponent)
    q = np.where(over, (1 << m) - 1, q)
    code_e = exponent - lowest + 1
    keep = nonzero & (code_e >= 1)
    codes = np.where(keep, (sign << (bits - 1)) | (code_e << m) | q, 0)
    magnitude = np.where(keep, 2.0 ** (code_e - 1 + lowest) * (1 + q / (1 << m)), 0.0)
    return codes, top, np.where(sign > 0, -magnitude, magnitude).astype(np.float32)


def fft_numpy(x, theta, bits=8, exponent_bits=3, chunk_size=16384):
    """Decoded output of one worker's payload for float32 ``x``."""
    flat = np.asarray(x, np.float32).reshape(-1)
    n = flat.size
    length = n if n <= chunk_size else chunk_size
    chunks = -(-n // length)
    frames = np.pad(flat, (0, chunks * length - n)).reshape(chunks, length)
    spectrum = tf.signal.rfft(tf.constant(frames)).numpy().reshape(-1)
    m = chunks * (length // 2 + 1)
    k = min(m, max(1, math.ceil((1 - theta) * m - 1e-9)))
    power = spectrum.real.astype(np.float32) ** 2 + spectrum.imag.astype(np.float32) ** 2
    kept = np.sort(np.argsort(-power, kind="stable")[:k])
    parts = np.stack([spectrum.real[kept], spectrum.imag[kept]], axis=1).reshape(-1)
    _, _, decoded = range_float_numpy(parts, bits, exponent_bits)
    rebuilt = np.zeros(m, np.complex128)
    rebuilt[kept] = decoded[0::2] + 1j * decoded[1::2]
    frames = np.fft.irfft(rebuilt.reshape(chunks, length // 2 + 1), length)
    return frames.reshape(-1)[:n].reshape(np.shape(x)).astype(np.float32)


def ef_fft_numpy(v):
    """Error feedback around fft (the cluster check's model): (decoded, residual)."""
    decoded = fft_numpy(v, 0.9)
    return decoded, v - decoded


@pytest.mark.parametrize("bits,exponent_bits", [(8, 3), (8, 2), (16, 5)])
def test_range_float_codes_match_numpy_bit_for_bit(bits, exponent_bits):
    rng = np.random.default_rng(bits + exponent_bits)
    x = (rng.standard_normal(2000) * 10.0 ** rng.uniform(-4, 1, 2000)).astype(np.float32)
    x[:5] = [0.0, -0.0, 1.9999, -1.99999, 3.0e-30]  # zeros, carries, far below the range
    codes, top = range_float_encode(tf.constant(x), bits, exponent_bits)
    want_codes, want_top, want = range_float_numpy(x, bits, exponent_bits)
    assert int(top) == want_top
    np.testing.assert_array_equal(codes.numpy().astype(np.int64), want_codes)
    np.testing.assert_array_equal(
        range_float_decode(codes, top, bits, exponent_bits).numpy(), want)


@pytest.mark.parametrize("bits,exponent_bits", [(8, 3), (16, 5)])
def test_range_float_error_inside_the_range(bits, exponent_bits):
    m = bits - 1 - exponent_bits
    rng = np.random.default_rng(0)
    x = rng.uniform(1.0, 8.0, 1000).astype(np.float32) * rng.choice([-1, 1], 1000)
    codes, top = range_float_encode(tf.constant(x), bits, exponent_bits)
    got = range_float_decode(codes, top, bits, exponent_bits).numpy()
    assert np.all(np.abs(got - x) <= np.abs(x) * 2.0 ** -(m + 1) + 1e-7)
    assert np.all(np.sign(got) == np.sign(x))
    # The exponent field spans the message's own range: values 2^(2^e - 2) times
    # below the largest still decode.
    small = np.array([100.0, 100.0 * 2.0 ** -(2 ** exponent_bits - 2)], np.float32)
    codes, top = range_float_encode(tf.constant(small), bits, exponent_bits)
    assert np.all(range_float_decode(codes, top, bits, exponent_bits).numpy() > 0)


@pytest.mark.parametrize("shape,theta", [((40, 30), 0.9), ((1001,), 0.5), ((7, 11, 13), 0.99)])
def test_compress_matches_numpy_model(shape, theta):
    c = FFT(theta=theta)
    x = tf.random.stateless_normal(shape, seed=[len(shape), 7])
    # A smooth signal plus noise: most energy in a few coefficients, as gradients.
    x = x + tf.reshape(tf.sin(tf.linspace(0.0, 20.0, int(np.prod(shape)))), shape) * 3.0
    payload, _ = c.compress(x, {}, CompressContext())
    got = c.decompress(payload, x.shape, tf.float32, CompressContext()).numpy()
    np.testing.assert_allclose(got, fft_numpy(x.numpy(), theta), rtol=1e-4, atol=1e-5)
    k = c.num_kept(x.shape)
    assert [t.shape.as_list() for t in payload] == [[k], [math.ceil(2 * k * 8 / 32)], [1]]


@pytest.mark.parametrize("shape,chunk_size", [((40, 30), 256), ((1001,), 1000), ((64, 64), 1024)])
def test_chunks_match_numpy_model(shape, chunk_size):
    # Larger tensors are cut into chunks of chunk_size entries (the last zero-padded),
    # one FFT each; the kept coefficients are the largest among all chunks'.
    c = FFT(theta=0.9, chunk_size=chunk_size)
    x = tf.random.stateless_normal(shape, seed=[3, len(shape)])
    x = x + tf.reshape(tf.sin(tf.linspace(0.0, 50.0, int(np.prod(shape)))), shape) * 3.0
    chunks, length = c.layout(x.shape)
    assert length == chunk_size and chunks == math.ceil(np.prod(shape) / chunk_size)
    assert c.num_coefficients(x.shape) == chunks * (chunk_size // 2 + 1)
    payload, _ = c.compress(x, {}, CompressContext())
    got = c.decompress(payload, x.shape, tf.float32, CompressContext()).numpy()
    np.testing.assert_allclose(got, fft_numpy(x.numpy(), 0.9, chunk_size=chunk_size),
                               rtol=1e-4, atol=1e-5)
    # Nothing dropped, 16 bits: every chunk comes back, the padding cut off.
    exact = FFT(theta=0.0, bits=16, exponent_bits=5, chunk_size=chunk_size)
    payload, _ = exact.compress(x, {}, CompressContext())
    back = exact.decompress(payload, x.shape, tf.float32, CompressContext()).numpy()
    assert np.linalg.norm(back - x.numpy()) / np.linalg.norm(x.numpy()) < 2e-3


def test_no_dropping_at_16_bits_is_nearly_exact():
    c = FFT(theta=0.0, bits=16, exponent_bits=5)
    x = tf.random.stateless_normal([64, 50], seed=[1, 1])
    payload, _ = c.compress(x, {}, CompressContext())
    got = c.decompress(payload, x.shape, tf.float32, CompressContext()).numpy()
    assert np.linalg.norm(got - x.numpy()) / np.linalg.norm(x.numpy()) < 2e-3


def test_aggregate_adds_spectra_then_inverts_once():
    c = FFT(theta=0.8)
    xs = [tf.random.stateless_normal([30, 20], seed=[r, 3]) for r in range(3)]
    payloads = [c.compress(x, {}, CompressContext(rank=r))[0] for r, x in enumerate(xs)]
    total = c.aggregate(payloads, xs[0].shape, tf.float32, CompressContext()).numpy()
    separate = sum(c.decompress(p, xs[0].shape, tf.float32, CompressContext()).numpy()
                   for p in payloads)
    np.testing.assert_allclose(total, separate, atol=1e-5)


def test_error_feedback_conserves_mass():
    c = tfgc.get_compressor("ef+fft:theta=0.95")
    shape = tf.TensorShape([20, 30])
    state = c.init_state(shape, tf.float32)
    rng = np.random.default_rng(4)
    total, sent = np.zeros(shape), np.zeros(shape)
    for step in range(5):
        g = rng.normal(size=shape).astype(np.float32)
        payload, state = c.compress(tf.constant(g), state, CompressContext(step=step))
        sent += c.decompress(payload, shape, tf.float32, CompressContext()).numpy()
        total += g
    np.testing.assert_allclose(sent + state["residual"].numpy(), total, atol=1e-4)


def test_diminishing_theta_halves_by_stage():
    c = FFT(theta=0.8, decay_steps=50, final_theta=0.15)
    stages = c.stages()
    assert [s for s, _ in stages] == [0, 50, 100, 150]
    assert [st.theta for _, st in stages] == [0.8, 0.4, 0.2, 0.15]
    shape = tf.TensorShape([100, 100])
    kept = [st.num_kept(shape) for _, st in stages]
    assert kept == sorted(kept) and kept[0] < kept[-1]
    assert FFT(theta=0.8).stages() == []


def test_malformed_payloads_fail_with_invalid_argument():
    c = FFT(theta=0.9)
    shape = tf.TensorShape([20, 20])
    indices, words, top = c.compress(tf.ones(shape), {}, CompressContext())[0]
    bad = indices.numpy().copy()
    bad[0] = 10**6
    with pytest.raises(tf.errors.InvalidArgumentError):
        c.decompress((tf.constant(bad), words, top), shape, tf.float32, None)
    with pytest.raises(tf.errors.InvalidArgumentError):
        c.decompress((indices, words, tf.constant([10**6], tf.int32)), shape, tf.float32, None)
    with pytest.raises(tf.errors.InvalidArgumentError):
        c.decompress((indices, words[:-1], top), shape, tf.float32, None)


@pytest.mark.parametrize("spec,arg", [
    ("fft:theta=1.0", "theta"), ("fft:theta=-0.5", "theta"), ("fft:bits=4", "bits"),
    ("fft:bits=32", "bits"), ("fft:exponent_bits=0", "exponent_bits"),
    ("fft:exponent_bits=7", "exponent_bits"), ("fft:decay_steps=-1", "decay_steps"),
    ("fft:theta=0.5,final_theta=0.6", "final_theta"), ("fft:chunk_size=1", "chunk_size"),
])
def test_bad_hyperparameters_name_the_argument(spec, arg):
    with pytest.raises(ValueError, match=arg):
        tfgc.get_compressor(spec)


def test_registry_round_trip():
    c = tfgc.get_compressor("fft:theta=0.8,bits=16,exponent_bits=4")
    assert isinstance(c, FFT) and not c.summable
    assert tfgc.get_compressor(tfgc.compressors.serialize(c)) == c
