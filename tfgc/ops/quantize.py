"""Stochastic bucketed quantization (QSGD, TernGrad) with b-bit code packing.

Each public function runs the compiled kernel from ``_tfgc_ops.so`` when it is
available (see ``tfgc.ops._loader``) and otherwise its ``*_reference`` twin in
plain TensorFlow. Both draw the same uniforms, so they agree bit for bit on
scales, codes and decoded values (up to the last-bit rounding of float64 l2
sums taken in a different order, which in practice never reaches float32).

Quantizer (QSGD, Alistarh, Grubic, Li, Tomioka & Vojnovic, NIPS 2017). The
input is flattened and cut into ``max(1, ceil(n / d))`` buckets of ``d =
bucket_size`` consecutive elements (the last one partial). Bucket ``b`` is
sent as ``scale_b`` = its l2 norm (``norm="l2"``, summed in float64 and
rounded to float32) or its max ``|v|`` (``norm="max"``), and each element as
a signed level ``q`` in ``[-s, s]`` (``s = levels``)::

    a     = min(s * |v| / scale_b, s)          (float32; 0 when scale_b == 0)
    l     = floor(a)
    level = l + 1 if u < a - l else l          (u ~ U[0, 1), so E[level] = a)
    q     = sign(v) * level

so ``E[q * scale_b / s] = v``, with per-element variance
``(scale_b / s)^2 p (1 - p)``, ``p = a - l``. An integral ``a`` (including
``v = 0``) is sent exactly. TernGrad (Wen et al., NIPS 2017) is ``s = 1``,
``norm="max"`` and a single bucket (``bucket_size >= n``); its 2.5-sigma
clipping is done by the caller.

Wire format (that of ``tfgc.compressors.quantizers.QSGD`` and of
``tfgc.ops.packing.pack_codes``): ``scales`` float32 ``[num_buckets]``, and the
codes ``q + s`` packed ``bits`` bits each (2, 4, 8 or 16, enough for the
``2s + 1`` codes), least significant field first, ``32 // bits`` per int32
word, ``ceil(n * bits / 32)`` words, padding fields zero.

Randomness. Element ``i`` uses ``tf.random.stateless_uniform([N], seed)[i]``
(Philox-4x32-10; counter ``i // 4``, output ``i % 4``), so the result depends
only on ``(x, seed)``: never on the thread count, and a tensor's prefix is
quantized the same way whatever follows it (for the same buckets).

Non-finite inputs. A NaN in a bucket makes its scale NaN; an infinity (or an
l2 norm overflowing float32) makes it +inf. Every element of a bucket with a
non-finite scale gets level 0 (code ``s``), so codes are always in range, and
decodes as ``0 * scale = NaN``: the receiver sees the whole bucket as NaN.
As in every TensorFlow CPU kernel, subnormal float32 values are flushed to 0
in the arithmetic.

``dequantize_bucketed_sum`` decodes N workers' payloads (stacked as
``[N, ...]``) and adds them in worker order in float32, bit-identical to N
``dequantize_bucketed`` calls added one by one, in a single pass.

Payload validation (``dequantize_bucketed*``): the payload may come from
another worker, so sizes are checked (``scales`` must have exactly
``max(1, ceil(n / d))`` entries and ``words`` exactly ``ceil(n * bits / 32)``,
``n >= 0``) and every used code must be ``<= 2s`` (padding fields are
ignored); any violation raises ``tf.errors.InvalidArgumentError`` in both
implementations, eagerly or at run time inside ``tf.function``.
"""

import collections

import numpy as np
import tensorflow as tf

from tfgc.ops import _loader
from tfgc.ops._validation import Checks, float_dtype, float_input, int64_scalar, invalid, typed_tensor

MAX_LEVELS = 32767
_VALID_BITS = (2, 4, 8, 16)

Quantized = collections.namedtuple("Quantized", ["scales", "words"])

for _op_type in ("TfgcQuantizeBucketed", "TfgcDequantizeBucketed", "TfgcDequantizeBucketedSum"):
    try:
        tf.no_gradient(_op_type)
    except KeyError:  # already registered, e.g. on module reload
        pass


def _check_attrs(levels, bucket_size, bits, norm=None):
    """Static configuration; a bad value raises InvalidArgumentError (as the kernels do)."""
    def _int(value, name):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            invalid(f"{name} must be an int, got {value!r}")
        return int(value)

    levels = _int(levels, "levels")
    bucket_size = _int(bucket_size, "bucket_size")
    bits = _int(bits, "bits")
    if not 1 <= levels <= MAX_LEVELS:
        invalid(f"levels must be in [1, {MAX_LEVELS}], got {levels}")
    if bucket_size < 1:
        invalid(f"bucket_size must be >= 1, got {bucket_size}")
    if bits not in _VALID_BITS:
        invalid(f"bits must be 2, 4, 8 or 16, got {bits}")
    if 2 * levels + 1 > (1 << bits):
        invalid(f"{bits}-bit fields cannot hold the {2 * levels + 1} codes of levels={levels}")
    if norm is not None and norm not in ("l2", "max"):
        invalid(f"norm must be 'l2' or 'max', got {norm!r}")
    return levels, bucket_size, bits


def _seed_tensor(seed):
    try:
        t = tf.convert_to_tensor(seed) if tf.is_tensor(seed) or isinstance(seed, (np.ndarray, np.generic)) \
            else tf.convert_to_tensor(seed, dtype_hint=tf.int64)
    except (TypeError, ValueError, OverflowError) as exc:
        invalid(f"seed must be an int64 tensor of shape [2]: {exc}")
    if t.dtype not in (tf.int32, tf.int64):
        invalid(f"seed must be an integer tensor, got {t.dtype.name}")
    if t.shape.rank is not None and t.shape != [2] and t.shape.is_fully_defined():
        invalid(f"seed must have shape [2], got {t.shape}")
    return tf.cast(t, tf.int64)


def _num_buckets(n, d):
    """max(1, ceil(n / d)) for an int64 tensor n >= 0."""
    return tf.maximum(n // d + tf.cast(n % d > 0, tf.int64), 1)


def _num_code_words(n, bits):
    per_word = 32 // bits
    return n // per_word + tf.cast(n % per_word > 0, tf.int64)


def _divide_by_levels(scales, levels):
    """scales / s, rounded once, also in graph mode.

    Grappler rewrites a division by a constant into a multiplication by its
    rounded reciprocal, which can change the last bit; a denominator that is
    not a compile-time constant keeps the true division the kernels do.
    """
    return scales / tf.fill(tf.shape(scales), tf.constant(float(levels), tf.float32))


# ---------------------------------------------------------------------------
# Pure-TensorFlow references.

def quantize_bucketed_reference(x, seed, *, levels, bucket_size, bits, norm="l2"):
    """Reference for :func:`quantize_bucketed`."""
    levels, d, bits = _check_attrs(levels, bucket_size, bits, norm)
    x = float_input(x)
    seed = _seed_tensor(seed)
    checks = Checks()
    checks.require_rank(seed, 1, "seed")
    checks.require(tf.equal(tf.size(seed), 2), "seed must have shape [2]")
    with tf.control_dependencies(checks.asserts):
        v = tf.reshape(tf.cast(x, tf.float32), [-1])
        n = tf.size(v, out_type=tf.int64)
        nb = _num_buckets(n, d)
        # A bucket larger than the tensor is the tensor: never pad up to d.
        d_eff = tf.minimum(tf.constant(d, tf.int64), tf.maximum(n, 1))
        padded = tf.pad(v, tf.reshape(tf.stack([tf.zeros([], tf.int64), nb * d_eff - n]), [1, 2]))
        buckets = tf.reshape(padded, tf.stack([nb, d_eff]))
        if norm == "l2":
            sq = tf.square(tf.cast(buckets, tf.float64))  # exact for float32 inputs
            scales = tf.cast(tf.sqrt(tf.reduce_sum(sq, axis=1)), tf.float32)
        else:
            scales = tf.reduce_max(tf.abs(buckets), axis=1)
            # Pin NaN propagation regardless of how reduce_max treats NaN.
            has_nan = tf.reduce_any(tf.math.is_nan(buckets), axis=1)
            scales = tf.where(has_nan, tf.constant(np.nan, tf.float32), scales)
        s = tf.constant(float(levels), tf.float32)
        a = tf.math.divide_no_nan(s * tf.abs(buckets), scales[:, None])
        a = tf.minimum(tf.where(tf.math.is_nan(a), tf.zeros_like(a), a), s)
        u = tf.random.stateless_uniform(tf.reshape(nb * d_eff, [1]), seed=seed, dtype=tf.float32)
        u = tf.reshape(u, tf.shape(buckets))
        low = tf.floor(a)
        level = low + tf.cast(u < a - low, tf.float32)
        signed = tf.where(buckets < 0, -level, level)
        codes = tf.cast(tf.reshape(signed, [-1])[:n], tf.int32) + levels
        words = _pack_codes(codes, n, bits)
    return Quantized(scales, words)


def _pack_codes(codes, n, bits):
    """tfgc.ops.packing.pack_codes for a dynamically sized code vector."""
    per_word = 32 // bits
    nw = _num_code_words(n, bits)
    codes = tf.cast(codes, tf.uint32)
    codes = tf.pad(codes, tf.reshape(tf.stack([tf.zeros([], tf.int64), nw * per_word - n]), [1, 2]))
    codes = tf.reshape(codes, tf.stack([nw, tf.constant(per_word, tf.int64)]))
    shifts = tf.constant([bits * j for j in range(per_word)], dtype=tf.uint32)
    packed = tf.reduce_sum(tf.bitwise.left_shift(codes, shifts), axis=1)  # disjoint fields
    return tf.bitcast(packed, tf.int32)


def _unpack_codes(words, n, bits):
    """Inverse of :func:`_pack_codes` along the last axis: int32 codes ``[..., n]``."""
    per_word = 32 // bits
    shifts = tf.constant([bits * j for j in range(per_word)], dtype=tf.uint32)
    fields = tf.bitwise.bitwise_and(
        tf.bitwise.right_shift(tf.bitcast(words, tf.uint32)[..., None], shifts),
        tf.constant((1 << bits) - 1, tf.uint32))
    flat = tf.reshape(fields, tf.concat([tf.shape(words)[:-1], [-1]], axis=0))
    return tf.cast(flat[..., :n], tf.int32)


def dequantize_bucketed_reference(scales, words, num_elements, *, levels, bucket_size, bits,
                                  dtype=tf.float32):
    """Reference for :func:`dequantize_bucketed`."""
    levels, d, bits = _check_attrs(levels, bucket_size, bits)
    dtype = float_dtype(dtype)
    scales = typed_tensor(scales, tf.float32, "scales")
    words = typed_tensor(words, tf.int32, "words")
    n = int64_scalar(num_elements, "num_elements")
    checks = Checks()
    checks.require_rank(scales, 1, "scales")
    checks.require_rank(words, 1, "words")
    checks.require_rank(n, 0, "num_elements")
    checks.require(n >= 0, "num_elements must be >= 0")
    n_safe = tf.maximum(n, 0)
    nb = _num_buckets(n_safe, d)
    checks.require(tf.equal(tf.size(scales, out_type=tf.int64), nb),
                   "scales must have exactly max(1, ceil(num_elements / bucket_size)) entries")
    checks.require(tf.equal(tf.size(words, out_type=tf.int64), _num_code_words(n_safe, bits)),
                   "words must have exactly ceil(num_elements * bits / 32) entries")
    with tf.control_dependencies(checks.asserts):
        codes = _unpack_codes(words, n, bits)
        checks2 = Checks()
        checks2.require(tf.reduce_all(codes <= 2 * levels), f"words holds a code above 2 * levels = {2 * levels}")
    with tf.control_dependencies(checks2.asserts):
        factor = _divide_by_levels(scales, levels)
        q = tf.cast(codes - levels, tf.float32)
        d_eff = tf.minimum(tf.constant(d, tf.int64), tf.maximum(n, 1))
        padded = tf.pad(q, tf.reshape(tf.stack([tf.zeros([], tf.int64), nb * d_eff - n]), [1, 2]))
        values = tf.reshape(padded, tf.stack([nb, d_eff])) * factor[:, None]
        return tf.cast(tf.reshape(values, [-1])[:n], dtype)


def dequantize_bucketed_sum_reference(scales, words, num_elements, *, levels, bucket_size, bits):
    """Reference for :func:`dequantize_bucketed_sum`."""
    levels, d, bits = _check_attrs(levels, bucket_size, bits)
    scales = typed_tensor(scales, tf.float32, "scales")
    words = typed_tensor(words, tf.int32, "words")
    n = int64_scalar(num_elements, "num_elements")
    checks = Checks()
    checks.require_rank(scales, 2, "scales")
    checks.require_rank(words, 2, "words")
    checks.require_rank(n, 0, "num_elements")
    checks.require(n >= 0, "num_elements must be >= 0")
    with tf.control_dependencies(checks.asserts):
        n_safe = tf.maximum(n, 0)
        nb = _num_buckets(n_safe, d)
        checks2 = Checks()
        checks2.require(tf.equal(tf.shape(scales, out_type=tf.int64)[0], tf.shape(words, out_type=tf.int64)[0]),
                        "scales and words must have the same number of workers")
        checks2.require(tf.equal(tf.shape(scales, out_type=tf.int64)[1], nb),
                        "scales must have max(1, ceil(num_elements / bucket_size)) columns")
        checks2.require(tf.equal(tf.shape(words, out_type=tf.int64)[1], _num_code_words(n_safe, bits)),
                        "words must have ceil(num_elements * bits / 32) columns")
    with tf.control_dependencies(checks2.asserts):
        codes = _unpack_codes(words, n, bits)
        checks3 = Checks()
        checks3.require(tf.reduce_all(codes <= 2 * levels), f"words holds a code above 2 * levels = {2 * levels}")
    with tf.control_dependencies(checks3.asserts):
        factor = _divide_by_levels(scales, levels)
        per_element = tf.gather(factor, tf.range(n) // d, axis=1)
        values = tf.cast(codes - levels, tf.float32) * per_element
        # Strictly sequential, worker by worker, as the kernel adds them.
        return tf.foldl(lambda acc, v: acc + v, values, initializer=tf.zeros(tf.reshape(n, [1]), tf.float32))


# ---------------------------------------------------------------------------
# Public dispatching API.

def quantize_bucketed(x, seed, *, levels, bucket_size, bits, norm="l2"):
    """QSGD / TernGrad stochastic quantization of ``x`` (see the module docstring).

    Args:
      x: float32/float16/bfloat16 tensor of any shape, flattened row-major.
      seed: int64 (or int32) tensor of shape ``[2]``, as for
        ``tf.random.stateless_uniform``; the draws depend only on it.
      levels: ``s``, non-zero levels per sign, 1 to 32767.
      bucket_size: ``d >= 1``, elements per bucket.
      bits: 2, 4, 8 or 16; must hold the ``2s + 1`` codes.
      norm: ``"l2"`` or ``"max"``.

    Returns:
      ``Quantized(scales, words)``: float32 ``[max(1, ceil(n / d))]`` and
      int32 ``[ceil(n * bits / 32)]``.
    """
    levels, d, bits = _check_attrs(levels, bucket_size, bits, norm)
    x = float_input(x)
    seed = _seed_tensor(seed)
    lib = _loader.load_library()
    if lib is None:
        return quantize_bucketed_reference(x, seed, levels=levels, bucket_size=d, bits=bits, norm=norm)
    return Quantized(*lib.tfgc_quantize_bucketed(x, seed, levels=levels, bucket_size=d, bits=bits,
                                                 norm=norm))


def dequantize_bucketed(scales, words, num_elements, *, levels, bucket_size, bits, dtype=tf.float32):
    """Inverse of :func:`quantize_bucketed`: ``[num_elements]`` values of ``dtype``.

    ``values_i = (code_i - s) * (scales[i // d] / s)`` in float32, then cast to
    ``dtype``. Raises ``tf.errors.InvalidArgumentError`` unless ``scales`` is
    1-D float32 with ``max(1, ceil(n / d))`` entries, ``words`` 1-D int32 with
    ``ceil(n * bits / 32)`` entries, ``n >= 0`` and every used code ``<= 2s``.
    """
    levels, d, bits = _check_attrs(levels, bucket_size, bits)
    dtype = float_dtype(dtype)
    scales = typed_tensor(scales, tf.float32, "scales")
    words = typed_tensor(words, tf.int32, "words")
    n = int64_scalar(num_elements, "num_elements")
    lib = _loader.load_library()
    if lib is None:
        return dequantize_bucketed_reference(scales, words, n, levels=levels, bucket_size=d, bits=bits,
                                             dtype=dtype)
    return lib.tfgc_dequantize_bucketed(scales, words, n, levels=levels, bucket_size=d, bits=bits, T=dtype)


def dequantize_bucketed_sum(scales, words, num_elements, *, levels, bucket_size, bits):
    """Sum of N workers' payloads, decoded in one pass: float32 ``[num_elements]``.

    ``scales`` is ``[N, max(1, ceil(n / d))]`` and ``words`` ``[N, ceil(n * bits / 32)]``
    (row k is worker k's :func:`quantize_bucketed` output). The result is
    ``((0 + dequantize(row 0)) + dequantize(row 1)) + ...`` in float32, bit for
    bit, without materialising the N decoded tensors; zeros for N = 0. The same
    validation as :func:`dequantize_bucketed` applies to every row.
    """
    levels, d, bits = _check_attrs(levels, bucket_size, bits)
    scales = typed_tensor(scales, tf.float32, "scales")
    words = typed_tensor(words, tf.int32, "words")
    n = int64_scalar(num_elements, "num_elements")
    lib = _loader.load_library()
    if lib is None:
        return dequantize_bucketed_sum_reference(scales, words, n, levels=levels, bucket_size=d, bits=bits)
    return lib.tfgc_dequantize_bucketed_sum(scales, words, n, levels=levels, bucket_size=d, bits=bits)
