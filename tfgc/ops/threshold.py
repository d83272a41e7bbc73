"""Threshold encoding with error feedback (Strom 2015; Dryden et al. 2016).

Strom ("Scalable distributed DNN training using commodity GPU cloud
computing", Interspeech 2015) sends only the gradient entries whose
accumulated value crossed a threshold ``tau``, each as one 32-bit word
holding its index and sign, and keeps everything else, plus the quantisation
error of what was sent, in a local residual. Dryden et al. ("Communication
quantization for data-parallel training of deep neural networks", MLHPC 2016,
LBANN) use separate positive and negative thresholds and reconstruction
values; these ops take both as scalars.

Math. With ``v = x + residual`` (flattened row-major, computed in ``x.dtype``)
and the thresholds rounded to ``x.dtype``::

    v_i >= pos_threshold  ->  word (i << 1) | 1,  new_residual_i = v_i - pos_threshold
    v_i <= neg_threshold  ->  word (i << 1) | 0,  new_residual_i = v_i - neg_threshold
    otherwise             ->  no word,            new_residual_i = v_i

Words come in ascending index order; subtractions are in float32, rounded
once to the dtype. Decoding with ``pos_value = pos_threshold`` and
``neg_value = neg_threshold`` in the same dtype therefore conserves mass:
``decode(words) + new_residual == x + residual`` up to that one rounding.

Behaviour pinned by the tests:

* NaN never compares, so a NaN entry is never sent and stays in the residual
  (it keeps poisoning that entry until the caller resets the residual). +Inf
  reaches the positive threshold and is sent; its residual stays +Inf
  (``inf - t``), likewise for -Inf.
* ``pos_threshold`` must be > 0 and ``neg_threshold`` < 0, both finite once
  rounded to the dtype (a float16 threshold of 1e-9 rounds to 0 and is
  rejected), and ``x`` may have at most 2^30 elements so that every word is a
  non-negative int32. Violations raise ``tf.errors.InvalidArgumentError``.
* Empty inputs give no words and an empty residual.
* Decode: index ``i`` named ``cp`` times by positive words and ``cn`` times by
  negative ones becomes ``cp * pos_value + cn * neg_value`` (float32, each
  term present only when its count is non-zero, rounded once to ``dtype``);
  indices never named are 0. This is order independent, hence
  deterministic, and equals ``pos_value`` / ``neg_value`` exactly for the
  encoder's own payloads, which never repeat an index.
* Decode payloads come from other workers: every word must be >= 0 with
  ``word >> 1 < num_elements`` and ``0 <= num_elements <= 2^30``; anything
  else raises ``tf.errors.InvalidArgumentError`` (never a crash or an
  out-of-bounds write), in both implementations.

Per-column values (Dryden's adaptive variant). Dryden et al. reconstruct each
column of a weight matrix with its own pair of values (the mean of the sent
entries in that column) instead of one global pair. The words are unchanged;
only decode would change, taking ``pos_value`` / ``neg_value`` as float32
``[cols]`` vectors and writing ``pos_value[i % cols]`` at index ``i``, i.e. the
same per-column lookup that ``onebit_dequantize`` does. The encoder would then
compute those means over the sent entries and take each residual against its
column's value. These ops keep the scalar form.
"""

import collections

import tensorflow as tf

from tfgc.ops import _loader
from tfgc.ops._validation import Checks, float32_scalar, float_dtype, float_input, int64_scalar, invalid, typed_tensor

MAX_ELEMENTS = 2**30

ThresholdEncoded = collections.namedtuple("ThresholdEncoded", ["words", "new_residual"])

# Index/sign words and a residual: nothing to differentiate through.
for _op_type in ("TfgcThresholdEncode", "TfgcThresholdDecode"):
    try:
        tf.no_gradient(_op_type)
    except KeyError:  # already registered, e.g. on module reload
        pass


def _encode_args(x, residual, pos_threshold, neg_threshold):
    x = float_input(x)
    try:
        residual = tf.convert_to_tensor(residual)
    except (TypeError, ValueError) as exc:
        invalid(f"residual must be a tensor: {exc}")
    if residual.dtype != x.dtype:
        invalid(f"residual must have x's dtype {x.dtype.name}, got {residual.dtype.name}")
    return (x, residual, float32_scalar(pos_threshold, "pos_threshold"),
            float32_scalar(neg_threshold, "neg_threshold"))


def _decode_args(words, pos_value, neg_value, num_elements, dtype):
    return (typed_tensor(words, tf.int32, "words"), float32_scalar(pos_value, "pos_value"),
            float32_scalar(neg_value, "neg_value"), int64_scalar(num_elements, "num_elements"),
            float_dtype(dtype))


# ---------------------------------------------------------------------------
# Pure-TensorFlow references.

def threshold_encode_reference(x, residual, pos_threshold, neg_threshold):
    """Reference for :func:`threshold_encode`."""
    x, residual, pos_threshold, neg_threshold = _encode_args(x, residual, pos_threshold,
                                                             neg_threshold)
    checks = Checks()
    if x.shape.is_fully_defined() and residual.shape.is_fully_defined():
        checks.require(x.shape == residual.shape,
                       f"x and residual must have the same shape, got {x.shape} and {residual.shape}")
    else:
        checks.require(
            tf.logical_and(tf.equal(tf.rank(x), tf.rank(residual)),
                           tf.reduce_all(tf.equal(tf.shape(x), tf.shape(residual)))),
            "x and residual must have the same shape")
    checks.require_rank(pos_threshold, 0, "pos_threshold")
    checks.require_rank(neg_threshold, 0, "neg_threshold")
    # Thresholds as the receiver will see them: rounded to x.dtype.
    pos_t = tf.cast(tf.cast(pos_threshold, x.dtype), tf.float32)
    neg_t = tf.cast(tf.cast(neg_threshold, x.dtype), tf.float32)
    checks.require(tf.logical_and(pos_t > 0, tf.math.is_finite(pos_t)),
                   f"pos_threshold must be > 0 and finite in {x.dtype.name}")
    checks.require(tf.logical_and(neg_t < 0, tf.math.is_finite(neg_t)),
                   f"neg_threshold must be < 0 and finite in {x.dtype.name}")
    checks.require(tf.size(x, out_type=tf.int64) <= MAX_ELEMENTS,
                   "threshold encoding addresses at most 2^30 elements")
    with tf.control_dependencies(checks.asserts):
        v = tf.cast(tf.reshape(x + residual, [-1]), tf.float32)
        pos = v >= pos_t  # False for NaN
        neg = v <= neg_t
        new_residual = tf.where(pos, v - pos_t, tf.where(neg, v - neg_t, v))
        new_residual = tf.reshape(tf.cast(new_residual, x.dtype), tf.shape(x))
        index = tf.reshape(tf.where(tf.logical_or(pos, neg)), [-1])  # ascending
        sign = tf.cast(tf.gather(pos, index), tf.int64)
        words = tf.cast(index * 2 + sign, tf.int32)
    return ThresholdEncoded(words, new_residual)


def threshold_decode_reference(words, pos_value, neg_value, num_elements, dtype=tf.float32):
    """Reference for :func:`threshold_decode`."""
    words, pos_value, neg_value, n, dtype = _decode_args(words, pos_value, neg_value,
                                                         num_elements, dtype)
    checks = Checks()
    checks.require_rank(words, 1, "words")
    checks.require_rank(pos_value, 0, "pos_value")
    checks.require_rank(neg_value, 0, "neg_value")
    checks.require_rank(n, 0, "num_elements")
    checks.require(tf.logical_and(n >= 0, n <= MAX_ELEMENTS), "num_elements must be in [0, 2^30]")
    index = tf.bitwise.right_shift(words, 1)
    checks.require(tf.reduce_all(words >= 0), "threshold words must be >= 0")
    checks.require(tf.reduce_all(tf.cast(index, tf.int64) < n),
                   "threshold word index outside [0, num_elements)")
    with tf.control_dependencies(checks.asserts):
        is_pos = tf.bitwise.bitwise_and(words, 1)
        cp = tf.math.unsorted_segment_sum(is_pos, index, n)
        cn = tf.math.unsorted_segment_sum(1 - is_pos, index, n)
        p = tf.cast(cp, tf.float32) * pos_value
        q = tf.cast(cn, tf.float32) * neg_value
        zero = tf.zeros_like(p)
        out = tf.where(cp > 0, tf.where(cn > 0, p + q, p), tf.where(cn > 0, q, zero))
        return tf.cast(out, dtype)


# ---------------------------------------------------------------------------
# Public dispatching API.

def threshold_encode(x, residual, pos_threshold, neg_threshold):
    """Threshold-encodes ``x + residual`` (see the module docstring).

    Args:
      x: float32/float16/bfloat16 tensor, at most 2^30 elements.
      residual: error-feedback state, same shape and dtype as ``x``.
      pos_threshold: scalar > 0 (finite once rounded to ``x.dtype``).
      neg_threshold: scalar < 0 (finite once rounded to ``x.dtype``).

    Returns:
      ``ThresholdEncoded(words, new_residual)``: int32 ``[m]`` words
      ``(i << 1) | (v_i >= pos_threshold)`` for the ``m`` sent entries in
      ascending index order, and the new residual, shaped like ``x``.
    """
    x, residual, pos_threshold, neg_threshold = _encode_args(x, residual, pos_threshold,
                                                             neg_threshold)
    lib = _loader.load_library()
    if lib is None:
        return threshold_encode_reference(x, residual, pos_threshold, neg_threshold)
    return ThresholdEncoded(*lib.tfgc_threshold_encode(x, residual, pos_threshold, neg_threshold))


def threshold_decode(words, pos_value, neg_value, num_elements, dtype=tf.float32):
    """Inverse of :func:`threshold_encode`: dense ``[num_elements]`` of ``dtype``.

    ``pos_value`` / ``neg_value`` (float32 scalars, typically the thresholds)
    are written at the indices of positive / negative words, 0 elsewhere;
    repeated indices add up (see the module docstring). Raises
    ``tf.errors.InvalidArgumentError`` unless ``words`` is 1-D int32 with every
    word >= 0 and ``word >> 1 < num_elements``, and ``num_elements`` is a
    scalar in ``[0, 2^30]``.
    """
    words, pos_value, neg_value, n, dtype = _decode_args(words, pos_value, neg_value,
                                                         num_elements, dtype)
    lib = _loader.load_library()
    if lib is None:
        return threshold_decode_reference(words, pos_value, neg_value, n, dtype)
    return lib.tfgc_threshold_decode(words, pos_value, neg_value, n, T=dtype)
