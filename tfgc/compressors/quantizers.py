"""Quantizers: 1-bit SGD, signSGD, EF-signSGD's scaled sign, QSGD and TernGrad.

Each keeps every coordinate but sends it in a few bits. Their payloads carry
per-worker scales (column means, norms, maxima), so they are not summable: workers
all-gather them and decode each one.
"""

import functools
import math

import tensorflow as tf

from tfgc.compressors.base import Recompressible, as_columns, check_int, num_elements
from tfgc.ops import packing
from tfgc.ops import quantize
from tfgc.ops import rotation
from tfgc.ops import sign_bits


# A 1-bit row block carries 2 float32 per column (64 bits) next to 1 bit per
# element: with at least this many rows per worker its means cost at most 1/8.
_ROW_BLOCK_ROWS = 512


class OneBit(Recompressible):
    """1-bit SGD (Seide, Fu, Droppo, Li & Yu, Interspeech 2014).

    The gradient is viewed as a matrix whose columns are the last axis. Each element
    is sent as its sign bit (threshold 0); the receiver rebuilds column j from two
    values, the mean of the column's non-negative entries and the mean of its
    negative ones, which minimise the squared error of that partition. The
    quantization error is carried to the next step: the registry name ``"onebit"``
    builds ``ErrorFeedback(OneBit())``, since without it "training quickly diverges".

    Wire: 1 bit per element plus 2 float32 per column.
    """

    name = "onebit"
    summable = False
    requires_error_feedback = True

    def chunk_layout(self, shape, num_ranks):
        # A row block is contiguous (no copy to cut or join), but sends its own two
        # means per column: 64 N / rows of its bits. Tall matrices, where that is
        # at most 1/8, are cut into row blocks; the others into whole columns, which
        # keep their means and add nothing, at the price of strided copies.
        rows, cols = as_columns(shape)
        by_rows = rows >= _ROW_BLOCK_ROWS * num_ranks or cols < num_ranks
        return (rows, cols), (0 if by_rows else 1), 1

    def _quantize(self, v):
        """Returns the payload and v - decode(payload), which the kernel computes in passing."""
        rows, cols = as_columns(v.shape)
        words, pos, neg, residual = sign_bits.onebit_quantize(tf.reshape(v, [rows, cols]))
        return (words, pos, neg), tf.reshape(residual, v.shape)

    def compress(self, x, state, ctx):
        return self._quantize(x)[0], state

    def compress_and_decode(self, x, state, ctx):
        payload, residual = self._quantize(x)
        return payload, state, x - residual

    def compress_with_feedback(self, x, residual, state, ctx):
        payload, new_residual = self._quantize(x + residual)
        return payload, state, new_residual

    def decompress(self, payload, shape, dtype, ctx):
        words, pos, neg = payload
        rows, _ = as_columns(shape)
        return tf.reshape(sign_bits.onebit_dequantize(words, pos, neg, rows, dtype=dtype), shape)


class SignSGD(Recompressible):
    """signSGD with majority vote (Bernstein, Wang, Azizzadenesheli & Anandkumar, ICML 2018).

    Each worker sends sign(g) with sign(0) = 0; the aggregate is
    sign(sum_m sign(g_m)), the majority vote, so the optimizer steps by
    ``learning_rate * vote``. A tie (possible with an even number of workers, or
    when zero votes leave the rest balanced) gives 0, and so does a coordinate
    whose gradient is exactly 0 on every worker: dead units (say, weights of an
    input pixel that is always 0) stay where they are instead of drifting by a
    full step each iteration. Use a small learning rate: every other coordinate
    moves by the full step.

    Wire: 2 bits per element, as two bit-vectors of ``ceil(n / 32)`` int32 words
    each (``8 * ceil(n / 32)`` bytes per tensor). One bit cannot encode three
    values, so next to the sign bits (1 iff g >= 0) a second vector marks the
    entries that are nonzero; an entry decodes to 0 when its nonzero bit is clear.
    Zero is decided by ``g != 0`` as TensorFlow evaluates it, the same test as
    ``tf.sign``: -0.0 is zero, and on CPU so are subnormals (TensorFlow flushes
    them). NaN is nonzero with sign bit 0, so it votes -1 (the vote hides it).
    """

    name = "signsgd"
    summable = False
    combines_by_sum = False
    # On the reduce-scatter the owner counts the votes of its chunk and sends the
    # majority back: the same result as the all-gather, in 2(N-1)/N of the bytes.

    def compress(self, x, state, ctx):
        flat = tf.reshape(x, [-1])
        zero = tf.zeros([], flat.dtype)
        one = tf.ones([], flat.dtype)
        nonzero = tf.not_equal(flat, zero)
        # Both vectors go through the sign-bit op (bit = 1 iff input >= 0): the mask
        # as +1 / -1, the signs with every zero entry made +0. The compiled kernel
        # and the reference disagree on the sign bit of a negative subnormal, which
        # counts as zero here, so this keeps the payload identical in both and gives
        # each zero entry one code (sign bit 1, nonzero bit 0).
        signs = sign_bits.pack_sign_bits(tf.where(nonzero, flat, zero))
        mask = sign_bits.pack_sign_bits(tf.where(nonzero, one, -one))
        return (signs, mask), state

    def _decode(self, payload, n, dtype):
        sign_words, nonzero_words = payload
        signs = sign_bits.unpack_sign_bits(sign_words, n, dtype=dtype)
        nonzero = sign_bits.unpack_sign_bits(nonzero_words, n, dtype=dtype)
        return tf.where(nonzero > 0, signs, tf.zeros_like(signs))

    def decompress(self, payload, shape, dtype, ctx):
        return tf.reshape(self._decode(payload, num_elements(shape), dtype), shape)

    def aggregate(self, payloads, shape, dtype, ctx):
        # Votes are counted in float32 (exact up to 2**24 workers), whatever the
        # gradient dtype, and summed in rank order.
        n = num_elements(shape)
        votes = self._decode(payloads[0], n, tf.float32)
        for payload in payloads[1:]:
            votes = votes + self._decode(payload, n, tf.float32)
        return tf.reshape(tf.cast(tf.sign(votes), dtype), shape)


class ScaledSign(Recompressible):
    """The scaled-sign compressor of EF-signSGD (Karimireddy, Rebjock, Stich & Jaggi, ICML 2019).

    Sends delta = (||p||_1 / d) * sign(p): one float and 1 bit per element. The
    registry name ``"efsignsgd"`` builds ``ErrorFeedback(ScaledSign())``, i.e.
    p = g + e, e <- p - delta. Error feedback acts on the gradient before the
    learning rate, which for a constant learning rate equals the paper's p = lr*g + e.
    """

    name = "scaledsign"
    summable = False
    requires_error_feedback = True

    def compress(self, x, state, ctx):
        flat = tf.reshape(x, [-1])
        scale = tf.reduce_mean(tf.abs(tf.cast(flat, tf.float32)), keepdims=True)
        return (scale, sign_bits.pack_sign_bits(flat)), state

    def decompress(self, payload, shape, dtype, ctx):
        scale, words = payload
        signs = sign_bits.unpack_sign_bits(words, num_elements(shape), dtype=tf.float32)
        return tf.reshape(tf.cast(scale * signs, dtype), shape)


def _code_bits(num_codes: int) -> int:
    """Smallest field width from {2, 4, 8, 16} that holds ``num_codes`` codes."""
    for bits in (2, 4, 8, 16):
        if num_codes <= (1 << bits):
            return bits
    raise ValueError("too many quantization levels")


class QSGD(Recompressible):
    """QSGD (Alistarh, Grubic, Li, Tomioka & Vojnovic, NIPS 2017), bucketed.

    The flattened gradient is cut into buckets of ``bucket_size``; bucket v is sent as
    its norm and, per element, Q_s(v_i) = norm * sgn(v_i) * xi_i with
    l = floor(s |v_i| / norm) and xi_i = (l + 1) / s with probability
    s |v_i| / norm - l, else l / s. E[Q(v)] = v and
    E||Q(v) - v||^2 <= min(d/s^2, sqrt(d)/s) ||v||^2 with d = bucket_size.

    Args:
      levels: s, the number of non-zero levels per sign (1 to 32767). Default 127.
      bucket_size: d, elements per bucket. Default 512 (the paper's 8-bit setting).
      norm: "l2" (the paper's analysis) or "max" (its practical variant, lower
        variance, no sparsity guarantee).
      rotate: rotate each bucket by a randomized Hadamard transform first
        (``tfgc.ops.rotation``; Suresh et al., ICML 2017; THC, NSDI 2024), with signs
        drawn from ``seed`` and the step, the same on every worker. Needs
        ``norm="max"`` and a power-of-two ``bucket_size``. A rotated bucket's largest
        element is of the order of its norm times sqrt(2 ln(d) / d), so the levels are
        finer: E||Q(v) - v||^2 <= min over t in (0, 1) of
        (ln d - ln(1 - t) / 2) / (2 t s^2) ||v||^2 for every v (``rotated_bound``),
        0.068 for s = 7 and d = 128 against QSGD's 1.6. The rotated payload covers
        the gradient padded to whole blocks (``rotation.padded_length``).
      seed: base seed of the stochastic rounding (independent per worker and step).

    Wire: one float32 per bucket and ceil(log2(2s + 1)) bits per element, rounded up
    to 2, 4, 8 or 16 (s = 1: 2 bits; s = 7: 4 bits; s = 127: 8 bits), instead of the
    paper's Elias coding.
    """

    name = "qsgd"
    summable = False

    def __init__(self, levels: int = 127, bucket_size: int = 512, norm: str = "l2",
                 rotate: bool = False, seed: int = 0):
        self.levels = check_int("levels", levels, 1, 32767)
        self.bucket_size = check_int("bucket_size", bucket_size, 1)
        if norm not in ("l2", "max"):
            raise ValueError(f"`norm` must be 'l2' or 'max', got {norm!r}")
        self.norm = norm
        if not isinstance(rotate, bool):
            raise ValueError(f"`rotate` must be true or false, got {rotate!r}")
        if rotate:
            if norm != "max":
                # After a rotation every element is about the same size: the case
                # that makes the l2 norm's levels coarsest (QSGD's sqrt(d)/s bound).
                raise ValueError("`rotate=True` needs `norm='max'`: a rotation spreads "
                                 "a bucket evenly, which the l2-normed levels resolve worst")
            if not rotation.is_power_of_two(bucket_size) or bucket_size > rotation.MAX_BLOCK:
                raise ValueError("`bucket_size` must be a power of two up to "
                                 f"{rotation.MAX_BLOCK} with `rotate=True`, got {bucket_size!r}")
        self.rotate = rotate
        self.seed = check_int("seed", seed, 0)

    @property
    def bits(self) -> int:
        return _code_bits(2 * self.levels + 1)

    def chunk_unit(self, shape):
        return self.bucket_size

    def variance_bound(self, num_elements: int) -> float:
        """The bound on E||Q(g) - g||^2 / ||g||^2 for a gradient of ``num_elements``.

        Per bucket of d elements and levels spaced scale/s apart, stochastic rounding
        adds (scale/s)^2 p(1 - p) <= (scale/s)^2 / 4 per element, and also at most
        (scale/s) |v_i|, so the bucket's error is at most min(d scale^2 / (4 s^2),
        scale ||v||_1 / s). With scale = ||v|| (l2) the paper's min(d/s^2, sqrt(d)/s)
        holds (Lemma 3.1); with scale = max |v| <= ||v||, min(d/(4 s^2), sqrt(d)/s).
        Rotated, E[max_i y_i^2] for the rotated bucket y is bounded through the
        sub-Gaussian tail of a Rademacher sum (``rotated_bound``). d is no larger than
        the gradient (rotated: its length rounded up to a power of two).
        """
        d = self.bucket_size
        if self.rotate:
            d = min(d, rotation.padded_length(max(num_elements, 1), d))
        else:
            d = min(d, max(num_elements, 1))
        s = self.levels
        if self.norm == "l2":
            return min(d / s ** 2, math.sqrt(d) / s)
        bound = min(d / (4 * s ** 2), math.sqrt(d) / s)
        if self.rotate:
            bound = min(bound, rotated_bound(d, s))
        return bound

    def _signs(self, ctx):
        """The rotation's signs at this step: from ``seed`` and the step only, so every
        worker, tensor and chunk of the step rotates alike and payloads add up before
        the one inverse rotation (``aggregate``)."""
        def draw():
            seed = tf.constant([self.seed & 0x7FFFFFFF, 0x207A7E], tf.int64)
            seed = tf.random.experimental.stateless_fold_in(seed, tf.cast(ctx.step, tf.int64))
            return rotation.random_signs(seed, self.bucket_size)

        if tf.executing_eagerly() or not isinstance(ctx.step, tf.Tensor):
            return draw()
        # Traced: one draw per graph and step tensor serves every gradient of the step
        # (a traced step of many rotated gradients drew them again for each, encode and
        # decode). Drawn outside any control dependencies, so that a later bucket's
        # encoding does not wait on the ops around an earlier one's decoding.
        # Kept on the graph (a tf.function's), whose life they share.
        graph = tf.compat.v1.get_default_graph()
        drawn = getattr(graph, "_tfgc_rotation_signs", None)
        if drawn is None:
            try:
                graph._tfgc_rotation_signs = drawn = {}  # pylint: disable=protected-access
            except AttributeError:  # a graph that keeps no attributes: drawn each time
                return draw()
        key = (self.seed & 0x7FFFFFFF, self.bucket_size, ctx.step.ref())
        if key not in drawn:
            with tf.control_dependencies(None):
                drawn[key] = draw()
        return drawn[key]

    def _coded_elements(self, shape):
        n = num_elements(shape)
        return rotation.padded_length(n, self.bucket_size) if self.rotate else n

    def _restore(self, values, shape, dtype, ctx):
        """Decoded (summed) float32 values back in the gradient's frame."""
        if self.rotate:
            values = rotation.unrotate(values, self._signs(ctx), self.bucket_size,
                                       num_elements(shape))
        return tf.reshape(tf.cast(values, dtype), shape)

    def compress(self, x, state, ctx):
        x = tf.reshape(x, [-1])
        if self.rotate:
            x = rotation.rotate(x, self._signs(ctx), self.bucket_size)
        scales, words = quantize.quantize_bucketed(
            x, ctx.seed(self.seed, shared=False), levels=self.levels,
            bucket_size=self.bucket_size, bits=self.bits, norm=self.norm)
        return (scales, words), state

    def decompress(self, payload, shape, dtype, ctx):
        scales, words = payload
        values = quantize.dequantize_bucketed(
            scales, words, self._coded_elements(shape), levels=self.levels,
            bucket_size=self.bucket_size, bits=self.bits,
            dtype=tf.float32 if self.rotate else dtype)
        return self._restore(values, shape, dtype, ctx)

    def aggregate(self, payloads, shape, dtype, ctx):
        # Every worker's payload decoded and added in one pass (the fused kernel), in
        # float32 and rank order: bit for bit the default's sum for float32. Rotated
        # payloads share their rotation, so the sum is rotated back once.
        total = quantize.dequantize_bucketed_sum(
            tf.stack([p[0] for p in payloads]), tf.stack([p[1] for p in payloads]),
            self._coded_elements(shape), levels=self.levels, bucket_size=self.bucket_size,
            bits=self.bits)
        return self._restore(total, shape, dtype, ctx)


@functools.lru_cache(maxsize=None)
def rotated_bound(d: int, s: int) -> float:
    """A bound on E||Q(y) - y||^2 / ||v||^2 for a bucket v of d elements rotated to y
    (randomized Hadamard, random signs) and quantized with max-normed levels s.

    Each y_i is a sum of the bucket's elements with independent random signs, divided
    by sqrt(d): sub-Gaussian with variance proxy ||v||^2 / d (Hoeffding), so
    E exp(lam y_i^2) <= (1 - 2 lam ||v||^2 / d)^(-1/2), and by Jensen over the d
    coordinates, with t = 2 lam ||v||^2 / d in (0, 1),
    E max_i y_i^2 <= (2 ||v||^2 / (t d)) (ln d - ln(1 - t) / 2). The rounding adds at
    most d (max |y| / s)^2 / 4, hence (ln d - ln(1 - t) / 2) / (2 t s^2); minimised
    over t on a grid of 1/1000 (the same number on every machine).
    """
    log_d = math.log(d)
    return min((log_d - 0.5 * math.log(1 - t / 1000)) / (2 * (t / 1000) * s * s)
               for t in range(1, 1000))


class TernGrad(Recompressible):
    """TernGrad (Wen, Xu, Yan, Wu, Wang, Chen & Li, NIPS 2017).

    Per tensor: clip g to +-c*sigma (sigma its standard deviation, c = 2.5), let
    s = max|clip(g)|, and send s * sign(g) * b with b_k ~ Bernoulli(|g_k| / s):
    values in {-s, 0, s}, unbiased for clip(g).

    Args:
      clip: c, the clipping factor in standard deviations; 0 disables clipping.
      seed: base seed of the Bernoulli draws (independent per worker and step).

    Wire: 2 bits per element plus one float32 per tensor. On the all-gather each
    worker keeps its own scaler. On the reduce-scatter the workers first agree on
    the paper's shared scaler, the largest of theirs (``compress_scaled``), so a
    chunk's owner adds the ternary codes as integers and sends the exact sums back
    in ceil(log2(2N + 1)) bits, rounded up to 2, 4, 8 or 16 (``sum_codes``): the
    second stage loses nothing.
    """

    name = "terngrad"
    summable = False

    def __init__(self, clip: float = 2.5, seed: int = 0):
        if isinstance(clip, bool) or not isinstance(clip, (int, float)) or clip < 0 \
                or math.isinf(clip) or math.isnan(clip):
            raise ValueError(f"`clip` must be a finite number >= 0, got {clip!r}")
        self.clip = float(clip)
        self.seed = check_int("seed", seed, 0)

    @property
    def shared_scale(self):
        """This quantizer: it shares its scaler on the reduce-scatter
        (``protocols.SharedScale``)."""
        return self

    def clipped(self, x):
        """The flattened float32 gradient, clipped to +-c*sigma."""
        g = tf.cast(tf.reshape(x, [-1]), tf.float32)
        if self.clip > 0:
            bound = self.clip * tf.math.reduce_std(g)
            g = tf.clip_by_value(g, -bound, bound)
        return g

    def compress_scaled(self, g, scale, ctx):
        """Ternarizes the already clipped ``g`` against ``scale`` >= max |g|.

        Element i is sign(g_i) * scale with probability |g_i| / scale, else 0: the
        payload format of ``compress`` with the given scaler.
        """
        g = tf.cast(tf.reshape(g, [-1]), tf.float32)
        n = int(g.shape[0])
        p = tf.minimum(tf.math.divide_no_nan(tf.abs(g), scale), 1.0)
        u = tf.random.stateless_uniform([n], seed=ctx.seed(self.seed, shared=False))
        level = tf.cast(u < p, tf.int32)
        codes = tf.where(g < 0, -level, level) + 1
        return tf.reshape(tf.cast(scale, tf.float32), [1]), packing.pack_codes(codes, 2)

    @staticmethod
    def count_bits(num_workers: int) -> int:
        """Field width of a sum of ``num_workers`` ternary codes (2N + 1 values)."""
        return _code_bits(2 * num_workers + 1)

    def count_payload_words(self, shape, num_workers: int) -> int:
        """int32 words of ``sum_codes``'s payload for a chunk of ``shape``."""
        return 1 + packing.packed_words(num_elements(shape), self.count_bits(num_workers))

    def sum_codes(self, payloads, shape):
        """The exact sum of N ternary payloads made with one shared scaler.

        With a common scaler s the decoded values are s * t, t in {-1, 0, 1}, so
        the sum is s times an integer in [-N, N] (Wen et al.'s scaler sharing): it
        is sent as that integer, in ``count_bits(N)`` bits, next to s, and nothing
        is lost at the second stage. A code outside {0, 1, 2} fails with
        InvalidArgument.
        """
        n = num_elements(shape)
        workers = len(payloads)
        counts = None
        for _, words in payloads:
            codes = tf.cast(packing.unpack_codes(words, n, 2), tf.int32)
            check = tf.debugging.assert_less_equal(
                codes, 2, message="terngrad payload holds a code outside {0, 1, 2}")
            with tf.control_dependencies([check]):
                ternary = codes - 1
            counts = ternary if counts is None else counts + ternary
        return payloads[0][0], packing.pack_codes(counts + workers, self.count_bits(workers))

    def decode_counts(self, payload, shape, dtype, num_workers: int):
        """Decodes ``sum_codes``'s payload: s * count."""
        scale, words = payload
        n = num_elements(shape)
        codes = tf.cast(packing.unpack_codes(words, n, self.count_bits(num_workers)), tf.int32)
        check = tf.debugging.assert_less_equal(
            codes, 2 * num_workers, message="terngrad count payload holds a code above 2N")
        with tf.control_dependencies([check]):
            counts = tf.cast(codes - num_workers, tf.float32)
        return tf.reshape(tf.cast(counts * scale[0], dtype), shape)

    def compress(self, x, state, ctx):
        g = self.clipped(x)
        # TernGrad is QSGD with one level, the max norm and one bucket per tensor.
        scale, words = quantize.quantize_bucketed(
            g, ctx.seed(self.seed, shared=False), levels=1, bucket_size=max(1, int(g.shape[0])),
            bits=2, norm="max")
        return (scale, words), state

    def decompress(self, payload, shape, dtype, ctx):
        scale, words = payload
        n = num_elements(shape)
        values = quantize.dequantize_bucketed(scale, words, n, levels=1, bucket_size=max(1, n),
                                              bits=2, dtype=dtype)
        return tf.reshape(values, shape)
