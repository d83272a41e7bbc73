"""Lossless and half-precision baselines: identity, fp16 and bf16.

All three are summable: their payload is the gradient itself (or a narrower copy),
so workers combine it with one dense all-reduce.
"""

import tensorflow as tf

from tfgc.compressors.base import Compressor


class Identity(Compressor):
    """Sends the gradient unchanged (32 bits per float32 element).

    Reduced through the same fused all-reduce as TensorFlow's own
    ``CollectiveAllReduce``, so training is bit-identical to the stock strategy.
    """

    name = "none"
    summable = True
    # Carries every inf/NaN of its input into its output: the reduction needs no finiteness check.
    passes_non_finite = True

    def compress(self, x, state, ctx):
        return (tf.reshape(x, [-1]),), state

    def decompress(self, payload, shape, dtype, ctx):
        return tf.reshape(tf.cast(payload[0], dtype), shape)


class _Cast(Compressor):
    summable = True
    wire_dtype = None
    # Carries every inf/NaN of its input into its output: the reduction needs no finiteness check.
    passes_non_finite = True

    def compress(self, x, state, ctx):
        return (tf.cast(tf.reshape(x, [-1]), self.wire_dtype),), state

    def decompress(self, payload, shape, dtype, ctx):
        return tf.reshape(tf.cast(payload[0], dtype), shape)


class FP16(_Cast):
    """Casts to IEEE half precision (16 bits per element) and all-reduces in fp16.

    Range: the payload is summed in float16, and a ring all-reduce rounds every
    partial sum to float16 at each hop, so the *sum over workers* must stay below
    65504 in magnitude, not just each worker's value: two workers sending 40000
    each give inf (which decompresses to inf in float32), while 30000 each give
    60000 exactly. The worst case is the sum of |g| over the workers, because the
    order of the partial sums is the collective's. At the other end, magnitudes
    below about 6e-8 (2**-24, the smallest float16 subnormal) are lost, those
    under 3e-8 rounding to zero, and below 6.1e-5 (2**-14) fewer than 11
    significant bits remain. Use it for gradients of moderate scale (or with loss
    scaling sized for N workers); ``bf16`` has float32's range.
    """

    name = "fp16"
    wire_dtype = tf.float16


class BF16(_Cast):
    """Casts to bfloat16 (16 bits per element): float32's range, 8 bits of mantissa."""

    name = "bf16"
    wire_dtype = tf.bfloat16
