"""FFT sparsification with range-based floats (Wang et al., HPDC 2020, arXiv 1811.08596).

A gradient is sparsified in the frequency domain: its real FFT is taken, the fraction
theta of coefficients with the smallest magnitudes is dropped, and the survivors are
quantized with a "range-based" float whose exponent field only spans the exponents
that occur in the message. The receiver rebuilds the spectrum and inverts the FFT.
The paper proves convergence with theta diminishing over training.

What tfgc chose where the paper's public text leaves room (the abstract and the
project's notes, not the full paper, were available):

* The FFT is per chunk: the flattened tensor is cut into chunks of ``chunk_size``
  entries (the last padded with zeros), each transformed on its own
  (``tf.signal.rfft``: L // 2 + 1 complex coefficients for L real entries); a tensor
  of at most ``chunk_size`` entries is one chunk of its own length, as a whole-tensor
  FFT. One FFT of ResNet-50's 2.4M-entry kernels cost more than the bytes it saved
  (3.4 s a step against stock's 0.83 s); chunks of 2^14 are fast power-of-two FFTs
  (the project's algorithm notes: "FFT(g) per tensor or chunk").
* K = ceil((1 - theta) M) coefficients are kept among the M of all chunks, the
  largest |c| (the top-k kernel of the sparsifiers picks them), each sent as an int32
  index and its real and imaginary parts as two ``bits``-bit codes.
* The range-based float: 1 sign bit, ``exponent_bits`` exponent bits and the rest
  mantissa. The message carries the largest exponent E_max among its values; the
  exponent field codes E_max - 2^e + 2 .. E_max (code 0 is zero), so the field's
  range follows the data instead of IEEE's fixed bias. Mantissas are rounded to
  nearest (half up) on the exact float32 bits; values below the range become 0.
  The relative error of a value inside the range is at most 2^-(m + 1).
* Diminishing theta: ``theta`` halves every ``decay_steps`` steps until it reaches
  ``final_theta``; each value is a stage with its own static payload size, chosen by
  the step counter every worker shares (as DGC's warm-up).
* The inverse FFT is linear, so the receiver adds the workers' spectra and inverts
  once. Error feedback is not part of the paper; ``"ef+fft"`` adds it.
"""

import math

import tensorflow as tf

from tfgc.compressors.base import Compressor, check_fraction, check_int, num_elements
from tfgc.ops import packing, sparsify

_MANTISSA_BITS_F32 = 23
# Exponents outside this range cannot come from float32 data.
_MIN_EXPONENT, _MAX_EXPONENT = -160, 128


def range_float_encode(x, bits, exponent_bits):
    """Codes of float32 ``x`` (1-D) as range-based floats: ``(uint32 codes, E_max)``."""
    mantissa = bits - 1 - exponent_bits
    raw = tf.bitcast(tf.cast(x, tf.float32), tf.int32)
    sign = tf.cast(raw < 0, tf.int32)
    biased = tf.bitwise.bitwise_and(tf.bitwise.right_shift(raw, _MANTISSA_BITS_F32), 0xFF)
    frac = tf.bitwise.bitwise_and(raw, (1 << _MANTISSA_BITS_F32) - 1)
    exponent = biased - 127
    nonzero = biased > 0  # subnormals and zeros code as 0
    top = tf.reduce_max(tf.where(nonzero, exponent, _MIN_EXPONENT))
    lowest = top - (2 ** exponent_bits - 2)
    # Round the mantissa to ``mantissa`` bits, half up; a carry moves to the next exponent.
    shift = _MANTISSA_BITS_F32 - mantissa
    q = tf.bitwise.right_shift(frac + (1 << (shift - 1)), shift)
    carry = q >= (1 << mantissa)
    exponent = tf.where(carry, exponent + 1, exponent)
    q = tf.where(carry, 0, q)
    # Above the range only by the carry of the largest: saturate at its largest code.
    over = exponent > top
    exponent = tf.where(over, top, exponent)
    q = tf.where(over, (1 << mantissa) - 1, q)
    code_e = exponent - lowest + 1
    keep = tf.logical_and(nonzero, code_e >= 1)
    code = tf.bitwise.bitwise_or(
        tf.bitwise.left_shift(sign, bits - 1),
        tf.bitwise.bitwise_or(tf.bitwise.left_shift(code_e, mantissa), q))
    return tf.cast(tf.where(keep, code, 0), tf.uint32), top


def range_float_decode(codes, top, bits, exponent_bits):
    """Float32 values of range-float ``codes`` (uint32) for a message whose largest
    exponent is ``top``."""
    mantissa = bits - 1 - exponent_bits
    codes = tf.cast(codes, tf.int32)
    sign = tf.bitwise.bitwise_and(tf.bitwise.right_shift(codes, bits - 1), 1)
    code_e = tf.bitwise.bitwise_and(tf.bitwise.right_shift(codes, mantissa),
                                    (1 << exponent_bits) - 1)
    q = tf.bitwise.bitwise_and(codes, (1 << mantissa) - 1)
    lowest = top - (2 ** exponent_bits - 2)
    exponent = tf.cast(code_e - 1 + lowest, tf.float32)
    magnitude = tf.pow(2.0, exponent) * (1.0 + tf.cast(q, tf.float32) / float(1 << mantissa))
    value = tf.where(sign > 0, -magnitude, magnitude)
    return tf.where(code_e > 0, value, 0.0)


class FFT(Compressor):
    """FFT sparsification with range-based floats (see the module docstring).

    Args:
      theta: fraction of the n // 2 + 1 frequency coefficients dropped, in [0, 1).
        Default 0.9.
      bits: bits per range-based float, 8 or 16. Default 8.
      exponent_bits: exponent bits of those floats, >= 1, leaving at least one
        mantissa bit. Default 3 (with 8 bits: 4 mantissa bits, a range of 64x below
        the message's largest value).
      decay_steps: with > 0, theta halves every ``decay_steps`` steps (diminishing
        theta) until it reaches ``final_theta``. Default 0: theta stays.
      final_theta: where the halving stops, in [0, theta]. Default 0.
      chunk_size: entries per FFT, >= 2; larger tensors are cut into chunks of this
        many entries. Default 16384 (2^14: power-of-two FFTs, fast on every backend).

    Wire per gradient: 32 bits per kept coefficient (its index) plus 2 ``bits``
    codes for its real and imaginary parts, and one word for the exponent range.
    """

    name = "fft"
    summable = False

    def __init__(self, theta: float = 0.9, bits: int = 8, exponent_bits: int = 3,
                 decay_steps: int = 0, final_theta: float = 0.0, chunk_size: int = 16384):
        self.theta = check_fraction("theta", theta)
        if isinstance(bits, bool) or bits not in (8, 16):
            raise ValueError(f"`bits` must be 8 or 16, got {bits!r}")
        self.bits = bits
        self.exponent_bits = check_int("exponent_bits", exponent_bits, 1, bits - 2)
        self.decay_steps = check_int("decay_steps", decay_steps, 0)
        self.final_theta = check_fraction("final_theta", final_theta)
        if self.final_theta > self.theta:
            raise ValueError(f"`final_theta` ({final_theta!r}) must not exceed `theta` "
                             f"({theta!r})")
        self.chunk_size = check_int("chunk_size", chunk_size, 2)

    def layout(self, shape):
        """(chunks, length): the flat gradient as ``chunks`` FFTs of ``length`` entries."""
        n = num_elements(shape)
        if n <= self.chunk_size:
            return 1, n
        return -(-n // self.chunk_size), self.chunk_size

    def num_coefficients(self, shape) -> int:
        chunks, length = self.layout(shape)
        return chunks * (length // 2 + 1)

    def num_kept(self, shape) -> int:
        m = self.num_coefficients(shape)
        return min(m, max(1, int(math.ceil((1.0 - self.theta) * m - 1e-9))))

    def stages(self):
        if not self.decay_steps or self.theta <= self.final_theta:
            return []
        config = dict(self.get_config(), decay_steps=0)
        thetas, t = [], self.theta
        while t > self.final_theta and t > 1e-6:
            thetas.append(t)
            t /= 2.0
        thetas.append(self.final_theta)
        return [(i * self.decay_steps, type(self)(**dict(config, theta=t)))
                for i, t in enumerate(thetas)]

    def compress(self, x, state, ctx):
        k = self.num_kept(x.shape)
        chunks, length = self.layout(x.shape)
        flat = tf.cast(tf.reshape(x, [-1]), tf.float32)
        flat = tf.pad(flat, [[0, chunks * length - num_elements(x.shape)]])
        spectrum = tf.reshape(tf.signal.rfft(tf.reshape(flat, [chunks, length])), [-1])
        # The k largest |c|: top-k of |c|^2 (the same order, no square root), with the
        # sparsifiers' exact kernel (ties to the lower index, indices ascending).
        power = tf.math.real(spectrum) ** 2 + tf.math.imag(spectrum) ** 2
        indices = tf.ensure_shape(sparsify.sparsify_with_residual(
            power, tf.zeros_like(power), k, exact=True).indices, [k])
        kept = tf.gather(spectrum, indices)
        parts = tf.reshape(tf.stack([tf.math.real(kept), tf.math.imag(kept)], axis=1), [-1])
        codes, top = range_float_encode(parts, self.bits, self.exponent_bits)
        return (indices, packing.pack_codes(codes, self.bits),
                tf.reshape(top, [1])), state

    def _spectrum(self, payload, shape):
        """The payload's sparse spectrum as a dense complex64 vector."""
        indices, words, top = payload
        k, m = self.num_kept(shape), self.num_coefficients(shape)
        top = tf.reshape(top, [])
        with tf.control_dependencies([tf.debugging.assert_greater_equal(
                top, _MIN_EXPONENT, message="range-float exponent out of range"),
                tf.debugging.assert_less_equal(
                    top, _MAX_EXPONENT, message="range-float exponent out of range")]):
            codes = packing.unpack_codes(words, 2 * k, self.bits)
            values = tf.reshape(range_float_decode(codes, top, self.bits, self.exponent_bits),
                                [k, 2])
        # The kernel checks every index against the spectrum's length.
        real = sparsify.scatter_add_payloads(values[:, 0], indices, m)
        imag = sparsify.scatter_add_payloads(values[:, 1], indices, m)
        return tf.complex(real, imag)

    def _inverse(self, spectrum, shape, dtype):
        chunks, length = self.layout(shape)
        frames = tf.signal.irfft(tf.reshape(spectrum, [chunks, length // 2 + 1]),
                                 fft_length=[length])
        flat = tf.reshape(frames, [-1])[:num_elements(shape)]
        return tf.reshape(tf.cast(flat, dtype), shape)

    def decompress(self, payload, shape, dtype, ctx):
        return self._inverse(self._spectrum(payload, shape), shape, dtype)

    def aggregate(self, payloads, shape, dtype, ctx):
        # The inverse FFT is linear: add the spectra (in rank order), invert once.
        total = self._spectrum(payloads[0], shape)
        for p in payloads[1:]:
            total = total + self._spectrum(p, shape)
        return self._inverse(total, shape, dtype)
