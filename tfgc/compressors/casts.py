"""Lossless and half-precision baselines: identity, fp16 and bf16.

All three are summable: their payload is the gradient itself (or a narrower copy),
so workers combine it with one dense all-reduce. The two casts also take the
reduce-scatter (``communication="reduce_scatter"``): each chunk's owner sums the
workers' 16-bit chunks in float32 and rounds the sum to 16 bits once, where a ring
all-reduce rounds every partial sum to 16 bits at every hop.
"""

import tensorflow as tf

from tfgc.compressors.base import Compressor, Recompressible


class Identity(Compressor):
    """Sends the gradient unchanged (32 bits per float32 element).

    Its gradients take TensorFlow's own ``CollectiveAllReduce`` (``reduces_as_stock``),
    so training is the stock strategy's, bit for bit.
    """

    name = "none"
    summable = True
    reduces_as_stock = True
    # Carries every inf/NaN of its input into its output: the reduction needs no finiteness check.
    passes_non_finite = True

    def compress(self, x, state, ctx):
        return (tf.reshape(x, [-1]),), state

    def decompress(self, payload, shape, dtype, ctx):
        return tf.reshape(tf.cast(payload[0], dtype), shape)


class _Cast(Recompressible):
    # On the reduce-scatter the owner decodes (to the gradient's float32), sums in
    # rank order and casts the sum once (the default aggregate and recompress).
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

    Range: on the all-reduce the payload is summed in float16, and a ring all-reduce
    rounds every partial sum to float16 at each hop, so the *sum over workers* must
    stay below 65504 in magnitude, not just each worker's value: two workers sending
    40000 each give inf (which decompresses to inf in float32), while 30000 each give
    60000 exactly. The worst case is the sum of |g| over the workers, because the
    order of the partial sums is the collective's. On the reduce-scatter the owners
    sum in float32: only each worker's values and the final sum must fit, and the
    sum is rounded once. At the other end, magnitudes below about 6e-8 (2**-24,
    the smallest float16 subnormal) are lost, those
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
