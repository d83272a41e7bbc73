"""Sign-bit packing and Seide-style 1-bit quantization.

Each public function runs the compiled kernel from ``_tfgc_ops.so`` when it is
available (see ``tfgc.ops._loader``) and otherwise its ``*_reference`` twin,
written in plain TensorFlow. The references are also the oracle in the tests:
sign words and dequantized values are bit-identical between the two, class
means agree to a few float32 ulps (summation order), and each residual is
exact given the means it was returned with.

Conventions shared by all four ops:

* Bit layout. The input is flattened row-major; element ``i`` is bit ``i % 32``
  (least significant first) of int32 word ``i // 32``. There are
  ``ceil(n / 32)`` words and the unused high bits of the last word are 0.
* A bit is 1 iff ``x >= 0``. Hence ``-0.0`` packs as 1 (it compares equal to
  0) and NaN, whatever its sign bit, packs as 0.
* ``onebit_quantize`` puts an element in the positive class iff its bit is 1,
  so NaN entries fall in the negative class: that column's ``neg_mean``
  becomes NaN, and so does the residual of every negative-class entry of the
  column; its ``pos_mean`` and positive-class residuals are unaffected. An
  infinite entry likewise makes its class mean infinite (and its residual
  ``inf - inf = NaN``). An empty class has mean 0.
* Class sums are kept in float64, also for float16/bfloat16 inputs (the
  kernels add runs of at most 128 rows in float32 first); means are float32.
  The residual is taken against the class mean rounded to the input dtype,
  i.e. against exactly what ``onebit_dequantize(..., dtype=x.dtype)``
  returns, computed in float32 and rounded once. As in every TensorFlow CPU
  kernel, arithmetic runs with denormals flushed to zero, so float32 and
  bfloat16 subnormals add 0 to the sums (their sign bit still counts).
* Payload validation (``unpack_sign_bits``, ``onebit_dequantize``): inputs
  may come from another worker, so every size relation is checked and a
  violation raises ``tf.errors.InvalidArgumentError`` in both
  implementations, eagerly or at run time inside ``tf.function``.
"""

import collections

import numpy as np
import tensorflow as tf

from tfgc.ops import _loader
from tfgc.ops._validation import Checks, float_dtype, float_input, int64_scalar, typed_tensor

_INT64_MAX = np.iinfo(np.int64).max

# Weight of bit position b in a word, as int32 (bit 31 is INT32_MIN). The
# weights are disjoint bits, so summing a subset equals OR-ing it and no
# partial sum can overflow.
_BIT_WEIGHTS = np.left_shift(np.uint32(1), np.arange(32, dtype=np.uint32)).view(np.int32)

OneBitQuantized = collections.namedtuple(
    "OneBitQuantized", ["words", "pos_mean", "neg_mean", "residual"])

# The outputs are bit patterns and statistics; nothing upstream of them should
# be differentiated through the compression step.
for _op_type in ("TfgcPackSignBits", "TfgcUnpackSignBits", "TfgcOneBitQuantize",
                 "TfgcOneBitDequantize"):
    try:
        tf.no_gradient(_op_type)
    except KeyError:  # already registered, e.g. on module reload
        pass


def _num_words(n):
    """ceil(n / 32) for an int64 tensor, without the overflow of n + 31."""
    return n // 32 + tf.cast(n % 32 > 0, tf.int64)


def _bits(words, n):
    """First n bits of 1-D int32 ``words`` as a bool vector (layout above)."""
    shifted = tf.bitwise.right_shift(tf.reshape(words, [-1, 1]), tf.range(32, dtype=tf.int32))
    bits = tf.equal(tf.bitwise.bitwise_and(shifted, 1), 1)
    return tf.slice(tf.reshape(bits, [-1]), tf.zeros([1], tf.int64), tf.reshape(n, [1]))


# ---------------------------------------------------------------------------
# Pure-TensorFlow references.

def pack_sign_bits_reference(x):
    """Reference for :func:`pack_sign_bits`."""
    x = float_input(x)
    flat = tf.reshape(x, [-1])
    n = tf.size(flat, out_type=tf.int64)
    nonneg = tf.greater_equal(flat, tf.zeros([], x.dtype))  # False for NaN
    pad = _num_words(n) * 32 - n
    nonneg = tf.pad(nonneg, tf.reshape(tf.stack([tf.zeros([], tf.int64), pad]), [1, 2]),
                    constant_values=False)
    weighted = tf.where(tf.reshape(nonneg, [-1, 32]), tf.constant(_BIT_WEIGHTS), 0)
    return tf.reduce_sum(weighted, axis=1)


def unpack_sign_bits_reference(words, num_elements, dtype=tf.float32):
    """Reference for :func:`unpack_sign_bits`."""
    dtype = float_dtype(dtype)
    words = typed_tensor(words, tf.int32, "words")
    n = int64_scalar(num_elements, "num_elements")
    checks = Checks()
    checks.require_rank(words, 1, "words")
    checks.require_rank(n, 0, "num_elements")
    checks.require(n >= 0, "num_elements must be >= 0")
    checks.require(
        tf.equal(tf.size(words, out_type=tf.int64), _num_words(n)),
        "words must have exactly ceil(num_elements / 32) entries")
    with tf.control_dependencies(checks.asserts):
        one = tf.ones([], dtype)
        return tf.where(_bits(words, n), one, -one)


def onebit_quantize_reference(x):
    """Reference for :func:`onebit_quantize`."""
    x = float_input(x)
    checks = Checks()
    checks.require_rank(x, 2, "x")
    with tf.control_dependencies(checks.asserts):
        x64 = tf.cast(x, tf.float64)
        pos = tf.greater_equal(x, tf.zeros([], x.dtype))  # NaN -> negative class
        zeros = tf.zeros_like(x64)
        pos_sum = tf.reduce_sum(tf.where(pos, x64, zeros), axis=0)
        neg_sum = tf.reduce_sum(tf.where(pos, zeros, x64), axis=0)
        rows = tf.shape(x, out_type=tf.int64)[0]
        pos_cnt = tf.reduce_sum(tf.cast(pos, tf.int64), axis=0)
        neg_cnt = rows - pos_cnt
        # An empty class divides its zero sum by 1.
        pos_mean = tf.cast(pos_sum / tf.cast(tf.maximum(pos_cnt, 1), tf.float64), tf.float32)
        neg_mean = tf.cast(neg_sum / tf.cast(tf.maximum(neg_cnt, 1), tf.float64), tf.float32)
        # Residual against the decoded value the receiver will see (the mean
        # rounded to x.dtype), subtracted in float32 and rounded once.
        decoded = tf.cast(tf.cast(tf.where(pos, pos_mean, neg_mean), x.dtype), tf.float32)
        residual = tf.cast(tf.cast(x, tf.float32) - decoded, x.dtype)
        words = pack_sign_bits_reference(x)
    return OneBitQuantized(words, pos_mean, neg_mean, residual)


def onebit_dequantize_reference(words, pos_mean, neg_mean, rows, dtype=tf.float32):
    """Reference for :func:`onebit_dequantize`."""
    dtype = float_dtype(dtype)
    words = typed_tensor(words, tf.int32, "words")
    pos_mean = typed_tensor(pos_mean, tf.float32, "pos_mean")
    neg_mean = typed_tensor(neg_mean, tf.float32, "neg_mean")
    rows = int64_scalar(rows, "rows")
    checks = Checks()
    checks.require_rank(words, 1, "words")
    checks.require_rank(pos_mean, 1, "pos_mean")
    checks.require_rank(neg_mean, 1, "neg_mean")
    cols = tf.size(pos_mean, out_type=tf.int64)
    checks.require(tf.equal(cols, tf.size(neg_mean, out_type=tf.int64)),
                   "pos_mean and neg_mean must have the same length")
    checks.require_rank(rows, 0, "rows")
    checks.require(rows >= 0, "rows must be >= 0")
    checks.require(
        tf.logical_or(tf.equal(cols, 0), rows <= _INT64_MAX // tf.maximum(cols, 1)),
        "rows * cols overflows int64")
    n = rows * cols
    checks.require(
        tf.equal(tf.size(words, out_type=tf.int64), _num_words(n)),
        "words must have exactly ceil(rows * cols / 32) entries")
    with tf.control_dependencies(checks.asserts):
        bits = tf.reshape(_bits(words, n), tf.stack([rows, cols]))
        return tf.cast(tf.where(bits, pos_mean, neg_mean), dtype)


# ---------------------------------------------------------------------------
# Public dispatching API.

def pack_sign_bits(x):
    """Packs the signs of ``x`` into int32 words.

    Args:
      x: float32/float16/bfloat16 tensor of any shape, flattened row-major.

    Returns:
      int32 ``[ceil(size(x) / 32)]``; bit ``i % 32`` of word ``i // 32`` is 1
      iff ``x_i >= 0`` (so -0.0 -> 1, NaN -> 0).
    """
    x = float_input(x)
    lib = _loader.load_library()
    if lib is None:
        return pack_sign_bits_reference(x)
    return lib.tfgc_pack_sign_bits(x)


def unpack_sign_bits(words, num_elements, dtype=tf.float32):
    """Inverse of :func:`pack_sign_bits`: ``[num_elements]`` of +1 / -1.

    ``words`` must be a 1-D int32 tensor with exactly
    ``ceil(num_elements / 32)`` entries and ``num_elements`` a scalar >= 0;
    otherwise ``tf.errors.InvalidArgumentError`` is raised.
    """
    dtype = float_dtype(dtype)
    words = typed_tensor(words, tf.int32, "words")
    n = int64_scalar(num_elements, "num_elements")
    lib = _loader.load_library()
    if lib is None:
        return unpack_sign_bits_reference(words, n, dtype)
    return lib.tfgc_unpack_sign_bits(words, n, T=dtype)


def onebit_quantize(x):
    """1-bit SGD quantization of a ``[rows, cols]`` matrix, per column.

    Returns:
      ``OneBitQuantized(words, pos_mean, neg_mean, residual)``: the sign bits of
      ``x`` packed like :func:`pack_sign_bits`; float32 ``[cols]`` means of
      each column's entries ``>= 0`` and ``< 0`` (0 for an empty class; NaN
      entries count as negative); and ``x - decoded`` in ``x.dtype``. See the
      module docstring for the NaN/Inf and rounding details.
    """
    x = float_input(x)
    lib = _loader.load_library()
    if lib is None:
        return onebit_quantize_reference(x)
    return OneBitQuantized(*lib.tfgc_one_bit_quantize(x))


def onebit_dequantize(words, pos_mean, neg_mean, rows, dtype=tf.float32):
    """Inverse of :func:`onebit_quantize`: ``[rows, cols]`` of class means.

    ``cols = size(pos_mean)``. Element ``[r, j]`` is ``pos_mean[j]`` if bit
    ``r * cols + j`` is set, else ``neg_mean[j]``, cast to ``dtype``. Raises
    ``tf.errors.InvalidArgumentError`` unless ``words`` is 1-D int32 with
    exactly ``ceil(rows * cols / 32)`` entries, the means are 1-D float32 of
    equal length, ``rows >= 0`` and ``rows * cols`` fits in int64.
    """
    dtype = float_dtype(dtype)
    words = typed_tensor(words, tf.int32, "words")
    pos_mean = typed_tensor(pos_mean, tf.float32, "pos_mean")
    neg_mean = typed_tensor(neg_mean, tf.float32, "neg_mean")
    rows = int64_scalar(rows, "rows")
    lib = _loader.load_library()
    if lib is None:
        return onebit_dequantize_reference(words, pos_mean, neg_mean, rows, dtype)
    return lib.tfgc_one_bit_dequantize(words, pos_mean, neg_mean, rows, T=dtype)
